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
all-reduce by `params.bucket_us` of its operands' bytes, any other by `collective_time_us`; a
model with `for_group(device ids)` costs each collective with the model of its replica group.

**The schedule** (XLA:GPU's execution, and what XLA:CPU's text allows): one compute stream runs
the compute kernels one after the other in schedule order. Collectives run on one communication
stream in the order they start, each when the compute stream reaches it and the communication
stream is free. An async collective's done makes the compute stream wait for it; a synchronous
one (every collective of XLA:CPU, which are blocking, DESIGN.md point 7; XLA:GPU's `is_sync`
ones) holds the compute stream until it ends. XLA:CPU's thunk executor also runs independent
thunks side by side; this model does not: a device's compute kernels add up (on `cpu-8dev` the
8 devices' thunks share 2 cores, and profiled times were taken under the same sharing). The
iteration ends when both streams are done, plus `params.step_overhead_us`.

**Control flow** (`backends.compiled.ControlFlow`). Where the schedule reaches a `while`, its body
runs on the same two streams, in the body's own schedule, once per iteration (its condition
before each iteration and after the last where the runtime evaluates it); the collectives of the
body start and are waited for where the body schedules them, so an all-reduce of layer l hides
under layer l's remaining kernels only. Every run of a kernel is a `CostedKernel` of its own
(`iteration`: its loop iterations, outermost first). A `conditional` runs its most expensive
branch (each branch is simulated from the same state; the one that ends latest is kept), and
`CompiledCost.control_flow` says which it took. `call`s are inlined by the reader.
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
    from disco_jax.backends.compiled import CompiledKernel, ControlFlow

# How a kernel was costed, by the name of the estimator that answered (others: that name).
METHODS = {"profile": "measured", "gnn": "gnn", "gnn+launch": "gnn", "analytical-scaled": "roofline"}
COLLECTIVE_METHOD = "collective model"


@dataclasses.dataclass(frozen=True)
class CompiledProgram:
    """A compiled module read for costing: its kernels (each scope in schedule order), its loops
    and conditionals, the module as graph IR (`build_graph(..., merge_duplicates=False,
    control_flow=True)`: loop bodies' ops too), and each compute kernel's ops in that graph."""

    kernels: tuple[CompiledKernel, ...]
    graph: Graph
    ops: Mapping[str, frozenset[int]]  # compute kernel name -> its op ids
    control_flow: tuple[ControlFlow, ...] = ()
    buffers: tuple[int, int] = (0, 0)  # arrays a call takes and returns (`cost.host.program_buffers`)

    @property
    def compute_kernels(self) -> list[CompiledKernel]:
        return [k for k in self.kernels if not k.is_collective]

    @property
    def collectives(self) -> list[CompiledKernel]:
        return [k for k in self.kernels if k.is_collective]

    @property
    def repeats(self) -> dict[str, int]:
        """Runs per step of each kernel, by name (a loop body's: its trip count)."""
        return {k.name: k.repeat for k in self.kernels}


def compiled_program(text: str, backend: Backend, scheduled: bool = True) -> CompiledProgram:
    """Read a compiled executable's module text (`compiled.as_text()`) of `backend`'s compiler
    (`scheduled=False`: a captured module, in its instructions' order)."""
    schedule = backend.read_kernels(text, scheduled)
    kernels = tuple(schedule)
    graph = build_graph(text, backend.fusible, merge_duplicates=False, control_flow=bool(schedule.control_flow))
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
    return CompiledProgram(kernels, graph, ops, schedule.control_flow, program_buffers(text))


def measured_table(program: CompiledProgram, times_us: Mapping[str, float]) -> TableEstimator:
    """Profiled kernel times by instruction name (`_device_timing.measure_kernel_times` of the executable
    `program` was read from: per step) as a table by kernel signature, per run: a loop body's
    kernel, whose trace shows each iteration's run, is its step's total over its trip count. The
    table answers for the same kernel in any program (names alone would not: another compile
    reuses them for other kernels). Kernels of one signature (the same computation, XLA:CPU's
    per-layer Adam fusions) get their mean. A conditional's branch kernel is divided as if its
    branch ran every time its conditional did."""
    graph = program.graph
    repeats = program.repeats
    by_signature: dict[str, list[float]] = {}
    for name, ops in program.ops.items():
        if name in times_us:  # a loop body's kernel: its per-step total over its runs
            by_signature.setdefault(graph.kernel_signature(ops), []).append(float(times_us[name]) / repeats[name])
    return TableEstimator({sig: sum(times) / len(times) for sig, times in by_signature.items()})


@dataclasses.dataclass(frozen=True)
class CostedKernel:
    """One run of a kernel as `cost_program` charged it. kind: the compute kernel's kind
    (`backends.compiled.CompiledKernel`) or the collective's name. lane: 'compute' or 'comm' (a
    synchronous collective is on 'comm' and holds the compute stream too); start_us / end_us on it.
    scope: where it runs (``""``: the entry; ``"while.3/body"``); iteration: the iterations of the
    loops around it, outermost first (() outside loops)."""

    name: str
    kind: str
    method: str
    time_us: float
    lane: str
    start_us: float
    end_us: float
    assumed: tuple[str, ...] = ()
    scope: str = ""
    iteration: tuple[int, ...] = ()

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["assumed"] = list(self.assumed)
        out["iteration"] = list(self.iteration)
        return out


@dataclasses.dataclass(frozen=True)
class CompiledCost:
    """What `cost_program` computed: times in microseconds, and every kernel."""

    iteration_us: float
    compute_us: float
    comm_us: float
    kernels: tuple[CostedKernel, ...]  # every run, in the order they start on their stream
    step_overhead_us: float = 0.0
    host_us: float = 0.0  # when the host lane issued the last kernel (0 without one)
    device_wait_us: float = 0.0  # compute-stream time spent waiting for the host to issue
    # Per loop and conditional, in the order first run: what it ran and cost (`cost_program`).
    control_flow: tuple[dict, ...] = ()

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
        """How many kernel runs each method costed."""
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
            # Runs per step: a loop body's kernels count once per iteration.
            "num_kernels": sum(1 for k in self.kernels if k.method != COLLECTIVE_METHOD),
            "num_collectives": sum(1 for k in self.kernels if k.method == COLLECTIVE_METHOD),
            "costed_by": self.costed_by,
            "assumed": dict(Counter(a for k in self.kernels for a in k.assumed)),
        }
        if self.control_flow:
            out["control_flow"] = [dict(c) for c in self.control_flow]
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
    # A cost that knows groups (`eval.clusters.GroupedCollectives`) costs a collective over part of
    # the devices for that group's size and links.
    for_group = getattr(allreduce, "for_group", None)
    if for_group is not None and k.group:
        allreduce = for_group(k.group)
    if k.collective == "all-reduce":
        return params.bucket_us(allreduce, list(k.tensor_bytes))
    return collective_time_us(allreduce, k.collective, sum(k.tensor_bytes))


@dataclasses.dataclass
class _Streams:
    """The compute and communication streams (and the host lane that issues their kernels) as
    `cost_program` runs them: when each is free, their busy time, and every kernel run so far."""

    compute_free: float = 0.0
    comm_free: float = 0.0
    compute_us: float = 0.0
    comm_us: float = 0.0
    issued: float = 0.0  # when the host lane has issued the kernels so far (0 without one)
    waited: float = 0.0  # compute-stream time spent waiting for the host
    costed: list[CostedKernel] = dataclasses.field(default_factory=list)
    control_flow: list[dict] = dataclasses.field(default_factory=list)

    def copy(self) -> _Streams:
        return dataclasses.replace(self, costed=list(self.costed), control_flow=list(self.control_flow))

    @property
    def end(self) -> float:
        return max(self.compute_free, self.comm_free, self.issued)


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
    collective_us = {k.name: _collective_us(k, allreduce, params) for k in program.collectives}
    # Per scope, its events in schedule order: (position, kernel start | kernel done | control flow).
    events: dict[str, list[tuple[int, str, object]]] = {}
    for k in program.kernels:
        events.setdefault(k.scope, []).append((k.position, "start", k))
        if k.done_position is not None:
            events[k.scope].append((k.done_position, "done", k))
    for flow in program.control_flow:
        events.setdefault(flow.scope, []).append((flow.position, "flow", flow))
    for found in events.values():
        found.sort(key=lambda e: e[0])

    def run(scope: str, iteration: tuple[int, ...], s: _Streams) -> None:
        ends: dict[str, float] = {}
        for _, what, item in events.get(scope, ()):
            if what == "flow":
                run_flow(item, iteration, s)  # type: ignore[arg-type]
                continue
            k: CompiledKernel = item  # type: ignore[assignment]
            if what == "done":
                s.compute_free = max(s.compute_free, ends[k.name])
                continue
            if host is not None:
                s.issued += host.issue(k.collective or k.kind)
            if k.is_collective:
                t = collective_us[k.name]
                start = max(s.compute_free, s.comm_free, s.issued)
                s.comm_free = ends[k.name] = start + t
                if k.done_position is None:  # synchronous: the compute stream waits for it
                    s.compute_free = s.comm_free
                s.comm_us += t
                s.costed.append(
                    CostedKernel(
                        k.name, k.collective, COLLECTIVE_METHOD, t, "comm", start, start + t, (), scope, iteration
                    )  # type: ignore[arg-type]
                )
            else:
                estimate, method, assumed = estimates[k.name]
                t = params.kernel_us(estimate)
                start = max(s.compute_free, s.issued)
                s.waited += start - s.compute_free
                s.compute_free = start + t
                s.compute_us += t
                s.costed.append(
                    CostedKernel(k.name, k.kind, method, t, "compute", start, s.compute_free, assumed, scope, iteration)
                )

    def run_flow(flow: ControlFlow, iteration: tuple[int, ...], s: _Streams) -> None:
        begin = s.compute_free
        record: dict = {"name": flow.name, "opcode": flow.opcode, "scope": flow.scope, "iteration": list(iteration)}
        if flow.opcode == "while":
            body, condition = flow.body, flow.condition
            for i in range(flow.trip_count or 0):
                if condition is not None:
                    run(condition, (*iteration, i), s)
                run(body, (*iteration, i), s)  # type: ignore[arg-type]
            if condition is not None:
                run(condition, (*iteration, flow.trip_count or 0), s)
            record.update(trip_count=flow.trip_count, trip_count_from=flow.trip_count_from)
        else:  # a conditional: the branch that ends latest, each run from the same state
            trials = []
            for part in flow.parts:
                trial = s.copy()
                run(part, iteration, trial)
                trials.append(trial)
            taken = max(range(len(trials)), key=lambda b: trials[b].end)
            record.update(
                branch=taken,
                branch_us=[t.end - s.end for t in trials],
                note="the most expensive branch is charged: which one runs is not in the program",
            )
            chosen = trials[taken]
            for field in ("compute_free", "comm_free", "compute_us", "comm_us", "issued", "waited"):
                setattr(s, field, getattr(chosen, field))
            s.costed[:], s.control_flow[:] = chosen.costed, chosen.control_flow
        record["time_us"] = s.end - begin
        s.control_flow.append(record)

    streams = _Streams(issued=host.prepare_us(*program.buffers) if host is not None else 0.0)
    run("", (), streams)
    return CompiledCost(
        streams.end + params.step_overhead_us,
        streams.compute_us,
        streams.comm_us,
        tuple(streams.costed),
        params.step_overhead_us,
        streams.issued if host is not None else 0.0,
        streams.waited,
        tuple(streams.control_flow),
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


def loop_program(program: CompiledProgram, loop: str) -> CompiledProgram:
    """The part of `program` the `while` named `loop` runs, as a program of its own: its body's
    kernels (and its condition's, nested loops' and branches'), the loop itself at the start of
    the entry. `cost_program` of it is what the loop costs where it runs."""
    [flow] = [f for f in program.control_flow if f.name == loop]
    scopes, grown = set(flow.parts), True
    while grown:
        inner = {part for f in program.control_flow if f.scope in scopes for part in f.parts}
        grown = not inner <= scopes
        scopes |= inner
    kernels = tuple(k for k in program.kernels if k.scope in scopes)
    flows = (dataclasses.replace(flow, scope="", position=0), *(f for f in program.control_flow if f.scope in scopes))
    return CompiledProgram(
        kernels,
        program.graph,
        {n: o for n, o in program.ops.items() if n in {k.name for k in kernels}},
        control_flow=flows,
    )


def captured_program(graph: Graph, backend: Backend) -> CompiledProgram | None:
    """A captured graph's own module read as a program (`compiled_program(..., scheduled=False)`:
    before scheduling, in instruction order), read once per graph and kept in its `derived` slot
    (the profile phase's loop-body table and `LoopEstimator` share it); None where a loop's trip
    count cannot be read or an op cannot be placed."""
    key = ("captured_program", backend.platform)
    if key not in graph.derived:
        try:
            graph.derived[key] = compiled_program(graph.module.to_text(), backend, scheduled=False)
        except (ValueError, KeyError):
            graph.derived[key] = None
    return graph.derived[key]


class LoopEstimator:
    """Costs a kernel that is one `while` op of a graph (the graph simulator's opaque loop) as the
    compiled-program model costs that loop: its body's kernels once per iteration, in the body's
    order, on the compute and communication streams, each by `estimator` (a profile's table holds
    a body kernel's traced time per iteration: `_profile_phase.profile`), its collectives by
    `allreduce`. The loop is read from the graph's own module (`compiled_program(...,
    scheduled=False)` of `backend`: the capture, before scheduling, in instruction order); other
    kernels get None, so a `chain` asks the next estimator. A loop whose trip count cannot be read
    gets None too (the next estimator's figure for an opaque op)."""

    name = "loop"

    def __init__(self, estimator: Estimator, allreduce: AllReduceCost, backend: Backend):
        self.estimator, self.allreduce, self.backend = estimator, allreduce, backend
        self._loops: dict[tuple[str, str], float | None] = {}

    def _program(self, graph: Graph) -> CompiledProgram | None:
        return captured_program(graph, self.backend)

    def estimate(self, graph: Graph, kernels):
        out: list[float | None] = []
        for k in kernels:
            op = graph.ops[next(iter(k))] if len(k) == 1 else None
            if op is None or op.opcode != "while":
                out.append(None)
                continue
            key = (graph.fingerprint, op.name)
            if key not in self._loops:
                program = self._program(graph)
                found = program is not None and any(f.name == op.name for f in program.control_flow)
                costed = cost_program(loop_program(program, op.name), self.estimator, self.allreduce) if found else None
                self._loops[key] = None if costed is None else costed.iteration_us
            out.append(self._loops[key])
        return out
