"""Estimators and the simulator on hand-built graphs with answers worked out by hand."""

import numpy as np
import pytest

from disco_jax import backends, _cost, _graph, _strategy
from disco_jax._profile import AllReduceCostModel

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
  %ar = (f32[4]{0}, f32[4]{0}) all-reduce(%g1, %g2), channel_id=1, replica_groups={{0,1}}, use_global_device_ids=true, to_apply=%sum
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
def graph():
    return _graph.build_graph(HLO, backends.CPU)


def test_handmade_graph(graph):
    assert [graph.ops[g.producer].name for g in graph.gradients] == ["g1", "g2"]
    assert graph.xla_buckets == [(0, 1)]
    assert {graph.ops[o].name for o in graph.fusible_ops} == {"g1", "g2", "u1", "u2"}


def test_one_allreduce_per_gradient_overlaps_the_second_gradient(graph):
    s = _strategy.unfused(graph)
    r = _cost.simulate(graph, s, FixedEstimator(), ALLREDUCE)
    # g1 [0,10]; ar1 [10,15]; g2 [10,20]; ar2 [20,25]; u1 [20,21]; u2 [25,26].
    assert r.iteration_us == pytest.approx(26.0)
    assert r.compute_us == pytest.approx(22.0) and r.comm_us == pytest.approx(10.0)
    assert r.overlap_ratio == pytest.approx(0.6)  # 6 of 10 us of comm hidden
    assert r.full_overlap_us == pytest.approx(22.0)
    assert r.num_allreduces == 2


def test_one_combined_allreduce_waits_for_the_last_gradient(graph):
    s = _strategy.with_buckets(_strategy.unfused(graph), [(0, 1)], "combined")
    r = _cost.simulate(graph, s, FixedEstimator(), ALLREDUCE)
    # g1, g2 [0,20]; ar [20,25]; u1 [25,26]; u2 [26,27]: nothing overlaps.
    assert r.iteration_us == pytest.approx(27.0)
    assert r.overlap_ratio == pytest.approx(0.0)
    assert r.num_allreduces == 1


def test_fusing_the_gradients_delays_the_first_allreduce(graph):
    s = _strategy.unfused(graph)
    g1 = next(o for o in graph.fusible_ops if graph.ops[o].name == "g1")
    g2 = next(o for o in graph.fusible_ops if graph.ops[o].name == "g2")
    groups = [grp for grp in s.groups if not grp & {g1, g2}] + [frozenset({g1, g2})]
    homes = list(s.homes)
    for o in graph.fusible_ops:
        homes[o] = next(i for i, grp in enumerate(groups) if o in grp)
    fused = _strategy.Strategy(tuple(groups), tuple(homes), s.buckets, "fused")
    assert _strategy.is_valid(graph, fused)
    r = _cost.simulate(graph, fused, FixedEstimator(fused=0.8), ALLREDUCE)
    # fused kernel [0,16]; ar1 [16,21]; ar2 [21,26]; u1 [21,22]; u2 [26,27]
    assert r.iteration_us == pytest.approx(27.0)
    assert r.num_fusions == 1


def test_blocking_allreduces_do_not_overlap(graph):
    s = _strategy.unfused(graph)
    params = _cost.SimulatorParams(compute_scale=1.0, comm_blocking=1.0)
    r = _cost.simulate(graph, s, FixedEstimator(), ALLREDUCE, params)
    assert r.iteration_us == pytest.approx(r.compute_us + r.comm_us)  # 32: fully serialized


def test_calibration_recovers_known_parameters(graph):
    one, two = _strategy.with_buckets(_strategy.unfused(graph), [(0, 1)], "one"), _strategy.unfused(graph)
    truth = _cost.SimulatorParams(compute_scale=2.0, comm_blocking=0.5)

    def simulate_at(p):
        return tuple(_cost.simulate(graph, s, FixedEstimator(), ALLREDUCE, p).iteration_us for s in (one, two))

    fitted = _cost.calibrate(simulate_at, simulate_at(truth))
    assert fitted.compute_scale == pytest.approx(2.0)
    assert fitted.comm_blocking == pytest.approx(0.5)


def test_invalid_strategy_simulates_to_none(graph):
    s = _strategy.unfused(graph)
    g2 = next(o for o in graph.fusible_ops if graph.ops[o].name == "g2")
    u1 = next(o for o in graph.fusible_ops if graph.ops[o].name == "u1")
    groups = list(s.groups)
    groups[s.homes[g2]] = frozenset({g2, u1})  # u1 needs ar1, which needs g1 only: fine ...
    homes = list(s.homes)
    homes[u1] = s.homes[g2]
    ok = _strategy.Strategy(tuple(groups), tuple(homes), s.buckets)
    assert _cost.simulate(graph, _strategy.Strategy(ok.groups, ok.homes, ((0, 1),)), FixedEstimator(),
                          ALLREDUCE) is None  # ... but one all-reduce for both is a cycle


def test_analytical_fit_recovers_coefficients(graph):
    rng = np.random.default_rng(0)
    true = np.array([2.0, 1e-3, 5e-4, 0.0, 1e-5])
    samples = []
    for _ in range(40):
        f = np.array([1.0, *rng.uniform(1e2, 1e6, 4)])
        samples.append((f, float(f @ true)))
    fitted = _cost.AnalyticalEstimator.fit(samples)
    assert np.allclose(fitted.coefficients, true, rtol=1e-6, atol=1e-9)


def test_calibrated_estimator_returns_measured_times_for_measured_kernels(graph):
    analytical = _cost.AnalyticalEstimator()
    kernels = [frozenset([o]) for o in graph.fusible_ops]
    measured = {k: 7.0 + i for i, k in enumerate(kernels)}
    calibrated = _cost.CalibratedEstimator(analytical, graph, measured)
    assert calibrated.estimate(graph, kernels) == pytest.approx([measured[k] for k in kernels])
    # A fused kernel is costed from its parts' measured shares and the base model's fusion gain.
    fused = frozenset(graph.fusible_ops[:2])
    (estimate,) = calibrated.estimate(graph, [fused])
    assert 0 < estimate <= sum(measured[frozenset([o])] for o in fused) * 1.0001


def test_chain_estimator_falls_through_and_caches(graph):
    table = _cost.TableEstimator({})
    chain = _cost.ChainEstimator([table, FixedEstimator()])
    k = frozenset([graph.fusible_ops[0]])
    assert chain.estimate_with_source(graph, [k]) == [(10.0, "fixed")]
    table.times_us[_cost.kernel_signature(graph, k)] = 3.0
    assert chain.estimate(graph, [k]) == [10.0]  # cached answer
