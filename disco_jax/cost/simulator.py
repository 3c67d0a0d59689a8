"""The step simulator (DisCo section 4.4) and the cost model the search simulates with.

`simulate` runs a strategy's kernel graph on one compute stream and one communication channel
and reports iteration time, compute and comm time, overlap and the full-overlap bound
(`SimulatedStep`). `SimulatorParams` are the two device parameters beyond kernel and all-reduce
costs, fitted to measured runs by `calibrate`. `CostModel` bundles what one search simulates
with: a kernel estimator, an all-reduce cost and the parameters.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from disco_jax._strategy import BUCKET, GROUP, KernelDag, Strategy, kernel_dag
from disco_jax.cost.allreduce import AllReduceCost
from disco_jax.cost.estimators import ChainEstimator, Estimator

if TYPE_CHECKING:
    from disco_jax._graph import Graph


@dataclasses.dataclass
class SimulatedStep:
    """Result of `simulate`: times in microseconds, plus the schedule for timelines."""

    iteration_us: float
    compute_us: float
    comm_us: float
    overlap_ratio: float  # fraction of comm time hidden under compute
    full_overlap_us: float  # FO: max(compute, comm), the bound with perfect overlap
    num_fusions: int
    num_allreduces: int
    events: list[tuple[str, str, float, float]]  # (lane 'compute'|'comm', kernel label, start, end)
    allreduce_ready_us: list[float]  # per bucket of the strategy, in order: when its last gradient is ready

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("events")
        d.pop("allreduce_ready_us")
        return d


@dataclasses.dataclass(frozen=True)
class SimulatorParams:
    """How the device executes, beyond kernel and all-reduce costs.

    compute_scale: measured step time per simulated compute time (dispatch, contention between
    devices sharing cores). comm_blocking: fraction of an all-reduce's time during which it also
    holds the compute stream (0 for a GPU's separate communication stream; XLA:CPU runs
    collectives on the executor's own threads, so they block compute). Both are fitted per step by
    `calibrate` from measured runs of two strategies."""

    compute_scale: float = 1.0
    comm_blocking: float = 0.0

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def calibrate(
    simulate_at: Callable[[SimulatorParams], tuple[float, float]],
    measured: tuple[float, float],
    blocking_grid: Sequence[float] = tuple(i / 20 for i in range(21)),
) -> SimulatorParams:
    """Fit SimulatorParams so two strategies simulate at their measured step times.

    `simulate_at(params)` returns the simulated (first, second) iteration times; `measured` the
    measured ones. For each blocking fraction, the compute scale makes the first match exactly;
    the fraction whose second ratio is closest wins."""
    best, best_err = SimulatorParams(), float("inf")
    for b in blocking_grid:
        scale = 1.0
        for _ in range(60):  # simulated time grows with the scale, but not in proportion (comm)
            first, _ = simulate_at(SimulatorParams(scale, b))
            if first <= 0:
                break
            step = measured[0] / first
            scale *= step
            if abs(step - 1.0) < 1e-9:
                break
        params = SimulatorParams(scale, b)
        sim_first, sim_second = simulate_at(params)
        if sim_first <= 0:
            continue
        err = abs(sim_second / sim_first - measured[1] / measured[0])
        if err < best_err - 1e-12:
            best, best_err = params, err
    return best


def simulate(
    graph: Graph,
    strategy: Strategy,
    estimator: Estimator,
    allreduce: AllReduceCost,
    params: SimulatorParams = SimulatorParams(),
    *,
    dag: KernelDag | None = None,
    record: bool = False,
) -> SimulatedStep | None:
    """DisCo's simulator: a ready queue of compute kernels on one stream in dependency order;
    all-reduces on one channel in the order their gradients are produced, each starting when its
    last gradient is ready and the channel is free (and holding the compute stream for
    `params.comm_blocking` of its time). None if the strategy is invalid."""
    dag = dag or kernel_dag(graph, strategy)
    if dag is None:
        return None
    n = len(dag.kinds)
    compute = [k for k in range(n) if dag.kinds[k] != BUCKET]
    costs = [0.0] * n
    times = estimator.estimate(graph, [dag.members[k] for k in compute])
    for k, t in zip(compute, times):
        costs[k] = float(t or 0.0) * params.compute_scale
    for k in range(n):
        if dag.kinds[k] == BUCKET:
            costs[k] = allreduce.time_us(sum(graph.gradients[g].nbytes for g in dag.members[k]))
    position = {k: i for i, k in enumerate(dag.order)}
    users: list[list[int]] = [[] for _ in range(n)]
    waiting = [len(d) for d in dag.deps]
    for k, d in enumerate(dag.deps):
        for p in d:
            users[p].append(k)
    ready_at = [0.0] * n
    end = [0.0] * n
    heap = [(0.0, position[k], k) for k in range(n) if waiting[k] == 0 and dag.kinds[k] != BUCKET]
    heapq.heapify(heap)
    stream_free = channel_free = 0.0
    events = []
    comm_queue = [k for k in range(n) if waiting[k] == 0 and dag.kinds[k] == BUCKET]

    def release(k: int):
        nonlocal channel_free
        for u in users[k]:
            ready_at[u] = max(ready_at[u], end[k])
            waiting[u] -= 1
            if waiting[u] == 0:
                if dag.kinds[u] == BUCKET:
                    start = max(channel_free, ready_at[u])
                    end[u] = channel_free = start + costs[u]
                    if record:
                        events.append(("comm", _label(graph, dag, u), start, end[u]))
                    if params.comm_blocking > 0:  # the stream is held once the all-reduce starts
                        heapq.heappush(heap, (start, -1, -1 - u))
                    release(u)
                else:
                    heapq.heappush(heap, (ready_at[u], position[u], u))

    for k in comm_queue:  # all-reduces of values that need no computation
        start = channel_free
        end[k] = channel_free = start + costs[k]
        if params.comm_blocking > 0:
            heapq.heappush(heap, (start, -1, -1 - k))
        release(k)
    while heap:
        # The stream takes the kernel that can start first (program order breaks ties).
        r, _, k = heapq.heappop(heap)
        if k < 0:  # compute time taken by a blocking all-reduce
            stream_free = max(stream_free, r) + params.comm_blocking * costs[-1 - k]
            continue
        start = max(stream_free, r)
        end[k] = stream_free = start + costs[k]
        if record:
            events.append(("compute", _label(graph, dag, k), start, end[k]))
        release(k)
    compute_us = sum(costs[k] for k in compute)
    comm_us = sum(costs[k] for k in range(n) if dag.kinds[k] == BUCKET)
    iteration = max(stream_free, channel_free)
    hidden = max(0.0, compute_us + comm_us - iteration) if comm_us else 0.0
    return SimulatedStep(
        iteration_us=iteration,
        compute_us=compute_us,
        comm_us=comm_us,
        overlap_ratio=min(1.0, hidden / comm_us) if comm_us else 1.0,
        full_overlap_us=max(compute_us, comm_us),
        num_fusions=sum(1 for k in range(n) if dag.kinds[k] == GROUP and len(dag.members[k]) > 1),
        num_allreduces=sum(1 for k in range(n) if dag.kinds[k] == BUCKET),
        events=events,
        allreduce_ready_us=[ready_at[k] for k in range(n) if dag.kinds[k] == BUCKET],
    )


def _label(graph: Graph, dag: KernelDag, k: int) -> str:
    if dag.kinds[k] == BUCKET:
        return f"all-reduce[{len(dag.members[k])}]"
    ops = sorted(dag.members[k])
    first = graph.ops[ops[-1]].name
    return first if len(ops) == 1 else f"fusion[{len(ops)}]:{first}"


@dataclasses.dataclass
class CostModel:
    """What the simulator needs, built once per search: estimator chain and all-reduce cost.
    `sources` says where each part came from (for the plan file)."""

    estimator: ChainEstimator
    allreduce: AllReduceCost
    sources: dict
    params: SimulatorParams = SimulatorParams()

    def simulate(
        self, graph: Graph, strategy: Strategy, record: bool = False, params: SimulatorParams | None = None
    ) -> SimulatedStep | None:
        return simulate(graph, strategy, self.estimator, self.allreduce, params or self.params, record=record)
