"""The measured search's side on the devices: each candidate compiled through the rewriter, its
outputs checked, timed against XLA's executable in interleaved pairs and its kernels traced
(`device_measure`), and `tune`, the search phase's measured loop (`_tuning.measured_search`) run
with it. `kernel_members` maps a rewritten module's kernels back to the ops the simulator costs,
so that the measured kernel times flow into the model."""

from __future__ import annotations

import itertools

from disco_jax import _distributed, _hlo, _profile_phase, _search, _validate, cost
from disco_jax._compile import Captured, Runner, compile_strategy, compiled_stats, keeps_plan
from disco_jax._console import Ui
from disco_jax._edit import prune
from disco_jax._graph import Graph
from disco_jax._ranking import CompiledRanking
from disco_jax._strategy import Strategy, group_exports, regroups_only
from disco_jax._tuning import Measure, Measurement, Tuned, TuningConfig, measured_search


def kernel_members(graph: Graph, strategy: Strategy, module_text: str) -> dict[str, frozenset[int]]:
    """Entry instruction name -> the ops of its kernel as the simulator costs it, in a module the
    backend's rewriter wrote for `strategy`: XLA's fusions it kept (by name), ops left unfused and
    opaque ops (by name), and new fusions (their fused computations name each op `<op>.<suffix>`,
    `disco_jax._rewrite.fused_computation`), each mapped back to the strategy's group."""
    module = _hlo.parse_module(module_text)
    op_ids = {op.name: op.id for op in graph.ops if op.kind in ("fusible", "opaque")}
    xla = dict(zip(graph.xla_kernel_names, graph.xla_groups))
    exports = group_exports(graph, strategy)
    groups = {prune(graph, g, exports[gi]): g for gi, g in enumerate(strategy.groups) if exports[gi]}
    out: dict[str, frozenset[int]] = {}
    for inst in module.entry.instructions:
        if inst.name in xla:
            out[inst.name] = xla[inst.name]
        elif inst.name in op_ids:
            out[inst.name] = frozenset([op_ids[inst.name]])
        elif inst.opcode == "fusion":
            body = module.computation((inst.attr("calls") or "").lstrip("%")).instructions
            ops = frozenset(op_ids[n] for n in (i.name.rsplit(".", 1)[0] for i in body) if n in op_ids)
            if ops and all(graph.ops[o].kind == "fusible" for o in ops):
                out[inst.name] = groups.get(ops, ops)
    return out


def device_measure(step: Captured, default_runner: Runner, tuning: TuningConfig) -> Measure:
    """The real `measure`: compile the candidate through the rewriter, check its outputs against
    the step's (`step.output_check`, the same check as validation's), time it against XLA's
    executable in interleaved pairs, and trace its kernels. Every process of a job calls it for
    the same candidates in the same order (the runs are collectives)."""
    graph, count = step.graph, itertools.count()

    def measure(strategy: Strategy) -> Measurement:
        index = next(count)
        runner = step.runner(compile_strategy(step.lowered, step.program, strategy)[0])
        outputs = step.output_check.compare(
            runner(),
            bitwise=regroups_only(graph, strategy),
            merge_key=None if step.scope is None else f"{step.scope}/tuning/{index}/outputs",
            rerun=runner.on,
        )
        # With several processes each pair is judged as the job's steps, as validation judges it.
        merge = None if step.scope is None else _distributed.slowest_pairs(f"{step.scope}/tuning/{index}/timing")
        timing = _validate.time_interleaved(default_runner, runner, pairs=tuning.pairs, merge=merge)
        times = _profile_phase.kernel_times(step, runner, strategy, steps=tuning.kernel_steps)
        names = kernel_members(graph, strategy, step.backend.rewriter.rewrite(step.program, strategy))
        kernels = {names[n]: t for n, t in times.items() if n in names}
        counts = compiled_stats(runner.as_text())
        return Measurement(timing, kernels, counts["all-reduce"], outputs, keeps_plan(counts, step.program, strategy))

    return measure


def tune(
    step: Captured,
    cost_model: cost.CostModel,
    first: _search.SearchResult | None,
    default_runner: Runner,
    search: _search.SearchConfig,
    candidates: int,
    validation_pairs: int,
    ui: Ui,
) -> Tuned | None:
    """The search phase's measured loop on the devices: `candidates` per round, timed with half
    the validation's first look of pairs (at least 6)."""
    tuning = TuningConfig(candidates=candidates, pairs=max(6, validation_pairs // 2))
    points = _profile_phase.calibration_points(step.program, cost_model.sources)
    measure, rank = device_measure(step, default_runner, tuning), CompiledRanking.of(step, cost_model)
    return measured_search(
        step.program, cost_model, first, search, tuning, measure, scope=step.scope, points=points, ui=ui, rank=rank
    )
