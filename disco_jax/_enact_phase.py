"""The enact phase: load → apply. The stored plan for the captured program is compiled into the
step (the rewriter at the hook) and its executable returned, or XLA's where there is no usable
plan, it does not fit the module, or XLA did not keep its collectives; a plan searched offline and
never measured is first measured as the search phase validates its own (`first_run`). With
several processes, process 0's plan is the one every process applies.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax

from disco_jax import _plan, _warnings
from disco_jax._compile import Captured, compile_program, compile_strategy, compiled_stats, keeps_plan, rules_applied
from disco_jax._console import Ui
from disco_jax._options import Options, StepReport
from disco_jax._search_phase import store_stage, validate
from disco_jax._strategy import Strategy
from disco_jax.sharding import choice


def enact_phase(step: Captured, options: Options, report: StepReport, ui: Ui) -> Any:
    plan = load(step, options.plan_dir, report)
    if plan is None:
        return step.default_compiled
    if plan.use_default:  # nothing to misapply, whatever weight update the plan was made with
        ui.say(f"{step.graph.module.name}: plan keeps XLA's default ({plan.reason})")
        report.reason = plan.reason
        return step.default_compiled
    recorded = (plan.weight_update or {}).get("leaves")
    if recorded is not None and recorded != (report.weight_update or {}).get("leaves"):
        _warnings.warn(
            f"disco-jax: plan {report.plan_path} shards other optimizer-state leaves than this step; "
            "running the unmodified step",
            _plan.PlanWarning,
        )
        report.reason = "the plan's weight update differs"
        return step.default_compiled
    if plan.strategy is None and plan.compile_options:
        return apply_options(step, plan, options, report, ui)
    return apply(step, plan, options, report, ui)


def apply_options(step: Captured, plan: _plan.Plan, options: Options, report: StepReport, ui: Ui) -> Any:
    """A plan that is XLA's own program under compile options (`disco_jax.schedule_options`):
    the step compiled with them (and its hook rules), XLA's executable (with a warning) where it
    does not compile or its peak exceeds `memory_limit_bytes`; measured first where the plan was
    searched offline and never measured (`first_run`)."""
    program = compile_program(step.lowered, step.program, "plan", None, dict(plan.compile_options))
    if not program.enacted:
        _warnings.warn(
            f"disco-jax: plan {report.plan_path}'s compile options do not compile here ({program.reason}); "
            "running the unmodified step",
            _plan.PlanWarning,
        )
        report.reason = f"plan not applicable: {program.reason}"
        return step.default_compiled
    compiled = program.compiled
    report.compile_status, report.plan_counts = program.status, program.stats
    if not within_limit(compiled, options.memory_limit_bytes, report):
        return step.default_compiled
    if "offline" in plan.search and not plan.measured:
        return first_run(step, plan, None, compiled, options, report, ui)
    report.applied, report.reason = True, plan.reason
    ui.say(f"{step.graph.module.name}: applied plan {os.path.basename(report.plan_path)} (compile options)")
    return compiled


def within_limit(compiled: Any, limit: int | None, report: StepReport) -> bool:
    """Whether the executable about to run fits `limit` bytes per device (XLA's memory analysis:
    arguments, outputs, temporaries less aliased); a warning and the reason on the report where
    it does not (the plan's executable is then not run). True without a limit or an analysis."""
    if limit is None:
        return True
    peak = choice.executable_peak(compiled)
    if peak is None or peak <= limit:
        return True
    _warnings.warn(
        f"disco-jax: the plan's executable needs {peak} bytes per device, over memory_limit_bytes={limit}; "
        "running the unmodified step",
        _plan.PlanWarning,
    )
    report.reason = f"the plan's executable exceeds the memory limit ({peak} > {limit} bytes per device)"
    return False


def load(step: Captured, plan_dir: str | None, report: StepReport) -> _plan.Plan | None:
    """The stored plan for this program and machine (process 0's, with several processes), or
    None with one warning when there is none."""
    graph = step.graph
    plan, path = _plan.find_plan(graph.fingerprint, step.machine, plan_dir)
    if step.scope is not None:
        plan = _plan.shared_plan(step.scope, plan)
        report.plan_from_process = 0
    report.plan_path = str(path)
    if plan is None:
        if not path.exists():
            _warnings.warn(
                f"disco-jax: no plan for {graph.module.name} (fingerprint {graph.fingerprint}) "
                f"in {path.parent}; running the unmodified step. Run once with ENABLE_SEARCH=1 "
                "to make one.",
                _plan.PlanWarning,
            )
        report.reason = "no usable plan"
        return None
    report.plan = plan.to_json()
    return plan


def apply(step: Captured, plan: _plan.Plan, options: Options, report: StepReport, ui: Ui) -> Any:
    """Compile the step with the plan; XLA's executable (with a warning) when the plan does not
    fit this module or XLA did not keep its all-reduces. A plan searched for a machine one did
    not have (`disco_jax.offline`) and not measured yet is measured here first (`first_run`)."""
    graph = step.graph
    try:
        strategy = Strategy.from_json(graph, plan.strategy)
        compiled, status = compile_strategy(step.lowered, step.program, strategy)
    except ValueError as e:
        _warnings.warn(
            f"disco-jax: plan {report.plan_path} cannot be applied ({e}); running the unmodified step",
            _plan.PlanWarning,
        )
        report.reason = f"plan not applicable: {e}"
        return step.default_compiled
    counts = compiled_stats(compiled.as_text())
    report.compile_status, report.plan_counts = status, counts
    if status == "fingerprint-mismatch" or not keeps_plan(counts, step.program, strategy):
        _warnings.warn(
            f"disco-jax: the compiled step has {counts['all-reduce']} all-reduces and {counts['reduce-scatter']} "
            f"reduce-scatters, not the plan's ({len(strategy.buckets)} buckets); running the unmodified step",
            _plan.PlanWarning,
        )
        report.reason = "plan not enacted by XLA"
        return step.default_compiled
    if not within_limit(compiled, options.memory_limit_bytes, report):
        return step.default_compiled
    if "offline" in plan.search and not plan.measured:
        return first_run(step, plan, strategy, compiled, options, report, ui)
    report.applied, report.reason, report.rules_applied = True, plan.reason, rules_applied(step.program, strategy)
    ui.say(
        f"{graph.module.name}: applied plan {os.path.basename(report.plan_path)} "
        f"({counts['all-reduce']} all-reduces, {counts['fusion']} fusions)"
    )
    return compiled


def first_run(
    step: Captured,
    plan: _plan.Plan,
    strategy: Strategy | None,
    compiled: Any,
    options: Options,
    report: StepReport,
    ui: Ui,
) -> Any:
    """Validate a stored plan searched offline and never measured, as the search phase validates its own
    (outputs, then the acceptance rule), and store the verdict in the plan: applied only when
    measured faster; later runs read the verdict."""
    ui.say(f"{step.graph.module.name}: plan {os.path.basename(report.plan_path)} was never measured; measuring it")
    simulated = plan.simulated or {}
    figure = "iteration_us" if strategy is not None else "compiled_us"  # options plans: compiled figures only
    try:
        ratio = simulated["plan"][figure] / simulated["default"][figure]
    except (KeyError, TypeError, ZeroDivisionError):
        ratio = float("nan")
    verdict = validate(step, strategy, compiled, options.validation_pairs, ratio)
    plan = dataclasses.replace(
        plan,
        use_default=verdict.use_default,
        strategy=None if verdict.use_default else plan.strategy,
        reason=verdict.reason,
        measured=verdict.measured,
    )
    if jax.process_index() == 0:
        store_stage(plan, {}, options.plan_dir)
    report.measured, report.plan, report.reason = plan.measured, plan.to_json(), plan.reason
    report.applied = not plan.use_default
    ui.say(f"{step.graph.module.name}: {plan.reason}")
    return step.default_compiled if plan.use_default else compiled
