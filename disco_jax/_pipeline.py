"""The phases behind `@optimize_distributed`, as functions over typed records.

    prepare ─ capture ─┬─ search phase: profile → calibrate → search → validate → store
                       └─ enact phase:  load → apply

`prepare` is what the decorator calls for a new program (argument signature and static values).
It returns the executable the program runs and fills a `StepReport`. With
`weight_update="sharded"` the captured step is first lowered again with its optimizer state
sharded over the data axis (`sharding.update.sharded_step`), and that program goes through the
phases; the first call then reshards its arguments (`sharding.update.Resharding`). With
`weight_update="search"` (the default) the search phase first profiles the replicated step and
chooses the program (`sharding.choice.choose`; the decision is stored as the replicated program's
plan), and the enact phase reads that decision back (`sharding.choice.recall`). With several processes every
process runs the same executables in the same order (profiling, calibration and validation run
the step: collectives); process 0 alone searches, its strategy is broadcast before validation and
its plan after, and in the enact phase process 0's plan is the one every process applies.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable
from typing import Any

import jax

from disco_jax import _distributed, _files, _plan, _profile_db, _search, _strategy, _validate, backends
from disco_jax._compile import Captured, Runner, capture, compile_strategy, compiled_stats, keeps_plan, rules_applied
from disco_jax._console import Ui
from disco_jax._output_check import Float64Run
from disco_jax._profile_phase import calibrate, profile
from disco_jax._strategy import Strategy
from disco_jax._tuning_devices import tune
from disco_jax.cost import CostModel
from disco_jax.sharding import choice, update

ENABLE_SEARCH_ENV = "ENABLE_SEARCH"


def search_enabled() -> bool:
    """The default phase, from ENABLE_SEARCH: '1' search, '0' or unset enact; anything else is an error."""
    value = os.environ.get(ENABLE_SEARCH_ENV, "").strip()
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    raise ValueError(f"{ENABLE_SEARCH_ENV} must be 0 or 1, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Options:
    """How a decorated step searches and validates. `search`: the search's parameters;
    `plan_dir`: where plans are stored (None: `$DISCO_JAX_PLAN_DIR` or the user cache);
    `validation_pairs`: interleaved timing pairs when validating a plan; `verbose`: print to stderr;
    `measured_candidates`: distinct candidates per round the measured search (`_tuning`) compiles
    and times against XLA's plan before one goes to validation (0: validate the search's best);
    `weight_update`: 'sharded' keeps the optimizer state sharded over the data axis
    (`disco_jax.sharding.update`), 'replicated' is XLA's data-parallel update, 'search' chooses
    per parameter group (`disco_jax.sharding.choice`) within `memory_limit_bytes` per device."""

    search: _search.SearchConfig = _search.SearchConfig()
    plan_dir: str | None = None
    validation_pairs: int = 20
    verbose: bool = True
    measured_candidates: int = 4
    weight_update: str = "search"
    memory_limit_bytes: int | None = None

    def __post_init__(self):
        update.check_weight_update(self.weight_update)
        limit = self.memory_limit_bytes
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0):
            raise ValueError(f"memory_limit_bytes must be a positive integer or None, got {limit!r}")
        if not isinstance(self.measured_candidates, int) or self.measured_candidates < 0:
            raise ValueError(f"measured_candidates must be a non-negative integer, got {self.measured_candidates!r}")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class StepReport:
    """What happened when one program of a decorated step was prepared (`OptimizedStep.reports`).

    phase: 'search' or 'enact'. applied: whether the program runs a disco-jax plan; reason: why
    (or why not). default_counts / plan_counts: `compiled_stats` of XLA's executable and the
    plan's. simulated / measured / search: the plan's records (see `Plan`)."""

    phase: str
    backend: str
    search_ran: bool = False
    applied: bool = False
    reason: str | None = None
    fingerprint: str | None = None
    module: str | None = None
    graph: dict | None = None
    default_counts: dict | None = None
    plan_counts: dict | None = None
    compile_status: str | None = None
    plan: dict | None = None
    plan_path: str | None = None
    simulated: dict | None = None
    measured: dict | None = None
    search: dict | None = None
    process_index: int | None = None
    plan_from_process: int | None = None
    weight_update: dict | None = None  # mode, sharded leaves, per-device memory (`sharding.update`)
    rules_applied: list | None = None  # sharding rules applied at the hook to the executable that runs

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The validation of a candidate plan against XLA's executable: whether to keep XLA's,
    why, and what was measured (times, output errors, what the compiled plan holds)."""

    use_default: bool
    reason: str
    measured: dict
    plan_counts: dict | None = None


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
    `args`/`kwargs` are the call as made (for lowering); `dynamic_*` without static arguments."""
    ui = Ui(options.verbose)
    backend = backends.for_platform(report.backend)
    if backend is None or not backend.decorator_ready:
        warnings.warn(
            f"disco-jax: backend {report.backend!r} is not supported by the decorator yet (supported: "
            f"{', '.join(backends.supported_platforms(decorator=True))}); running the unmodified step",
            stacklevel=5,
        )
        report.reason = "unsupported backend"
        return fn
    step = capture(fn.lower(*args, **kwargs), backend, dynamic_args, dynamic_kwargs)
    step.exact = Float64Run(fn, args, kwargs)  # run only if a plan's outputs need it
    layout, costs = None, None
    if options.weight_update == "sharded":  # the program to optimize is the step lowered again
        agree(step, report)  # its output check runs both programs and merges every process's verdict
        step, layout, report.weight_update = update.sharded_step(fn, step, args, kwargs, backend, search, stacklevel=6)
    elif options.weight_update == "search" and step.graph.gradients:
        agree(step, report)  # before anything collective
        if search:
            costs = profiled(step, options, ui)
            chosen, layout, report.weight_update = choice.choose(
                *(fn, step, args, kwargs, backend, costs),
                *(options.memory_limit_bytes, options.validation_pairs, ui, options.search),
            )
            if layout is not None:
                if jax.process_index() == 0:
                    store(choice.decision_plan(step, report.weight_update), {}, options.plan_dir)
                step, costs = chosen, None
        else:
            step, layout, report.weight_update = choice.recall(
                *(fn, step, args, kwargs, backend), options.plan_dir, options.memory_limit_bytes
            )
    else:
        report.weight_update = {"mode": "replicated", "requested": options.weight_update, "reason": None}
    run = _phase(step, options, search, report, ui, costs)
    return run if layout is None else update.Resharding(run, layout)


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


def _phase(step: Captured, options: Options, search: bool, report: StepReport, ui: Ui, costs=None) -> Any:
    """Capture done: check that the processes agree, then the search or the enact phase.
    `costs`: the step's cost model and profile database, where the weight-update choice built them."""
    graph = step.graph
    report.fingerprint, report.module, report.graph = graph.fingerprint, graph.module.name, graph.summary()
    report.default_counts = compiled_stats(step.default_compiled.as_text())
    report.rules_applied = list(graph.rules_applied)
    if costs is None:
        agree(step, report)
    if not graph.gradients and not graph.fusible_ops:  # one device still has fusion to decide
        ui.say(f"{graph.module.name}: no all-reduce and no fusible op in the step; running it unmodified")
        report.reason = "nothing to optimize"
        return step.default_compiled
    if search:
        return search_phase(step, options, report, ui, costs)
    return enact_phase(step, options, report, ui)


# ---------------------------------------------------------------------------------- search phase


def store_kernel_times(database: _profile_db.ProfileDatabase, machine, times: dict[str, float]) -> None:
    """Kernels the measured loop timed (the candidates' own) into the profile database, where
    the next search's table and the GNN's training data find them."""
    if not times:
        return
    try:
        database.merge_kernel_times(machine.device_kind, times, backend=machine.backend)
    except OSError as e:
        warnings.warn(f"disco-jax: could not store the measured kernel times: {e}", stacklevel=2)


def profiled(step: Captured, options: Options, ui: Ui) -> tuple[CostModel, _profile_db.ProfileDatabase]:
    """The step's cost model (its kernels profiled, the simulator calibrated) and the profile database."""
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
    return cost_model, database


def search_phase(step: Captured, options: Options, report: StepReport, ui: Ui, costs=None) -> Any:
    graph, machine = step.graph, step.machine
    leader = jax.process_index() == 0
    report.search_ran = leader
    default_runner = step.runner(step.default_compiled)
    cost_model, database = costs or profiled(step, options, ui)
    default = _strategy.xla_default(graph)
    sim_default = cost_model.simulate(graph, default, record=True)
    best, search_info, result, tuned = default, {}, None, None
    if leader:
        result = run_search(step, cost_model, options.search, sim_default.iteration_us, ui)
        best = result.best
        search_info = {**result.stats(), "options": options.to_json(), "cost_model": cost_model.sources}
    if options.measured_candidates > 0:  # the search proposes, the devices decide (every process measures)
        k, pairs = options.measured_candidates, options.validation_pairs
        tuned = tune(step, cost_model, result, default_runner, options.search, k, pairs, ui)
        if tuned is not None:
            best = tuned.best
            search_info.update(tuned.to_json())
            store_kernel_times(database, machine, tuned.kernel_times_us)
    if step.scope is not None:
        found = None if best.key() == default.key() else best.to_json(graph)
        found = _distributed.broadcast_json(
            f"{step.scope}/strategy", found, timeout_s=_distributed.sync_timeout_s() + options.search.budget_s
        )
        best = default if found is None else Strategy.from_json(graph, found)
    sim_default = cost_model.simulate(graph, default, record=True)  # the measured loop may have recalibrated
    sim_best = cost_model.simulate(graph, best, record=True)
    simulated = {"default": sim_default.to_json(), "plan": sim_best.to_json()}
    compiled = None
    if best.key() == default.key():
        reason = "the search found nothing better than XLA's plan in simulation"
        verdict = Verdict(True, tuned.reason or reason, tuned.evidence) if tuned else Verdict(True, reason, {})
    else:
        compiled, _ = compile_strategy(step.lowered, graph, best)
        verdict = validate(
            step,
            default_runner,
            best,
            compiled,
            options.validation_pairs,
            sim_best.iteration_us / sim_default.iteration_us,
        )
    report.plan_counts = verdict.plan_counts
    plan = _plan.Plan(
        graph.fingerprint,
        graph.module.name,
        machine,
        verdict.use_default,
        None if verdict.use_default else best.to_json(graph),
        verdict.reason,
        simulated=simulated,
        measured=verdict.measured,
        search=search_info,
        weight_update=report.weight_update or {},
        rules_applied=list(graph.rules_applied) if verdict.use_default else rules_applied(graph, best),
    )
    if step.scope is not None:  # process 0 measured and decided for everyone
        plan = _plan.Plan.from_json(_distributed.broadcast_json(f"{step.scope}/plan", plan.to_json()))
    report.simulated, report.measured, report.search = plan.simulated, plan.measured, plan.search
    report.plan, report.reason, report.applied = plan.to_json(), plan.reason, not plan.use_default
    report.rules_applied = plan.rules_applied
    if leader:
        report.plan_path = store(plan, {"default": sim_default.events, "plan": sim_best.events}, options.plan_dir)
        ui.summary(graph.module.name, plan, report.default_counts, report.plan_counts, report.plan_path)
    return step.default_compiled if plan.use_default else compiled


def run_search(
    step: Captured, cost_model: CostModel, config: _search.SearchConfig, default_cost: float, ui: Ui
) -> _search.SearchResult:
    """DisCo's backtracking search over the step's graph, costed by the simulator."""
    graph = step.graph
    cost = cost_model.evaluator(graph)
    return ui.search(
        lambda progress: _search.backtracking_search(graph, cost, config, progress=progress), config, default_cost
    )


def validate(
    step: Captured, default_runner: Runner, best: Strategy, compiled: Any, pairs: int, simulated_ratio: float
) -> Verdict:
    """Compare the candidate's outputs with XLA's (bitwise when only all-reduces were regrouped:
    every element is then reduced in the same order; else `step.output_check`'s float64 reference
    or ulp tolerance), time both interleaved, and check that XLA kept the planned all-reduces. With
    several processes each compares its own output shards."""
    graph = step.graph
    counts = compiled_stats(compiled.as_text())
    plan_runner = step.runner(compiled)
    bitwise = _strategy.regroups_only(graph, best)
    merge_key = None if step.scope is None else f"{step.scope}/validation"
    comparison = step.output_check.compare(plan_runner(), bitwise=bitwise, merge_key=merge_key)
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
    if not keeps_plan(counts, graph, best):
        return Verdict(True, "rejected: XLA did not keep the planned collectives", measured, counts)
    low, high = timing.ratio_ci95
    return Verdict(
        False,
        f"simulated {simulated_ratio:.3f}x, measured {timing.ratio:.3f}x the default step time "
        f"({timing.confidence:.1%} interval [{low:.3f}, {high:.3f}] over {timing.pairs} pairs)",
        measured,
        counts,
    )


def store(plan: _plan.Plan, timeline: dict, plan_dir: str | None) -> str | None:
    """Write the plan and its simulated timelines; None (with a warning) when it cannot be written."""
    try:
        path = _plan.save_plan(plan, plan_dir)
        if timeline:
            _files.write_json_atomic(path.with_suffix(".timeline.json"), timeline)
        return str(path)
    except OSError as e:
        warnings.warn(f"disco-jax: {e}; the plan is used for this run only", _plan.PlanWarning, stacklevel=7)
        return None


# ---------------------------------------------------------------------------------- enact phase


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
        warnings.warn(
            f"disco-jax: plan {report.plan_path} shards other optimizer-state leaves than this step; "
            "running the unmodified step",
            _plan.PlanWarning,
            stacklevel=7,
        )
        report.reason = "the plan's weight update differs"
        return step.default_compiled
    return apply(step, plan, options, report, ui)


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
            warnings.warn(
                f"disco-jax: no plan for {graph.module.name} (fingerprint {graph.fingerprint}) "
                f"in {path.parent}; running the unmodified step. Run once with ENABLE_SEARCH=1 "
                "to make one.",
                _plan.PlanWarning,
                stacklevel=7,
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
        compiled, status = compile_strategy(step.lowered, graph, strategy)
    except ValueError as e:
        warnings.warn(
            f"disco-jax: plan {report.plan_path} cannot be applied ({e}); running the unmodified step",
            _plan.PlanWarning,
            stacklevel=7,
        )
        report.reason = f"plan not applicable: {e}"
        return step.default_compiled
    counts = compiled_stats(compiled.as_text())
    report.compile_status, report.plan_counts = status, counts
    if status == "fingerprint-mismatch" or not keeps_plan(counts, graph, strategy):
        warnings.warn(
            f"disco-jax: the compiled step has {counts['all-reduce']} all-reduces and {counts['reduce-scatter']} "
            f"reduce-scatters, not the plan's ({len(strategy.buckets)} buckets); running the unmodified step",
            _plan.PlanWarning,
            stacklevel=7,
        )
        report.reason = "plan not enacted by XLA"
        return step.default_compiled
    if "offline" in plan.search and not plan.measured:
        return first_run(step, plan, strategy, compiled, options, report, ui)
    report.applied, report.reason, report.rules_applied = True, plan.reason, rules_applied(graph, strategy)
    ui.say(
        f"{graph.module.name}: applied plan {os.path.basename(report.plan_path)} "
        f"({counts['all-reduce']} all-reduces, {counts['fusion']} fusions)"
    )
    return compiled


def first_run(
    step: Captured, plan: _plan.Plan, strategy: Strategy, compiled: Any, options: Options, report: StepReport, ui: Ui
) -> Any:
    """Validate a stored plan searched offline and never measured, as the search phase validates its own
    (outputs, then the acceptance rule), and store the verdict in the plan: applied only when
    measured faster; later runs read the verdict."""
    ui.say(f"{step.graph.module.name}: plan {os.path.basename(report.plan_path)} was never measured; measuring it")
    simulated = plan.simulated or {}
    try:
        ratio = simulated["plan"]["iteration_us"] / simulated["default"]["iteration_us"]
    except (KeyError, TypeError, ZeroDivisionError):
        ratio = float("nan")
    verdict = validate(step, step.runner(step.default_compiled), strategy, compiled, options.validation_pairs, ratio)
    plan = dataclasses.replace(
        plan,
        use_default=verdict.use_default,
        strategy=None if verdict.use_default else plan.strategy,
        reason=verdict.reason,
        measured=verdict.measured,
    )
    if jax.process_index() == 0:
        store(plan, {}, options.plan_dir)
    report.measured, report.plan, report.reason = plan.measured, plan.to_json(), plan.reason
    report.applied = not plan.use_default
    ui.say(f"{step.graph.module.name}: {plan.reason}")
    return step.default_compiled if plan.use_default else compiled
