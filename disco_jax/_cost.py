"""Kernel cost estimators and the step simulator (DisCo section 4.4).

An `Estimator` maps kernels (sets of op ids of one graph) to times in microseconds, or None where
it does not know. Estimators chain (`ChainEstimator`): the profiled table answers for kernels that
ran, the GNN (when trained weights exist for the device kind) or the analytical roofline for those
the search invents. `simulate` runs a strategy's kernel graph on one compute stream and one
communication channel and reports iteration time, compute and comm time, overlap and the
full-overlap bound.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import re
from typing import Callable, Protocol, Sequence

import numpy as np

from disco_jax._graph import TRANSCENDENTAL, Graph
from disco_jax._profile import AllReduceCostModel
from disco_jax._strategy import BUCKET, GROUP, KernelDag, Strategy, kernel_dag


class Estimator(Protocol):
    """Kernel -> time. `kernels` are frozensets of op ids of `graph` (a fusion group, or one
    opaque op). Returns microseconds, None for a kernel the estimator cannot cost."""

    name: str

    def estimate(self, graph: Graph, kernels: Sequence[frozenset[int]]) -> list[float | None]: ...


def _op_signature(graph: Graph, o: int) -> str:
    inst = graph.ops[o].inst
    attrs = inst.attrs_text(drop_metadata=True)
    attrs = re.sub(r"(calls|to_apply)=%?[\w.\-]+", lambda m: f"{m.group(1)}=" + _called_body(graph, m.group(0)), attrs)
    attrs = re.sub(r"channel_id=\d+, ?", "", attrs)
    return f"{inst.opcode}:{re.sub(r'{[^{}]*}', '', inst.shape)}:{inst.literal or ''}:{attrs}"


def _called_body(graph: Graph, attr: str) -> str:
    name = attr.split("=", 1)[1].lstrip("%")
    try:
        comp = graph.module.computation(name)
    except KeyError:
        return name
    return "[" + ";".join(f"{i.opcode}:{re.sub(r'{[^{}]*}', '', i.shape)}" for i in comp.instructions) + "]"


def kernel_signature(graph: Graph, members: frozenset[int]) -> str:
    """A name for a kernel that is equal for equal computations in any module: its ops in
    order with shapes and attributes, internal edges by position, inputs by shape."""
    cache = graph.__dict__.setdefault("_signatures", {})
    sig = cache.get(members)
    if sig is None:
        ordered = sorted(members)
        pos = {o: i for i, o in enumerate(ordered)}
        parts = []
        for o in ordered:
            refs = []
            for v in graph.ops[o].operands:
                refs.append(f"#{pos[v]}" if v in pos else "in:" + re.sub(r"{[^{}]*}", "", graph.ops[v].inst.shape))
            parts.append(_op_signature(graph, o) + "(" + ",".join(refs) + ")")
        sig = hashlib.sha1("|".join(parts).encode()).hexdigest()[:20]
        cache[members] = sig
    return sig


def kernel_io_bytes(graph: Graph, members: frozenset[int], exports: Sequence[int] | None = None) -> tuple[int, int]:
    """Bytes read from outside the kernel and bytes written by it (exports default: ops used
    outside the kernel)."""
    inputs = {v for o in members for v in graph.ops[o].operands if v not in members}
    read = sum(graph.ops[v].output_bytes for v in inputs if graph.ops[v].opcode != "constant"
               or graph.ops[v].output_bytes > 64)
    if exports is None:
        exports = [o for o in members if any(u not in members for u in graph.users[o])] or [max(members)]
    written = sum(graph.ops[o].output_bytes for o in exports)
    return read, written


class TableEstimator:
    """Measured kernel times by `kernel_signature` (the profile database's table)."""

    name = "profile"

    def __init__(self, times_us: dict[str, float]):
        self.times_us = times_us

    def estimate(self, graph, kernels):
        return [self.times_us.get(kernel_signature(graph, k)) for k in kernels]


def kernel_features(graph: Graph, members: frozenset[int]) -> np.ndarray:
    """[1, bytes moved, elementwise work, transcendental work, dot/conv flops] of one kernel."""
    read, written = kernel_io_bytes(graph, members)
    elementwise = transcendental = dots = 0.0
    for o in members:
        op = graph.ops[o]
        if op.kind == "opaque":
            dots += graph.op_flops[o]
        elif op.opcode in TRANSCENDENTAL:
            transcendental += sum(t.elements for t in op.inst.outputs)
        elif op.opcode == "reduce":
            elementwise += graph.op_flops[o]
        else:
            elementwise += sum(t.elements for t in op.inst.outputs)
    return np.array([1.0, float(read + written), elementwise, transcendental, dots])


@dataclasses.dataclass
class AnalyticalEstimator:
    """Additive roofline: launch + bytes moved + elementwise, transcendental and dot work, each
    with a per-unit cost fitted (non-negative least squares, relative error) to the device's
    profiled kernels. The defaults are rough CPU figures for when nothing was profiled."""

    coefficients: tuple[float, ...] = (3.0, 1.0 / 5e3, 1.0 / 2e3, 1.0 / 2e2, 1.0 / 1e4)
    name: str = "analytical"

    def estimate(self, graph, kernels):
        coef = np.array(self.coefficients)
        return [float(kernel_features(graph, k) @ coef) for k in kernels]

    @classmethod
    def fit(cls, samples: Sequence[tuple[np.ndarray, float]]) -> "AnalyticalEstimator":
        """samples: (kernel_features, measured us). Defaults with fewer than 8 samples."""
        if len(samples) < 8:
            return cls()
        x = np.stack([f for f, _ in samples])
        y = np.array([t for _, t in samples])
        w = 1.0 / np.maximum(y, 1e-3)  # kernels span orders of magnitude: fit relative error
        n = x.shape[1]
        best, best_err = None, np.inf
        for mask in range(1, 2 ** n):  # exhaustive NNLS over the few coefficients
            cols = [i for i in range(n) if mask >> i & 1]
            coef, *_ = np.linalg.lstsq(x[:, cols] * w[:, None], y * w, rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(n)
            full[cols] = coef
            err = float(np.sum(((x @ full - y) * w) ** 2))
            if err < best_err:
                best, best_err = full, err
        return cls() if best is None else cls(tuple(float(c) for c in best))

    def to_json(self) -> dict:
        return {"coefficients": list(self.coefficients),
                "features": ["launch", "bytes", "elementwise", "transcendental", "dot_flops"]}


class CalibratedEstimator:
    """Measured time, redistributed: a base estimator supplies only the relative gain of fusion.

    Each op of a profiled kernel K carries a share of K's measured time, split by the base
    model's cost of the op alone, and the fusion gain of K (base(K) / sum of base(op) over K).
    A kernel is estimated as the sum of its ops' shares times its own fusion gain over theirs:

        estimate(K') = sum_{o in K'} share(o) * gain(K') / gain(K_o)

    so a kernel XLA formed costs exactly its measured time, and kernels the search forms from
    its pieces are costed consistently with them: the search cannot win by trading measured
    kernels for ones the base model underestimates. Ops never measured use the base model
    scaled by the median measured/estimated ratio."""

    def __init__(self, base: Estimator, graph: Graph, measured: dict[frozenset[int], float]):
        self.base = base
        self.name = f"calibrated-{base.name}"
        self.graph = graph
        self.share: dict[int, float] = {}
        self.gain: dict[int, float] = {}
        ratios = []
        for k, t in measured.items():
            alone = self._alone(k)
            total = sum(alone.values()) or 1.0
            kernel = self.base.estimate(graph, [k])[0] or total
            ratios.append(t / kernel if kernel > 0 else 1.0)
            for o, b in alone.items():
                if o not in self.share:  # an op XLA duplicated: its first kernel speaks for it
                    self.share[o] = t * b / total
                    self.gain[o] = kernel / total
        self.default_ratio = float(np.median(ratios)) if ratios else 1.0

    def _alone(self, kernel: frozenset[int]) -> dict[int, float]:
        ops = sorted(kernel)
        return {o: float(b or 0.0) for o, b in zip(ops, self.base.estimate(self.graph, [frozenset([o]) for o in ops]))}

    def estimate(self, graph, kernels):
        if graph is not self.graph:
            return [None] * len(kernels)
        out = []
        for k, est in zip(kernels, self.base.estimate(graph, kernels)):
            if est is None:
                out.append(None)
                continue
            alone = self._alone(k)
            gain = est / (sum(alone.values()) or 1.0)
            total = 0.0
            for o, b in alone.items():
                if o in self.share:
                    total += self.share[o] * gain / max(self.gain[o], 1e-9)
                else:
                    total += b * gain * self.default_ratio
            out.append(total)
        return out


class ChainEstimator:
    """Ask each estimator in turn; the first answer wins. Caches per graph and kernel."""

    def __init__(self, estimators: Sequence[Estimator]):
        self.estimators = list(estimators)
        self.name = "+".join(e.name for e in self.estimators)
        self._cache: dict[tuple[int, frozenset[int]], tuple[float, str]] = {}

    def estimate(self, graph, kernels):
        return [t for t, _ in self.estimate_with_source(graph, kernels)]

    def estimate_with_source(self, graph, kernels) -> list[tuple[float, str]]:
        gid = id(graph)
        missing = [k for k in dict.fromkeys(kernels) if (gid, k) not in self._cache]
        for est in self.estimators:
            if not missing:
                break
            answers = est.estimate(graph, missing)
            still = []
            for k, t in zip(missing, answers):
                if t is None:
                    still.append(k)
                else:
                    self._cache[(gid, k)] = (max(float(t), 0.0), est.name)
            missing = still
        for k in missing:
            self._cache[(gid, k)] = (0.0, "none")
        return [self._cache[(gid, k)] for k in kernels]


# --------------------------------------------------------------------------- simulator


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
    holds the compute stream (0 for a GPU's separate communication stream; on XLA:CPU collectives
    run on the executor's threads and block, DESIGN.md point 7). Both are fitted per step by
    `calibrate` from measured runs of two strategies."""

    compute_scale: float = 1.0
    comm_blocking: float = 0.0

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def calibrate(simulate_at: "Callable[[SimulatorParams], tuple[float, float]]", measured: tuple[float, float],
              blocking_grid: Sequence[float] = tuple(i / 20 for i in range(21))) -> SimulatorParams:
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


def simulate(graph: Graph, strategy: Strategy, estimator: Estimator, allreduce: AllReduceCostModel,
             params: SimulatorParams = SimulatorParams(), *, dag: KernelDag | None = None,
             record: bool = False) -> SimulatedStep | None:
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
        iteration_us=iteration, compute_us=compute_us, comm_us=comm_us,
        overlap_ratio=min(1.0, hidden / comm_us) if comm_us else 1.0,
        full_overlap_us=max(compute_us, comm_us),
        num_fusions=sum(1 for k in range(n) if dag.kinds[k] == GROUP and len(dag.members[k]) > 1),
        num_allreduces=sum(1 for k in range(n) if dag.kinds[k] == BUCKET),
        events=events,
        allreduce_ready_us=[ready_at[k] for k in range(n) if dag.kinds[k] == BUCKET])


def _label(graph: Graph, dag: KernelDag, k: int) -> str:
    if dag.kinds[k] == BUCKET:
        return f"all-reduce[{len(dag.members[k])}]"
    ops = sorted(dag.members[k])
    first = graph.ops[ops[-1]].name
    return first if len(ops) == 1 else f"fusion[{len(ops)}]:{first}"
