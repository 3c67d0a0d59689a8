"""Strategies are enacted in the compiled program, and outputs stay equal."""

import random
import re

import pytest

from disco_jax import _capture, _compile, _hlo, _program, _strategy, _validate, backends

from _steps import make_step


def _compiled(step, args, strategy, program):
    compiled, status = _compile.compile_strategy(step.lower(*args), program, strategy)
    assert status in ("rewritten", "cached")
    return compiled


def _allreduce_operand_sets(text):
    entry = _hlo.parse_module(text).entry
    return sorted(len(i.operands) for i in entry.instructions if i.opcode == "all-reduce")


@pytest.fixture(scope="module", params=["jit", "shard_map"])
def setup(request):
    step, args = make_step(request.param)
    text, default = _capture.capture(step.lower(*args))
    return step, args, _program.build_program(text, backends.CPU), default(*args)


def test_xla_default_strategy_reproduces_the_program_bitwise(setup):
    step, args, program, reference = setup
    graph = program.graph
    compiled = _compiled(step, args, _strategy.xla_default(graph), program)
    assert _validate.compare_outputs(reference, compiled(*args), bitwise=True).bitwise_equal


def test_per_gradient_allreduces_are_in_the_compiled_hlo(setup):
    step, args, program, reference = setup
    graph = program.graph
    s = _strategy.with_buckets(_strategy.xla_default(graph), [(g.id,) for g in graph.gradients], "split")
    compiled = _compiled(step, args, s, program)
    text = compiled.as_text()
    assert _allreduce_operand_sets(text) == [1] * len(graph.gradients)
    # Regrouping all-reduces does not reorder arithmetic: bitwise equal.
    assert _validate.compare_outputs(reference, compiled(*args), bitwise=True).bitwise_equal


def test_buckets_carry_exactly_the_planned_gradients(setup):
    step, args, program, reference = setup
    graph = program.graph
    order = sorted(g.id for g in graph.gradients)
    buckets = [tuple(order[:3]), tuple(order[3:])]
    s = _strategy.with_buckets(_strategy.xla_default(graph), buckets, "two")
    compiled = _compiled(step, args, s, program)
    entry = _hlo.parse_module(compiled.as_text()).entry
    allreduces = [i for i in entry.instructions if i.opcode == "all-reduce"]
    assert sorted(len(i.operands) for i in allreduces) == sorted(len(b) for b in buckets)
    sizes = sorted(sorted(t.bytes for t in i.outputs) for i in allreduces)
    expected = sorted(sorted(graph.gradients[g].nbytes for g in b) for b in buckets)
    assert sizes == expected
    assert _validate.compare_outputs(reference, compiled(*args), bitwise=True).bitwise_equal


def test_unfused_strategy_removes_loop_fusions(setup):
    step, args, program, reference = setup
    graph = program.graph
    compiled = _compiled(step, args, _strategy.unfused(graph), program)
    # XLA:CPU (jaxlib 0.12) wraps each lone op the hook returns in a one-op kLoop fusion; it fuses
    # nothing more: no kernel holds two ops, where XLA's own plan had multi-op fusions.
    assert _compile.compiled_stats(graph.module.to_text())["multi_op_loop_fusions"] > 0
    stats = _compile.compiled_stats(compiled.as_text())
    assert stats["loop_fusions"] > 0 and stats["multi_op_loop_fusions"] == 0
    assert _validate.compare_outputs(reference, compiled(*args), bitwise=False).within_tolerance


def test_random_move_sequences_compile_and_match(setup):
    step, args, program, reference = setup
    graph = program.graph
    rng = random.Random(7)
    s = _strategy.xla_default(graph)
    for _ in range(80):
        nxt = _strategy.MOVES[rng.choice(sorted(_strategy.MOVES))](program, s, rng)
        if nxt is not None and _strategy.kernel_dag(program, nxt) is not None:
            s = nxt
    compiled = _compiled(step, args, s, program)
    counts = _compile.compiled_stats(compiled.as_text())
    assert counts["all-reduce"] == len(s.buckets)
    new_fusions = re.findall(r"calls=%disco_fused_computation", compiled.as_text())
    assert len(new_fusions) <= len(s.fused_groups)
    assert _validate.compare_outputs(reference, compiled(*args), bitwise=False).within_tolerance


def test_a_new_fusion_appears_in_the_compiled_hlo(setup):
    step, args, program, reference = setup
    graph = program.graph
    rng = random.Random(0)
    s = _strategy.unfused(graph)
    for _ in range(200):
        nxt = _strategy.fuse_producer(program, s, rng, duplicate=rng.random() < 0.5)
        if nxt is not None and _strategy.kernel_dag(program, nxt) is not None:
            s = nxt
            if len(s.fused_groups) >= 3:
                break
    compiled = _compiled(step, args, s, program)
    assert "disco_fused_computation" in compiled.as_text()
    assert _validate.compare_outputs(reference, compiled(*args), bitwise=False).within_tolerance


def test_only_registered_backends_are_found():
    assert backends.for_platform("cpu") is backends.CPU
    assert backends.for_platform("cuda") is backends.GPU
    assert backends.for_platform("rocm") is None and backends.supported_platforms() == ("cpu", "cuda")


def test_transformer_with_scatter_and_large_constants_round_trips_bitwise():
    """Regression: large constants must be printed in full (not `{...}`), and the copies XLA's
    copy insertion made for in-place scatters must not be merged. The tiny transformer with one
    encoder and one decoder layer (half its compile time): its two embeddings' gradients are the
    scatters, its positional table the large constant."""
    import optax

    from disco_jax import zoo

    spec = zoo.resized("transformer", num_encoder_layers=1, num_decoder_layers=1)
    step, state, batch = zoo.make_train_step(spec, optax.adam(1e-3), zoo.data_mesh(8), "jit")
    lowered = step.lower(state, batch)
    text, default = _capture.capture(lowered)
    assert "{...}" not in text
    program = _program.build_program(text, backends.CPU)
    graph = program.graph
    scatters = [op for op in graph.ops if "scatter" in op.name]
    assert len(scatters) >= 2
    operands = [s.operands[0] for s in scatters]
    assert len(set(operands)) == len(operands), "in-place operands were merged"
    reference = default(state, batch)
    compiled, _ = _compile.compile_strategy(lowered, program, _strategy.xla_default(graph))
    assert _validate.compare_outputs(reference, compiled(state, batch), bitwise=True).bitwise_equal
    # Unfusing everything only reorders rounding: within the step's own one-ulp sensitivity.
    floor = _validate.sensitivity(reference, default(*_validate.nudge((state, batch))))
    compiled, _ = _compile.compile_strategy(lowered, program, _strategy.unfused(graph))
    assert _validate.compare_outputs(reference, compiled(state, batch), bitwise=False, floor=floor).within_tolerance
