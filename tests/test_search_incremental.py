"""Incremental evaluation: what the moves maintain equals what is computed from scratch.

For random sequences of moves on small graphs, each move's result is compared with a from-scratch
evaluation of the same strategy: its group index rebuilt from its groups, its normalization redone
over every group (a move normalizes only what it touched), the backend's emittability checked
over every group (a move checks only the groups whose exports it may have changed), and its cost
simulated on a freshly parsed graph with fresh estimator caches."""

import random

import optax
import pytest

from disco_jax import _capture, _edit, _graph, _strategy, backends
from disco_jax.cost import AllReduceCostModel, AnalyticalEstimator, CostModel, chain, simulate

from _steps import make_step

STEPS = {
    "mlp-jit": ("jit", (16, 32, 32, 32, 4), None),
    "mlp-shard_map-adam": ("shard_map", (16, 64, 32, 4), optax.adam(1e-3)),
}


@pytest.fixture(scope="module", params=sorted(STEPS))
def captured(request):
    style, sizes, optimizer = STEPS[request.param]
    step, args = make_step(style, sizes=sizes, optimizer=optimizer)
    text, _ = _capture.capture(step.lower(*args))
    return text, _graph.build_graph(text, backends.CPU)


def _random_walk(graph, seed: int, length: int):
    """(parent, child) for `length` random moves from a random start, each child the next parent."""
    rng = random.Random(seed)
    s = rng.choice(_strategy.start_candidates(graph))
    names = sorted(_strategy.MOVES)
    for _ in range(length):
        child = _strategy.MOVES[rng.choice(names)](graph, s, rng)
        if child is None:
            continue
        yield s, child
        s = child


@pytest.mark.parametrize("seed", range(6))
def test_moves_maintain_the_state_a_from_scratch_evaluation_computes(captured, seed):
    text, graph = captured
    allreduce = AllReduceCostModel(per_byte_us=1e-3, latency_us=20.0)
    incremental = CostModel(chain(AnalyticalEstimator()), allreduce, {}).evaluator(graph)
    fused = 0
    for parent, child in _random_walk(graph, seed, 80):
        # A bucket move keeps its parent's index (None on a start: built when needed).
        assert child.group_index() == _edit.group_index(child.groups, len(graph.ops))
        assert child.index is not None or child.groups == parent.groups
        again = _strategy.normalize(graph, _strategy.Strategy(child.groups, child.homes, child.buckets))
        assert again is not None and (again.groups, again.homes) == (child.groups, child.homes)
        assert _strategy.emittable(graph, child)
        fused += child.groups != parent.groups
        # From scratch: a new graph (no cached kernel inputs, signatures, consumers), new caches.
        fresh = _graph.build_graph(text, backends.CPU)
        plain = _strategy.Strategy(child.groups, child.homes, child.buckets)
        expected = simulate(fresh, plain, chain(AnalyticalEstimator()), allreduce)
        got = incremental(child)
        assert (got is None) == (expected is None)
        if got is not None:
            assert got == pytest.approx(expected.iteration_us, rel=1e-9)
    assert fused > 0


def test_whole_normalization_of_a_start_is_a_fixed_point(captured):
    _, graph = captured
    for start in _strategy.start_candidates(graph):
        once = _strategy.normalize(graph, start)
        if once is None:
            continue
        twice = _strategy.normalize(graph, once)
        assert (twice.groups, twice.homes) == (once.groups, once.homes)
