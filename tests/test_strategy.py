"""Strategies and moves: every move keeps the strategy valid; plans survive JSON."""

import random

import pytest

from disco_jax import AllReduceCostModel, AnalyticalEstimator, _capture, _program, _strategy, backends, simulate

from _steps import make_step


@pytest.fixture(scope="module")
def program():
    step, args = make_step("jit", sizes=(16, 32, 32, 32, 4))
    text, _ = _capture.capture(step.lower(*args))
    return _program.build_program(text, backends.CPU)


@pytest.fixture(scope="module")
def graph(program):
    return program.graph


def test_start_candidates_are_valid_and_distinct(program, graph):
    starts = _strategy.start_candidates(graph)
    assert all(_strategy.is_valid(program, s) for s in starts)
    assert len({s.key() for s in starts}) == len(starts)
    assert len(_strategy.unfused(graph).buckets) == len(graph.gradients)
    assert len(_strategy.xla_default(graph).buckets) == 1


# The loop-body packing applies only to a step with loops: tests/test_scanned_layers.py checks it.
@pytest.mark.parametrize("move", sorted(set(_strategy.MOVES) - {"pack_loop_allreduce"}))
def test_each_move_keeps_the_strategy_valid(program, graph, move):
    rng = random.Random(move)
    changed = 0
    for start in _strategy.start_candidates(graph):
        s = start
        for _ in range(60):
            nxt = _strategy.MOVES[move](program, s, rng)
            if nxt is None or _strategy.kernel_dag(program, nxt) is None:
                continue  # not applicable here, or rejected as invalid by the search
            assert _strategy.is_valid(program, nxt), f"{move} produced an invalid strategy"
            changed += nxt.key() != s.key()
            s = nxt
    assert changed > 0, f"{move} never applied"


def test_fuse_move_merges_two_groups(program, graph):
    rng = random.Random(0)
    s = _strategy.unfused(graph)
    for _ in range(50):
        nxt = _strategy.fuse_producer(program, s, rng, duplicate=False)
        if nxt is not None:
            break
    assert len(nxt.groups) == len(s.groups) - 1
    assert len(nxt.fused_groups) == 1


def test_merge_buckets_joins_neighbours_only(program, graph):
    rng = random.Random(0)
    s = _strategy.unfused(graph)
    nxt = _strategy.merge_buckets(program, s, rng)
    assert len(nxt.buckets) == len(s.buckets) - 1
    merged = next(b for b in nxt.buckets if len(b) == 2)
    order = sorted(range(len(graph.gradients)), key=lambda g: graph.gradients[g].producer)
    assert abs(order.index(merged[0]) - order.index(merged[1])) == 1


def test_strategy_json_round_trip(program, graph):
    rng = random.Random(3)
    s = _strategy.xla_default(graph)
    for _ in range(30):
        s = _strategy.MOVES[rng.choice(sorted(_strategy.MOVES))](program, s, rng) or s
    back = _strategy.Strategy.from_json(graph, s.to_json(graph))
    assert back.key() == s.key()


def test_strategy_json_with_unknown_op_is_refused(graph):
    data = _strategy.xla_default(graph).to_json(graph)
    data["groups"][0]["ops"].append("no-such-op")
    with pytest.raises(ValueError, match="no-such-op"):
        _strategy.Strategy.from_json(graph, data)


def test_cycle_is_invalid(program, graph):
    # Put a gradient's producer and an op that reads the reduced value into one group:
    # the all-reduce would both feed and wait for the group.
    g = next(
        gr
        for gr in graph.gradients
        if any(graph.ops[u].kind == "fusible" for u in graph.users[gr.reduced])
        and graph.ops[gr.producer].kind == "fusible"
    )
    user = next(u for u in graph.users[g.reduced] if graph.ops[u].kind == "fusible")
    s = _strategy.xla_default(graph)
    groups = list(s.groups)
    home = s.homes[g.producer]
    groups[home] = groups[home] | groups[s.homes[user]]
    bad = _strategy.Strategy(tuple(groups), s.homes, s.buckets)
    assert _strategy.kernel_dag(program, bad) is None
    assert not _strategy.is_valid(program, bad)


def test_packing_is_a_bucket_move_that_survives_json_and_is_costed(program, graph):
    xla = _strategy.xla_default(graph)
    packed = _strategy.pack_buckets(program, xla, random.Random(0))
    assert packed.packed and packed.buckets == xla.buckets and packed.key() != xla.key()
    assert _strategy.pack_buckets(program, packed, random.Random(0)).key() == xla.key()  # and back
    assert _strategy.Strategy.from_json(graph, packed.to_json(graph)).key() == packed.key()
    assert any(s.packed for s in _strategy.start_candidates(graph, packs=True))
    assert not any(s.packed for s in _strategy.start_candidates(graph))
    # Costed: one rendezvous instead of one per tensor, against copying the buffer in and out.
    (bucket,) = xla.buckets
    total = sum(graph.gradients[g].nbytes for g in bucket)
    estimator = AnalyticalEstimator()
    for per_tensor_us, packing_wins in ((50.0, True), (0.0, False)):
        allreduce = AllReduceCostModel(per_byte_us=1e-3, latency_us=50.0, per_tensor_us=per_tensor_us)
        variadic_us = simulate(program, xla, estimator, allreduce).comm_us
        packed_us = simulate(program, packed, estimator, allreduce).comm_us
        expected = allreduce.time_us(total) + 1e-3 * total
        assert packed_us == pytest.approx(expected)
        assert variadic_us == pytest.approx(allreduce.time_us(total) + per_tensor_us * (len(bucket) - 1))
        assert (packed_us < variadic_us) is packing_wins


def test_a_backend_that_does_not_pack_is_never_offered_packing(graph):
    gpu_program = _program.Program(graph, backends.GPU)
    assert _strategy.pack_buckets(gpu_program, _strategy.xla_default(graph), random.Random(0)) is None
