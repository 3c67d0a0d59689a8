"""Operator parallelism on 8 CPU devices (`sharding.operators`, `sharding.constrain`,
`sharding.mesh_step`): a small Flax GPT step (scanned blocks, Adam), unchanged, lowered again on a
1x8 mesh with a forced tensor-parallel plan and on a 2x4 mesh with FSDP x TP and sequence
parallelism. Its outputs pass the output check against the unmodified step, its parameters come
back in the plan's layout (per-device shard shapes), and the compiled module holds the plan's
collectives over the model axis' groups."""

import dataclasses
import re

import jax
import optax
import pytest

from disco_jax import backends, zoo
from disco_jax._compile import capture
from disco_jax.sharding import choice, constrain, mesh_step, operators, rules, update

# 8 heads of 8, vocabulary 128: every split of the plans below divides.
GPT = {"d_model": 64, "num_heads": 8, "vocab_size": 128, "num_layers": 2, "seq_len": 16, "scan_layers": True}
QKV = "['blocks']['block']['CausalSelfAttention_0']['qkv']['kernel']"
OUT = "['blocks']['block']['CausalSelfAttention_0']['out']['kernel']"
UP, DOWN = "['blocks']['block']['Dense_0']['kernel']", "['blocks']['block']['Dense_1']['kernel']"


@pytest.fixture(scope="module")
def gpt():
    spec = zoo.resized("gpt", **GPT)
    step, state, batch = zoo.make_train_step(spec, optax.adam(1e-3), zoo.data_mesh(), "jit")
    args = (state, batch)
    program = capture(step.lower(*args), backends.CPU, args, {})
    return step, args, program, mesh_step.structure(step, args)


def _index(found, suffix: str) -> int:
    return next(p for p, path in found.parameters.items() if path.endswith(suffix))


def _group_sizes(text: str) -> set[int]:
    """The sizes of the replica groups of every collective in a compiled module, as XLA prints them:
    iota groups `[groups,size]<=[8]`, or a mesh and the axes it runs over."""
    sizes = set()
    for line in text.splitlines():
        if not re.search(r" (all-reduce|reduce-scatter|all-gather)(-start)?\(", line):
            continue
        iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
        mesh = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
        if iota:
            sizes.add(int(iota.group(2)))
        elif mesh:
            axes = dict((k.strip("'"), int(v)) for k, v in (a.split("=") for a in mesh.group(1).split(",")))
            size = 1
            for name in re.findall(r"'([^']+)'", mesh.group(2)):
                size *= axes[name]
            sizes.add(size)
    return sizes


def test_roles_are_found_from_the_dots_that_read_each_parameter(gpt):
    _, _, _, found = gpt
    kinds = {path: found.roles[p].kind for p, path in found.parameters.items() if p in found.roles}
    assert {k: v for k, v in kinds.items() if "blocks" in k} == {
        f"[0][0].params{QKV}": "column",
        f"[0][0].params{OUT}": "row",
        f"[0][0].params{UP}": "column",
        f"[0][0].params{DOWN}": "row",
    }
    assert kinds["[0][0].params['Embed_0']['embedding']"] == "column"  # the tied head: split on the vocabulary
    assert not any("LayerNorm" in k or "positions" in k for k in kinds)


def _run(gpt, plan):
    step, args, program, found = gpt
    lowered, moved, enacted = mesh_step.relower(step, args, found, plan)
    planned = capture(lowered, backends.CPU, moved, {})
    planned.exact = program.exact
    return planned, moved, enacted


def test_a_forced_tensor_parallel_plan_computes_the_same_and_holds_its_layout(gpt):
    step, args, program, found = gpt
    plan = operators.OperatorPlan(1, 8, {"blocks": "tp", "Embed": "tp"})
    planned, moved, enacted = _run(gpt, plan)
    check = update.check_outputs(program, planned)
    assert check.within_tolerance, check
    new_state, _ = planned.default_compiled(*moved)
    params = new_state.params
    kernels = params["blocks"]["block"]
    # Per device: the stacked (layers, in, out) kernels split on the model axis, column then row.
    assert kernels["CausalSelfAttention_0"]["qkv"]["kernel"].addressable_shards[0].data.shape == (2, 64, 192 // 8)
    assert kernels["CausalSelfAttention_0"]["out"]["kernel"].addressable_shards[0].data.shape == (2, 64 // 8, 64)
    assert kernels["Dense_0"]["kernel"].addressable_shards[0].data.shape == (2, 64, 256 // 8)
    assert kernels["Dense_1"]["kernel"].addressable_shards[0].data.shape == (2, 256 // 8, 64)
    assert params["Embed_0"]["embedding"].addressable_shards[0].data.shape == (128 // 8, 64)
    mu = new_state.opt_state[0].mu["blocks"]["block"]["Dense_1"]["kernel"]
    assert mu.addressable_shards[0].data.shape == (2, 256 // 8, 64)  # the state held as its parameter
    text = planned.default_compiled.as_text()
    assert update.collectives(text)["all-reduce"] > 0  # the row dots' partial sums
    assert _group_sizes(text) == {8}  # one model axis of 8: every collective over all devices
    assert set(enacted.to_json(found)["rules"]) == set(rules.TENSOR_PARALLEL_RULES)


def test_a_two_dimensional_plan_with_sequence_parallelism_uses_model_axis_groups(gpt):
    step, args, program, found = gpt
    plan = operators.OperatorPlan(2, 4, {"blocks": "fsdp_tp_sp", "Embed": "tp"})
    planned, moved, enacted = _run(gpt, plan)
    check = update.check_outputs(program, planned)
    assert check.within_tolerance, check
    new_state, _ = planned.default_compiled(*moved)
    down = new_state.params["blocks"]["block"]["Dense_1"]["kernel"]
    assert down.sharding.spec == jax.sharding.PartitionSpec(None, "model", "data")
    assert down.addressable_shards[0].data.shape == (2, 256 // 4, 64 // 2)
    text = planned.default_compiled.as_text()
    counts = update.collectives(text)
    assert counts["all-gather"] > 0 and counts["reduce-scatter"] + counts["all-reduce"] > 0
    # Groups of 4 (the model axis: TP's partial sums, SP's gathers) and of 2 (the data axis: FSDP).
    assert {2, 4} <= _group_sizes(text)
    rules_cited = enacted.to_json(found)["rules"]
    assert "all_reduce_as_reduce_scatter_all_gather" in rules_cited and "row_parallel_dot" in rules_cited


def test_the_transformation_inserts_constraints_inside_scan_and_remat_bodies():
    spec = zoo.resized("gpt", **{**GPT, "remat": "full"})
    step, state, batch = zoo.make_train_step(spec, optax.adam(1e-3), zoo.data_mesh(), "jit")
    mesh = operators.build_mesh(jax.devices(), 2, 4)
    spec_ = jax.sharding.PartitionSpec("data")
    constrained = constrain.constrained(step.__wrapped__, lambda dot: spec_, mesh)
    regions = _regions(jax.make_jaxpr(constrained)(state, batch).jaxpr)
    assert all(n == 0 for _, n in _regions(jax.make_jaxpr(step.__wrapped__)(state, batch).jaxpr))
    # Both scans (forward, backward) and the backward's rematerialized forward hold constraints.
    scans = [n for kind, n in regions if kind == "scan"]
    remats = [n for kind, n in regions if kind in ("remat2", "checkpoint")]
    assert len(scans) == 2 and all(n > 0 for n in scans) and remats and all(n > 0 for n in remats), regions


def _constraints(jaxpr) -> int:
    """Sharding constraints in a jaxpr and every region inside it."""
    inner = (eqn.params.get("jaxpr") for eqn in jaxpr.eqns)
    own = sum(eqn.primitive.name == "sharding_constraint" for eqn in jaxpr.eqns)
    return own + sum(_constraints(getattr(b, "jaxpr", b)) for b in inner if b is not None)


def _regions(jaxpr) -> list[tuple[str, int]]:
    """(primitive, constraints inside) of every scan and remat region, outermost first."""
    out = []
    for eqn in jaxpr.eqns:
        body = eqn.params.get("jaxpr")
        if body is None:
            continue
        body = getattr(body, "jaxpr", body)
        if eqn.primitive.name in ("scan", "remat2", "checkpoint"):
            out.append((eqn.primitive.name, _constraints(body)))
        out += _regions(body)
    return out


def test_a_two_dimensional_plan_with_its_loops_rematerialized_computes_the_same_and_needs_less(gpt):
    step, args, program, found = gpt
    plain = operators.OperatorPlan(2, 4, {"blocks": "fsdp_tp", "Embed": "tp"})
    full = dataclasses.replace(plain, remat="full")
    assert full.label.endswith("loops rematerialized (full)") and full.to_json()["remat"] == "full"
    planned, _, enacted = _run(gpt, full)
    check = update.check_outputs(program, planned)
    assert check.within_tolerance, check
    kept, _, _ = _run(gpt, plain)
    peak = lambda p: choice.executable_peak(p.default_compiled)  # noqa: E731
    assert peak(planned) < peak(kept)
    # The recomputed forward in the backward loop is constrained as the forward is: the model
    # axis' groups still carry the tensor-parallel collectives.
    assert 4 in _group_sizes(planned.default_compiled.as_text())
