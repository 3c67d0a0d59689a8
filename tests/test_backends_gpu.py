"""The XLA:GPU backend without a GPU: a tiny MLP training step compiled deviceless for 8 H100s,
captured at PRE_SCHEDULER with XLA's own decisions read at POST_SCHEDULER, and plans enacted by
the GPU rewriter, asserted on the compiled module. Never skipped: a missing CUDA plugin fails."""

import dataclasses
import json
import random

import optax
import pytest

from disco_jax import _compile, _hlo, _strategy, backends, targets, zoo
from disco_jax.backends import gpu, gpu_schedule
from disco_jax.eval import baselines


@pytest.fixture(scope="module")
def captured():
    lowered = zoo.lower_abstract(zoo.get_model("mlp", "tiny"), optax.sgd(0.1), targets.mesh("h100-sxm", 8))
    program, compiled = _compile.capture_program(lowered, backends.GPU)
    return lowered, program, compiled.as_text()


def _compile_plan(captured, strategy, options=None):
    lowered, program, _ = captured
    compiled, status = _compile.compile_strategy(lowered, program, strategy, options)
    assert status == "rewritten"
    return compiled.as_text()


def _reduced_elements(text: str) -> list[int]:
    """Elements each all-reduce of a compiled module carries (XLA:GPU flattens a variadic one)."""
    entry = _hlo.parse_module(text).entry
    return sorted(
        sum(t.elements for t in i.outputs) if i.opcode == "all-reduce" else i.outputs[-1].elements
        for i in entry.instructions
        if i.opcode in ("all-reduce", "all-reduce-start")
    )


def _gradient_elements(graph, bucket) -> int:
    return sum(graph.ops[graph.gradients[g].producer].inst.outputs[0].elements for g in bucket)


def test_gpu_backend_is_registered_for_cuda():
    assert backends.for_platform("cuda") is backends.GPU
    assert backends.GPU.rewrite_options == {
        "xla_gpu_all_reduce_combine_threshold_bytes": "0",
        "xla_disable_hlo_passes": "all-reduce-reassociate",
    }
    assert backends.GPU.decisions_options == {"xla_disable_hlo_passes": "all-reduce-reassociate"}


def test_targets_h100_and_a100_give_compile_only_devices():
    assert targets.mesh("a100-sxm", 4).devices.flat[0].device_kind == "NVIDIA A100-SXM4-80GB"
    assert targets.mesh("h100-sxm", 8).devices.flat[0].device_kind == "NVIDIA H100 80GB HBM3"
    with pytest.raises(ValueError, match="shipped targets: a100-sxm, h100-sxm"):
        targets.target_config("h200")
    with pytest.raises(ValueError, match="positive int"):
        targets.topology("h100-sxm", 0)


def test_capture_is_before_combining_and_reads_xla_gpu_decisions(captured):
    _, program, default_text = captured
    graph = program.graph
    # PRE_SCHEDULER: unfused, one all-reduce per gradient.
    entry = graph.module.entry.instructions
    assert not any(i.opcode == "fusion" for i in entry)
    assert sum(i.opcode == "all-reduce" for i in entry) == len(graph.gradients) > 2
    # XLA:GPU combined every gradient into one all-reduce (read at POST_SCHEDULER).
    assert graph.xla_buckets == [tuple(range(len(graph.gradients)))]
    assert _reduced_elements(default_text) == [_gradient_elements(graph, graph.xla_buckets[0])]
    kinds = [k.kind for k in graph.xla_schedule]
    assert {"gemm", "loop", "input", "collective"} <= set(kinds)
    assert [k.position for k in graph.xla_schedule] == sorted(k.position for k in graph.xla_schedule)
    gemms = [k for k in graph.xla_schedule if k.kind == "gemm"]
    dots = [o for o in graph.opaque_ops if graph.ops[o].opcode == "dot"]
    assert len(gemms) == len(dots) and all(k.work.dot > 0 and k.work.bytes > 0 for k in gemms)
    assert sorted(o for k in gemms for o in k.ops if graph.ops[o].opcode == "dot") == sorted(dots)
    (allreduce,) = [k for k in graph.xla_schedule if k.kind == "collective"]
    assert allreduce.done_position > allreduce.position and allreduce.gradients == graph.xla_buckets[0]
    assert graph.summary()["xla_fusions"] > 0


def test_scheduled_kernels_refuse_an_unscheduled_module(captured):
    _, program, _ = captured
    graph = program.graph
    with pytest.raises(ValueError, match="not a scheduled module"):
        gpu_schedule.scheduled_kernels(graph, graph.module.to_text())


def test_xla_default_plan_compiles_to_xla_gpu_program(captured):
    _, program, default_text = captured
    graph = program.graph
    text = _compile_plan(captured, _strategy.xla_default(graph))
    assert _compile.compiled_stats(text) == _compile.compiled_stats(default_text)


def test_every_bucket_is_one_all_reduce_with_its_gradients(captured):
    _, program, _ = captured
    graph = program.graph
    order = sorted(g.id for g in graph.gradients)
    buckets = [tuple(order[:2]), tuple(order[2:5]), (order[5],), tuple(order[6:])]
    text = _compile_plan(captured, _strategy.with_buckets(_strategy.xla_default(graph), buckets, "four"))
    assert _compile.compiled_stats(text)["all-reduce"] == len(buckets)
    assert _reduced_elements(text) == sorted(_gradient_elements(graph, b) for b in buckets)


def test_per_gradient_buckets_survive_the_combiner(captured):
    _, program, _ = captured
    graph = program.graph
    buckets = [(g.id,) for g in graph.gradients]
    text = _compile_plan(captured, _strategy.with_buckets(_strategy.xla_default(graph), buckets, "each"))
    assert _reduced_elements(text) == sorted(_gradient_elements(graph, b) for b in buckets)


def test_unfused_plan_leaves_no_multi_op_loop_fusion(captured):
    _, program, default_text = captured
    graph = program.graph
    assert _compile.compiled_stats(default_text)["multi_op_loop_fusions"] > 0
    text = _compile_plan(captured, _strategy.unfused(graph))
    stats = _compile.compiled_stats(text)
    assert stats["multi_op_loop_fusions"] == 0 and stats["all-reduce"] == len(graph.gradients)
    assert "opt-barrier" not in text  # the cuts are gone once XLA:GPU has fused


def test_splitting_one_xla_fusion_cuts_exactly_there(captured):
    _, program, default_text = captured
    graph = program.graph
    xla = _strategy.xla_default(graph)
    # The optimizer update of one weight: XLA fuses multiply and add into one loop fusion.
    gi = next(
        i
        for i, g in enumerate(xla.groups)
        if sorted(graph.ops[o].opcode for o in g) == ["add", "broadcast", "multiply"]
    )
    add = next(o for o in xla.groups[gi] if graph.ops[o].opcode == "add")
    rest = xla.groups[gi] - {add}
    groups = [rest if i == gi else g for i, g in enumerate(xla.groups)] + [frozenset([add])]
    homes = list(xla.homes)
    homes[add] = len(groups) - 1
    split = dataclasses.replace(xla, groups=tuple(groups), homes=tuple(homes), origin="split-one")
    rewritten = backends.GPU.rewriter.rewrite(program, split)
    multiply = next(o for o in rest if graph.ops[o].opcode == "multiply")
    # One cut more than XLA's own plan needs (which cuts the edges XLA left unfused), on that edge.
    xla_cuts = backends.GPU.rewriter.rewrite(program, xla).count("opt-barrier(")
    assert rewritten.count("opt-barrier(") == xla_cuts + 1
    assert f"%{graph.ops[multiply].name}.disco_cut_barrier" in rewritten
    before = _compile.compiled_stats(default_text)
    after = _compile.compiled_stats(_compile_plan(captured, split))
    # The fusion became two kernels: the multiply (with its broadcast) and the add alone.
    assert after["fusion"] == before["fusion"] + 1
    assert after["multi_op_loop_fusions"] == before["multi_op_loop_fusions"]


def _fuse_randomly(program, moves=300):
    """The plan the search's fuse moves reach from the unfused one, and every multi-op group they formed."""
    rng, s, formed = random.Random(0), _strategy.unfused(program.graph), set()
    for _ in range(moves):
        s = _strategy.MOVES["fuse"](program, s, rng) or s
        formed |= {g for g in s.groups if len(g) > 1}
    return s, formed


def test_fuse_moves_only_form_groups_inside_xla_gpu_fusions(captured):
    """XLA:GPU forms its kernels itself and the rewriter only cuts edges, so a group outside XLA's
    fusions would be costed fused and compile apart: the fuse moves never make one, and the plan
    they reach compiles with each of its groups inside one fusion of the compiled module. A backend
    that emits its fusions (XLA:CPU's way) makes groups outside from the same graph and moves."""
    lowered, program, _ = captured
    graph = program.graph
    inside = lambda g, groups: any(g <= x for x in groups)  # noqa: E731
    plan, formed = _fuse_randomly(program)
    assert formed and all(inside(g, graph.xla_groups) for g in formed)
    compiled = backends.GPU.read_decisions(graph, _compile_plan(captured, plan))
    assert all(inside(g, compiled.xla_groups) for g in plan.groups if len(g) > 1)
    emitting = dataclasses.replace(program, backend=dataclasses.replace(backends.GPU, emits_fusions=True))
    assert not all(inside(g, graph.xla_groups) for g in _fuse_randomly(emitting)[1])


def test_rewriter_rejects_an_invalid_strategy(captured):
    _, program, _ = captured
    graph = program.graph
    xla = _strategy.xla_default(graph)
    bad = dataclasses.replace(xla, buckets=xla.buckets[:0])
    with pytest.raises(ValueError, match="not valid"):
        backends.GPU.rewriter.rewrite(program, bad)


def test_latency_hiding_scheduler_keeps_the_plans_all_reduces_async(captured):
    _, program, _ = captured
    graph = program.graph
    plan = _strategy.with_buckets(_strategy.xla_default(graph), [(g.id,) for g in graph.gradients], "each")
    on = _compile_plan(captured, plan, gpu.collective_options(latency_hiding_scheduler=True))
    off = _compile_plan(captured, plan, gpu.collective_options(latency_hiding_scheduler=False))
    n = len(graph.gradients)
    assert on.count(" all-reduce-start(") == n and on.count(" all-reduce(") == 0
    assert off.count(" all-reduce-start(") == 0 and off.count(" all-reduce(") == n


def test_combine_threshold_sets_xla_gpu_own_combining(captured):
    lowered, program, _ = captured
    graph = program.graph
    split = lowered.compile(compiler_options=gpu.collective_options(combine_threshold_bytes=20_000)).as_text()
    assert 1 < _compile.compiled_stats(split)["all-reduce"] < len(graph.gradients)
    with pytest.raises(ValueError, match="non-negative int"):
        gpu.collective_options(combine_threshold_bytes=-1)


def test_adam_step_on_a100_xla_plan_reproduces_xla_program():
    """Adam's update has ops whose names XLA:GPU rewrites beyond recognition: edges at them are
    left to XLA, so XLA's own plan still compiles to XLA's program (on the A100 target)."""
    lowered = zoo.lower_abstract(zoo.get_model("mlp", "tiny"), optax.adam(1e-3), targets.mesh("a100-sxm", 4))
    program, compiled = _compile.capture_program(lowered, backends.GPU)
    plan, status = _compile.compile_strategy(lowered, program, _strategy.xla_default(program.graph))
    assert status == "rewritten"
    assert _compile.compiled_stats(plan.as_text()) == _compile.compiled_stats(compiled.as_text())


@pytest.fixture(scope="module", params=["transformer", "rnnlm"])
def zoo_captured(request, xla_gpu_zoo):
    """Zoo models whose XLA:GPU programs fuse across opaque ops (embedding gathers), recompute
    layer norms and LSTM gates in later fusions, and reassociate sums of all-reduces by default
    (compiled once per session at `_zoo_sizes.SMALL`: `conftest.xla_gpu_zoo`)."""
    return xla_gpu_zoo(request.param)


def test_xla_buckets_cover_every_gradient_once_as_xla_compiled(zoo_captured):
    """XLA's combined all-reduces read back onto the graph: every gradient in exactly one bucket,
    as many buckets as XLA compiled all-reduces (slices of merged dots, a reassociated scatter)."""
    _, program, default_text = zoo_captured
    graph = program.graph
    assert sorted(g for b in graph.xla_buckets for g in b) == list(range(len(graph.gradients)))
    assert len(graph.xla_buckets) == _compile.compiled_stats(default_text)["all-reduce"]


def test_xla_plan_as_read_is_valid_and_compiles_to_xla_program(zoo_captured):
    _, program, default_text = zoo_captured
    graph = program.graph
    xla = _strategy.xla_default(graph)
    assert _strategy.is_valid(program, xla)
    assert backends.GPU.rewriter.rewrite(program, xla).count("opt-barrier(") == 0  # nothing to impose
    before = _compile.compiled_stats(default_text)
    after = _compile.compiled_stats(_compile_plan(zoo_captured, xla))
    assert after["all-reduce"] == before["all-reduce"]
    assert after["multi_op_loop_fusions"] == before["multi_op_loop_fusions"]
    assert abs(after["fusion"] - before["fusion"]) <= 0.02 * before["fusion"]


def test_per_gradient_buckets_survive_reassociation(xla_gpu_zoo):
    """With XLA's all-reduce reassociation on, a plan of one all-reduce per gradient compiles to
    fewer all-reduces on the RNNLM (its weights' sums over time steps reassociated: 7 for the 16
    gradients of conftest's size); the rewrite options turn the pass off, so every gradient keeps
    its own. Run on the RNNLM alone, the model whose reassociation is known."""
    rnnlm = xla_gpu_zoo("rnnlm")
    _, program, _ = rnnlm
    graph = program.graph
    each = _strategy.with_buckets(_strategy.xla_default(graph), [(g.id,) for g in graph.gradients], "each")
    text = _compile_plan(rnnlm, each)
    assert _compile.compiled_stats(text)["all-reduce"] == len(graph.gradients)


def test_rewrite_floor_bounds_the_rewriters_programs_and_stops_what_cannot_win(xla_gpu_zoo):
    """The rewriter all-reduces every gradient of the graph (reassociation off), so one all-reduce
    of all their bytes bounds its programs' compiled cost from below. On the RNNLM XLA's own
    program reassociates the sums over time steps and all-reduces fewer bytes: under a collective
    model where bytes dominate, the floor exceeds XLA's whole program and no candidate is compiled."""
    from disco_jax import _ranking, offline
    from disco_jax.cost.allreduce import AllReduceCostModel
    from disco_jax.eval import clusters

    rnnlm = xla_gpu_zoo("rnnlm")
    lowered, program, _ = rnnlm
    graph = program.graph
    node = offline.program_costs(clusters.node_of("h100-sxm", 8))
    xla_plan = _strategy.xla_default(graph)
    rewritten = _compile.compile_program(lowered, program, "xla plan, rewritten", xla_plan, None)
    assert rewritten.status in ("rewritten", "cached")  # cached: the same plan compiled earlier in the process
    assert _ranking.rewrite_floor_us(graph, xla_plan, node) <= node(rewritten).iteration_us

    by_bytes = _ranking.ProgramCosts(backends.GPU, node.estimator, AllReduceCostModel(0.05, 0.0), node.params)
    xla = _compile.compile_program(lowered, program, "XLA", None, {})
    floor = _ranking.rewrite_floor_us(graph, xla_plan, by_bytes)
    assert floor > by_bytes(xla).iteration_us  # XLA all-reduces the sums: fewer bytes

    def never(label, strategy):
        raise AssertionError("a candidate that cannot win was compiled")

    ranked = _ranking.rank_by_compiled_cost(
        xla, [(xla_plan, 1.0)], never, by_bytes, floor_us=lambda s: _ranking.rewrite_floor_us(graph, s, by_bytes)
    )
    assert [r.label for r in ranked][0] == _ranking.XLA_PROGRAM
    assert ranked[1].cost is None and "cannot win" in ranked[1].program.reason


# --------------------------------------------------------------------------- DisCo's baselines on XLA:GPU


@pytest.fixture(scope="module")
def baseline_programs(captured):
    """Every baseline of the tiny MLP step compiled as XLA:GPU enacts it (one compile each), DDP
    and Horovod with bucket limits small enough to give its 0.25-16 KiB gradients several buckets."""
    lowered, program, _ = captured
    candidates = baselines.all_baselines(
        program,
        combine=backends.GPU.xla_buckets,
        bucket_cap_bytes=20_000,
        first_bucket_bytes=8_000,
        threshold_bytes=20_000,
    )
    programs = _compile.Programs(lowered, program)
    return {b.name: b for b in candidates}, baselines.compile_baselines(programs, candidates), programs


def test_every_baseline_is_enacted_by_xla_gpu_options_or_the_rewriter(baseline_programs):
    candidates, compiled, _ = baseline_programs
    assert list(compiled) == list(baselines.BASELINES)
    for name, program in compiled.items():
        assert program.enacted and program.reason is None, (name, program.reason)
        options = backends.GPU.baseline_options.get(name)
        assert candidates[name].compiler_options == options
        if options is None:  # DDP and Horovod: their buckets written into the module
            assert (program.enacted_by, program.status) == ("rewrite", "rewritten")
            assert program.compiler_options == backends.GPU.rewrite_options
        else:
            assert (program.enacted_by, program.status, program.compiler_options) == (
                "compile options",
                "compiled",
                options,
            )
        record = program.to_json()
        assert record["compiled"] == program.stats and json.loads(json.dumps(record)) == record


def test_gpu_no_fusion_emits_every_op_alone_with_one_all_reduce_per_gradient(captured, baseline_programs):
    _, program, _ = captured
    graph = program.graph
    _, compiled, _ = baseline_programs
    stats = {name: p.stats for name, p in compiled.items()}
    n = len(graph.gradients)
    assert stats["JAX_default"]["multi_op_loop_fusions"] > 0 and stats["JAX_default"]["all-reduce"] < n
    for name in ("JAX_no_fusion", "JAX_AllReduce_fusion"):
        assert stats[name]["multi_op_loop_fusions"] == 0, name
        assert stats[name]["loop_fusions"] > stats["JAX_default"]["loop_fusions"], name  # one op per fusion
    assert stats["JAX_no_fusion"]["all-reduce"] == n
    assert _reduced_elements(compiled["JAX_no_fusion"].text) == sorted(_gradient_elements(graph, [g]) for g in range(n))
    # XLA's combining as XLA does it on the unfused program: the default's all-reduces.
    assert stats["JAX_AllReduce_fusion"]["all-reduce"] == stats["JAX_default"]["all-reduce"]


def test_gpu_op_fusion_keeps_xla_fusions_with_one_all_reduce_per_gradient(captured, baseline_programs):
    _, program, _ = captured
    graph = program.graph
    _, compiled, _ = baseline_programs
    op_fusion, default = compiled["JAX_op_fusion"].stats, compiled["JAX_default"].stats
    assert op_fusion["multi_op_loop_fusions"] == default["multi_op_loop_fusions"] > 0
    n = len(graph.gradients)
    assert op_fusion["all-reduce"] == n
    assert _reduced_elements(compiled["JAX_op_fusion"].text) == sorted(_gradient_elements(graph, [g]) for g in range(n))


def test_gpu_default_is_xla_gpu_untouched(captured, baseline_programs):
    lowered, program, _ = captured
    graph = program.graph
    _, compiled, _ = baseline_programs
    program = compiled["JAX_default"]
    assert program.compiler_options == {}
    assert program.stats == _compile.compiled_stats(lowered.compile().as_text())
    assert program.stats["all-reduce"] == len(graph.xla_buckets)  # XLA's combined all-reduces


@pytest.mark.parametrize("name", ["PyTorch_DDP", "Horovod"])
def test_gpu_framework_buckets_are_the_all_reduces_compiled(captured, baseline_programs, name):
    _, program, _ = captured
    graph = program.graph
    candidates, compiled, _ = baseline_programs
    buckets = candidates[name].strategy.buckets
    stats = compiled[name].stats
    assert stats["all-reduce"] == len(buckets) > 1
    assert _reduced_elements(compiled[name].text) == sorted(_gradient_elements(graph, b) for b in buckets)
    # XLA's op fusion, as XLA forms it.
    assert stats["multi_op_loop_fusions"] == compiled["JAX_default"].stats["multi_op_loop_fusions"]


def test_a_strategy_that_cannot_be_enacted_says_why_and_compiles_nothing(captured, baseline_programs):
    _, program, _ = captured
    graph = program.graph
    *_, programs = baseline_programs
    xla = _strategy.xla_default(graph)
    program = programs.compile("broken", dataclasses.replace(xla, buckets=xla.buckets[:0]), None)
    assert not program.enacted and program.status == "not enacted" and "not valid" in program.reason
    assert program.text is None and program.stats is None and program.to_json()["compiled"] is None


def test_programs_compile_each_enactment_once(captured, baseline_programs):
    _, compiled, programs = baseline_programs
    again = programs.compile("again", None, backends.GPU.baseline_options["JAX_op_fusion"])
    assert again.compiled is compiled["JAX_op_fusion"].compiled
    assert (again.name, again.same_program_as) == ("again", "JAX_op_fusion")
