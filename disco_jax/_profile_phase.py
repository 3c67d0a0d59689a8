"""The profile and calibrate phases: what the simulator knows about this step on these devices.

`profile` measures the kernel times of XLA's own executable and (once per device kind, device count
and process count: `shared_allreduce_fit`) the all-reduce cost, stores them in the profile database,
and builds the `disco_jax.cost.CostModel`:
a chain of kernel estimators (measured table, then each estimator plugin that has one for the
device kind, calibrated, then the calibrated analytical estimator) and the all-reduce fit.
`calibrate` then fits the simulator's device parameters (`disco_jax.cost.SimulatorParams`) to the
measured step times of several strategies (`calibration_strategies`), so that simulated step times
are in the units of measured ones, and reports how well they fit (the misfit).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from disco_jax import _device_timing, _distributed, _profile_db, _strategy, _validate, _warnings, cost
from disco_jax._compile import Captured, Runner, compile_strategy
from disco_jax._console import Ui
from disco_jax._graph import Graph
from disco_jax._profile_db import process_count
from disco_jax._program import Program
from disco_jax.cost.allreduce import collective_ops


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What the calibrate phase fitted (`fitted`: the parameters, the misfit and every measured
    configuration) and the measured step times of XLA's plan and of one all-reduce per gradient."""

    fitted: cost.Calibrated
    measured_default_us: float
    measured_per_gradient_us: float

    @property
    def params(self) -> cost.SimulatorParams:
        return self.fitted.params

    @property
    def misfit(self) -> float:
        return self.fitted.misfit

    @property
    def points(self) -> tuple[cost.CalibrationPoint, ...]:
        return self.fitted.points

    def to_json(self) -> dict:
        fitted = self.fitted.to_json()
        return {
            **fitted.pop("params"),
            "measured_default_us": self.measured_default_us,
            "measured_per_gradient_us": self.measured_per_gradient_us,
            **fitted,
        }


def traced_runner(captured: Captured, runner: Runner, strategy: _strategy.Strategy | None = None) -> Runner:
    """The runner the profiler traces in place of `runner` (XLA's executable, or the one of
    `strategy`): the same program compiled again with the backend's `profile_options` where it
    has any (XLA:GPU: command buffers off, so each kernel is a trace event of its own), else
    `runner` itself."""
    options = dict(captured.backend.profile_options)
    if not options:
        return runner
    if strategy is None:
        compiled = captured.lowered.compile(compiler_options=options)
    else:
        compiled, _ = compile_strategy(captured.lowered, captured.program, strategy, options)
    return captured.runner(compiled, runner.args, runner.kwargs)


def kernel_times(captured: Captured, runner: Runner, strategy: _strategy.Strategy, steps: int) -> dict[str, float]:
    """Traced kernel times of a candidate's executable (`runner`), through `traced_runner`."""
    traced = traced_runner(captured, runner, strategy)
    return _device_timing.measure_kernel_times(traced, (), steps=steps, warmup=1, module_name=captured.module_name)


def profile(
    captured: Captured, default_runner: Runner, database: _profile_db.ProfileDatabase, ui: Ui
) -> cost.CostModel:
    """Measure kernel times of the default executable and the all-reduce fit on these devices,
    merge them into the profile database, and build the cost model."""
    graph, devices, machine = captured.graph, captured.devices, captured.machine
    traced = traced_runner(captured, default_runner)
    times = _device_timing.measure_kernel_times(traced, (), module_name=captured.module_name)
    by_name = kernels_by_name(graph)
    table, measured = {}, {}
    for name, t in times.items():
        members = by_name.get(name)
        if members is not None:
            table[graph.kernel_signature(members)] = t
            measured[members] = t
    table.update(loop_body_times(captured, times))
    cost.record_loop_allreduce_times(graph, captured.backend, times)
    stored = database.load(machine.device_kind, machine.backend, machine.num_devices, process_count(devices))
    allreduce = shared_allreduce_fit(stored, captured.scope)
    fit_from = "profile"
    if allreduce is None:
        fit_from = "measured"
        where = f" in {jax.process_count()} processes" if _distributed.is_multiprocess() else ""
        ui.say(f"measuring all-reduce cost on {len(devices)} devices{where}")
        mesh = jax.sharding.Mesh(np.array(devices), ("all",))
        allreduce, points = _device_timing.measure_allreduce_cost(mesh)  # a collective: every process runs it
    else:  # process 0's stored fit, and only process 0 stores it again: another's points do not matter
        points = stored.allreduce_points if stored is not None else []
    if collective_ops(graph):
        allreduce = with_scatter_gather(allreduce, captured, None, ui)
    if jax.process_index() == 0:
        profile = _profile_db.Profile.for_devices(
            devices, allreduce=allreduce, allreduce_points=points, kernel_times_us=table
        )
        try:
            database.save(profile)
        except OSError as e:
            _warnings.warn(f"disco-jax: could not store the profile: {e}")
    known = dict(stored.kernel_times_us) if stored is not None else {}
    known.update(table)
    analytical = cost.AnalyticalEstimator.fit([(cost.kernel_features(graph, k), t) for k, t in measured.items()])
    # Plugins (the GNN, when trained weights exist for this device kind) read each op's own
    # measured time where known; the analytical estimator answers what they cannot.
    plugins = [cost.with_op_times(p, known) for p in cost.plugin_estimators(machine.device_kind)]
    estimators: list[cost.Estimator] = [cost.TableEstimator(known)]
    if any(graph.ops[o].opcode == "while" for o in graph.opaque_ops):
        # A loop no profile timed whole (a candidate's own): its body, per iteration, as measured.
        inner = cost.chain(cost.TableEstimator(known), *plugins, analytical)
        estimators.append(cost.LoopEstimator(inner, allreduce, captured.backend))
    estimators += [cost.CalibratedEstimator(base, graph, measured) for base in plugins or [analytical]]
    if plugins:
        estimators.append(cost.CalibratedEstimator(analytical, graph, measured))
    return cost.CostModel(
        cost.chain(*estimators),
        allreduce,
        {
            "kernel_times": len(table),
            "estimators": [e.name for e in estimators],
            "analytical": analytical.to_json(),
            "allreduce": allreduce.to_json(),
            "allreduce_from": fit_from,
        },
        kernel_times_us=times,
    )


def loop_body_times(captured: Captured, times: dict[str, float]) -> dict[str, float]:
    """Traced times of the step's loop bodies' kernels (by instruction name, per step: every
    iteration's run summed) as a table by kernel signature, per iteration: `cost.measured_table`
    of the captured module's loops, read as `cost.LoopEstimator` reads them (names, as for the
    entry's kernels, are the executable's). {} for a step without loops."""
    if not any(op.opcode == "while" for op in captured.graph.ops):
        return {}
    program = cost.captured_program(captured.graph, captured.backend)
    if program is None:  # a loop whose trip count cannot be read: costed by its own traced time only
        return {}
    body = {k.name for k in program.kernels if k.scope}
    return cost.measured_table(program, {n: t for n, t in times.items() if n in body}).times_us


def shared_allreduce_fit(stored: _profile_db.Profile | None, scope: str | None) -> cost.AllReduceCostModel | None:
    """The stored all-reduce fit the step's cost model takes (None: measure one). `stored` is this
    process's profile for the step's device kind, device count and process count. In a job of
    several processes each host reads its own profile directory, and measuring is a collective
    that every process must enter or none, so process 0 decides: its fit (or None) is broadcast
    under `scope` and every process takes it."""
    fit = stored.allreduce if stored is not None else None
    if fit is not None and fit.spread is None:
        fit = None  # fitted by an older disco-jax: one sample per size, no per-tensor cost
    if not _distributed.is_multiprocess():
        return fit
    key = f"{scope or _distributed.new_scope('profile')}/allreduce-fit"
    shared = _distributed.broadcast_json(key, None if fit is None else fit.to_json())
    return None if shared is None else cost.AllReduceCostModel.from_json(shared)


def kernels_by_name(graph: Graph) -> dict[str, frozenset[int]]:
    """XLA's kernels of the graph by the instruction name a profile of XLA's executable reports:
    its fusions and the opaque ops it left alone."""
    by_name = {op.name: frozenset([op.id]) for op in graph.ops if op.kind == "opaque"}
    by_name.update(zip(graph.xla_kernel_names, graph.xla_groups))
    return by_name


def with_scatter_gather(
    allreduce: cost.AllReduceCostModel,
    captured: Captured,
    database: _profile_db.ProfileDatabase | None,
    ui: Ui,
) -> cost.AllReduceCostModel:
    """`allreduce` with its reduce-scatter / all-gather line (`AllReduceCostModel.scatter_gather`),
    measured on the step's devices when it has none (`_device_timing.measure_scatter_gather_cost`, a
    collective: every process runs it) and, given a `database`, stored with the all-reduce fit by
    process 0. Every process measures or none: the fit's line comes from process 0's profile
    (`shared_allreduce_fit`) or from none. `profile` stores it itself for a program that has such
    collectives."""
    if allreduce.scatter_gather is not None:
        return allreduce
    devices = captured.devices
    ui.say(f"measuring reduce-scatter and all-gather cost on {len(devices)} devices")
    line, _ = _device_timing.measure_scatter_gather_cost(jax.sharding.Mesh(np.array(devices), ("all",)))
    allreduce = dataclasses.replace(allreduce, scatter_gather=line)
    if database is not None and jax.process_index() == 0:
        machine = captured.machine
        stored = database.load(machine.device_kind, machine.backend, machine.num_devices, process_count(devices))
        same_fit = stored is not None and stored.allreduce == dataclasses.replace(allreduce, scatter_gather=None)
        points = stored.allreduce_points if same_fit else []
        try:
            database.save(_profile_db.Profile.for_devices(devices, allreduce=allreduce, allreduce_points=points))
        except OSError as e:
            _warnings.warn(f"disco-jax: could not store the profile: {e}")
    return allreduce


def calibration_strategies(program: Program) -> dict[str, _strategy.Strategy]:
    """The configurations the simulator is fitted to, by label: XLA's plan; its fusions with one
    all-reduce per gradient (how much an all-reduce costs the step, and how much of it hides);
    no op fusion with XLA's all-reduces (what a kernel costs beyond its traced time: many more,
    smaller kernels); and no op fusion with one all-reduce per gradient. Configurations that
    coincide on this graph (one gradient, nothing fused) are measured once; one the backend could
    not emit is left out."""
    graph = program.graph
    default = _strategy.xla_default(graph)
    per_gradient = [(g.id,) for g in graph.gradients]
    unfused = _strategy.unfused(graph)
    candidates = {
        "default": default,
        "per-gradient": _strategy.with_buckets(default, per_gradient, "per-gradient"),
        "unfused": _strategy.with_buckets(unfused, default.buckets, "unfused-ops"),
        "unfused-per-gradient": unfused,
    }
    out, seen = {}, set()
    for label, s in candidates.items():
        if s.key() not in seen and (label == "default" or _strategy.is_valid(program, s)):
            seen.add(s.key())
            out[label] = s
    return out


def null_program(captured: Captured) -> Callable[[], Any]:
    """A program with the step's arguments and results that computes nothing (it fills its results
    with zeros): what launching the step costs on these devices, whatever the step computes. On
    XLA:CPU's virtual devices that is a large, fixed share of the step: each device's launch
    handles every argument and result buffer (docs/simulator-fidelity.md)."""
    out_info = captured.lowered.out_info

    def zeros(args, kwargs):
        return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), out_info)

    program = jax.jit(zeros, out_shardings=captured.default_compiled.output_shardings)
    compiled = program.lower(captured.args, captured.kwargs).compile()
    return lambda: compiled(captured.args, captured.kwargs)


# Fitted by `calibrate`; the step's fixed cost is measured. The per-kernel overhead is not fitted:
# on XLA:CPU it comes out at 0-1 us (docs/simulator-fidelity.md), where the per-tensor latency of
# an all-reduce as the step sees it differs from the one measured apart (over gloo).
CALIBRATED = ("compute_scale", "comm_blocking", "allreduce_tensor_us")


def calibrated_free(num_points: int) -> tuple[str, ...]:
    """The parameters fitted to `num_points` measured configurations: the first of `CALIBRATED`,
    at most one fewer than the points, so that the misfit can show a wrong model."""
    return CALIBRATED[: max(1, min(len(CALIBRATED), num_points - 1))]


def calibrate(
    cost_model: cost.CostModel, captured: Captured, default_runner: Runner, pairs: int, ui: Ui
) -> Calibration:
    """Fit the simulator's parameters to the step as measured: its fixed cost (`step_overhead_us`)
    is the `null_program`'s time; the compute scale, the all-reduces' blocking and the per-tensor
    latency of a combined all-reduce are fitted (`cost.calibrate`) to the measured step times of the
    `calibration_strategies`. Every program is timed in interleaved pairs against XLA's executable
    (its time: the median ratio to XLA's, times the median of XLA's own times). Sets
    `cost_model.params`."""
    program = captured.program
    strategies = calibration_strategies(program)
    pairs = max(6, pairs)
    ratios, default_samples = {"default": 1.0}, []
    for label, s in strategies.items():
        if label == "default":
            continue
        compiled, _ = compile_strategy(captured.lowered, program, s)
        timing = _validate.time_interleaved(default_runner, captured.runner(compiled), pairs=pairs)
        ratios[label] = timing.ratio
        default_samples.append(timing.default_us)
    null = _validate.time_interleaved(default_runner, null_program(captured), pairs=pairs)
    default_samples.append(null.default_us)
    default_us = float(np.median(default_samples))
    labels = list(strategies)
    measured = [ratios[label] * default_us for label in labels]
    start = cost.SimulatorParams(
        step_overhead_us=null.ratio * default_us,
        allreduce_tensor_us=float(getattr(cost_model.allreduce, "per_tensor_us", 0.0)),
    )
    states = {label: cost.kernel_state(program, s) for label, s in strategies.items()}

    def simulate_at(p: cost.SimulatorParams) -> list[float]:
        model = cost_model
        return [
            cost.simulate(program, strategies[x], model.estimator, model.allreduce, p, state=states[x]).iteration_us
            for x in labels
        ]

    if len(labels) == 1:  # nothing to vary on this graph: the compute scale alone (the point twice)
        fitted = cost.calibrate(
            lambda p: simulate_at(p) * 2, measured * 2, free=("compute_scale",), start=start, labels=labels * 2
        )
        fitted = dataclasses.replace(fitted, points=fitted.points[:1], misfit=abs(fitted.points[0].error))
    else:
        fitted = cost.calibrate(simulate_at, measured, free=calibrated_free(len(labels)), start=start, labels=labels)
    params = fitted.params
    cost_model.params = params
    ui.say(
        f"simulator calibrated on {len(labels)} configurations: {params.step_overhead_us:.0f} us per step "
        f"(measured), compute x{params.compute_scale:.2f}, {params.allreduce_tensor_us or 0.0:.0f} us per tensor "
        "combined into an all-reduce, "
        f"all-reduces hold compute {params.comm_blocking:.0%} of their time; misfit {fitted.misfit:.1%} "
        f"(measured {default_us:.0f} us default)"
    )
    return Calibration(
        fitted, default_us, measured[labels.index("per-gradient")] if "per-gradient" in labels else default_us
    )


def calibration_points(program: Program, sources: dict) -> list[tuple[_strategy.Strategy, float, str]]:
    """What the calibrate phase measured besides XLA's plan (`calibration_strategies`,
    its points by label), as (strategy, measured ratio to XLA's plan, label)."""
    found = sources.get("calibration") or {}
    measured = {p.get("label"): p.get("measured_us") for p in found.get("points") or []}
    default_us = measured.get("default") or found.get("measured_default_us")
    if not default_us:
        return []
    strategies = calibration_strategies(program)
    return [
        (strategies[label], us / default_us, label)
        for label, us in measured.items()
        if label in strategies and label != "default" and us
    ]
