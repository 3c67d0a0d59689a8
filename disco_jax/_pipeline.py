"""The stages behind `@optimize_distributed`, as functions over typed records.

    prepare ─ capture ─ weight-update choice ─┬─ search phase (`_search_phase`):
              (Captured)   (WeightUpdate)      │    profile → calibrate → search → measure → validate → store
                                               └─ enact phase (`_enact_phase`): load → apply

`prepare` is what the decorator calls for a new program (argument signature and static values):
the list of stages. It returns the executable the program runs and fills a `StepReport`
(`_options`). The weight-update stage decides which program the phases optimize: with
`weight_update="sharded"` the captured step lowered again with its optimizer state sharded over
the data axis (`sharding.update.sharded_step`); with `weight_update="search"` (the default) the
search phase first profiles the replicated step and chooses (`sharding.choice.choose`; the
decision is stored as the replicated program's plan) and the enact phase reads that decision back
(`sharding.choice.recall`); where a sharded program was chosen, its first call reshards the
arguments (`sharding.update.Resharding`). With several processes every process holds the same
program (`agree`, before anything collective runs) and runs the same executables in the same
order; process 0 alone searches and decides (`_search_phase`, `_enact_phase`).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any

import jax

from disco_jax import _distributed, _plan, _warnings, backends
from disco_jax._compile import Captured, capture, compiled_stats
from disco_jax._console import Ui
from disco_jax._enact_phase import enact_phase
from disco_jax._options import Options, StepReport
from disco_jax._output_check import Float64Run
from disco_jax._search_phase import Profiled, profile_stage, search_phase, store_stage
from disco_jax.sharding import choice, mesh_plan, update

__all__ = ["prepare"]


@dataclasses.dataclass
class WeightUpdate:
    """The weight-update stage's result: the program the later stages optimize (the step as
    captured, or lowered again with its optimizer state sharded), its `Layout` (None: replicated),
    what the report and plan record, and the replicated step's `Profiled` where the choice built
    one (the search phase then reuses it when the program stayed the replicated one)."""

    step: Captured
    layout: update.Layout | None
    info: dict
    profiled: Profiled | None = None


def prepare(
    fn: Callable,
    args: tuple,
    kwargs: dict,
    dynamic_args: tuple,
    dynamic_kwargs: dict,
    options: Options,
    search: bool,
    report: StepReport,
) -> Callable:
    """The executable for one program: the plan's, or XLA's own when there is no usable plan
    (compiled either way), or `fn` itself on a backend disco-jax does not support.
    `args`/`kwargs` are the call as made (for lowering); `dynamic_*` without static arguments.

    The stages, in order: capture, weight-update choice, then the search phase (profile,
    calibrate, search, measure, validate, store) or the enact phase (load, apply)."""
    ui = Ui(options.verbose)
    backend = supported_backend(report)
    if backend is None:
        return fn
    step = capture_stage(fn, args, kwargs, dynamic_args, dynamic_kwargs, backend)
    meshed = layout_stage(fn, step, args, kwargs, dynamic_args, backend, options, search, report, ui)
    if meshed is not None:
        return meshed
    chosen = weight_update_stage(fn, step, args, kwargs, backend, options, search, report, ui)
    if chosen.info.get("mode") == "mesh":  # memory chose a two-axis plan: XLA's program of it runs
        _describe(step, report, chosen.info["layout"])
        return mesh_plan.MeshRun(chosen.step)
    run = _phase(chosen.step, options, search, report, ui, chosen.profiled)
    return run if chosen.layout is None else update.Resharding(run, chosen.layout)


def supported_backend(report: StepReport) -> Any:
    """The step's backend, or None (with a warning) where the decorator does not support it."""
    backend = backends.for_platform(report.backend)
    if backend is None or not backend.decorator_ready:
        _warnings.warn(
            f"disco-jax: backend {report.backend!r} is not supported by the decorator yet (supported: "
            f"{', '.join(backends.supported_platforms(decorator=True))}); running the unmodified step",
        )
        report.reason = "unsupported backend"
        return None
    return backend


def capture_stage(
    fn: Callable, args: tuple, kwargs: dict, dynamic_args: tuple, dynamic_kwargs: dict, backend
) -> Captured:
    """The step lowered as called and captured through the backend's hook (graph, XLA's plan,
    its executable); its float64 run is kept for an output check that needs it."""
    step = capture(fn.lower(*args, **kwargs), backend, dynamic_args, dynamic_kwargs)
    step.exact = Float64Run(fn, args, kwargs)  # run only if a plan's outputs need it
    return step


def layout_stage(
    fn: Callable,
    step: Captured,
    args: tuple,
    kwargs: dict,
    dynamic_args: tuple,
    backend,
    options: Options,
    search: bool,
    report: StepReport,
    ui: Ui,
) -> Any | None:
    """A two-axis plan (`sharding.mesh_plan`) where `options.layout` forces one, or (enact phase,
    `layout="search"`) where the stored plan holds one: its `MeshRun`; None where the step stays
    on its one data axis (the weight-update stage and the phases then run as before). A plan chosen
    under a memory limit in the search phase is the weight-update stage's (`choice.choose`)."""
    value = options.layout
    forced = mesh_plan.is_forced(value)
    if value == "data" or (search and not forced):
        return None
    why = mesh_plan.not_applicable(fn, step, args, kwargs, dynamic_args)
    if why is None and not forced:
        with warnings.catch_warnings():  # a corrupt or stale plan is reported once, by the enact phase
            warnings.simplefilter("ignore", _plan.PlanWarning)
            plan, _ = _plan.find_plan(step.graph.fingerprint, step.machine, options.plan_dir)
        if mesh_plan.stored_layout(plan, len(step.devices))[0] is None:
            return None
    found = None
    if why is None:
        found, why = mesh_plan.structure_of(fn, step)
    if found is None:
        if forced:
            _warnings.warn(f"disco-jax: layout {value!r} not applicable ({why}); running the one-axis step")
        return None
    if forced:
        try:
            run, info = mesh_plan.forced(fn, step, found, value, backend, options, search, ui)
        except ValueError as e:
            _warnings.warn(f"disco-jax: layout {value!r} not applicable ({e}); running the one-axis step")
            return None
    else:
        recalled = mesh_plan.recall(fn, step, found, backend, options, ui)
        if recalled is None:
            return None
        run, info = recalled
    report.layout = info
    if run is None and forced:  # the forced plan's outputs differ: the unmodified step, nothing searched
        report.reason = info["reason"]
        return step.default_compiled
    if run is None:
        return None
    _describe(step, report, info)
    return run


def _describe(step: Captured, report: StepReport, info: dict) -> None:
    """The report of a program that runs a two-axis plan."""
    report.layout, report.applied, report.reason = info, True, info["reason"]
    report.fingerprint, report.module = step.graph.fingerprint, step.graph.module.name
    report.default_counts = compiled_stats(step.default_compiled.as_text())


def weight_update_stage(
    fn: Callable,
    step: Captured,
    args: tuple,
    kwargs: dict,
    backend,
    options: Options,
    search: bool,
    report: StepReport,
    ui: Ui,
) -> WeightUpdate:
    """Which program the later stages optimize, by `options.weight_update`: 'sharded' lowers the
    step again with its optimizer state sharded (`update.sharded_step`); 'search' chooses
    (`choice.choose`, which profiles the replicated step and measures its candidates; the decision
    is stored as the replicated program's plan) in the search phase and reads the stored decision
    back (`choice.recall`) in the enact phase; otherwise the replicated step."""
    if options.weight_update == "sharded":
        agree(step, report)  # its output check runs both programs and merges every process's verdict
        program, layout, info = update.sharded_step(fn, step, args, kwargs, backend, search)
        chosen = WeightUpdate(program, layout, info)
    elif options.weight_update == "search" and step.graph.gradients:
        agree(step, report)  # before anything collective
        if search:
            profiled = profile_stage(step, options, ui)
            beyond = None
            limit = options.memory_limit_bytes
            if (
                options.layout == "search"
                and limit is not None
                and mesh_plan.not_applicable(fn, step, args, kwargs, step.args) is None
            ):
                beyond = functools.partial(
                    mesh_plan.choose_for_memory,
                    fn,
                    step,
                    backend,
                    limit,
                    options.validation_pairs,
                    options.measured_candidates,
                    ui,
                )
            program, layout, info = choice.choose(
                fn,
                step,
                args,
                kwargs,
                backend,
                profiled,
                options.memory_limit_bytes,
                options.validation_pairs,
                ui,
                options.search,
                beyond,
            )
            meshed = info.get("mode") == "mesh"
            chosen = WeightUpdate(program, layout, info, profiled if layout is None and not meshed else None)
            if (layout is not None or meshed) and jax.process_index() == 0:
                store_stage(choice.decision_plan(step.graph, step.machine, info), {}, options.plan_dir)
        else:
            program, layout, info = choice.recall(
                fn, step, args, kwargs, backend, options.plan_dir, options.memory_limit_bytes
            )
            chosen = WeightUpdate(program, layout, info)
    else:
        chosen = WeightUpdate(step, None, {"mode": "replicated", "requested": options.weight_update, "reason": None})
    report.weight_update = chosen.info
    return chosen


def agree(step: Captured, report: StepReport) -> None:
    """Before anything collective runs: with several processes, every process must hold the same
    program, machine, versions and phase, or all of them fail here with one message."""
    if _distributed.is_multiprocess():
        step.scope = _distributed.new_scope("step")
        report.process_index = jax.process_index()
        _distributed.agree(
            f"{step.scope}/program",
            {"fingerprint": step.graph.fingerprint, "phase": report.phase, **dataclasses.asdict(step.machine)},
        )


def _phase(
    step: Captured, options: Options, search: bool, report: StepReport, ui: Ui, profiled: Profiled | None
) -> Any:
    """Capture done: check that the processes agree, then the search or the enact phase.
    `profiled`: the step's cost model and profile database, where the weight-update choice built them."""
    graph = step.graph
    report.fingerprint, report.module, report.graph = graph.fingerprint, graph.module.name, graph.summary()
    report.default_counts = compiled_stats(step.default_compiled.as_text())
    report.rules_applied = list(step.program.rules_applied)
    if step.scope is None:
        agree(step, report)
    if not graph.gradients and not graph.fusible_ops:  # one device still has fusion to decide
        ui.say(f"{graph.module.name}: no all-reduce and no fusible op in the step; running it unmodified")
        report.reason = "nothing to optimize"
        return step.default_compiled
    if search:
        return search_phase(step, options, report, ui, profiled)
    return enact_phase(step, options, report, ui)
