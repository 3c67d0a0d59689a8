"""The dependency bound: no schedule of a strategy's kernels can finish sooner.

DisCo's full-overlap bound (FO, `SimulatedStep.full_overlap_us`) is max(compute, comm): the
iteration if every all-reduce overlapped compute. In data-parallel training it cannot be reached:
no gradient exists before the forward pass ends, and the gradient the backward pass produces last
is all-reduced after all compute that feeds it. `dependency_bound` adds what the kernel graph
forces. The kernels run as `events.run` runs them: compute kernels on one stream, communication
kernels on one channel, each kernel with its fixed time. Each kernel then gets:

* a *head*: it cannot start before its longest chain of predecessors has run, nor before all its
  ancestors on either lane have run there one after another (an all-reduce waits for all the
  compute that feeds it);
* a *tail*: after it ends, its longest chain of successors still runs, and so do all its
  descendants on either lane, one after another.

On one lane, any set S of kernels needs min head + total time + min tail over S (Carlier's bound
for one machine with release and delivery times). The bound is the largest of:

* that over the sets {kernels with head >= t}, per lane;
* the longest head + time + tail of one kernel (the critical path);
* each lane's total time (FO's two terms).

It is a lower bound on `events.run`'s iteration time for any order `run` could choose. An
all-reduce that blocks the stream (`SimulatorParams.comm_blocking`) only adds to that time, so the
bound holds with it too. Where the simulated iteration equals the bound, the remaining gap to FO is
forced by dependencies. No reordering can close it, only different kernels (other fusions, other
buckets, a sharded update). Costs a few full passes over the kernel graph: used for reports, not
inside the search.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from disco_jax.cost import events

if TYPE_CHECKING:
    from disco_jax._program import Program
    from disco_jax.cost.allreduce import AllReduceCost
    from disco_jax.cost.events import SimulatorParams
    from disco_jax.cost.kernels import KernelState


def dependency_bound(
    program: Program, st: KernelState, params: SimulatorParams, allreduce: AllReduceCost
) -> float | None:
    """The least iteration time (us, without the step overhead) of any schedule of `st`'s
    kernels (of `program`) on one stream and one channel; None when they form a cycle."""
    costs, comm_slots = events.kernel_costs(program, st, params, allreduce)
    alive = st.alive()
    order = _topological(st, alive)
    if order is None:
        return None
    comm = st.comm
    n = len(st.keys)
    lanes = np.zeros((n, 2))  # per slot: its time in the column of its lane (compute, comm)
    for k in alive:
        lanes[k, int(comm[k])] = costs[k]

    head = dict.fromkeys(alive, 0.0)
    ancestors = dict.fromkeys(alive, 0)  # bit masks of slots
    for k in order:
        for d in st.deps[k]:
            head[k] = max(head[k], head[d] + costs[d])
            ancestors[k] |= ancestors[d] | (1 << d)
        head[k] = max(head[k], *_per_lane(ancestors[k], lanes))
    tail = dict.fromkeys(alive, 0.0)
    descendants = dict.fromkeys(alive, 0)
    for k in reversed(order):
        for u in st.users[k]:
            tail[k] = max(tail[k], tail[u] + costs[u])
            descendants[k] |= descendants[u] | (1 << u)
        tail[k] = max(tail[k], *_per_lane(descendants[k], lanes))

    comm_us = sum(costs[k] for k in comm_slots)  # FO's terms, summed as `events.run` sums them
    bound = max(comm_us, sum(costs) - comm_us, *(head[k] + costs[k] + tail[k] for k in alive))
    for lane in (False, True):
        bound = max(bound, _one_lane([(head[k], costs[k], tail[k]) for k in alive if comm[k] == lane]))
    return bound


def _topological(st: KernelState, alive: list[int]) -> list[int] | None:
    waiting = {k: len(st.deps[k]) for k in alive}
    ready = [k for k in alive if not waiting[k]]
    order = []
    while ready:
        k = ready.pop()
        order.append(k)
        for u in st.users[k]:
            waiting[u] -= 1
            if not waiting[u]:
                ready.append(u)
    return order if len(order) == len(alive) else None


def _per_lane(mask: int, lanes: np.ndarray) -> np.ndarray:
    """The summed times, per lane, of the slots in a bit mask."""
    if not mask:
        return np.zeros(2)
    n = len(lanes)
    bits = np.unpackbits(np.frombuffer(mask.to_bytes((n + 7) // 8, "little"), np.uint8), bitorder="little")
    return bits[:n].astype(np.float64) @ lanes


def _one_lane(jobs: list[tuple[float, float, float]]) -> float:
    """max over t of (t + the times of the jobs with head >= t + their least tail)."""
    bound, total, least_tail = 0.0, 0.0, float("inf")
    for head, time, tail in sorted(jobs, reverse=True):
        total += time
        least_tail = min(least_tail, tail)
        bound = max(bound, head + total + least_tail)
    return bound
