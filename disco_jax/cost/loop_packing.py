"""What packing a loop body's all-reduces into flat buffers (`Strategy.packed_loops`) takes off
a loop's time per step, for the graph simulator, which keeps a loop as one opaque op costed from
its body (`compiled.LoopEstimator`). `events.kernel_costs` calls it through
`events.PACKED_LOOP_SAVINGS`, set here: this module reads the compiled program, which imports
`events`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from disco_jax._graph import Graph
from disco_jax.cost import events
from disco_jax.cost.allreduce import AllReduceCost
from disco_jax.cost.compiled import captured_program, loop_program
from disco_jax.cost.events import SimulatorParams

if TYPE_CHECKING:
    from disco_jax.backends import Backend

_TRACED_LOOP_ALLREDUCES = "traced_loop_allreduces"  # graph.derived key: `record_loop_allreduce_times`


def record_loop_allreduce_times(graph: Graph, backend: Backend, times_us: Mapping[str, float]) -> None:
    """Keep the traced time per run of each of the graph's loop-body all-reduces
    (`Graph.loop_allreduces`; `times_us`: per step, by instruction name, as a profile of XLA's
    executable reports them), for `packed_loop_savings_us`: a loop costed by its own traced time
    holds its all-reduce's traced time, not the collective model's."""
    program = captured_program(graph, backend)
    names = {name for _, name in graph.loop_allreduces}
    if program is None or not names:
        return
    runs = program.repeats
    graph.derived[_TRACED_LOOP_ALLREDUCES] = {n: times_us[n] / runs[n] for n in names if n in times_us and runs.get(n)}
    for key in [k for k in graph.derived if isinstance(k, tuple) and k[0] == "packed_loop_savings"]:
        del graph.derived[key]


def packed_loop_savings_us(graph: Graph, backend: Backend, allreduce: AllReduceCost) -> dict[int, float]:
    """Per `while` op of the graph (op id), what packing its bodies' all-reduces into flat buffers
    (`Strategy.packed_loops`, `Graph.loop_allreduces`) takes off the loop's time per step: per
    run of such an all-reduce, its time as the loop's cost holds it (traced, where a profile
    recorded it: `record_loop_allreduce_times`; else the variadic all-reduce's by `allreduce`, as
    `LoopEstimator` charges it) times the share packing saves by the collective model (1 - the
    packed all-reduce's time, `SimulatorParams.packed_bucket_us`, over the variadic one's), times
    its runs per step. Subtracting is right where a body's collectives block its compute, as
    XLA:CPU's do, the one backend that packs (`Backend.packs_buckets`). Loops the capture's
    program cannot cost save nothing."""
    key = ("packed_loop_savings", backend.platform, repr(allreduce))
    if key in graph.derived:
        return graph.derived[key]
    program, packed = captured_program(graph, backend), {name for _, name in graph.loop_allreduces}
    traced = graph.derived.get(_TRACED_LOOP_ALLREDUCES, {})
    saved: dict[int, float] = {}
    if program is not None and packed:
        params, ops = SimulatorParams(), {op.name: op.id for op in graph.ops}
        for flow in program.control_flow:
            if flow.scope or flow.name not in ops:
                continue
            for k in loop_program(program, flow.name).kernels:
                if k.name in packed and k.collective == "all-reduce":
                    variadic = params.bucket_us(allreduce, list(k.tensor_bytes))
                    share = 1.0 - params.packed_bucket_us(allreduce, list(k.tensor_bytes)) / variadic
                    charged = traced.get(k.name, variadic)
                    o = ops[flow.name]
                    saved[o] = saved.get(o, 0.0) + program.repeats[k.name] * charged * share
    graph.derived[key] = saved
    return saved


events.PACKED_LOOP_SAVINGS = packed_loop_savings_us
