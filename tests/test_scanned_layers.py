"""Steps whose layers run under `lax.scan` (the zoo's `scan_layers=True`: Flax `nn.scan` over the
GPT's blocks, a `while` loop per pass in the step), on 8 CPU devices: the weight update splits
the stacked `(layers, ...)` parameters and their state after the layer axis, and with parameters
gathered again for each use each loop body gathers its own layer (FSDP per layer) and the step
computes what the replicated one does."""

import dataclasses
import random
import re
import tempfile
from collections import Counter
from pathlib import Path

import jax
import optax
import pytest

from disco_jax import (
    _device_timing,
    _hlo,
    _profile_phase,
    _strategy,
    _validate,
    backends,
    cost,
    optimize_distributed,
    simulate,
    zoo,
)
from disco_jax._compile import capture, compile_strategy, compiled_stats, keeps_plan
from disco_jax.sharding import choice, update

LAYERS = 8  # the layer axis the data axis divides: a split on it would be the first choice


@pytest.fixture(scope="module")
def scanned_step():
    """The tiny GPT with 8 scanned blocks and Adam: (step, args) on 8 CPU devices."""
    spec = zoo.resized("gpt", num_layers=LAYERS, scan_layers=True)
    step, state, batch = zoo.make_train_step(spec, optax.adam(1e-3), zoo.data_mesh(), "jit")
    return step, (state, batch)


@pytest.fixture(scope="module")
def three_blocks():
    """The tiny GPT with 3 scanned blocks and AdamW: (step, args) on 8 CPU devices."""
    spec = zoo.resized("gpt", num_layers=3, scan_layers=True)
    step, state, batch = zoo.make_train_step(spec, optax.adamw(1e-3), zoo.data_mesh(), "jit")
    return step, (state, batch)


@pytest.fixture(scope="module")
def three_blocks_captured(three_blocks):
    """The 3-block step captured for XLA:CPU (the loop-packing tests share it)."""
    step, args = three_blocks
    return capture(step.lower(*args), backends.CPU, args, {})


def _bodies(text: str) -> dict[str, list[str]]:
    """Instruction lines per computation of a module's text (the ENTRY's under "ENTRY")."""
    found, name = {}, None
    for line in text.splitlines():
        header = re.match(r"^(ENTRY )?%?([\w.\-]+) \(", line)
        if header:
            name = "ENTRY" if header.group(1) else header.group(2)
            found[name] = []
        elif line.strip() == "}":
            name = None
        elif name is not None:
            found[name].append(line)
    return found


def test_stacked_parameters_and_their_state_are_split_after_the_layer_axis_or_on_it_for_whole_layers(scanned_step):
    step, args = scanned_step
    layout, reason = update.find_layout(step, args, {}, args, {}, [x.sharding for x in jax.tree.leaves(args)])
    stacked = {layout.all_paths()[p] for p in layout.all_paths() if "['blocks']" in p}
    assert stacked and layout.stacked == stacked and "stacked on a layer axis" in reason
    specs = {**layout.inputs, **{p: q.spec for p, q in layout.parameters.items()}}
    for i in stacked:  # (8, ...) leaves: the layer axis stays whole, a later dimension is split
        assert specs[i][0] is None and "data" in tuple(specs[i]), (layout.all_paths(), specs[i])
    others = [specs[i] for i in specs if i not in stacked and len(specs[i]) and specs[i][0] == "data"]
    assert others  # an unstacked leaf still takes its first divisible dimension (the embedding's)
    assert layout.to_json()["stacked"]
    # `whole_layers` (offline.WHOLE_LAYERS, the planner's other choice): split on the layer axis.
    whole, _ = update.find_layout(
        step, args, {}, args, {}, [x.sharding for x in jax.tree.leaves(args)], whole_layers=True
    )
    whole_specs = {**whole.inputs, **{p: q.spec for p, q in whole.parameters.items()}}
    assert not whole.stacked and all(whole_specs[i][0] == "data" for i in stacked)


def test_gathered_again_each_layer_is_gathered_in_the_loop_and_the_step_computes_the_same(scanned_step):
    """Parameters and state sharded, gathered again for each use: the stacked parameters enter
    the loops split and each loop body (forward, backward) all-gathers its own layer, where
    gathered once the entry gathers whole stacks; the outputs are the replicated step's (the
    output check)."""
    step, args = scanned_step
    program = capture(step.lower(*args), backends.CPU, args, {})
    layout, _ = update.find_layout(step, args, {}, args, {}, [x.sharding for x in jax.tree.leaves(args)])
    held = update.held_leaves(program)
    again = choice.candidate(step, program, layout, layout.all_leaves(), args, {}, backends.CPU, held, regather=True)
    once = choice.candidate(step, program, layout, layout.all_leaves(), args, {}, backends.CPU, held)
    bodies = _bodies(again.step.default_compiled.as_text())
    loops = [b for name, b in bodies.items() if name != "ENTRY" and any(" all-gather(" in line for line in b)]
    assert len(loops) == 2  # the forward and the backward loop body
    shape = lambda x: f"f32[{','.join(map(str, x.shape))}]"  # noqa: E731
    params = args[0].params
    stacks = {shape(x) for x in jax.tree.leaves(params["blocks"])}
    stacks -= {shape(x) for k, v in params.items() if k != "blocks" for x in jax.tree.leaves(v)}  # (8, 32) positions
    gathered_in_entry = [line for line in bodies["ENTRY"] if " all-gather(" in line]
    assert not any(line.split(" = ")[1].split("{")[0] in stacks for line in gathered_in_entry)
    once_entry = [line for line in _bodies(once.step.default_compiled.as_text())["ENTRY"] if " all-gather(" in line]
    assert any(line.split(" = ")[1].split("{")[0] in stacks for line in once_entry)  # once: whole stacks
    check = update.check_outputs(program, again.step)
    assert check.within_tolerance, check


def test_a_cpu_trace_shows_each_iteration_and_the_compiled_model_costs_a_body_kernel_per_iteration(three_blocks):
    """XLA:CPU's trace of the scanned step has one event per iteration of every loop body kernel
    (3 blocks: 3 per device and step); the compiled-program model, costed by that trace, runs
    each body kernel 3 times at its traced step total over 3, and every run is measured."""
    step, (state, batch) = three_blocks
    compiled = step.lower(state, batch).compile()
    text = compiled.as_text()
    program = cost.compiled_program(text, backends.CPU)
    body = {k.name for k in program.compute_kernels if k.scope.endswith("/body")}
    assert body and all(program.repeats[name] == 3 for name in body)
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.block_until_ready(compiled(state, batch))
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready(compiled(state, batch))
        traces = [jax.profiler.ProfileData.from_file(str(p)) for p in Path(trace_dir).rglob("*.xplane.pb")]
    events = _device_timing.module_op_events(traces, _device_timing.hlo_module_name(text))
    runs = Counter((e.op, e.device) for e in events if e.op in body)
    assert runs and set(runs.values()) == {3}
    times = _device_timing.kernel_times_from_trace(traces, _device_timing.hlo_module_name(text), steps=1)
    costed = cost.cost_program(program, cost.measured_table(program, times), cost.AllReduceCostModel(1e-4, 50.0))
    runs_per_step = sum(k.repeat for k in program.compute_kernels)
    assert costed.costed_by.get("none", 0) == 0 and costed.costed_by["measured"] == runs_per_step
    signature = {n: program.graph.kernel_signature(ops) for n, ops in program.ops.items()}
    unique = [n for n in body if n in times and list(signature.values()).count(signature[n]) == 1]
    assert unique
    for k in costed.kernels:
        if k.name in unique:
            assert k.time_us == pytest.approx(times[k.name] / 3)


def test_the_graph_simulator_costs_a_loop_from_its_body_per_iteration(three_blocks):
    """The captured step's `while` ops are opaque ops of the graph; `cost.LoopEstimator` costs
    one as the compiled-program model costs that loop: each body kernel once per iteration at its
    per-iteration table time (`_profile_phase.loop_body_times` of the traced executable), the
    backward body's all-reduce of the layer's gradients by the collective model, once per layer
    (XLA:CPU's collectives block, so the two add up); other kernels are left to the chain."""
    step, args = three_blocks
    captured = capture(step.lower(*args), backends.CPU, args, {})
    times = _device_timing.measure_kernel_times(captured.default_compiled, args, steps=1, warmup=1)
    table = _profile_phase.loop_body_times(captured, times)
    graph = captured.graph
    # The loops as the capture holds them (before scheduling: the estimator's reading).
    program = cost.compiled_program(graph.module.to_text(), backends.CPU, scheduled=False)
    collectives = cost.AllReduceCostModel(1e-3, 60.0, per_tensor_us=100.0)
    estimator = cost.LoopEstimator(cost.TableEstimator(table), collectives, backends.CPU)
    loops = [o for o in graph.opaque_ops if graph.ops[o].opcode == "while"]
    assert len(loops) == 2 and estimator.estimate(graph, [frozenset([graph.opaque_ops[0]])]) == [None]
    for o in loops:
        [flow] = [f for f in program.control_flow if f.name == graph.ops[o].name]
        body = [k for k in program.kernels if k.scope == flow.body]
        traced = [table.get(program.graph.kernel_signature(program.ops[k.name])) for k in body if not k.is_collective]
        assert all(t is not None for t in traced)  # every body kernel traced, per iteration
        reduced = sum(collectives.bucket_time_us(k.tensor_bytes) for k in body if k.is_collective)
        [loop_us] = estimator.estimate(graph, [frozenset([o])])
        assert flow.trip_count == 3 and loop_us == pytest.approx(3 * (sum(t or 0.0 for t in traced) + reduced))
    assert any(k.is_collective for k in program.kernels if k.scope)  # the backward body's all-reduce


def test_the_decorator_searches_stores_and_reuses_a_plan_for_a_scanned_adamw_step(three_blocks, tmp_path):
    """A scanned GPT with AdamW through `@optimize_distributed` on 8 CPU devices: the search phase
    profiles it (its loops' bodies per iteration), searches, checks and stores a plan; a fresh
    decorator finds it without searching; both compute what the unmodified step computes."""
    step, (state, batch) = three_blocks
    reference = step(state, batch)
    fast = dict(budget_s=1.0, validation_pairs=4, measured_candidates=0, verbose=False, weight_update="replicated")
    searched = optimize_distributed(search=True, plan_dir=tmp_path, **fast)(step)
    outputs = searched(state, batch)
    assert searched.last_report.phase == "search" and list(tmp_path.glob("*.json"))
    reused = optimize_distributed(search=False, plan_dir=tmp_path, verbose=False, weight_update="replicated")(step)
    again = reused(state, batch)
    assert reused.last_report.phase == "enact" and reused.last_report.reason == searched.last_report.reason
    for found in (outputs, again):
        assert _validate.compare_outputs(reference, found, bitwise=not searched.last_report.applied).within_tolerance


def test_a_loop_bodys_allreduce_is_packed_per_iteration_and_the_step_computes_the_same(three_blocks_captured):
    """`Strategy.packed_loops` on XLA:CPU: the backward body's variadic all-reduce of one layer's
    gradients (one rendezvous per operand) becomes one all-reduce of a flat buffer inside the same
    `while` body, run once per iteration; the outputs are XLA's bit for bit; the move proposes
    it, the search starts from it, and a plan keeps it through JSON."""
    captured = three_blocks_captured
    program, graph = captured.program, captured.graph
    [(body, name)] = graph.loop_allreduces  # the backward body's, of 12 tensors
    xla = _strategy.xla_default(graph)
    packed = _strategy.pack_buckets(program, xla, random.Random(0), loops=True)
    assert packed.packed_loops and packed.key() != xla.key() and _strategy.regroups_only(graph, packed)
    assert _strategy.kernel_dag(program, packed) is not None and _strategy.is_valid(program, packed)
    assert _strategy.pack_buckets(program, packed, random.Random(0), loops=True).key() == xla.key()
    assert _strategy.Strategy.from_json(graph, packed.to_json(graph)).key() == packed.key()
    assert any(s.packed_loops for s in _strategy.start_candidates(graph, packs=True))
    compiled, status = compile_strategy(captured.lowered, program, packed)
    assert status in ("rewritten", "cached")
    text = compiled.as_text()
    loops = {
        i.attr("body").lstrip("%")
        for c in _hlo.parse_module(text).computations
        for i in c.instructions
        if i.opcode == "while"
    }
    reduced = {n: [line for line in b if " all-reduce(" in line] for n, b in _bodies(text).items() if n in loops}
    [in_body] = [lines for lines in reduced.values() if lines]
    assert len(in_body) == 1 and re.search(r"= f32\[\d+\]\{0\} all-reduce\(%[\w.\-]+\)", in_body[0]), in_body
    default = [line for n, b in _bodies(captured.default_compiled.as_text()).items() if n in loops for line in b]
    assert any(" all-reduce(" in line and line.count("f32[") > 2 for line in default)  # variadic there
    assert compiled_stats(captured.default_compiled.as_text())["loop_variadic_all-reduces"] == 1
    assert compiled_stats(text)["loop_variadic_all-reduces"] == 0 and keeps_plan(compiled_stats(text), program, packed)
    check = _validate.compare_outputs(
        captured.runner(captured.default_compiled)(), captured.runner(compiled)(), bitwise=True
    )
    assert check.bitwise_equal, check


def test_the_simulator_charges_a_packed_loop_body_one_flat_allreduce_per_iteration(three_blocks_captured):
    """The graph simulator costs the opaque backward loop with its all-reduce packed: per
    iteration, the variadic all-reduce's per-tensor latency gone, the copies in and out added
    (`SimulatorParams.packed_bucket_us`); so the packed plan is cheaper exactly where per-tensor
    latency outweighs the copies, as for the entry's buckets. Where the profile traced the
    all-reduce, the saving is that share of its traced time."""
    captured = three_blocks_captured
    graph = captured.graph
    xla = _strategy.xla_default(graph)
    packed = dataclasses.replace(xla, packed_loops=True)
    program = cost.captured_program(graph, backends.CPU)
    [backward] = [
        f
        for f in program.control_flow
        if any(k.name == graph.loop_allreduces[0][1] for k in cost.loop_program(program, f.name).kernels)
    ]
    [kernel] = [k for k in program.kernels if k.name == graph.loop_allreduces[0][1]]
    tensors = list(kernel.tensor_bytes)
    assert backward.trip_count == 3 and len(tensors) == 12
    for per_tensor_us, packing_wins in ((100.0, True), (0.0, False)):
        allreduce = cost.AllReduceCostModel(1e-3, 60.0, per_tensor_us=per_tensor_us)
        estimator = cost.chain(
            cost.LoopEstimator(cost.AnalyticalEstimator(), allreduce, backends.CPU), cost.AnalyticalEstimator()
        )
        variadic_us = simulate(captured.program, xla, estimator, allreduce).iteration_us
        packed_us = simulate(captured.program, packed, estimator, allreduce).iteration_us
        one = cost.SimulatorParams()
        saved = 3 * (one.bucket_us(allreduce, tensors) - one.packed_bucket_us(allreduce, tensors))
        assert variadic_us - packed_us == pytest.approx(saved)
        assert (packed_us < variadic_us) is packing_wins
    # A loop costed by its traced time: packing saves that share of the traced all-reduce, never
    # more than the trace holds (the collective model alone may charge more than the loop took).
    allreduce = cost.AllReduceCostModel(1e-3, 60.0, per_tensor_us=100.0)
    cost.record_loop_allreduce_times(graph, backends.CPU, {kernel.name: 3 * 400.0})
    share = 1.0 - one.packed_bucket_us(allreduce, tensors) / one.bucket_us(allreduce, tensors)
    [(o, saved_us)] = cost.packed_loop_savings_us(graph, backends.CPU, allreduce).items()
    assert graph.ops[o].name == backward.name and 0 < saved_us == pytest.approx(3 * 400.0 * share)
