"""The step simulator (DisCo section 4.4) and the cost model the search simulates with.

`simulate` runs a strategy's kernel graph (of one `_program.Program`: its graph and the compiler,
which says what it can emit and which all-reduces become reduce-scatters) on one compute stream and
one communication channel and reports iteration time, compute and comm time, overlap and the full-overlap bound
(`SimulatedStep`). A bucket's all-reduce costs what the all-reduce cost says for its tensors
(`cost.allreduce.bucket_time_us`: on XLA:CPU every tensor of a variadic all-reduce pays the
latency again). `SimulatorParams` (defined with the event core, `cost.events`, which runs by them)
are the device parameters beyond kernel and all-reduce costs (compute scale, the share of an
all-reduce that blocks compute, a per-kernel and a per-step overhead), fitted to any number of
measured runs by `calibrate`, which reports how well they fit
(`Calibrated`: the misfit and every point). `CostModel` bundles what one search simulates with:
a kernel estimator, an all-reduce cost and the parameters. docs/simulator-fidelity.md says why
the model is what it is on XLA:CPU.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from disco_jax._strategy import BUCKET, GROUP, Strategy, emittable
from disco_jax.cost import events, kernels, sharded
from disco_jax.cost.allreduce import AllReduceCost
from disco_jax.cost.bound import dependency_bound
from disco_jax.cost.estimators import ChainEstimator, Estimator
from disco_jax.cost.events import SimulatorParams
from disco_jax.cost.kernels import KernelState, is_scatter

if TYPE_CHECKING:
    from disco_jax._program import Program


@dataclasses.dataclass
class SimulatedStep:
    """Result of `simulate`: times in microseconds, plus the schedule for timelines."""

    iteration_us: float
    compute_us: float
    comm_us: float
    overlap_ratio: float  # fraction of comm time hidden under compute
    full_overlap_us: float  # FO: max(compute, comm), the bound with perfect overlap
    num_fusions: int
    num_allreduces: int
    events: list[tuple[str, str, float, float]]  # (lane 'compute'|'comm', kernel label, start, end)
    allreduce_ready_us: list[float]  # per bucket of the strategy, in order: when its last gradient is ready
    # The least iteration any schedule of these kernels reaches (`cost.bound`); None unless asked for.
    dependency_bound_us: float | None = None

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("events")
        d.pop("allreduce_ready_us")
        if d["dependency_bound_us"] is None:
            d.pop("dependency_bound_us")
        return d


BARE_PARAMS = SimulatorParams()
"""DisCo's bare simulator: no scale, blocking or overheads (the defaults of `SimulatorParams`)."""
PARAM_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SimulatorParams))
# What `calibrate` fits by default, by how many measured configurations there are: always the
# compute scale and the blocking (the two-point calibration); the overheads only with enough
# points left over to tell a wrong model (a misfit) from noise.
DEFAULT_FREE: tuple[str, ...] = ("compute_scale", "comm_blocking", "step_overhead_us", "kernel_overhead_us")
BLOCKING_GRID: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclasses.dataclass(frozen=True)
class CalibrationPoint:
    """One measured configuration of a calibration: its measured and (fitted) simulated time."""

    measured_us: float
    simulated_us: float
    label: str | None = None

    @property
    def error(self) -> float:
        """Relative error of the simulation, (simulated - measured) / measured."""
        return (self.simulated_us - self.measured_us) / self.measured_us

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "error": self.error}


@dataclasses.dataclass(frozen=True)
class Calibrated:
    """What `calibrate` fitted: the parameters, how well the fitted simulator reproduces the
    measured configurations (`misfit`: the median of |simulated - measured| / measured over the
    points; `max_error`: the largest), each point, and which parameters were free. With as many
    free parameters as points the fit is exact whatever the model, so the misfit says something
    only when `dof` (points - free parameters) is positive."""

    params: SimulatorParams
    misfit: float
    points: tuple[CalibrationPoint, ...]
    free: tuple[str, ...]

    @property
    def max_error(self) -> float:
        return max((abs(p.error) for p in self.points), default=0.0)

    @property
    def dof(self) -> int:
        return len(self.points) - len(self.free)

    def to_json(self) -> dict:
        return {
            "params": self.params.to_json(),
            "misfit": self.misfit,
            "max_error": self.max_error,
            "dof": self.dof,
            "free": list(self.free),
            "points": [p.to_json() for p in self.points],
        }


def default_free(num_points: int) -> tuple[str, ...]:
    """The parameters `calibrate` fits to `num_points` configurations: scale and blocking for two
    (exact, the old two-point calibration); then one overhead per further point while at least
    one point is left over to measure the misfit with."""
    if num_points < 2:
        raise ValueError(f"calibrate needs at least two measured configurations, got {num_points}")
    return DEFAULT_FREE[: max(2, min(len(DEFAULT_FREE), num_points - 1))]


def calibrate(
    simulate_at: Callable[[SimulatorParams], Sequence[float]],
    measured: Sequence[float],
    *,
    free: Sequence[str] | None = None,
    start: SimulatorParams = BARE_PARAMS,
    labels: Sequence[str] | None = None,
    blocking_grid: Sequence[float] = BLOCKING_GRID,
) -> Calibrated:
    """Fit `SimulatorParams` so that simulated step times match measured ones, over any number
    (>= 2) of configurations.

    `simulate_at(params)` returns the simulated iteration time of every configuration, in the
    order of `measured`. `free` names the parameters to fit (default `default_free(len(measured))`);
    the others keep their value in `start`. The fit minimizes the squared relative errors: for
    each blocking fraction of `blocking_grid` (when `comm_blocking` is free), the other free
    parameters by Gauss-Newton with non-negative parameters (simulated times are piecewise linear
    in the scale and the overheads: exact in a few steps); the fraction with the least error wins.
    Two configurations and the default `free` (scale and blocking) is DisCo's two-point
    calibration: exact whenever some blocking fraction can be exact."""
    measured = [float(m) for m in measured]
    if len(measured) < 2:
        raise ValueError(f"calibrate needs at least two measured configurations, got {len(measured)}")
    if any(m <= 0 for m in measured):
        raise ValueError(f"measured times must be positive, got {measured}")
    free = tuple(default_free(len(measured)) if free is None else free)
    unknown = set(free) - set(PARAM_NAMES)
    if unknown:
        raise ValueError(f"unknown simulator parameters {sorted(unknown)}; known: {PARAM_NAMES}")
    target = np.array(measured)
    linear = [n for n in PARAM_NAMES if n in free and n != "comm_blocking"]
    grid = list(blocking_grid) if "comm_blocking" in free else [start.comm_blocking]

    def loss(sim: np.ndarray) -> float:
        return float(np.sum(((sim - target) / target) ** 2))

    best, best_sim, best_loss = start, None, float("inf")
    current = start
    for b in grid:
        p, sim = _fit_linear(dataclasses.replace(current, comm_blocking=float(b)), linear, target, simulate_at)
        if loss(sim) < best_loss - 1e-15:
            best, best_sim, best_loss = p, sim, loss(sim)
        current = p  # warm start for the next fraction
    if "comm_blocking" in free and len(grid) > 1:  # refine the blocking between grid points
        step = min(abs(a - b) for a, b in zip(grid, grid[1:]) if a != b) / 2
        for _ in range(3):
            for b in (best.comm_blocking - step, best.comm_blocking + step):
                if 0.0 <= b <= 1.0:
                    p, sim = _fit_linear(dataclasses.replace(best, comm_blocking=b), linear, target, simulate_at)
                    if loss(sim) < best_loss - 1e-15:
                        best, best_sim, best_loss = p, sim, loss(sim)
            step /= 2
    points = tuple(
        CalibrationPoint(m, float(s), None if labels is None else labels[i])
        for i, (m, s) in enumerate(zip(measured, best_sim))
    )
    misfit = float(np.median([abs(p.error) for p in points]))
    return Calibrated(best, misfit, points, free)


def _fit_linear(
    params: SimulatorParams,
    names: list[str],
    target: np.ndarray,
    simulate_at: Callable[[SimulatorParams], Sequence[float]],
    iterations: int = 8,
) -> tuple[SimulatorParams, np.ndarray]:
    """Gauss-Newton on relative errors over the parameters `names` (each >= 0; the compute scale
    > 0), from `params`; returns the parameters and their simulated times. The Jacobian is taken
    by secants of a tenth of each parameter's size, except the step overhead's, which is 1 (the
    simulator adds it to every iteration)."""

    def sim(p: SimulatorParams) -> np.ndarray:
        out = np.array([float(t) for t in simulate_at(p)])
        if out.shape != target.shape:
            raise ValueError(f"simulate_at returned {out.shape[0]} times for {target.shape[0]} measurements")
        return out

    current = sim(params)
    if not names:
        return params, current
    weights = 1.0 / target

    def err(s: np.ndarray) -> float:
        return float(np.sum(((s - target) * weights) ** 2))

    for _ in range(iterations):
        x = np.array([getattr(params, n) or 0.0 for n in names])
        jac = np.ones((len(target), len(names)))
        for j, n in enumerate(names):
            if n != "step_overhead_us":
                h = max(abs(x[j]) * 0.1, 1e-2)
                jac[:, j] = (sim(dataclasses.replace(params, **{n: x[j] + h})) - current) / h
        # Linear model s(x') = current + jac (x' - x): least squares for x' >= 0.
        new_x = _nonnegative_lstsq(jac * weights[:, None], (target - current + jac @ x) * weights)
        if "compute_scale" in names:
            i = names.index("compute_scale")
            new_x[i] = max(new_x[i], 1e-6)
        predicted = current + jac @ (new_x - x)
        before, t = err(current), 1.0
        while True:  # damped: piecewise linear, so a full step can overshoot a kink
            candidate = dataclasses.replace(params, **{n: float(v) for n, v in zip(names, x + t * (new_x - x))})
            s = sim(candidate)
            if err(s) <= before or t < 1e-3:
                break
            t /= 4
        if err(s) > before:
            break
        # Done when the step gained nothing, or landed where the linear model said (no kink
        # crossed: the least-squares solution of the linear model is the fit).
        linear = t == 1.0 and np.allclose(s, predicted, rtol=1e-6, atol=1e-9 * float(np.max(target)))
        converged = linear or err(s) >= before * (1 - 1e-6) or err(s) < 1e-24
        params, current = candidate, s
        if converged:
            break
    return params, current


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min |a x - b| over x >= 0, for a few columns: the best unconstrained solution over every
    subset of columns that comes out non-negative (the optimum is one of them)."""
    n = a.shape[1]
    best, best_err = np.zeros(n), float(np.sum(b**2))
    for mask in range(1, 1 << n):
        cols = [j for j in range(n) if mask >> j & 1]
        sol, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
        if np.any(sol < 0):
            continue
        x = np.zeros(n)
        x[cols] = sol
        e = float(np.sum((a @ x - b) ** 2))
        if e < best_err - 1e-15:
            best, best_err = x, e
    return best


def simulate(
    program: Program,
    strategy: Strategy,
    estimator: Estimator,
    allreduce: AllReduceCost,
    params: SimulatorParams = BARE_PARAMS,
    *,
    state: KernelState | None = None,
    record: bool = False,
    bound: bool = False,
) -> SimulatedStep | None:
    """DisCo's simulator: a ready queue of compute kernels on one stream in dependency order;
    all-reduces on one channel in the order their gradients are produced, each starting when its
    last gradient is ready and the channel is free (and holding the compute stream for
    `params.comm_blocking` of its time). The program's other collectives (`cost.allreduce.collective_ops`:
    the all-gathers and reduce-scatters of a sharded weight update) share that channel, costed by
    `collective_time_us`. A compute kernel costs `params.kernel_us` of its
    estimate; the step's fixed cost `params.step_overhead_us` is added to the iteration time (and
    to the full-overlap bound; not to compute time). None if the strategy is invalid: a fused
    group the backend cannot emit, or a dependency cycle. `state`: the strategy's kernel state
    (`cost.kernels`), when the caller simulates it several times (calibration). `bound`: also
    compute the dependency bound (`cost.bound`; a few passes over the kernel graph), with the
    step overhead added as to FO."""
    state = state or kernel_state(program, strategy)
    if state is None:
        return None
    kernels.estimate_missing(program.graph, [state], estimator)
    timeline = events.run(program, state, params, allreduce, record=record)
    if timeline is None:
        return None
    alive = state.alive()
    return SimulatedStep(
        iteration_us=timeline.iteration_us + params.step_overhead_us,
        compute_us=timeline.compute_us,
        comm_us=timeline.comm_us,
        overlap_ratio=timeline.overlap_ratio,
        full_overlap_us=max(timeline.compute_us, timeline.comm_us) + params.step_overhead_us,
        num_fusions=sum(1 for k in alive if state.kinds[k] == GROUP and len(state.members[k]) > 1),
        num_allreduces=sum(1 for k in alive if state.kinds[k] == BUCKET),
        events=[(lane, _label(program, state, k, allreduce), a, b) for lane, k, a, b in timeline.events],
        allreduce_ready_us=[timeline.ready_at[k] for k in state.bucket_slots(strategy)],
        dependency_bound_us=(
            dependency_bound(program, state, params, allreduce) + params.step_overhead_us if bound else None
        ),
    )


def kernel_state(program: Program, strategy: Strategy) -> KernelState | None:
    """The strategy's kernel state for repeated `simulate(..., state=)` calls; None when the
    backend cannot emit it. A cycle shows when it is simulated."""
    if strategy.index is None and not emittable(program, strategy):
        return None
    return kernels.build(program.graph, strategy)


def _label(program: Program, state: KernelState, k: int, allreduce: AllReduceCost) -> str:
    if state.kinds[k] == BUCKET:
        scatter = is_scatter(state.keys[k]) and sharded.reduce_scatters(program, allreduce)
        return f"{'reduce-scatter' if scatter else 'all-reduce'}[{len(state.members[k])}]"
    if state.kinds[k] == kernels.GATHER:
        return f"all-gather[{len(state.members[k])}]"
    ops = sorted(state.members[k])
    first = program.graph.ops[ops[-1]].name
    return first if len(ops) == 1 else f"fusion[{len(ops)}]:{first}"


@dataclasses.dataclass
class CostModel:
    """What the simulator needs, built once per search: estimator chain and all-reduce cost.
    `sources` says where each part came from (for the plan file). `kernel_times_us`: the profiled
    times of XLA's executable by instruction name (`_device_timing.measure_kernel_times`), for the
    compiled-program model (`cost.compiled.measured_table`); not written to the plan."""

    estimator: ChainEstimator
    allreduce: AllReduceCost
    sources: dict
    params: SimulatorParams = BARE_PARAMS
    kernel_times_us: dict[str, float] = dataclasses.field(default_factory=dict, repr=False)

    def evaluator(self, program: Program) -> SimulatedCost:
        """The search's cost function on `program` (`SimulatedCost`). The estimators prepare first
        (`ChainEstimator.warm_up`: the GNN compiles its batch shapes), so the search compiles
        nothing."""
        warm_up = getattr(self.estimator, "warm_up", None)
        if callable(warm_up):
            warm_up()
        return SimulatedCost(program, self)

    def simulate(
        self, program: Program, strategy: Strategy, record: bool = False, params: SimulatorParams | None = None
    ) -> SimulatedStep | None:
        return simulate(program, strategy, self.estimator, self.allreduce, params or self.params, record=record)


@dataclasses.dataclass(frozen=True)
class SimulatedCost:
    """A strategy's simulated iteration time, None when it is invalid: `cost(strategy)`, or
    `cost.many(strategies, parent=)` for the candidates of one search step. Their kernel states
    are derived from the parent's (`kernels.derive`: only what the moves touched is rebuilt),
    their new kernels are estimated in one call (the GNN predicts them in one batch), and the
    states of the last `KEEP_STATES` valid strategies are kept for the next steps' parents."""

    program: Program
    model: CostModel
    _states: OrderedDict = dataclasses.field(default_factory=OrderedDict, init=False, repr=False, compare=False)
    # Communication times by kernel for (params, all-reduce cost): calibration may change the params.
    _comm_costs: list = dataclasses.field(
        default_factory=lambda: [None, None, {}], init=False, repr=False, compare=False
    )

    # A step's parent is the cheapest queued candidate, nearly always evaluated a few steps before:
    # 64 states (about 0.5 MB each on a 7k-op graph) answered every parent lookup of a bert:paper search.
    KEEP_STATES: ClassVar[int] = 64

    def __call__(self, strategy: Strategy) -> float | None:
        return self.many([strategy])[0]

    def state(self, strategy: Strategy) -> KernelState | None:
        """The kernel state of an evaluated strategy (kept), else built; None if not emittable."""
        key = strategy.key()
        found = self._states.get(key)
        if found is not None:
            self._states.move_to_end(key)
            return found
        return kernel_state(self.program, strategy)

    def many(self, strategies: Sequence[Strategy], parent: Strategy | None = None) -> list[float | None]:
        program, graph, model = self.program, self.program.graph, self.model
        base = self.state(parent) if parent is not None else None
        states: list[KernelState | None] = []
        for s in strategies:
            if base is not None and s.rehomed is not None and s.index is not None:
                states.append(kernels.derive(graph, base, s))
            else:
                states.append(kernel_state(program, s))
        kernels.estimate_missing(graph, [st for st in states if st is not None], model.estimator)
        out: list[float | None] = []
        if self._comm_costs[0] != model.params or self._comm_costs[1] is not model.allreduce:
            self._comm_costs[:] = [model.params, model.allreduce, {}]
        memo = self._comm_costs[2]
        for s, st in zip(strategies, states):
            timeline = None if st is None else events.run(program, st, model.params, model.allreduce, comm_costs=memo)
            if timeline is None:
                out.append(None)
                continue
            out.append(timeline.iteration_us + model.params.step_overhead_us)
            self._states[s.key()] = st
            if len(self._states) > self.KEEP_STATES:
                self._states.popitem(last=False)
        return out
