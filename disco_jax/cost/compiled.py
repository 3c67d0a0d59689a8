"""The cost of a compiled program: its own kernels, in XLA's schedule (DESIGN.md point 18).

The graph-level simulator (`cost.simulator`) costs a strategy as the search sees it: groups of
graph ops. This model costs what XLA compiled, after all of its passes, and nothing else:

    executable text -> compiled_program(text, backend) -> CompiledProgram
        (its kernels, `Backend.read_kernels`: fusions, library calls, ops left unfused,
         collectives, in schedule order; and the module as graph IR, every fusion's ops its own)
    -> cost_program(program, estimator, collectives, params) -> CompiledCost
        (per kernel: kind, how it was costed, time, start and end on its stream; iteration,
         compute, communication, FO)

**A compute kernel** is costed by the estimator chain (`cost.estimators`) on its ops in that
graph: a fusion XLA built from loop-emitted ops is those ops (what the GNN reads); any other
kernel (a gemm or convolution fusion, a library call, a copy) is the one opaque op the graph
makes of it. The first estimator that answers costs it, and the kernel records which
(`method`: ``measured`` for a profile's table, ``gnn``, ``roofline``, or the estimator's own
name), plus the assumed constants its time rests on where the estimator says
(`RooflineEstimator.assumptions`). Its time is `params.kernel_us(estimate)`. Profiled times by
instruction name (XLA:CPU's trace names the executable's instructions) enter as a table by
kernel signature (`measured_table`), so they cost the same kernel in any other program too.

**A collective** is costed by the collective model (`cost.allreduce.AllReduceCost`): an
all-reduce by `params.bucket_us` of its operands' bytes, any other by `collective_time_us`.

**The schedule** (XLA:GPU's execution, and what XLA:CPU's text allows): one compute stream runs
the compute kernels one after the other in schedule order. Collectives run on one communication
stream in the order they start, each when the compute stream reaches it and the communication
stream is free. An async collective's done makes the compute stream wait for it; a synchronous
one (every collective of XLA:CPU, which are blocking, DESIGN.md point 7; XLA:GPU's `is_sync`
ones) holds the compute stream until it ends. XLA:CPU's thunk executor also runs independent
thunks side by side; this model does not: a device's compute kernels add up (on `cpu-8dev` the
8 devices' thunks share 2 cores, and profiled times were taken under the same sharing). The
iteration ends when both streams are done, plus `params.step_overhead_us`.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING

from disco_jax._graph import Graph, build_graph
from disco_jax.cost.allreduce import AllReduceCost, collective_time_us
from disco_jax.cost.estimators import ChainEstimator, Estimator, TableEstimator
from disco_jax.cost.events import SimulatorParams
from disco_jax.cost.host import program_buffers

if TYPE_CHECKING:
    from disco_jax.backends import Backend
    from disco_jax.backends.compiled import CompiledKernel

# How a kernel was costed, by the name of the estimator that answered (others: that name).
METHODS = {"profile": "measured", "gnn": "gnn", "gnn+launch": "gnn", "analytical-scaled": "roofline"}
COLLECTIVE_METHOD = "collective model"


@dataclasses.dataclass(frozen=True)
class CompiledProgram:
    """A compiled module read for costing: its kernels in schedule order, the module as graph IR
    (`build_graph(..., merge_duplicates=False)`), and each compute kernel's ops in that graph."""

    kernels: tuple[CompiledKernel, ...]
    graph: Graph
    ops: Mapping[str, frozenset[int]]  # compute kernel name -> its op ids
    buffers: tuple[int, int] = (0, 0)  # arrays a call takes and returns (`cost.host.program_buffers`)

    @property
    def compute_kernels(self) -> list[CompiledKernel]:
        return [k for k in self.kernels if not k.is_collective]

    @property
    def collectives(self) -> list[CompiledKernel]:
        return [k for k in self.kernels if k.is_collective]


def compiled_program(text: str, backend: Backend) -> CompiledProgram:
    """Read a compiled executable's module text (`compiled.as_text()`) of `backend`'s compiler."""
    kernels = tuple(backend.read_kernels(text))
    graph = build_graph(text, backend.fusible, merge_duplicates=False)
    by_name = dict(zip(graph.xla_kernel_names, graph.xla_groups))  # XLA's loop fusions, opened
    for op in graph.ops:
        if op.kind == "opaque":
            by_name.setdefault(op.name, frozenset([op.id]))
    ops = {}
    for k in kernels:
        if not k.is_collective:
            members = by_name.get(k.name)
            if not members:
                raise ValueError(f"kernel {k.name} ({k.opcode}) has no ops in the module's graph")
            ops[k.name] = members
    return CompiledProgram(kernels, graph, ops, program_buffers(text))


def measured_table(program: CompiledProgram, times_us: Mapping[str, float]) -> TableEstimator:
    """Profiled kernel times by instruction name (`_device_timing.measure_kernel_times` of the executable
    `program` was read from) as a table by kernel signature: it answers for the same kernel in any
    program (names alone would not: another compile reuses them for other kernels). Kernels of
    one signature (the same computation, XLA:CPU's per-layer Adam fusions) get their mean."""
    graph = program.graph
    by_signature: dict[str, list[float]] = {}
    for name, ops in program.ops.items():
        if name in times_us:
            by_signature.setdefault(graph.kernel_signature(ops), []).append(float(times_us[name]))
    return TableEstimator({sig: sum(times) / len(times) for sig, times in by_signature.items()})


@dataclasses.dataclass(frozen=True)
class CostedKernel:
    """One kernel as `cost_program` charged it. kind: the compute kernel's kind
    (`backends.compiled.CompiledKernel`) or the collective's name. lane: 'compute' or 'comm' (a
    synchronous collective is on 'comm' and holds the compute stream too); start_us / end_us on it."""

    name: str
    kind: str
    method: str
    time_us: float
    lane: str
    start_us: float
    end_us: float
    assumed: tuple[str, ...] = ()

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["assumed"] = list(self.assumed)
        return out


@dataclasses.dataclass(frozen=True)
class CompiledCost:
    """What `cost_program` computed: times in microseconds, and every kernel."""

    iteration_us: float
    compute_us: float
    comm_us: float
    kernels: tuple[CostedKernel, ...]  # in schedule order
    step_overhead_us: float = 0.0
    host_us: float = 0.0  # when the host lane issued the last kernel (0 without one)
    device_wait_us: float = 0.0  # compute-stream time spent waiting for the host to issue

    @property
    def full_overlap_us(self) -> float:
        """FO: max(compute, comm) plus the step's fixed cost (as `simulator.SimulatedStep`)."""
        return max(self.compute_us, self.comm_us) + self.step_overhead_us

    @property
    def overlap_ratio(self) -> float:
        """The fraction of communication time hidden under compute."""
        if not self.comm_us:
            return 1.0
        busy = self.iteration_us - self.step_overhead_us
        return min(1.0, max(0.0, self.compute_us + self.comm_us - busy) / self.comm_us)

    @property
    def costed_by(self) -> dict[str, int]:
        """How many kernels each method costed."""
        return dict(Counter(k.method for k in self.kernels))

    def to_json(self, kernels: bool = False) -> dict:
        """The figures and how the kernels were costed (counts); `kernels`: every kernel too."""
        out = {
            "iteration_us": self.iteration_us,
            "compute_us": self.compute_us,
            "comm_us": self.comm_us,
            "full_overlap_us": self.full_overlap_us,
            "overlap_ratio": self.overlap_ratio,
            "step_overhead_us": self.step_overhead_us,
            "host_us": self.host_us,
            "device_wait_us": self.device_wait_us,
            "num_kernels": sum(1 for k in self.kernels if k.method != COLLECTIVE_METHOD),
            "num_collectives": sum(1 for k in self.kernels if k.method == COLLECTIVE_METHOD),
            "costed_by": self.costed_by,
            "assumed": dict(Counter(a for k in self.kernels for a in k.assumed)),
        }
        if kernels:
            out["kernels"] = [k.to_json() for k in self.kernels]
        return out


def _flat(estimator: Estimator) -> ChainEstimator:
    """The estimator as one chain (nested chains opened), so each kernel's answer names the
    estimator that gave it."""
    parts, stack = [], [estimator]
    while stack:
        e = stack.pop(0)
        if isinstance(e, ChainEstimator):
            stack[:0] = e.estimators
        else:
            parts.append(e)
    return ChainEstimator(parts)


def _compute_times(program: CompiledProgram, estimator: Estimator) -> dict[str, tuple[float, str, tuple[str, ...]]]:
    """Per compute kernel: (estimate, method, assumed constants)."""
    chain = _flat(estimator)
    by_name = {e.name: e for e in chain.estimators}
    graph = program.graph
    names = list(program.ops)
    answers = chain.estimate_with_source(graph, [program.ops[n] for n in names])
    out = {}
    for name, (t, source) in zip(names, answers):
        explain = getattr(by_name.get(source), "assumptions", None)
        assumed = tuple(explain(graph, program.ops[name])) if callable(explain) else ()
        out[name] = (t, METHODS.get(source, source), assumed)
    return out


def _collective_us(k: CompiledKernel, allreduce: AllReduceCost, params: SimulatorParams) -> float:
    if k.collective == "all-reduce":
        return params.bucket_us(allreduce, list(k.tensor_bytes))
    return collective_time_us(allreduce, k.collective, sum(k.tensor_bytes))


def cost_program(
    program: CompiledProgram,
    estimator: Estimator,
    allreduce: AllReduceCost,
    params: SimulatorParams | None = None,
) -> CompiledCost:
    """The program's step on its streams (see the module docstring); `params`: the simulator's
    device parameters (compute scale, per-kernel and per-step overheads, per-tensor all-reduce
    latency, the host lane), default none.

    With a host lane (`params.host`), the host first prepares the call (`HostLane.prepare_us` of
    the program's arguments and results), then issues the kernels in schedule order, each taking it
    `HostLane.issue(kind)`; a kernel, compute or collective, starts no earlier than the host has
    issued it. The step ends when the streams and the host are done."""
    params = params or SimulatorParams()
    host = params.host
    estimates = _compute_times(program, estimator)
    events = []  # (schedule position, kernel index, is the done of an async collective)
    for i, k in enumerate(program.kernels):
        events.append((k.position, i, False))
        if k.done_position is not None:
            events.append((k.done_position, i, True))
    compute_free = comm_free = 0.0
    issued = host.prepare_us(*program.buffers) if host is not None else 0.0
    waited = 0.0
    ends: dict[int, float] = {}
    costed: list[CostedKernel | None] = [None] * len(program.kernels)
    compute_us = comm_us = 0.0
    for _, i, is_done in sorted(events):
        k = program.kernels[i]
        if is_done:
            compute_free = max(compute_free, ends[i])
            continue
        if host is not None:
            issued += host.issue(k.collective or k.kind)
        if k.is_collective:
            t = _collective_us(k, allreduce, params)
            start = max(compute_free, comm_free, issued)
            comm_free = ends[i] = start + t
            if k.done_position is None:  # synchronous: the compute stream waits for it
                compute_free = comm_free
            comm_us += t
            costed[i] = CostedKernel(k.name, k.collective, COLLECTIVE_METHOD, t, "comm", start, start + t)
            continue
        estimate, method, assumed = estimates[k.name]
        t = params.kernel_us(estimate)
        start = max(compute_free, issued)
        waited += start - compute_free
        compute_free = start + t
        compute_us += t
        costed[i] = CostedKernel(k.name, k.kind, method, t, "compute", start, compute_free, assumed)
    return CompiledCost(
        max(compute_free, comm_free, issued) + params.step_overhead_us,
        compute_us,
        comm_us,
        tuple(costed),  # type: ignore[arg-type]
        params.step_overhead_us,
        issued if host is not None else 0.0,
        waited,
    )


def compiled_cost(
    text: str,
    backend: Backend,
    estimator: Estimator,
    allreduce: AllReduceCost,
    params: SimulatorParams | None = None,
) -> CompiledCost:
    """`cost_program` of a compiled executable's text (`compiled_program`): one call for a row."""
    return cost_program(compiled_program(text, backend), estimator, allreduce, params)
