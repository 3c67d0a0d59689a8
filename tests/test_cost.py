"""The cost package on hand-built graphs with answers worked out by hand: the work counter, the
estimators and their plugin registry, the all-reduce cost protocol and the simulator."""

import random

import numpy as np
import optax
import pytest

from disco_jax import _capture, _graph, _program, _strategy, backends, cost
from disco_jax.cost import AllReduceCostModel, sharded

from _steps import make_step

# Two gradients produced one after the other (g1 then g2), each consumed by an update.
HLO = """HloModule handmade, entry_computation_layout={(f32[4]{0}, f32[4]{0})->(f32[4]{0}, f32[4]{0})}

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p0: f32[4], p1: f32[4]) -> (f32[4], f32[4]) {
  %p0 = f32[4]{0} parameter(0)
  %p1 = f32[4]{0} parameter(1)
  %g1 = f32[4]{0} multiply(%p0, %p0)
  %g2 = f32[4]{0} multiply(%g1, %p1)
  %ar = (f32[4]{0}, f32[4]{0}) all-reduce(%g1, %g2), channel_id=1, replica_groups={{0,1}}, \
use_global_device_ids=true, to_apply=%sum
  %r1 = f32[4]{0} get-tuple-element(%ar), index=0
  %r2 = f32[4]{0} get-tuple-element(%ar), index=1
  %u1 = f32[4]{0} subtract(%p0, %r1)
  %u2 = f32[4]{0} subtract(%p1, %r2)
  ROOT %out = (f32[4]{0}, f32[4]{0}) tuple(%u1, %u2)
}
"""

TIMES = {"g1": 10.0, "g2": 10.0, "u1": 1.0, "u2": 1.0}
ALLREDUCE = AllReduceCostModel(per_byte_us=0.0, latency_us=5.0)


class FixedEstimator:
    """Singletons by name; a fused group costs `fused` times the sum of its ops."""

    name = "fixed"

    def __init__(self, fused=1.0):
        self.fused = fused

    def estimate(self, graph, kernels):
        out = []
        for k in kernels:
            total = sum(TIMES[graph.ops[o].name] for o in k)
            out.append(total if len(k) == 1 else total * self.fused)
        return out


@pytest.fixture(scope="module")
def program():
    return _program.build_program(HLO, backends.CPU)


@pytest.fixture(scope="module")
def graph(program):
    return program.graph


def test_handmade_graph(graph):
    assert [graph.ops[g.producer].name for g in graph.gradients] == ["g1", "g2"]
    assert graph.xla_buckets == [(0, 1)]
    assert {graph.ops[o].name for o in graph.fusible_ops} == {"g1", "g2", "u1", "u2"}


def test_one_allreduce_per_gradient_overlaps_the_second_gradient(program, graph):
    s = _strategy.unfused(graph)
    r = cost.simulate(program, s, FixedEstimator(), ALLREDUCE)
    # g1 [0,10]; ar1 [10,15]; g2 [10,20]; ar2 [20,25]; u1 [20,21]; u2 [25,26].
    assert r.iteration_us == pytest.approx(26.0)
    assert r.compute_us == pytest.approx(22.0) and r.comm_us == pytest.approx(10.0)
    assert r.overlap_ratio == pytest.approx(0.6)  # 6 of 10 us of comm hidden
    assert r.full_overlap_us == pytest.approx(22.0)
    assert r.num_allreduces == 2


def test_one_combined_allreduce_waits_for_the_last_gradient(program, graph):
    s = _strategy.with_buckets(_strategy.unfused(graph), [(0, 1)], "combined")
    r = cost.simulate(program, s, FixedEstimator(), ALLREDUCE)
    # g1, g2 [0,20]; ar [20,25]; u1 [25,26]; u2 [26,27]: nothing overlaps.
    assert r.iteration_us == pytest.approx(27.0)
    assert r.overlap_ratio == pytest.approx(0.0)
    assert r.num_allreduces == 1


def test_fusing_the_gradients_delays_the_first_allreduce(program, graph):
    s = _strategy.unfused(graph)
    g1 = next(o for o in graph.fusible_ops if graph.ops[o].name == "g1")
    g2 = next(o for o in graph.fusible_ops if graph.ops[o].name == "g2")
    groups = [grp for grp in s.groups if not grp & {g1, g2}] + [frozenset({g1, g2})]
    homes = list(s.homes)
    for o in graph.fusible_ops:
        homes[o] = next(i for i, grp in enumerate(groups) if o in grp)
    fused = _strategy.Strategy(tuple(groups), tuple(homes), s.buckets, "fused")
    assert _strategy.is_valid(program, fused)
    r = cost.simulate(program, fused, FixedEstimator(fused=0.8), ALLREDUCE)
    # fused kernel [0,16]; ar1 [16,21]; ar2 [21,26]; u1 [21,22]; u2 [26,27]
    assert r.iteration_us == pytest.approx(27.0)
    assert r.num_fusions == 1


def test_a_bucket_pays_the_per_tensor_latency_of_each_tensor_after_the_first(program, graph):
    s = _strategy.with_buckets(_strategy.unfused(graph), [(0, 1)], "combined")
    per_tensor = AllReduceCostModel(per_byte_us=0.0, latency_us=5.0, per_tensor_us=4.0)
    assert per_tensor.bucket_time_us([16, 16]) == pytest.approx(9.0)
    assert cost.allreduce.bucket_time_us(ALLREDUCE, [16, 16]) == pytest.approx(5.0)  # no per-tensor term
    r = cost.simulate(program, s, FixedEstimator(), per_tensor)
    # g1, g2 [0,20]; ar (5 + 4) [20,29]; u1 [29,30]; u2 [30,31].
    assert r.iteration_us == pytest.approx(31.0) and r.comm_us == pytest.approx(9.0)
    assert AllReduceCostModel.from_json(per_tensor.to_json()).per_tensor_us == 4.0
    # The simulator's own per-tensor latency (fitted by calibration) replaces the cost's.
    r = cost.simulate(program, s, FixedEstimator(), per_tensor, cost.SimulatorParams(allreduce_tensor_us=1.0))
    assert r.comm_us == pytest.approx(6.0) and r.iteration_us == pytest.approx(28.0)


def test_blocking_allreduces_do_not_overlap(program, graph):
    s = _strategy.unfused(graph)
    params = cost.SimulatorParams(compute_scale=1.0, comm_blocking=1.0)
    r = cost.simulate(program, s, FixedEstimator(), ALLREDUCE, params)
    assert r.iteration_us == pytest.approx(r.compute_us + r.comm_us)  # 32: fully serialized


def test_kernel_and_step_overheads(program, graph):
    s = _strategy.unfused(graph)
    params = cost.SimulatorParams(kernel_overhead_us=1.0, step_overhead_us=3.0)
    r = cost.simulate(program, s, FixedEstimator(), ALLREDUCE, params)
    # g1 [0,11]; ar1 [11,16]; g2 [11,22]; ar2 [22,27]; u1 [22,24]; u2 [27,29]; + 3 for the step.
    assert r.iteration_us == pytest.approx(32.0)
    assert r.compute_us == pytest.approx(26.0) and r.full_overlap_us == pytest.approx(29.0)
    assert set(params.to_json()) == {
        "compute_scale",
        "comm_blocking",
        "kernel_overhead_us",
        "step_overhead_us",
        "allreduce_tensor_us",
        "host",
    }


def test_the_dependency_bound_is_reached_where_the_schedule_is_forced(program, graph):
    unfused = _strategy.unfused(graph)
    combined = _strategy.with_buckets(unfused, [(0, 1)], "combined")
    overheads = cost.SimulatorParams(kernel_overhead_us=1.0, step_overhead_us=3.0)
    # Worked out above: g2 feeds ar2, which feeds u2 (26); the one bucket waits for both
    # gradients and both updates wait for it (27); with overheads g1 g2 ar2 u2 + step (32).
    for s, params, expected in [
        (unfused, cost.SimulatorParams(), 26.0),
        (combined, cost.SimulatorParams(), 27.0),
        (unfused, overheads, 32.0),
    ]:
        r = cost.simulate(program, s, FixedEstimator(), ALLREDUCE, params, bound=True)
        assert r.dependency_bound_us == pytest.approx(expected) == r.iteration_us
        assert r.full_overlap_us < expected  # FO ignores that ar2 waits for g2 and u2 for ar2
    # A blocking all-reduce costs stream time no dependency forces: the bound stays below.
    blocking = cost.SimulatorParams(comm_blocking=1.0)
    r = cost.simulate(program, unfused, FixedEstimator(), ALLREDUCE, blocking, bound=True)
    assert r.dependency_bound_us == pytest.approx(26.0) and r.iteration_us == pytest.approx(32.0)
    assert "dependency_bound_us" not in cost.simulate(program, unfused, FixedEstimator(), ALLREDUCE).to_json()


@pytest.mark.parametrize("latency_us", [1.0, 2000.0])
def test_no_strategy_simulates_below_its_dependency_bound(latency_us):
    """Random strategies of a small Adam step (fusions, buckets, sharded updates): the simulated
    iteration never beats the bound. Where communication dominates, the bound exceeds FO by the
    time before the first gradient exists."""
    step, args = make_step("jit", sizes=(16, 64, 32, 4), optimizer=optax.adam(1e-3))
    p = _program.build_program(_capture.capture(step.lower(*args))[0], backends.CPU)
    g = p.graph
    moves = _strategy.with_sharding(sharded.regions_of(g).shardable)
    allreduce = AllReduceCostModel(per_byte_us=1e-3, latency_us=latency_us)
    rng = random.Random(0)
    s = _strategy.xla_default(g)
    above_fo = 0
    for _ in range(60):
        s = moves[rng.choice(sorted(moves))](p, s, rng) or s
        r = cost.simulate(p, s, cost.AnalyticalEstimator(), allreduce, bound=True)
        if r is None:
            continue
        assert r.full_overlap_us <= r.dependency_bound_us <= r.iteration_us * (1 + 1e-9)
        # Packed buckets add copies proportional to bytes, not latency: counted for the bound only.
        above_fo += not s.packed and r.dependency_bound_us > 1.05 * r.full_overlap_us
    assert (above_fo > 0) == (latency_us > 1000.0)


def test_two_point_calibration_recovers_known_parameters(program, graph):
    one, two = _strategy.with_buckets(_strategy.unfused(graph), [(0, 1)], "one"), _strategy.unfused(graph)
    truth = cost.SimulatorParams(compute_scale=2.0, comm_blocking=0.5)

    def simulate_at(p):
        return tuple(cost.simulate(program, s, FixedEstimator(), ALLREDUCE, p).iteration_us for s in (one, two))

    fitted = cost.calibrate(simulate_at, simulate_at(truth))
    assert fitted.free == ("compute_scale", "comm_blocking") and fitted.dof == 0
    assert fitted.params.compute_scale == pytest.approx(2.0)
    assert fitted.params.comm_blocking == pytest.approx(0.5)
    assert fitted.misfit == pytest.approx(0.0, abs=1e-9)
    assert [p.measured_us for p in fitted.points] == pytest.approx(list(simulate_at(truth)))


def _synthetic_configurations(n, seed=0):
    """n configurations of a step: estimated kernel time, kernel count, all-reduce count and time."""
    rng = np.random.default_rng(seed)
    kernel_sum = rng.uniform(500, 3000, n)
    kernels = rng.integers(20, 400, n).astype(float)
    allreduces = rng.integers(1, 40, n).astype(float)
    comm = allreduces * 30.0 + rng.uniform(100, 800, n)
    return kernel_sum, kernels, allreduces, comm


def _synthetic_simulator(configs):
    """A simulator in the simulator's own terms: compute (scaled kernels plus their overheads and
    the blocked share of the all-reduces) or communication, whichever is longer, plus the step."""
    kernel_sum, kernels, _, comm = configs

    def simulate_at(p):
        compute = p.compute_scale * kernel_sum + p.kernel_overhead_us * kernels + p.comm_blocking * comm
        return list(np.maximum(compute, comm + 0.2 * kernel_sum) + p.step_overhead_us)

    return simulate_at


def test_many_point_calibration_recovers_parameters_from_noisy_measurements():
    configs = _synthetic_configurations(16)
    simulate_at = _synthetic_simulator(configs)
    truth = cost.SimulatorParams(compute_scale=4.0, comm_blocking=0.3, kernel_overhead_us=6.0, step_overhead_us=900.0)
    noise = np.random.default_rng(1).normal(1.0, 0.02, 16)
    fitted = cost.calibrate(simulate_at, np.array(simulate_at(truth)) * noise, labels=[f"c{i}" for i in range(16)])
    assert fitted.free == ("compute_scale", "comm_blocking", "step_overhead_us", "kernel_overhead_us")
    assert fitted.dof == 12 and len(fitted.points) == 16 and fitted.points[3].label == "c3"
    p = fitted.params
    assert p.compute_scale == pytest.approx(4.0, rel=0.1)
    assert p.kernel_overhead_us == pytest.approx(6.0, rel=0.2)
    assert p.step_overhead_us == pytest.approx(900.0, rel=0.3)
    assert p.comm_blocking == pytest.approx(0.3, abs=0.1)
    assert fitted.misfit < 0.03  # the noise, no more
    assert fitted.to_json()["params"] == p.to_json() and fitted.to_json()["misfit"] == fitted.misfit


def test_calibration_reports_a_large_misfit_when_the_model_is_wrong():
    configs = _synthetic_configurations(12, seed=2)
    simulate_at = _synthetic_simulator(configs)
    kernel_sum, kernels, _, _ = configs
    # Measured times the simulator cannot express: they fall as its kernel work grows.
    measured = 2e7 / (kernel_sum + 10.0 * kernels)
    fitted = cost.calibrate(simulate_at, measured)
    assert fitted.misfit > 0.2 and fitted.max_error > fitted.misfit
    # ... and where it can (the same configurations, a true parameter set), none.
    exact = cost.calibrate(simulate_at, simulate_at(cost.SimulatorParams(2.0, 0.0, 3.0, 100.0)))
    assert exact.misfit < 1e-3


def test_calibration_keeps_fixed_parameters_and_refuses_one_point():
    configs = _synthetic_configurations(5)
    simulate_at = _synthetic_simulator(configs)
    start = cost.SimulatorParams(kernel_overhead_us=2.0)
    fitted = cost.calibrate(
        simulate_at, simulate_at(cost.SimulatorParams(3.0, 0.0, 2.0)), free=["compute_scale"], start=start
    )
    assert fitted.params == cost.SimulatorParams(pytest.approx(3.0), 0.0, 2.0, 0.0)
    with pytest.raises(ValueError, match="at least two"):
        cost.calibrate(simulate_at, [1.0])
    with pytest.raises(ValueError, match="unknown"):
        cost.calibrate(simulate_at, [1.0, 2.0], free=["speed"])


def test_invalid_strategy_simulates_to_none(program, graph):
    s = _strategy.unfused(graph)
    g2 = next(o for o in graph.fusible_ops if graph.ops[o].name == "g2")
    u1 = next(o for o in graph.fusible_ops if graph.ops[o].name == "u1")
    groups = list(s.groups)
    groups[s.homes[g2]] = frozenset({g2, u1})  # u1 needs ar1, which needs g1 only: fine ...
    homes = list(s.homes)
    homes[u1] = s.homes[g2]
    ok = _strategy.Strategy(tuple(groups), tuple(homes), s.buckets)
    assert (
        cost.simulate(program, _strategy.Strategy(ok.groups, ok.homes, ((0, 1),)), FixedEstimator(), ALLREDUCE) is None
    )  # ... but one all-reduce for both is a cycle


def test_analytical_fit_recovers_coefficients(graph):
    rng = np.random.default_rng(0)
    true = np.array([2.0, 1e-3, 5e-4, 0.0, 1e-5])
    samples = []
    for _ in range(40):
        f = np.array([1.0, *rng.uniform(1e2, 1e6, 4)])
        samples.append((f, float(f @ true)))
    fitted = cost.AnalyticalEstimator.fit(samples)
    assert np.allclose(fitted.coefficients, true, rtol=1e-6, atol=1e-9)


def test_calibrated_estimator_returns_measured_times_for_measured_kernels(graph):
    analytical = cost.AnalyticalEstimator()
    kernels = [frozenset([o]) for o in graph.fusible_ops]
    measured = {k: 7.0 + i for i, k in enumerate(kernels)}
    calibrated = cost.CalibratedEstimator(analytical, graph, measured)
    assert calibrated.estimate(graph, kernels) == pytest.approx([measured[k] for k in kernels])
    # A fused kernel is costed from its parts' measured shares and the base model's fusion gain.
    fused = frozenset(graph.fusible_ops[:2])
    (estimate,) = calibrated.estimate(graph, [fused])
    assert 0 < estimate <= sum(measured[frozenset([o])] for o in fused) * 1.0001


def test_chain_estimator_falls_through_and_caches(graph):
    table = cost.TableEstimator({})
    chain = cost.ChainEstimator([table, FixedEstimator()])
    k = frozenset([graph.fusible_ops[0]])
    assert chain.estimate_with_source(graph, [k]) == [(10.0, "fixed")]
    table.times_us[graph.kernel_signature(k)] = 3.0
    assert chain.estimate(graph, [k]) == [10.0]  # cached answer


def test_chain_composes_like_optax_chain(graph):
    k = frozenset([graph.fusible_ops[0]])
    composed = cost.chain(cost.TableEstimator({graph.kernel_signature(k): 3.0}), FixedEstimator())
    assert isinstance(composed, cost.ChainEstimator) and composed.name == "profile+fixed"
    other = frozenset(o for o in graph.fusible_ops if graph.ops[o].name == "u1")  # a subtract: not in the table
    assert composed.estimate_with_source(graph, [k, other]) == [(3.0, "profile"), (1.0, "fixed")]


# Work: exp is transcendental, the reduce sums 4x8 elements, the dot contracts 8.
WORK_HLO = """HloModule work, entry_computation_layout={(f32[4,8]{1,0}, f32[8,2]{1,0})->(f32[4]{0}, f32[4,2]{1,0})}

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (x: f32[4,8], w: f32[8,2]) -> (f32[4], f32[4,2]) {
  %x = f32[4,8]{1,0} parameter(0)
  %w = f32[8,2]{1,0} parameter(1)
  %e = f32[4,8]{1,0} exponential(%x)
  %t = f32[8,4]{0,1} transpose(%e), dimensions={1,0}
  %zero = f32[] constant(0)
  %r = f32[4]{0} reduce(%e, %zero), dimensions={1}, to_apply=%sum
  %d = f32[4,2]{1,0} dot(%e, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %out = (f32[4]{0}, f32[4,2]{1,0}) tuple(%r, %d)
}
"""


def test_the_work_counter_counts_each_op_once_and_the_graph_caches_it():
    g = _graph.build_graph(WORK_HLO, backends.CPU.fusible)
    by_name = {op.name: op.id for op in g.ops}
    work = cost.work_per_op(g)
    assert work[by_name["e"]] == cost.Work(flops=8.0 * 32, transcendental=32.0, bytes=128)
    assert work[by_name["t"]] == cost.Work(flops=0.0, elementwise=32.0, bytes=128)  # moves data: no flops
    assert work[by_name["r"]] == cost.Work(flops=32.0, elementwise=32.0, bytes=16)
    assert work[by_name["d"]] == cost.Work(flops=2.0 * 4 * 2 * 8, dot=2.0 * 4 * 2 * 8, bytes=32)
    assert cost.flops_per_op(g) == [w.flops for w in work]
    assert cost.work_per_op(g) is work  # computed once per graph, kept with it
    kernel = frozenset([by_name["e"], by_name["r"]])
    assert cost.kernel_work(g, kernel) == cost.KernelWork(128.0, 16.0 + 128.0, 32.0, 32.0, 0.0)
    np.testing.assert_array_equal(cost.kernel_features(g, kernel), [1.0, 272.0, 32.0, 32.0, 0.0])
    assert cost.loop_work("exponential", 32) == cost.Work(flops=256.0, transcendental=32.0)


def test_allreduce_costs_share_one_protocol():
    from disco_jax.eval import clusters

    measured = AllReduceCostModel(per_byte_us=1e-3, latency_us=5.0)
    simulated = clusters.H100_NVLINK_8.allreduce_model()
    for model in (measured, simulated):
        assert isinstance(model, cost.AllReduceCost)
        assert model.time_us(1 << 20) > model.time_us(4) > 0 and isinstance(model.to_json(), dict)
    fitted = cost.fit_allreduce_cost([(1000, 6.0), (2000, 7.0)])
    assert (fitted.per_byte_us, fitted.latency_us) == pytest.approx((1e-3, 5.0))


class ProbeEstimator:
    """A plugin estimator: a fixed time for every kernel of fusible ops; remembers what it got."""

    name = "probe"

    def __init__(self, device_kind):
        self.device_kind = device_kind
        self.op_times = None

    def with_op_times(self, op_times_us):
        self.op_times = dict(op_times_us)
        return self

    def estimate(self, graph, kernels):
        return [7.0 if all(graph.ops[o].kind == "fusible" for o in k) else None for k in kernels]


def test_registered_plugins_come_first_then_entry_points_and_failures_are_skipped():
    cost.register_estimator("probe", ProbeEstimator)
    cost.register_estimator("broken", lambda kind: 1 / 0)
    cost.register_estimator("nothing", lambda kind: None)
    try:
        names = list(cost.estimator_factories())
        assert names[:3] == ["probe", "broken", "nothing"]
        assert "gnn" in names  # the entry point in pyproject.toml
        with pytest.warns(cost.EstimatorPluginWarning, match="broken"):
            found = cost.plugin_estimators("no-such-device")  # the GNN has no weights for it
        assert [type(e) for e in found] == [ProbeEstimator] and found[0].device_kind == "no-such-device"
    finally:
        for name in ("probe", "broken", "nothing"):
            cost.unregister_estimator(name)
    assert "probe" not in cost.estimator_factories()


def test_cudnn_backward_convolutions_cost_what_the_forward_one_costs():
    # One 3x3 convolution of N=8, 32x32, 16 -> 64 features (stride 1, same padding) as XLA:GPU's
    # three cuDNN calls: each carries the forward convolution's attributes, with its tensors
    # in other places (the backward-filter call's output is the kernel's gradient).
    from disco_jax import _hlo
    from disco_jax.cost.work import instruction_work

    attrs = "window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_o01i->b01f"
    x, k, y = "f32[8,32,32,16]{3,2,1,0}", "f32[64,3,3,16]{3,2,1,0}", "f32[8,32,32,64]{3,2,1,0}"
    text = f"""HloModule m, is_scheduled=true

ENTRY %main (p0: f32[8,32,32,16], p1: f32[64,3,3,16], p2: f32[8,32,32,64]) -> f32[8,32,32,16] {{
  %p0 = {x} parameter(0)
  %p1 = {k} parameter(1)
  %p2 = {y} parameter(2)
  %fwd = ({y}, u8[0]{{0}}) custom-call(%p0, %p1), {attrs}, custom_call_target="__cudnn$convForward"
  %bwi = ({x}, u8[0]{{0}}) custom-call(%p2, %p1), {attrs}, custom_call_target="__cudnn$convBackwardInput"
  %bwf = ({k}, u8[0]{{0}}) custom-call(%p0, %p2), {attrs}, custom_call_target="__cudnn$convBackwardFilter"
  ROOT %gte = {x} get-tuple-element(%bwi), index=0
}}
"""
    module = _hlo.parse_module(text)
    insts = {i.name: i for i in module.entry.instructions}
    specs = {n: _hlo.parse_shape(s) for n, s in (("p0", x), ("p1", k), ("p2", y))}
    expected = 2.0 * (8 * 32 * 32 * 64) * (3 * 3 * 16)
    for name, operands in (("fwd", ("p0", "p1")), ("bwi", ("p2", "p1")), ("bwf", ("p0", "p2"))):
        work = instruction_work(insts[name], [list(specs[o]) for o in operands])
        assert work.dot == expected, name


REGIONS = """HloModule regions

%fused_store (stack: f32[32,1024], layer: f32[1024], i: s32[]) -> f32[32,1024] {
  %stack = f32[32,1024]{1,0} parameter(0)
  %layer = f32[1024]{0} parameter(1)
  %i = s32[] parameter(2)
  %grown = f32[1024]{0} exponential(%layer)
  %row = f32[1,1024]{1,0} bitcast(%grown)
  %zero = s32[] constant(0)
  ROOT %stored = f32[32,1024]{1,0} dynamic-update-slice(%stack, %row, %i, %zero)
}

%fused_load (weights: f32[32,1024], j: s32[]) -> f32[1,1024] {
  %weights = f32[32,1024]{1,0} parameter(0)
  %j = s32[] parameter(1)
  %zero.1 = s32[] constant(0)
  %sliced = f32[1,1024]{1,0} dynamic-slice(%weights, %j, %zero.1), dynamic_slice_sizes={1,1024}
  ROOT %scaled = f32[1,1024]{1,0} negate(%sliced)
}

ENTRY %main (s: f32[32,1024], x: f32[1024], k: s32[]) -> (f32[32,1024], f32[1,1024], f32[32,1024]) {
  %s = f32[32,1024]{1,0} parameter(0)
  %x = f32[1024]{0} parameter(1)
  %k = s32[] parameter(2)
  %store = f32[32,1024]{1,0} fusion(%s, %x, %k), kind=kLoop, calls=%fused_store
  %load = f32[1,1024]{1,0} fusion(%s, %k), kind=kLoop, calls=%fused_load
  %whole = f32[32,1024]{1,0} negate(%s)
  ROOT %out = (f32[32,1024]{1,0}, f32[1,1024]{1,0}, f32[32,1024]{1,0}) tuple(%store, %load, %whole)
}
"""


def test_a_dynamic_slice_reads_its_slice_and_an_in_place_update_writes_its_update():
    """A scanned layer's kernels: storing a layer's activations into a (layers, ...) stack by an
    in-place dynamic-update-slice moves the layer's row, not the stack; reading a layer's
    parameters by a dynamic slice reads its row; a kernel that reads the stack whole pays it."""
    graph = _graph.build_graph(REGIONS, backends.GPU.fusible, merge_duplicates=False)
    kernels = dict(zip(graph.xla_kernel_names, graph.xla_groups))
    row, stack, index = 1024 * 4, 32 * 1024 * 4, 4
    assert cost.kernel_io_bytes(graph, kernels["store"]) == (row + index, row)
    assert cost.kernel_io_bytes(graph, kernels["load"]) == (row + index, row)
    assert cost.kernel_io_bytes(graph, kernels["whole"]) == (stack, stack)
