"""The event simulation of one kernel state (`kernels.KernelState`): `run`.

Compute kernels run on one stream and communication kernels (all-reduce buckets, reduce-scatters
and all-gathers of sharded updates, opaque collectives) on one channel. Ties between kernels ready
at the same time go to the earlier rank: program position (a group's last op, an all-reduce after
its last gradient's producer), then a hash of the key. A state with a dependency cycle leaves
kernels unrun: `run` returns None for it. `simulator.simulate` and `simulator.SimulatedCost`
call it. `SimulatorParams`, the device parameters `run` executes by, are defined here (the
simulator fits them) so that the event core and the bound below it need nothing of the simulator.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

from disco_jax._program import Program
from disco_jax.cost import sharded
from disco_jax.cost.allreduce import (
    AllReduceCost,
    bucket_time_us,
    collective_ops,
    collective_time_us,
    transfer_bytes,
)
from disco_jax.cost.host import HostLane
from disco_jax.cost.kernels import BUCKET, GATHER, GROUP, KernelState, is_packed, is_scatter

# What packing a loop body's all-reduces saves per `while` op (`cost.loop_packing`, which sets
# it: it reads the compiled program, and `cost.compiled` imports this module).
PACKED_LOOP_SAVINGS = None


@dataclasses.dataclass(frozen=True)
class SimulatorParams:
    """How the device executes, beyond kernel and all-reduce costs.

    compute_scale: step time per estimated kernel time (the estimates are one device's kernels as
    the trace times them; XLA:CPU's virtual devices share the host's cores, so the step waits for
    every device's kernels: about devices / cores).
    comm_blocking: fraction of an all-reduce's time during which it also holds the compute stream
    (0 for a GPU's separate communication stream; XLA:CPU runs collectives on the executor's own
    threads, so they block compute). kernel_overhead_us: added to every compute kernel (the
    executor's dispatch of one thunk, which the kernel trace does not show). step_overhead_us:
    added once per step (launching the executable, handing over arguments and results).
    allreduce_tensor_us: what each tensor after the first adds to an all-reduce of several, in
    place of the all-reduce cost's own (`AllReduceCostModel.per_tensor_us`, measured apart from
    any step); None: the cost's own.
    host: the host lane (`cost.host.HostLane`: the call's set-up per argument and result buffer,
    and the host's time to issue each kernel, which the device cannot start before); read by the
    compiled-program model (`cost.compiled.cost_program`), not by the graph simulator; None: the
    host keeps ahead of the device.
    Each can be fitted per step by `calibrate` from measured runs of several strategies; the
    defaults are the bare simulator of DisCo. JSON: the field names (plans record them; nothing
    reads them back, so plans written before the overheads existed stay loadable)."""

    compute_scale: float = 1.0
    comm_blocking: float = 0.0
    kernel_overhead_us: float = 0.0
    step_overhead_us: float = 0.0
    allreduce_tensor_us: float | None = None
    host: HostLane | None = None

    def kernel_us(self, estimated_us: float) -> float:
        """The simulated time of a compute kernel whose estimator says `estimated_us`."""
        return float(estimated_us) * self.compute_scale + self.kernel_overhead_us

    def bucket_us(self, allreduce: AllReduceCost, tensor_bytes: Sequence[int]) -> float:
        """The simulated time of one all-reduce of these tensors (bytes of each, per device)."""
        if self.allreduce_tensor_us is None:
            return bucket_time_us(allreduce, tensor_bytes)
        return allreduce.time_us(sum(tensor_bytes)) + self.allreduce_tensor_us * max(0, len(tensor_bytes) - 1)

    def packed_bucket_us(self, allreduce: AllReduceCost, tensor_bytes: Sequence[int]) -> float:
        """One all-reduce of these tensors packed into one flat buffer (`Strategy.packed`): one
        tensor's all-reduce of their total, plus the concatenation and the split, charged together
        at the all-reduce's own per-byte rate (the only memory rate the simulator has measured: a
        reduction over the devices reads every device's buffer, the two copies read and write one
        buffer each). An approximation; the compiled-program model costs XLA's concatenate and
        slice kernels themselves, and the measured loop decides."""
        total = sum(tensor_bytes)
        copies = allreduce.time_us(total) - allreduce.time_us(0)
        return allreduce.time_us(total) + copies

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Timeline:
    """What `run` computed: times in microseconds and, when recorded, the schedule."""

    iteration_us: float
    compute_us: float
    comm_us: float
    end: list[float]
    ready_at: list[float]
    events: list[tuple[str, int, float, float]]  # (lane, slot, start, end)

    @property
    def overlap_ratio(self) -> float:
        """The fraction of communication time hidden under compute."""
        if not self.comm_us:
            return 1.0
        hidden = max(0.0, self.compute_us + self.comm_us - self.iteration_us)
        return min(1.0, hidden / self.comm_us)


def run(
    program: Program,
    st: KernelState,
    params: SimulatorParams,
    allreduce: AllReduceCost,
    record: bool = False,
    comm_costs: dict | None = None,
) -> Timeline | None:
    """`program`'s kernels in `st`: compute kernels on one stream, each taking the stream when it
    is free and the kernel is the earliest ready (rank breaks ties); communication kernels on one
    channel, each starting when its inputs are ready and the channel is free, in the order their
    last input finishes (holding the stream for `params.comm_blocking` of their time). None on a
    dependency cycle.
    The step overhead is not added here (`simulator.simulate` adds it). `comm_costs`: a memo of
    communication kernels' times by key, for these params and all-reduce cost only. A sharded
    update (`cost.sharded`) shows in the state: its buckets reduce-scatter where the backend forms
    reduce-scatters, its all-gathers are kernels, and a group whose ops all belong to sharded
    updates costs 1/N of its estimate."""
    keys, deps, users, comm, rank = st.keys, st.deps, st.users, st.comm, st.rank
    n = len(keys)
    blocking = params.comm_blocking
    costs, comm_slots = kernel_costs(program, st, params, allreduce, comm_costs)
    waiting = [len(d) for d in deps]
    ready_at = [0.0] * n
    end = [0.0] * n
    heap = [(0.0, rank[k], k) for k in range(n) if not waiting[k] and not comm[k] and keys[k] is not None]
    heapq.heapify(heap)
    stream_free = channel_free = 0.0
    events: list[tuple[str, int, float, float]] = []
    done = 0

    push, pop = heapq.heappush, heapq.heappop

    def start_comm(ready: list[int]) -> None:
        """Communication kernels whose inputs are ready take the channel now, by rank; each one
        readies its users as it ends, and a communication kernel it readies starts before the
        next of `ready` (depth first). A stack, not recursion: a function calling itself through
        its closure is a reference cycle, and every run's lists would wait for the collector."""
        nonlocal channel_free, done
        stack = [iter(sorted(ready, key=rank.__getitem__) if len(ready) > 1 else ready)]
        while stack:
            u = next(stack[-1], None)
            if u is None:
                stack.pop()
                continue
            r = ready_at[u]
            start = channel_free if channel_free > r else r
            end[u] = channel_free = finished = start + costs[u]
            if record:
                events.append(("comm", u, start, finished))
            if blocking > 0:  # the stream is held once the all-reduce starts
                push(heap, (start, -1.0, -1 - u))
            done += 1
            ready_comm = None
            for v in users[u]:
                if finished > ready_at[v]:
                    ready_at[v] = finished
                left = waiting[v] - 1
                waiting[v] = left
                if not left:
                    if comm[v]:
                        ready_comm = [v] if ready_comm is None else [*ready_comm, v]
                    else:
                        push(heap, (ready_at[v], rank[v], v))
            if ready_comm is not None:
                stack.append(iter(sorted(ready_comm, key=rank.__getitem__) if len(ready_comm) > 1 else ready_comm))

    start_comm([k for k in comm_slots if not waiting[k]])  # collectives of values needing no compute
    while heap:
        r, _, k = pop(heap)
        if k < 0:  # compute time taken by a blocking all-reduce
            stream_free = max(stream_free, r) + blocking * costs[-1 - k]
            continue
        start = stream_free if stream_free > r else r
        end[k] = stream_free = finished = start + costs[k]
        if record:
            events.append(("compute", k, start, finished))
        # Kernel k's users, readied here rather than in a function: this loop is the search's hottest.
        done += 1
        ready_comm = None
        for u in users[k]:
            if finished > ready_at[u]:
                ready_at[u] = finished
            left = waiting[u] - 1
            waiting[u] = left
            if not left:
                if comm[u]:
                    ready_comm = [u] if ready_comm is None else [*ready_comm, u]
                else:
                    push(heap, (ready_at[u], rank[u], u))
        if ready_comm is not None:
            start_comm(ready_comm)
    if done != n - len(st.free):
        return None  # a cycle: some kernels never became ready
    comm_us = sum(costs[k] for k in comm_slots)
    compute_us = sum(costs) - comm_us
    return Timeline(max(stream_free, channel_free), compute_us, comm_us, end, ready_at, events)


def kernel_costs(
    program: Program, st: KernelState, params: SimulatorParams, allreduce: AllReduceCost, comm_costs: dict | None = None
) -> tuple[list[float], list[int]]:
    """Every slot's time in microseconds as `run` charges it (0 for a free slot), and the live
    communication slots. `comm_costs`: as for `run`."""
    keys, comm, members = st.keys, st.comm, st.members
    scale, overhead = float(params.compute_scale), params.kernel_overhead_us
    costs = [0.0 if e is None else e * scale + overhead for e in st.estimate]
    if st.sharded:
        region_of, sharded, shards = st.regions.region_of, st.sharded, st.regions.num_shards
        for k, e in enumerate(st.estimate):
            if e and st.kinds[k] == GROUP and all(region_of[o] in sharded for o in members[k]):
                costs[k] = e * scale / shards + overhead
    if st.packed_loops and PACKED_LOOP_SAVINGS is not None:
        for o, saved_us in PACKED_LOOP_SAVINGS(program.graph, program.backend, allreduce).items():
            costs[st.provider[o]] -= saved_us * scale
    comm_slots = [k for k in range(len(keys)) if comm[k] and keys[k] is not None]
    memo = {} if comm_costs is None else comm_costs
    for k in comm_slots:
        c = memo.get(keys[k])
        if c is None:
            c = memo[keys[k]] = _comm_us(program, st, k, params, allreduce)
        costs[k] = c
    return costs, comm_slots


def _comm_us(program: Program, st: KernelState, k: int, params: SimulatorParams, allreduce: AllReduceCost) -> float:
    graph, kind, members = program.graph, st.kinds[k], st.members[k]
    if kind == GATHER:  # the updated parameters, as large as their gradients
        return collective_time_us(allreduce, "all-gather", sum(graph.gradients[g].nbytes for g in members))
    if kind == BUCKET:
        moved = transfer_bytes(program)
        tensors = [moved[g] for g in members]
        if is_scatter(st.keys[k]) and sharded.reduce_scatters(program, allreduce):
            return collective_time_us(allreduce, "reduce-scatter", sum(tensors))
        # Gradients the program slices and the backend reduce-scatters leave the all-reduce for
        # one reduce-scatter of them all (`cost.sharded.scattered_gradients`).
        scattered = sharded.scattered_gradients(program)
        whole = [t for g, t in zip(members, tensors) if g not in scattered]
        split = sum(graph.gradients[g].nbytes for g in members if g in scattered)
        bucket_us = params.packed_bucket_us if is_packed(st.keys[k]) else params.bucket_us
        return (bucket_us(allreduce, whole) if whole else 0.0) + (
            collective_time_us(allreduce, "reduce-scatter", split) if split else 0.0
        )
    (o,) = members
    collective, nbytes = collective_ops(graph)[o]
    time_us = collective_time_us(allreduce, collective, nbytes)
    if o in sharded.grouped_gathers(program):  # its group's all-gather paid the latency
        time_us -= collective_time_us(allreduce, collective, 0)
    return time_us
