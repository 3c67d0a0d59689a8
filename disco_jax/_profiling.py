"""The profile and calibrate phases: what the simulator knows about this step on these devices.

`profile` measures the kernel times of XLA's own executable and (once per device kind and count)
the all-reduce cost, stores them in the profile database, and builds the `disco_jax.cost.CostModel`:
a chain of kernel estimators (measured table, then each estimator plugin that has one for the
device kind, calibrated, then the calibrated analytical estimator) and the all-reduce fit.
`calibrate` then fits the simulator's two device parameters to two measured strategies, so that
simulated step times are in the units of measured ones.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import numpy as np

from disco_jax import _distributed, _profile, _profile_store, _strategy, _validate, cost
from disco_jax._compile import Captured, Runner, compile_strategy
from disco_jax._console import Ui


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The fitted simulator parameters and the two measured step times they were fitted to."""

    params: cost.SimulatorParams
    measured_default_us: float
    measured_per_gradient_us: float

    def to_json(self) -> dict:
        return {
            **self.params.to_json(),
            "measured_default_us": self.measured_default_us,
            "measured_per_gradient_us": self.measured_per_gradient_us,
        }


def profile(
    captured: Captured, default_runner: Runner, database: _profile_store.ProfileDatabase, ui: Ui
) -> cost.CostModel:
    """Measure kernel times of the default executable and the all-reduce fit on these devices,
    merge them into the profile database, and build the cost model."""
    graph, devices, machine = captured.graph, captured.devices, captured.machine
    times = _profile.measure_kernel_times(default_runner, (), module_name=captured.module_name)
    by_name = {op.name: frozenset([op.id]) for op in graph.ops if op.kind == "opaque"}
    for name, members in zip(graph.xla_kernel_names, graph.xla_groups):
        by_name[name] = members
    table, measured = {}, {}
    for name, t in times.items():
        members = by_name.get(name)
        if members is not None:
            table[graph.kernel_signature(members)] = t
            measured[members] = t
    stored = database.load(machine.device_kind, machine.backend, machine.num_devices)
    # Stored fits are keyed by device count only, not by transport: with several processes the
    # fit is measured over the real one (gloo, NCCL) every time, and not stored.
    multiprocess = _distributed.is_multiprocess()
    allreduce = stored.allreduce if stored is not None and not multiprocess else None
    if allreduce is None:
        where = f" in {jax.process_count()} processes" if multiprocess else ""
        ui.say(f"measuring all-reduce cost on {len(devices)} devices{where}")
        mesh = jax.sharding.Mesh(np.array(devices), ("all",))
        allreduce, points = _profile.measure_allreduce_cost(mesh)  # a collective: every process runs it
        profile = _profile_store.Profile.for_devices(
            devices,
            allreduce=None if multiprocess else allreduce,
            allreduce_points=[] if multiprocess else points,
            kernel_times_us=table,
        )
    else:
        profile = _profile_store.Profile.for_devices(
            devices, allreduce=allreduce, allreduce_points=stored.allreduce_points, kernel_times_us=table
        )
    if jax.process_index() == 0:
        try:
            database.save(profile)
        except OSError as e:
            warnings.warn(f"disco-jax: could not store the profile: {e}", stacklevel=2)
    known = dict(stored.kernel_times_us) if stored is not None else {}
    known.update(table)
    analytical = cost.AnalyticalEstimator.fit([(cost.kernel_features(graph, k), t) for k, t in measured.items()])
    # Plugins (the GNN, when trained weights exist for this device kind) read each op's own
    # measured time where known; the analytical estimator answers what they cannot.
    plugins = [cost.with_op_times(p, known) for p in cost.plugin_estimators(machine.device_kind)]
    estimators: list[cost.Estimator] = [cost.TableEstimator(known)]
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
        },
    )


def calibrate(
    cost_model: cost.CostModel, captured: Captured, default_runner: Runner, pairs: int, ui: Ui
) -> Calibration:
    """Fit the simulator's compute scale and all-reduce blocking to two measured strategies:
    XLA's plan and the same fusions with one all-reduce per gradient. Sets `cost_model.params`."""
    graph = captured.graph
    default = _strategy.xla_default(graph)
    split = _strategy.with_buckets(default, [(g.id,) for g in graph.gradients], "per-gradient")
    if len(split.buckets) == len(default.buckets):
        timing_default = _validate.time_interleaved(default_runner, default_runner, pairs=5)
        measured = (timing_default.default_us, timing_default.default_us)
        params = cost.SimulatorParams(measured[0] / cost_model.simulate(graph, default).iteration_us, 0.0)
    else:
        compiled, _ = compile_strategy(captured.lowered, graph, split)
        timing = _validate.time_interleaved(default_runner, captured.runner(compiled), pairs=max(6, pairs))
        measured = (timing.default_us, timing.plan_us)

        def simulate_at(p):
            return (
                cost_model.simulate(graph, default, params=p).iteration_us,
                cost_model.simulate(graph, split, params=p).iteration_us,
            )

        params = cost.calibrate(simulate_at, measured)
    cost_model.params = params
    ui.say(
        f"simulator calibrated: compute x{params.compute_scale:.2f}, all-reduces hold compute "
        f"{params.comm_blocking:.0%} of their time (measured {measured[0]:.0f} us default, "
        f"{measured[1]:.0f} us with one all-reduce per gradient)"
    )
    return Calibration(params, measured[0], measured[1])
