"""The backtracking search (Algorithm 1)."""

import gc

import pytest

from disco_jax import _capture, _program, _search, _strategy, backends
from disco_jax.cost import AllReduceCostModel, AnalyticalEstimator, ChainEstimator, CostModel, simulate

from _steps import make_step


@pytest.fixture(scope="module")
def problem():
    step, args = make_step("jit", sizes=(16, 64, 64, 64, 4))
    program = _program.build_program(_capture.capture(step.lower(*args))[0], backends.CPU)
    estimator = ChainEstimator([AnalyticalEstimator()])
    allreduce = AllReduceCostModel(per_byte_us=1e-3, latency_us=20.0)

    def cost(s):
        r = simulate(program, s, estimator, allreduce)
        return None if r is None else r.iteration_us

    return program, cost


def test_search_never_returns_worse_than_its_starts(problem):
    program, cost = problem
    result = _search.backtracking_search(program, cost, _search.SearchConfig(budget_s=3))
    assert result.best_cost <= min(result.start_costs.values())
    assert result.best_cost == pytest.approx(cost(result.best))
    assert _strategy.is_valid(program, result.best)
    assert result.evaluated >= len(result.start_costs)


def test_a_search_forms_no_reference_cycles_and_restores_the_collector(problem):
    """`_search._fewer_collections` runs the cyclic collector rarely during a search: sound only
    while the search's garbage is freed by reference counting. A simulation that formed a cycle
    (a closure calling itself held every run's lists) left about 40 objects per candidate."""
    program, _ = problem
    allreduce = AllReduceCostModel(per_byte_us=1e-3, latency_us=20.0)
    evaluator = CostModel(ChainEstimator([AnalyticalEstimator()]), allreduce, {}).evaluator(program)
    threshold, enabled = gc.get_threshold(), gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        config = _search.SearchConfig(budget_s=30, max_unchanged=300, alpha=10.0, seed=1)
        result = _search.backtracking_search(program, evaluator, config)
        assert gc.get_threshold() == threshold
        garbage = gc.collect()
    finally:
        if enabled:
            gc.enable()
    assert result.evaluated > 100
    assert garbage < result.evaluated // 10


def test_search_is_deterministic_for_a_seed(problem):
    program, cost = problem
    config = _search.SearchConfig(budget_s=30, max_unchanged=150, seed=3)
    a = _search.backtracking_search(program, cost, config)
    b = _search.backtracking_search(program, cost, config)
    assert a.best.key() == b.best.key() and a.evaluated == b.evaluated


def test_search_respects_the_budget_and_reports_progress(problem):
    program, cost = problem
    seen = []
    config = _search.SearchConfig(budget_s=0.5, max_unchanged=10**9, alpha=10.0)
    result = _search.backtracking_search(program, cost, config, progress=lambda b, n, t: seen.append((b, n, t)))
    assert result.seconds < 3.0
    assert seen and all(b1 >= b2 for (b1, _, _), (b2, _, _) in zip(seen, seen[1:]))
    assert result.candidates_per_second > 0


def test_search_improves_on_a_bad_start(problem):
    program, cost = problem
    start = _strategy.unfused(program.graph)
    result = _search.backtracking_search(program, cost, _search.SearchConfig(budget_s=5, alpha=1.2), starts=[start])
    assert result.best_cost < cost(start)
    assert result.improvements > 0


@pytest.mark.parametrize("bad", [dict(alpha=0.5), dict(beta=0), dict(budget_s=0)])
def test_bad_search_parameters_are_refused(bad):
    with pytest.raises(ValueError):
        _search.SearchConfig(**bad)


def test_search_result_keeps_its_cheapest_distinct_candidates(problem):
    """`top(k)`: what the measured search times, from the costs the search computed."""
    program, cost = problem
    result = _search.backtracking_search(program, cost, _search.SearchConfig(budget_s=2, max_unchanged=200))
    top = result.top(5)
    keys = [s.key() for s, _ in top]
    assert len(top) == 5 and len(set(keys)) == 5
    assert [c for _, c in top] == sorted(c for _, c in top)
    assert keys[0] == result.best.key() and top[0][1] == result.best_cost
    assert [c for _, c in top] == pytest.approx([cost(s) for s, _ in top])
    rest = result.top(4, exclude={keys[0], keys[2]})
    assert [s.key() for s, _ in rest] == [keys[1], keys[3], keys[4]] + [s.key() for s, _ in result.top(6)[5:6]]
    assert "candidates" not in result.stats() and len(result.candidates) <= _search.KEEP


def test_a_later_round_starts_from_a_given_strategy(problem):
    program, cost = problem
    start = _strategy.with_buckets(
        _strategy.xla_default(program.graph), [(g.id,) for g in program.graph.gradients], "measured"
    )
    result = _search.backtracking_search(program, cost, _search.SearchConfig(budget_s=1, seed=5), starts=[start])
    assert result.start_costs == {"measured": cost(start)}
    assert result.best_cost <= cost(start) and result.top(1)[0][1] == result.best_cost


def test_restarts_continue_where_backtracking_empties_its_queue(problem):
    """alpha = 1 keeps only improvements queued: Algorithm 1 stops when they run out; restarts
    follow the same path (same seed) and then refill the queue from the cheapest candidates."""
    program, cost = problem
    base = dict(alpha=1.0, budget_s=60, max_unchanged=150, seed=1)
    plain = _search.backtracking_search(program, cost, _search.SearchConfig(**base))
    again = _search.backtracking_search(program, cost, _search.SearchConfig(mode="restarts", **base))
    assert plain.stop_reason == "queue empty" and plain.restarts == 0
    assert again.restarts > 0 and again.stop_reason.startswith("best unchanged")
    assert again.best_cost <= plain.best_cost and again.evaluated > plain.evaluated


def test_mcmc_walk_is_deterministic_and_never_worse_than_its_start(problem):
    program, cost = problem
    config = _search.SearchConfig(mode="mcmc", budget_s=60, max_unchanged=100, seed=2)
    a = _search.backtracking_search(program, cost, config)
    b = _search.backtracking_search(program, cost, config)
    assert a.best.key() == b.best.key() and a.evaluated == b.evaluated
    assert a.best_cost <= min(a.start_costs.values()) and a.best_cost == pytest.approx(cost(a.best))
    assert _strategy.is_valid(program, a.best)


@pytest.mark.parametrize("bad", [dict(mode="annealing"), dict(temperature=0.0)])
def test_bad_search_modes_are_refused(bad):
    with pytest.raises(ValueError):
        _search.SearchConfig(**bad)
