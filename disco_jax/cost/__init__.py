"""The cost model: what kernels and all-reduces cost, and the step simulator built on them.

* `work`: the one work counter: flops, elements, transcendentals and bytes of an op
  (`Work`, cached per graph: `work_per_op`) and of a kernel (`KernelWork`).
* `estimators`: the `Estimator` protocol (kernels -> microseconds) and its implementations:
  measured table, analytical roofline, calibrated wrapper, per-kernel overhead, `chain`; plus the registry of
  estimator plugins (entry-point group ``disco_jax.estimators``; the GNN is one).
* `allreduce`: the `AllReduceCost` protocol and the measured line `AllReduceCostModel`.
* `kernels`: a strategy's kernel graph as the simulator runs it (`KernelState`), built from
  scratch or derived from its parent's by what the search's moves changed.
* `sharded`: the sharded weight update as the simulator costs it (`Strategy.sharded`): per
  gradient, its update region and optimizer state (`UpdateRegions`).
* `events`: `run`, the event simulation of a kernel state, and `SimulatorParams` (its
  calibrated constants; `simulator.BARE_PARAMS`, uncalibrated).
* `bound`: `dependency_bound`, the least iteration any order of a kernel state's kernels reaches
  (FO plus what dependencies force; `simulate(..., bound=True)`, reported per benchmark row).
* `compiled`: the cost of a compiled program, kernel by kernel as XLA compiled and scheduled it
  (`compiled_program`, `cost_program`, `compiled_cost` -> `CompiledCost`; DESIGN.md point 18):
  what a strategy costs once compiled, beside the simulator that proposes strategies; and
  `LoopEstimator`, the simulator's opaque `while` costed the same way, from its body.
* `simulator`: `simulate`, the parameters' multi-point `calibrate` (-> `Calibrated`:
  the parameters, the misfit and each point), `CostModel`, and `SimulatedCost` (the search's
  cost function, `CostModel.evaluator`).

Data flow: profile table + plugins + analytical fit -> `chain(...)` -> `CostModel` (with the
all-reduce cost) -> `simulate(program, strategy)` for every candidate of the search; the
executable compiled for a candidate -> `compiled_cost(text, backend, estimator, all-reduce cost)`.
"""

from disco_jax.cost.allreduce import AllReduceCost, AllReduceCostModel, fit_allreduce_cost, fit_allreduce_samples
from disco_jax.cost.compiled import (
    CompiledCost,
    CompiledProgram,
    CostedKernel,
    LoopEstimator,
    captured_program,
    compiled_cost,
    compiled_program,
    cost_program,
    loop_program,
    measured_table,
)
from disco_jax.cost.estimators import (
    ENTRY_POINT_GROUP,
    AnalyticalEstimator,
    CalibratedEstimator,
    ChainEstimator,
    Estimator,
    EstimatorFactory,
    EstimatorPluginWarning,
    OverheadEstimator,
    TableEstimator,
    chain,
    estimator_factories,
    kernel_features,
    plugin_estimators,
    register_estimator,
    unregister_estimator,
    with_op_times,
)
from disco_jax.cost.loop_packing import packed_loop_savings_us, record_loop_allreduce_times
from disco_jax.cost.simulator import (
    Calibrated,
    CalibrationPoint,
    CostModel,
    SimulatedCost,
    SimulatedStep,
    SimulatorParams,
    calibrate,
    kernel_state,
    simulate,
)
from disco_jax.cost.work import (
    ANALYTICAL_FEATURES,
    ELEMENTWISE,
    TRANSCENDENTAL,
    TRANSCENDENTAL_FLOPS,
    KernelWork,
    Work,
    flops_per_op,
    kernel_half_bytes,
    kernel_io_bytes,
    kernel_work,
    loop_work,
    work_per_op,
)

__all__ = [
    "ANALYTICAL_FEATURES",
    "ELEMENTWISE",
    "ENTRY_POINT_GROUP",
    "TRANSCENDENTAL",
    "TRANSCENDENTAL_FLOPS",
    "AllReduceCost",
    "AllReduceCostModel",
    "AnalyticalEstimator",
    "Calibrated",
    "CalibratedEstimator",
    "CalibrationPoint",
    "ChainEstimator",
    "CompiledCost",
    "CompiledProgram",
    "CostedKernel",
    "CostModel",
    "Estimator",
    "EstimatorFactory",
    "EstimatorPluginWarning",
    "OverheadEstimator",
    "KernelWork",
    "SimulatedCost",
    "SimulatedStep",
    "SimulatorParams",
    "TableEstimator",
    "Work",
    "calibrate",
    "chain",
    "compiled_cost",
    "compiled_program",
    "cost_program",
    "estimator_factories",
    "fit_allreduce_cost",
    "fit_allreduce_samples",
    "kernel_features",
    "kernel_half_bytes",
    "kernel_io_bytes",
    "kernel_state",
    "kernel_work",
    "loop_work",
    "LoopEstimator",
    "captured_program",
    "packed_loop_savings_us",
    "record_loop_allreduce_times",
    "loop_program",
    "work_per_op",
    "flops_per_op",
    "measured_table",
    "plugin_estimators",
    "register_estimator",
    "simulate",
    "unregister_estimator",
    "with_op_times",
]
