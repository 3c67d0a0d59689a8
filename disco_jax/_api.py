"""`@optimize_distributed`: the search phase, the enactment phase, and what connects them.

For each new argument signature, the first call lowers the jitted step, captures its module at
XLA's hook stage and builds the graph IR. Then:

* search phase (`ENABLE_SEARCH=1`): profile kernels and all-reduces on the real devices, build the
  estimator chain, simulate XLA's plan, run the backtracking search, rewrite and compile the best
  strategy, validate it against the unmodified step (outputs and time), store the plan, and train
  with it;
* enactment phase (`ENABLE_SEARCH` unset or 0): load the stored plan for this exact module and
  machine, rewrite and compile with it; no plan means one warning and the unmodified step.

Later calls with the same signature go straight to the compiled executable.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import logging
import os
import warnings
from typing import Any, Callable

import jax
import numpy as np

from disco_jax import (_capture, _cost, _distributed, _files, _graph, _hlo, _plan, _profile, _rewrite, _search,
                       _strategy, _validate)

logger = logging.getLogger("disco_jax")
ENABLE_SEARCH_ENV = "ENABLE_SEARCH"


def search_enabled() -> bool:
    """ENABLE_SEARCH: '1' search, '0' or unset enact; anything else is an error."""
    value = os.environ.get(ENABLE_SEARCH_ENV, "").strip()
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    raise ValueError(f"{ENABLE_SEARCH_ENV} must be 0 or 1, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Options:
    alpha: float = 1.05
    beta: int = 10
    seed: int = 0
    budget_s: float = 60.0
    max_unchanged: int = 1000
    plan_dir: str | None = None
    validation_pairs: int = 20
    verbose: bool = True

    def search_config(self) -> _search.SearchConfig:
        return _search.SearchConfig(alpha=self.alpha, beta=self.beta, max_unchanged=self.max_unchanged,
                                    budget_s=self.budget_s, seed=self.seed)


def _console():
    from rich.console import Console
    return Console(stderr=True)


def _say(options: Options, message: str) -> None:
    logger.info(message)
    if options.verbose:
        _console().print(f"[bold cyan]disco-jax[/] {message}", highlight=False)


def _donated(lowered) -> list[bool]:
    return [bool(getattr(a, "donated", False)) for a in jax.tree.leaves(lowered.args_info)]


class _Runner:
    """Calls a compiled step with fresh copies of the inputs it donates, so it can run again."""

    def __init__(self, compiled, lowered, args, kwargs):
        self.compiled, self.args, self.kwargs = compiled, args, kwargs
        self.donates = any(_donated(lowered))

    def __call__(self, *_ignored):
        args, kwargs = self.args, self.kwargs
        if self.donates:
            args, kwargs = jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, (args, kwargs))
        return self.compiled(*args, **kwargs)

    def as_text(self) -> str:
        return self.compiled.as_text()


def compiled_counts(text: str) -> dict[str, int]:
    """All-reduces and fusions in a compiled module's entry computation (the truth of a plan)."""
    entry = _hlo.parse_module(text).entry
    return {"all-reduce": sum(1 for i in entry.instructions if i.opcode in ("all-reduce", "all-reduce-start")),
            "fusion": sum(1 for i in entry.instructions if i.opcode == "fusion")}


def _step_devices(args, kwargs) -> list:
    devices = {}
    for leaf in jax.tree.leaves((args, kwargs)):
        if isinstance(leaf, jax.Array):
            for d in leaf.sharding.device_set:
                devices[d.id] = d
    return [devices[k] for k in sorted(devices)] or jax.devices()


@dataclasses.dataclass
class CostModel:
    """What the simulator needs, built once per search: estimator chain and all-reduce fit."""

    estimator: _cost.ChainEstimator
    allreduce: _profile.AllReduceCostModel
    sources: dict
    params: _cost.SimulatorParams = _cost.SimulatorParams()

    def simulate(self, graph, strategy, record=False, params=None):
        return _cost.simulate(graph, strategy, self.estimator, self.allreduce, params or self.params, record=record)


def calibrate_simulator(cost_model: CostModel, graph, lowered, default_runner: "_Runner", args, kwargs,
                        options: Options) -> dict:
    """Fit the simulator's compute scale and all-reduce blocking to two measured strategies:
    XLA's plan and the same fusions with one all-reduce per gradient."""
    default = _strategy.xla_default(graph)
    split = _strategy.with_buckets(default, [(g.id,) for g in graph.gradients], "per-gradient")
    if len(split.buckets) == len(default.buckets):
        split = None
    if split is None:
        timing_default = _validate.time_interleaved(default_runner, default_runner, pairs=5)
        measured = (timing_default.default_us, timing_default.default_us)
        params = _cost.SimulatorParams(measured[0] / cost_model.simulate(graph, default).iteration_us, 0.0)
    else:
        compiled, _ = compile_strategy(lowered, graph, split, "cpu")
        timing = _validate.time_interleaved(default_runner, _Runner(compiled, lowered, args, kwargs),
                                            pairs=max(6, options.validation_pairs))
        measured = (timing.default_us, timing.plan_us)

        def simulate_at(p):
            return (cost_model.simulate(graph, default, params=p).iteration_us,
                    cost_model.simulate(graph, split, params=p).iteration_us)

        params = _cost.calibrate(simulate_at, measured)
    cost_model.params = params
    _say(options, f"simulator calibrated: compute x{params.compute_scale:.2f}, all-reduces hold compute "
                  f"{params.comm_blocking:.0%} of their time (measured {measured[0]:.0f} us default, "
                  f"{measured[1]:.0f} us with one all-reduce per gradient)")
    return {**params.to_json(), "measured_default_us": measured[0], "measured_per_gradient_us": measured[1]}


def profile_step(graph: _graph.Graph, runner: _Runner, module_name: str, devices: list,
                 database: _profile.ProfileDatabase, options: Options) -> CostModel:
    """Measure kernel times of the default executable and the all-reduce fit on these devices,
    merge them into the profile database, and build the cost model."""
    machine = _plan.MachineKey.current(devices)
    times = _profile.measure_kernel_times(runner, (), module_name=module_name)
    by_name = {op.name: frozenset([op.id]) for op in graph.ops if op.kind == "opaque"}
    for name, members in zip(graph.xla_kernel_names, graph.xla_groups):
        by_name[name] = members
    table, measured = {}, {}
    for name, t in times.items():
        members = by_name.get(name)
        if members is not None:
            table[_cost.kernel_signature(graph, members)] = t
            measured[members] = t
    stored = database.load(machine.device_kind, machine.backend, machine.num_devices)
    # Stored fits are keyed by device count only, not by transport: with several processes the
    # fit is measured over the real one (gloo, NCCL) every time, and not stored.
    multiprocess = _distributed.is_multiprocess()
    allreduce = stored.allreduce if stored is not None and not multiprocess else None
    if allreduce is None:
        where = f" in {jax.process_count()} processes" if multiprocess else ""
        _say(options, f"measuring all-reduce cost on {len(devices)} devices{where}")
        mesh = jax.sharding.Mesh(np.array(devices), ("all",))
        allreduce, points = _profile.measure_allreduce_cost(mesh)  # a collective: every process runs it
        profile = _profile.Profile.for_devices(devices, allreduce=None if multiprocess else allreduce,
                                               allreduce_points=[] if multiprocess else points,
                                               kernel_times_us=table)
    else:
        profile = _profile.Profile.for_devices(devices, allreduce=allreduce,
                                               allreduce_points=stored.allreduce_points, kernel_times_us=table)
    if jax.process_index() == 0:
        try:
            database.save(profile)
        except OSError as e:
            warnings.warn(f"disco-jax: could not store the profile: {e}", stacklevel=2)
    known = dict(stored.kernel_times_us) if stored is not None else {}
    known.update(table)
    analytical = _cost.AnalyticalEstimator.fit(
        [(_cost.kernel_features(graph, k), t) for k, t in measured.items()])
    gnn = _load_gnn(machine.device_kind)
    if gnn is not None:
        gnn = gnn.with_op_times(known)  # the network reads each op's own measured time where known
    base = gnn if gnn is not None else analytical
    estimators: list = [_cost.TableEstimator(known), _cost.CalibratedEstimator(base, graph, measured)]
    if gnn is not None:
        estimators.append(_cost.CalibratedEstimator(analytical, graph, measured))
    return CostModel(_cost.ChainEstimator(estimators), allreduce,
                     {"kernel_times": len(table), "estimators": [e.name for e in estimators],
                      "analytical": analytical.to_json(), "allreduce": allreduce.to_json()})


def _load_gnn(device_kind: str):
    """The trained GNN estimator for this device kind, if weights are shipped or cached."""
    import gnn_estimator
    return gnn_estimator.load_estimator(device_kind)


def _plan_tag(fingerprint: str, strategy_json: dict) -> str:
    digest = hashlib.sha256(json.dumps(strategy_json, sort_keys=True).encode()).hexdigest()[:16]
    return f"{fingerprint}:{digest}"


def compile_strategy(lowered, graph: _graph.Graph, strategy: _strategy.Strategy, backend: str):
    """Compile the step with `strategy` rewritten into its module at the hook.

    Returns (compiled, status): 'rewritten'; 'cached' when JAX served the executable compiled
    earlier in this process for the same plan (the cache key carries the plan's digest); or
    'fingerprint-mismatch' when the module at the hook is not the one the plan was made for
    (it is then compiled unmodified)."""
    text = _rewrite.rewriter_for(backend).rewrite(graph, strategy)
    status = ["cached"]

    def handler(module_text: str) -> str | None:
        if _hlo.fingerprint(module_text) != graph.fingerprint:
            status[0] = "fingerprint-mismatch"
            return None
        status[0] = "rewritten"
        return text

    compiled = _capture.compile_with_hook(lowered, handler,
                                          cache_tag=_plan_tag(graph.fingerprint, strategy.to_json(graph)))
    return compiled, status[0]


class _StaticArgs:
    """Which arguments of a jitted function are static (`static_argnums` / `static_argnames`, read
    from the jit object): they are part of the program, not inputs of the executable. `split`
    separates a call into the executable's arguments and the static values, by position and by
    name, whichever way the caller passed them."""

    def __init__(self, fn: Callable):
        info = getattr(fn, "_jit_info", None)
        nums = set(getattr(info, "static_argnums", ()) or ())
        names = set(getattr(info, "static_argnames", ()) or ())
        signature = getattr(info, "fun_signature", None)
        positional = [] if signature is None else [
            p.name for p in signature.parameters.values()
            if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        self.nums = frozenset(nums | {i for i, n in enumerate(positional) if n in names})
        self.names = frozenset(names | {positional[i] for i in nums if 0 <= i < len(positional)})
        self.any = bool(self.nums or self.names)

    def split(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, tuple]:
        """(executable's positional args, its keyword args, the static values as a hashable key)."""
        if not self.any:
            return args, kwargs, ()
        nums = {i if i >= 0 else i + len(args) for i in self.nums}
        dynamic_args = tuple(a for i, a in enumerate(args) if i not in nums)
        dynamic_kwargs = {k: v for k, v in kwargs.items() if k not in self.names}
        static = (tuple((i, args[i]) for i in sorted(nums) if 0 <= i < len(args)),
                  tuple(sorted(((k, v) for k, v in kwargs.items() if k in self.names), key=lambda kv: kv[0])))
        return dynamic_args, dynamic_kwargs, static


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """What one program (argument signature and static values) runs: a compiled executable that
    takes the dynamic arguments only, or the user's jitted function (`takes_static`)."""

    run: Callable
    static: tuple
    takes_static: bool


class OptimizedStep:
    """A jitted step with disco-jax's plan applied. Call it like the original function.

    Calls go first to the executable of the previous call, whose own (C++) argument check is the
    only per-call work: a call it does not fit (other shapes, dtypes, shardings, tree or static
    values) raises there before anything runs, and takes the slow path, which keys programs by
    signature and static values and prepares a new one when needed."""

    def __init__(self, fn: Callable, options: Options):
        if not hasattr(fn, "lower") or not callable(fn):
            raise TypeError(f"optimize_distributed expects a function, got {fn!r}")
        self._fn = fn
        self.options = options
        self._statics = _StaticArgs(fn)
        self._prepared: dict[Any, _Prepared] = {}
        self._last: _Prepared | None = None
        self.reports: list[dict] = []
        functools.update_wrapper(self, fn)

    @property
    def last_report(self) -> dict | None:
        return self.reports[-1] if self.reports else None

    def lower(self, *args, **kwargs):
        return self._fn.lower(*args, **kwargs)

    def executable(self, *args, **kwargs) -> Callable:
        """What a call with these arguments runs, prepared (searched or enacted) if it is new: a
        `jax.stages.Compiled` taking the non-static arguments (`.as_text()` shows the plan in the
        compiled module), or the jitted function itself on backends disco-jax leaves alone."""
        return self._lookup(args, kwargs)[0].run

    def __call__(self, *args, **kwargs):
        last = self._last
        if last is not None:
            try:
                if last.takes_static or not self._statics.any:
                    return last.run(*args, **kwargs)
                dynamic_args, dynamic_kwargs, static = self._statics.split(args, kwargs)
                if static == last.static:
                    return last.run(*dynamic_args, **dynamic_kwargs)
            except (TypeError, ValueError):
                pass  # not this program: the executable refused the arguments before running
        prepared, dynamic_args, dynamic_kwargs = self._lookup(args, kwargs)
        self._last = prepared
        if prepared.takes_static:
            return prepared.run(*args, **kwargs)
        return prepared.run(*dynamic_args, **dynamic_kwargs)

    def _lookup(self, args: tuple, kwargs: dict) -> tuple[_Prepared, tuple, dict]:
        """The slow path: the program of this call by signature and static values, prepared if
        new; with the call's dynamic arguments."""
        dynamic_args, dynamic_kwargs, static = self._statics.split(args, kwargs)
        key = (_signature(dynamic_args, dynamic_kwargs), static)
        prepared = self._prepared.get(key)
        if prepared is None:
            run = self._prepare(args, kwargs, dynamic_args, dynamic_kwargs)
            prepared = self._prepared[key] = _Prepared(run, static, takes_static=run is self._fn)
        return prepared, dynamic_args, dynamic_kwargs

    # ---------------------------------------------------------------- phases

    def _prepare(self, args, kwargs, dynamic_args, dynamic_kwargs) -> Callable:
        """The executable for this program: the plan's, or XLA's own when there is no usable plan
        (compiled either way, so that later calls of another program miss it and come back here).
        `args`/`kwargs` are the call as made (for lowering); `dynamic_*` without static arguments."""
        search = search_enabled()  # validate the variable before any work
        options = self.options
        backend = jax.default_backend()
        report: dict[str, Any] = {"phase": "search" if search else "enact", "backend": backend,
                                  "search_ran": False, "applied": False}
        self.reports.append(report)
        if backend != "cpu":
            warnings.warn(f"disco-jax: backend {backend!r} is not supported yet (CPU only); "
                          "running the unmodified step", stacklevel=3)
            report["reason"] = "unsupported backend"
            return self._fn
        lowered = self._fn.lower(*args, **kwargs)
        text, default_compiled = _capture.capture(lowered)
        graph = _graph.build_graph(text)
        devices = _step_devices(dynamic_args, dynamic_kwargs)
        machine = _plan.MachineKey.current(devices)
        report.update(fingerprint=graph.fingerprint, module=graph.module.name, graph=graph.summary(),
                      default_counts=compiled_counts(default_compiled.as_text()))
        scope = None
        if _distributed.is_multiprocess():
            # Before anything collective runs: every process must hold the same program, machine,
            # versions and phase, or all of them fail here with one message.
            scope = _distributed.new_scope("step")
            report["process_index"] = jax.process_index()
            _distributed.agree(f"{scope}/program", {"fingerprint": graph.fingerprint, "phase": report["phase"],
                                                    **dataclasses.asdict(machine)})
        if not graph.gradients:
            _say(options, f"{graph.module.name}: no all-reduce in the step, nothing to optimize; "
                          "running it unmodified")
            report["reason"] = "no collectives"
            return default_compiled
        if search:
            return self._search_phase(lowered, graph, default_compiled, dynamic_args, dynamic_kwargs, devices,
                                      machine, report, scope)
        return self._enact_phase(lowered, graph, default_compiled, machine, report, scope)

    def _enact_phase(self, lowered, graph, default_compiled, machine, report, scope: str | None = None) -> Callable:
        options = self.options
        plan, path = _plan.find_plan(graph.fingerprint, machine, options.plan_dir)
        if scope is not None:
            plan = _shared_plan(scope, plan)
            report["plan_from_process"] = 0
        report["plan_path"] = str(path)
        if plan is None:
            if not path.exists():
                warnings.warn(f"disco-jax: no plan for {graph.module.name} (fingerprint {graph.fingerprint}) "
                              f"in {path.parent}; running the unmodified step. Run once with ENABLE_SEARCH=1 "
                              "to make one.", _plan.PlanWarning, stacklevel=4)
            report["reason"] = "no usable plan"
            return default_compiled
        report["plan"] = plan.to_json()
        if plan.use_default:
            _say(options, f"{graph.module.name}: plan keeps XLA's default ({plan.reason})")
            report["reason"] = plan.reason
            return default_compiled
        try:
            strategy = _strategy.Strategy.from_json(graph, plan.strategy)
            compiled, applied = compile_strategy(lowered, graph, strategy, machine.backend)
        except ValueError as e:
            warnings.warn(f"disco-jax: plan {path} cannot be applied ({e}); running the unmodified step",
                          _plan.PlanWarning, stacklevel=4)
            report["reason"] = f"plan not applicable: {e}"
            return default_compiled
        counts = compiled_counts(compiled.as_text())
        report.update(compile_status=applied, plan_counts=counts)
        if applied == "fingerprint-mismatch" or counts["all-reduce"] != len(strategy.buckets):
            warnings.warn(f"disco-jax: the compiled step has {counts['all-reduce']} all-reduces, the plan "
                          f"{len(strategy.buckets)}; running the unmodified step", _plan.PlanWarning, stacklevel=4)
            report["reason"] = "plan not enacted by XLA"
            return default_compiled
        report.update(applied=True, reason=plan.reason)
        _say(options, f"{graph.module.name}: applied plan {path.name} "
                      f"({counts['all-reduce']} all-reduces, {counts['fusion']} fusions)")
        return compiled

    def _search_phase(self, lowered, graph, default_compiled, args, kwargs, devices, machine, report,
                      scope: str | None = None) -> Callable:
        """With several processes (`scope` set), every process runs the same executables in the same
        order (profiling, calibration and validation run the step: collectives); process 0 alone
        searches, its strategy is broadcast before validation and its plan after."""
        options = self.options
        leader = jax.process_index() == 0
        report["search_ran"] = leader
        module_name = _capture.module_name(lowered)
        default_runner = _Runner(default_compiled, lowered, args, kwargs)
        _say(options, f"{graph.module.name}: profiling {len(graph.ops)} ops, {len(graph.gradients)} gradients "
                      f"on {len(devices)} {machine.device_kind} devices")
        cost_model = profile_step(graph, default_runner, module_name, devices, _profile.ProfileDatabase(), options)
        calibration = calibrate_simulator(cost_model, graph, lowered, default_runner, args, kwargs, options)
        cost_model.sources["calibration"] = calibration
        default = _strategy.xla_default(graph)
        sim_default = cost_model.simulate(graph, default, record=True)
        best, search_info = default, {}
        if leader:
            def cost(s):
                r = cost_model.simulate(graph, s)
                return None if r is None else r.iteration_us

            result = _run_search(graph, cost, options, sim_default.iteration_us)
            best = result.best
            search_info = {**result.stats(), "options": dataclasses.asdict(options), "cost_model": cost_model.sources}
        if scope is not None:
            found = None if best.key() == default.key() else best.to_json(graph)
            found = _distributed.broadcast_json(f"{scope}/strategy", found,
                                                timeout_s=_distributed.sync_timeout_s() + options.budget_s)
            best = default if found is None else _strategy.Strategy.from_json(graph, found)
        sim_best = cost_model.simulate(graph, best, record=True)
        simulated = {"default": sim_default.to_json(), "plan": sim_best.to_json()}
        report.update(simulated=simulated, search=search_info)
        compiled = None
        measured: dict = {}
        if best.key() == default.key():
            use_default, reason = True, "the search found nothing better than XLA's plan in simulation"
        else:
            compiled, _ = compile_strategy(lowered, graph, best, machine.backend)
            counts = compiled_counts(compiled.as_text())
            plan_runner = _Runner(compiled, lowered, args, kwargs)
            # Same fusion decisions (only all-reduces regrouped): every element is reduced in
            # the same order, so outputs must be bitwise equal.
            bitwise = best.key()[0] == default.key()[0]
            local = _distributed.addressable  # each process compares its own shards
            reference = local(default_runner())
            floor = None
            if not bitwise:
                nudged_args, nudged_kwargs = _validate.nudge((args, kwargs))
                floor = _validate.sensitivity(reference, local(_Runner(default_compiled, lowered, nudged_args,
                                                                       nudged_kwargs)()))
            comparison = _validate.compare_outputs(reference, local(plan_runner()), bitwise=bitwise, floor=floor)
            timing = _validate.time_interleaved(default_runner, plan_runner, pairs=options.validation_pairs)
            if scope is not None:
                comparison = _merge_comparisons(
                    _distributed.gather_json(f"{scope}/validation", dataclasses.asdict(comparison)))
            measured = {"default_us": timing.default_us, "plan_us": timing.plan_us, "ratio": timing.ratio,
                        "ratio_iqr": [timing.ratio_low, timing.ratio_high], "pairs": timing.pairs,
                        "bitwise_required": bitwise, **dataclasses.asdict(comparison), "plan_counts": counts}
            report["plan_counts"] = counts
            if not comparison.within_tolerance:
                use_default, reason = True, (f"rejected: outputs differ (max abs error {comparison.max_abs_error:.3g}"
                                             f"{', bitwise equality required' if bitwise else ''})")
            elif not timing.not_slower:
                use_default, reason = True, (f"rejected: measured {timing.ratio:.3f}x the default step time "
                                             f"(noise {timing.noise:.3f})")
            elif counts["all-reduce"] != len(best.buckets):
                use_default, reason = True, "rejected: XLA did not keep the planned all-reduces"
            else:
                use_default, reason = False, (f"simulated {sim_best.iteration_us / sim_default.iteration_us:.3f}x, "
                                              f"measured {timing.ratio:.3f}x the default step time")
        report["measured"] = measured
        plan = _plan.Plan(graph.fingerprint, graph.module.name, machine, use_default,
                          None if use_default else best.to_json(graph), reason,
                          simulated=simulated, measured=measured, search=search_info)
        if scope is not None:  # process 0 measured and decided for everyone
            plan = _plan.Plan.from_json(_distributed.broadcast_json(f"{scope}/plan", plan.to_json()))
            report.update(simulated=plan.simulated, measured=plan.measured, search=plan.search)
        report.update(plan=plan.to_json(), reason=plan.reason, applied=not plan.use_default)
        timeline = {"default": sim_default.events, "plan": sim_best.events}
        if leader:
            try:
                path = _plan.save_plan(plan, options.plan_dir)
                _files.write_json_atomic(path.with_suffix(".timeline.json"), timeline)
                report["plan_path"] = str(path)
            except OSError as e:
                warnings.warn(f"disco-jax: {e}; the plan is used for this run only", _plan.PlanWarning, stacklevel=4)
                report["plan_path"] = None
            if options.verbose:
                _print_summary(graph, plan, report)
        return default_compiled if plan.use_default else compiled


def _merge_comparisons(comparisons: list[dict]) -> _validate.Comparison:
    """One verdict from every process's comparison of its own output shards."""
    worst = max(comparisons, key=lambda c: c["max_abs_error"])
    return _validate.Comparison(
        bitwise_equal=all(c["bitwise_equal"] for c in comparisons),
        within_tolerance=all(c["within_tolerance"] for c in comparisons),
        max_abs_error=worst["max_abs_error"], max_rel_error=max(c["max_rel_error"] for c in comparisons),
        num_outputs=worst["num_outputs"], worst_output=worst["worst_output"])


def _shared_plan(scope: str, plan: _plan.Plan | None) -> _plan.Plan | None:
    """Multi-process enactment: process 0's plan (or None) on every process. A process whose own
    plan directory holds a different plan for this program makes every process fail."""
    decisions = None if plan is None else {k: v for k, v in (plan.strategy or {}).items() if k != "origin"}
    mine = None if plan is None else _distributed.digest([plan.fingerprint, plan.use_default, decisions])
    digests = _distributed.gather_json(f"{scope}/plan-digest", mine)
    differing = [i for i, d in enumerate(digests) if d is not None and d != digests[0]]
    if differing:
        raise _distributed.PlanMismatchError(
            f"disco-jax: process(es) {differing} hold a different plan for this program than process 0 "
            f"(plan digests {digests}); give every process the same plan directory, or remove the stale plans")
    shared = _distributed.broadcast_json(f"{scope}/plan", None if plan is None else plan.to_json())
    return None if shared is None else _plan.Plan.from_json(shared)


def _run_search(graph, cost, options: Options, default_cost: float) -> _search.SearchResult:
    config = options.search_config()
    if not options.verbose:
        return _search.backtracking_search(graph, cost, config)
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    columns = [TextColumn("[bold cyan]disco-jax[/] search"), BarColumn(),
               TextColumn("best {task.fields[best]:.1f} us ({task.fields[ratio]:.3f}x default)"),
               TextColumn("{task.fields[n]} candidates"), TimeElapsedColumn()]
    with Progress(*columns, console=_console(), transient=False) as bar:
        task = bar.add_task("search", total=config.budget_s, best=default_cost, ratio=1.0, n=0)

        def progress(best, n, elapsed):
            bar.update(task, completed=min(elapsed, config.budget_s), best=best, ratio=best / default_cost, n=n)

        result = _search.backtracking_search(graph, cost, config, progress=progress)
        bar.update(task, completed=config.budget_s)
    return result


def _print_summary(graph, plan: _plan.Plan, report: dict) -> None:
    from rich.table import Table
    sim, meas, stats = plan.simulated, plan.measured, plan.search
    table = Table(title=f"disco-jax: {graph.module.name}", title_justify="left")
    table.add_column("")
    table.add_column("JAX default", justify="right")
    table.add_column("disco-jax plan", justify="right")
    table.add_row("simulated step (us)", f"{sim['default']['iteration_us']:.1f}", f"{sim['plan']['iteration_us']:.1f}")
    table.add_row("  compute / comm (us)", f"{sim['default']['compute_us']:.0f} / {sim['default']['comm_us']:.0f}",
                  f"{sim['plan']['compute_us']:.0f} / {sim['plan']['comm_us']:.0f}")
    table.add_row("  overlap ratio", f"{sim['default']['overlap_ratio']:.2f}", f"{sim['plan']['overlap_ratio']:.2f}")
    if meas:
        table.add_row("measured step (us)", f"{meas['default_us']:.1f}", f"{meas['plan_us']:.1f}")
    table.add_row("all-reduces", str(report["default_counts"]["all-reduce"]),
                  str(report.get("plan_counts", report["default_counts"])["all-reduce"]))
    table.add_row("fusions", str(report["default_counts"]["fusion"]),
                  str(report.get("plan_counts", report["default_counts"])["fusion"]))
    console = _console()
    console.print(table)
    console.print(f"search: {stats['evaluated']} candidates in {stats['seconds']:.1f} s "
                  f"({stats['candidates_per_second']:.0f}/s), stopped: {stats['stop_reason']}")
    console.print(f"decision: {'XLA default' if plan.use_default else 'disco-jax plan'} — {plan.reason}")
    if report.get("plan_path"):
        console.print(f"plan: {report['plan_path']}")


def _signature(args, kwargs):
    """Cache key of a call, on the hot path of every training step: the tree structure and each
    array's shape, dtype and sharding (hashable objects; no string formatting)."""
    leaves, tree = jax.tree.flatten((args, kwargs))
    return tree, tuple(
        (leaf.shape, leaf.dtype, leaf.sharding) if isinstance(leaf, jax.Array)
        else (type(leaf), tuple(leaf.shape), str(leaf.dtype)) if hasattr(leaf, "shape")
        else (type(leaf),)  # Python scalars are traced, their value does not matter
        for leaf in leaves)


def optimize_distributed(fn: Callable | None = None, *, alpha: float = 1.05, beta: int = 10, seed: int = 0,
                         budget_s: float = 60.0, max_unchanged: int = 1000, plan_dir: str | os.PathLike | None = None,
                         validation_pairs: int = 20, verbose: bool = True, **jit_kwargs):
    """Optimize a data-parallel training step by joint op fusion and all-reduce fusion.

    Use as `@optimize_distributed` or `@optimize_distributed(alpha=..., ...)`, above `@jax.jit` or on
    a plain function, which is then jitted with `jit_kwargs` (`static_argnames=`, `donate_argnums=`,
    ... as `jax.jit` takes them). Static arguments are part of the program: each static value is a
    program of its own, with a plan of its own.

    With `ENABLE_SEARCH=1` the first call searches for a plan, validates it against the
    unmodified step and stores it in `plan_dir` (default `$DISCO_JAX_PLAN_DIR` or
    `~/.cache/disco-jax/plans`); otherwise the first call applies the stored plan, or runs the
    unmodified step with a warning when there is none.

    alpha, beta, max_unchanged, seed: DisCo's search parameters (see `SearchConfig`); budget_s:
    search time limit in seconds; validation_pairs: interleaved timing pairs when validating."""
    options = Options(alpha=alpha, beta=beta, seed=seed, budget_s=budget_s, max_unchanged=max_unchanged,
                      plan_dir=None if plan_dir is None else str(plan_dir), validation_pairs=validation_pairs,
                      verbose=verbose)
    options.search_config()  # validate early

    def wrap(f: Callable) -> OptimizedStep:
        if not callable(f):
            raise TypeError(f"optimize_distributed expects a function, got {f!r}")
        if hasattr(f, "lower"):
            if jit_kwargs:
                raise TypeError(f"optimize_distributed got jax.jit options ({', '.join(sorted(jit_kwargs))}) for a "
                                "function that is jitted already; pass them to its jax.jit")
        else:
            f = jax.jit(f, **jit_kwargs)
        return OptimizedStep(f, options)

    return wrap if fn is None else wrap(fn)
