"""The search phase, as stages over typed records:

    profile → calibrate (`Profiled`) → search → measure (`Searched`) → validate (`Validated`) → store

`search_phase` runs them for one captured program and returns the executable the verdict keeps:
the plan's where it was measured faster with confidence and computes what XLA's program computes,
else XLA's. With several processes every process runs the same executables in the same order
(profiling, calibration, the measured loop and validation run the step: collectives); process 0
alone searches, its strategy is broadcast before validation and its plan after.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax

from disco_jax import _distributed, _files, _plan, _profile_db, _search, _strategy, _validate, _warnings
from disco_jax._compile import Captured, compile_strategy, compiled_stats, keeps_plan, rules_applied
from disco_jax._console import Ui
from disco_jax._options import Options, StepReport
from disco_jax._profile_phase import calibrate, profile
from disco_jax._strategy import Strategy
from disco_jax._tuning import Tuned
from disco_jax._tuning_devices import tune
from disco_jax.cost import CostModel
from disco_jax.sharding import choice


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The validation of a candidate plan against XLA's executable: whether to keep XLA's,
    why, and what was measured (times, output errors, what the compiled plan holds)."""

    use_default: bool
    reason: str
    measured: dict
    plan_counts: dict | None = None


class Profiled(NamedTuple):
    """The profile and calibrate stages' result: the step's cost model (its kernels profiled on
    the devices, the simulator calibrated) and the profile database it was read from and added to."""

    cost_model: CostModel
    database: _profile_db.ProfileDatabase


@dataclasses.dataclass
class Searched:
    """The search and measure stages' result: the strategy proposed for validation (XLA's own
    where nothing beat it), what the plan records about how it was found, and the measured loop's
    record (None where it did not run)."""

    best: Strategy
    info: dict
    result: _search.SearchResult | None = None
    tuned: Tuned | None = None


@dataclasses.dataclass(frozen=True)
class Validated:
    """The validate stage's result: the verdict, the candidate's executable (None: XLA's plan was
    the candidate) and both strategies' simulations, as the plan records them."""

    verdict: Verdict
    compiled: Any
    simulated: dict
    timelines: dict


def search_phase(step: Captured, options: Options, report: StepReport, ui: Ui, profiled: Profiled | None = None) -> Any:
    """profile → calibrate → search → measure → validate → store; the executable the verdict keeps."""
    report.search_ran = jax.process_index() == 0
    profiled = profiled or profile_stage(step, options, ui)
    searched = search_stage(step, profiled, options, ui)
    searched = measure_stage(step, profiled, searched, options, ui)
    validated = validate_stage(step, profiled, searched, options)
    plan = plan_of(step, searched, validated, report)
    report.simulated, report.measured, report.search = plan.simulated, plan.measured, plan.search
    report.plan, report.reason, report.applied = plan.to_json(), plan.reason, not plan.use_default
    report.rules_applied = plan.rules_applied
    if jax.process_index() == 0:
        report.plan_path = store_stage(plan, validated.timelines, options.plan_dir)
        ui.summary(step.graph.module.name, plan, report.default_counts, report.plan_counts, report.plan_path)
    return step.default_compiled if plan.use_default else validated.compiled


def profile_stage(step: Captured, options: Options, ui: Ui) -> Profiled:
    """The profile and calibrate stages: the default executable's kernels timed on the devices
    (`_profile_phase.profile`), then the simulator calibrated against measured configurations."""
    graph, machine = step.graph, step.machine
    default_runner = step.runner(step.default_compiled)
    ui.say(
        f"{graph.module.name}: profiling {len(graph.ops)} ops, {len(graph.gradients)} gradients "
        f"on {len(step.devices)} {machine.device_kind} devices"
    )
    database = _profile_db.ProfileDatabase()
    cost_model = profile(step, default_runner, database, ui)
    cost_model.sources["calibration"] = calibrate(
        cost_model, step, default_runner, options.validation_pairs, ui
    ).to_json()
    return Profiled(cost_model, database)


def search_stage(step: Captured, profiled: Profiled, options: Options, ui: Ui) -> Searched:
    """DisCo's backtracking search over the step's graph, costed by the calibrated simulator; on
    process 0 only (the others propose XLA's plan and receive process 0's after measuring)."""
    graph, cost_model = step.graph, profiled.cost_model
    default = _strategy.xla_default(graph)
    if jax.process_index() != 0:
        return Searched(default, {})
    default_us = cost_model.simulate(step.program, default).iteration_us
    cost = cost_model.evaluator(step.program)
    result = ui.search(
        lambda progress: _search.backtracking_search(step.program, cost, options.search, progress=progress),
        options.search,
        default_us,
    )
    info = {**result.stats(), "options": options.to_json(), "cost_model": cost_model.sources}
    return Searched(result.best, info, result)


def measure_stage(step: Captured, profiled: Profiled, searched: Searched, options: Options, ui: Ui) -> Searched:
    """The search proposes, the devices decide: the measured loop (`_tuning`) times the search's
    best few candidates against XLA's executable on every process; with several processes process
    0's choice is then broadcast, so every process validates the same strategy."""
    best, info, tuned = searched.best, dict(searched.info), None
    if options.measured_candidates > 0:
        k, pairs = options.measured_candidates, options.validation_pairs
        runner = step.runner(step.default_compiled)
        tuned = tune(step, profiled.cost_model, searched.result, runner, options.search, k, pairs, ui)
        if tuned is not None:
            best = tuned.best
            info.update(tuned.to_json())
            store_kernel_times(profiled.database, step.machine, tuned.kernel_times_us)
    if step.scope is not None:
        graph, default = step.graph, _strategy.xla_default(step.graph)
        found = None if best.key() == default.key() else best.to_json(graph)
        found = _distributed.broadcast_json(
            f"{step.scope}/strategy", found, timeout_s=_distributed.sync_timeout_s() + options.search.budget_s
        )
        best = default if found is None else Strategy.from_json(graph, found)
    return Searched(best, info, searched.result, tuned)


def store_kernel_times(database: _profile_db.ProfileDatabase, machine, times: dict[str, float]) -> None:
    """Kernels the measured loop timed (the candidates' own) into the profile database, where
    the next search's table and the GNN's training data find them."""
    if not times:
        return
    try:
        database.merge_kernel_times(machine.device_kind, times, backend=machine.backend)
    except OSError as e:
        _warnings.warn(f"disco-jax: could not store the measured kernel times: {e}")


def validate_stage(step: Captured, profiled: Profiled, searched: Searched, options: Options) -> Validated:
    """Both strategies simulated (the measured loop may have recalibrated), and the candidate
    compiled and held to the acceptance rule (`validate`); XLA's plan as the candidate is kept
    with the measured loop's evidence."""
    graph, cost_model, tuned = step.graph, profiled.cost_model, searched.tuned
    default, best = _strategy.xla_default(graph), searched.best
    sim_default = cost_model.simulate(step.program, default, record=True)
    same = best.key() == default.key()
    sim_best = sim_default if same else cost_model.simulate(step.program, best, record=True)
    simulated = {"default": sim_default.to_json(), "plan": sim_best.to_json()}
    timelines = {"default": sim_default.events, "plan": sim_best.events}
    if same:
        reason = "the search found nothing better than XLA's plan in simulation"
        verdict = Verdict(True, tuned.reason or reason, tuned.evidence) if tuned else Verdict(True, reason, {})
        return Validated(verdict, None, simulated, timelines)
    compiled, _ = compile_strategy(step.lowered, step.program, best)
    limit, peak = options.memory_limit_bytes, choice.executable_peak(compiled)
    if limit is not None and peak is not None and peak > limit:  # the executable that would run
        reason = f"rejected: the plan's executable needs {peak} bytes per device, over memory_limit_bytes={limit}"
        return Validated(Verdict(True, reason, {"peak_bytes": peak}), None, simulated, timelines)
    ratio = sim_best.iteration_us / sim_default.iteration_us
    verdict = validate(step, best, compiled, options.validation_pairs, ratio)
    return Validated(verdict, compiled, simulated, timelines)


def plan_of(step: Captured, searched: Searched, validated: Validated, report: StepReport) -> _plan.Plan:
    """The plan the search phase stores: the verdict, the strategy it keeps, the figures behind it;
    with several processes, process 0's (it measured and decided for everyone)."""
    graph, verdict = step.graph, validated.verdict
    report.plan_counts = verdict.plan_counts
    plan = _plan.Plan(
        graph.fingerprint,
        graph.module.name,
        step.machine,
        verdict.use_default,
        None if verdict.use_default else searched.best.to_json(graph),
        verdict.reason,
        simulated=validated.simulated,
        measured=verdict.measured,
        search=searched.info,
        weight_update=report.weight_update or {},
        rules_applied=(
            list(step.program.rules_applied) if verdict.use_default else rules_applied(step.program, searched.best)
        ),
    )
    if step.scope is not None:
        plan = _plan.Plan.from_json(_distributed.broadcast_json(f"{step.scope}/plan", plan.to_json()))
    return plan


def validate(step: Captured, best: Strategy | None, compiled: Any, pairs: int, simulated_ratio: float) -> Verdict:
    """Compare the candidate's outputs with XLA's (bitwise when only all-reduces were regrouped:
    every element is then reduced in the same order; else `step.output_check`'s float64 reference
    or ulp tolerance), time both interleaved, and check that XLA kept the planned all-reduces. With
    several processes each compares its own output shards. `best` None: XLA's own program under
    other compile options (`Plan.compile_options`): no planned all-reduces to check, and not
    bitwise (another combining changes the collectives' buffers, and NCCL's order of summation with
    them)."""
    graph = step.graph
    counts = compiled_stats(compiled.as_text())
    default_runner, plan_runner = step.runner(step.default_compiled), step.runner(compiled)
    bitwise = best is not None and _strategy.regroups_only(graph, best)
    merge_key = None if step.scope is None else f"{step.scope}/validation"
    comparison = step.output_check.compare(plan_runner(), bitwise=bitwise, merge_key=merge_key, rerun=plan_runner.on)
    timing = _validate.time_until_decided(
        default_runner,
        plan_runner,
        looks=(pairs, 2 * pairs, 4 * pairs),
        merge=None if step.scope is None else _distributed.slowest_pairs(f"{step.scope}/timing"),
    )
    measured = {
        **timing.to_json(),
        "bitwise_required": bitwise,
        **dataclasses.asdict(comparison),
        "plan_counts": counts,
    }
    if not comparison.within_tolerance:
        return Verdict(
            True,
            f"rejected: outputs differ ({comparison.summary()})",
            measured,
            counts,
        )
    if not timing.faster:
        low, high = timing.ratio_ci95
        return Verdict(
            True,
            f"rejected: measured {timing.ratio:.3f}x the default step time, not faster with confidence "
            f"({timing.verdict}: {timing.confidence:.1%} interval [{low:.3f}, {high:.3f}] over {timing.pairs} pairs)",
            measured,
            counts,
        )
    if best is not None and not keeps_plan(counts, step.program, best):
        return Verdict(True, "rejected: XLA did not keep the planned collectives", measured, counts)
    low, high = timing.ratio_ci95
    return Verdict(
        False,
        f"simulated {simulated_ratio:.3f}x, measured {timing.ratio:.3f}x the default step time "
        f"({timing.confidence:.1%} interval [{low:.3f}, {high:.3f}] over {timing.pairs} pairs)",
        measured,
        counts,
    )


def store_stage(plan: _plan.Plan, timeline: dict, plan_dir: str | None) -> str | None:
    """Write the plan and its simulated timelines; None (with a warning) when it cannot be written."""
    try:
        path = _plan.save_plan(plan, plan_dir)
        if timeline:
            _files.write_json_atomic(path.with_suffix(".timeline.json"), timeline)
        return str(path)
    except OSError as e:
        _warnings.warn(f"disco-jax: {e}; the plan is used for this run only", _plan.PlanWarning)
        return None
