"""Two-axis plans enacted by `@optimize_distributed` on 8 CPU devices (`sharding.mesh_plan`): a
small Flax GPT step (scanned blocks, Adam), unchanged. A forced tensor-parallel plan
(`layout="tp"`) is checked and measured, then trains: its losses and parameters match the
unmodified step's, its parameters and Adam moments stay in the plan's layout between steps
(per-device shard shapes) and the executable that runs holds all-reduces over the model axis. A
memory limit no one-axis weight update meets makes the search choose a two-axis plan, stored and
recalled by a fresh decorator in the enact phase."""

import re
import types

import jax
import numpy as np
import optax
import pytest
from test_mesh_step import _group_sizes

from disco_jax import _plan, optimize_distributed, zoo
from disco_jax.sharding import mesh_plan, operators

FAST = dict(budget_s=1.0, validation_pairs=4, verbose=False)
# Width 128 over 8 heads, vocabulary 2048, one scanned block, 8 sequences of 8 tokens: weights
# large against activations, so tensor parallelism (weights never gathered) needs less memory
# per device than FSDP (each weight gathered whole where it is used).
GPT = {"d_model": 128, "num_heads": 8, "vocab_size": 2048, "num_layers": 1, "seq_len": 8, "scan_layers": True}
# Computing in the parameters' dtype (no float32 cast written in the model): the output check then
# judges the plans against the step run in float64, as tensor parallelism's partial sums need.
GPT["compute_dtype"] = "params"
STEPS = 3
LR = 1e-3


def gpt():
    spec = zoo.resized("gpt", **GPT)
    return zoo.make_train_step(spec, optax.adam(LR), zoo.data_mesh(), "jit", global_batch_size=8)


def train(step, state, batch):
    losses = []
    for _ in range(STEPS):
        state, loss = step(state, batch)
        losses.append(float(loss))
    return state, losses


@pytest.fixture(scope="module")
def reference():
    step, state, batch = gpt()
    return train(step, state, batch)


def blocks(tree):
    return tree["blocks"]["block"]


def assert_same_training(state, losses, reference):
    """Losses close; parameters within what Adam can move two runs apart in STEPS steps (2 x lr
    per step): the key projection's bias has a gradient of zero up to rounding (softmax ignores
    a constant per row), which Adam turns into learning-rate-sized steps of either sign. The
    output check (float64 reference, moved state) is the exact judge; this is the training."""
    ref_state, ref_losses = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=2 * LR * STEPS)


def test_a_forced_tensor_parallel_plan_trains_in_its_layout(tmp_path, reference):
    step, state, batch = gpt()
    run = optimize_distributed(search=True, plan_dir=tmp_path, layout="tp", **FAST)(step)
    new_state, losses = train(run, state, batch)
    assert len(run.reports) == 1  # later calls reached the same executable: the state stayed in its layout
    report = run.reports[0]
    info = report.layout
    assert report.applied and info["mode"] == "mesh" and info["forced"] == "layout option", report.reason
    assert info["plan"]["mesh"] == {"data": 1, "model": 8}
    assert info["check"]["within_tolerance"] and info["check"]["state_steps"]  # the moved state checked too
    assert info["measured"]["pairs"] >= 4 and "measured" in report.reason
    assert_same_training(new_state, losses, reference)
    # Per device after 3 steps: kernels split on the model axis, column then row; the tied
    # embedding on the vocabulary; Adam's moments as their parameters.
    params, mu = new_state.params, new_state.opt_state[0].mu
    shard = lambda x: x.addressable_shards[0].data.shape  # noqa: E731
    assert shard(blocks(params)["CausalSelfAttention_0"]["qkv"]["kernel"]) == (1, 128, 384 // 8)
    assert shard(blocks(params)["CausalSelfAttention_0"]["out"]["kernel"]) == (1, 128 // 8, 128)
    assert shard(blocks(params)["Dense_0"]["kernel"]) == (1, 128, 512 // 8)
    assert shard(blocks(params)["Dense_1"]["kernel"]) == (1, 512 // 8, 128)
    assert shard(params["Embed_0"]["embedding"]) == (2048 // 8, 128)
    assert shard(blocks(mu)["Dense_1"]["kernel"]) == (1, 512 // 8, 128)
    assert shard(mu["Embed_0"]["embedding"]) == (2048 // 8, 128)
    text = run.executable(state, batch).as_text()  # the program the first call prepared, and the later ones ran
    assert len(re.findall(r" all-reduce(?:-start)?\(", text)) > 0  # the row dots' partial sums
    assert _group_sizes(text) == {8}  # the model axis is every device


def test_a_forced_layout_is_refused_where_its_mesh_is_not_the_devices(tmp_path):
    step, state, batch = gpt()
    with pytest.raises(ValueError, match="unknown choice"):
        optimize_distributed(layout="2x4:megatron")
    run = optimize_distributed(search=False, plan_dir=tmp_path, layout="2x2:tp", **FAST)(step)
    with pytest.warns(UserWarning, match="needs 4 devices"):
        run(state, batch)
    assert run.reports[0].layout is None and not run.reports[0].applied


def test_a_memory_limit_no_one_axis_update_meets_chooses_a_two_axis_plan(tmp_path, reference):
    step, state, batch = gpt()
    # Between the smallest one-axis footprint and the 1x8 tensor-parallel one (`_footprints`).
    one_axis, tensor_parallel = _footprints(step, state, batch)
    assert tensor_parallel < one_axis, (tensor_parallel, one_axis)
    limit = (tensor_parallel + one_axis) // 2
    # One two-axis candidate within the limit measured (the fewest collectives): a small test.
    run = optimize_distributed(search=True, plan_dir=tmp_path, memory_limit_bytes=limit, measured_candidates=1, **FAST)(
        step
    )
    new_state, losses = train(run, state, batch)
    report = run.reports[0]
    info = report.weight_update
    assert info["mode"] == "mesh" and report.applied, report.reason
    assert all(c["footprint_bytes"] > limit for c in info["candidates"])  # DP, ZeRO, FSDP: none fits
    chosen = report.layout
    assert chosen["footprint_bytes"] <= limit and chosen["check"]["within_tolerance"]
    assert sum("measured" in c for c in chosen["candidates"]) == 1
    assert any(c.get("within_limit") is False for c in chosen["candidates"])  # some two-axis plans do not fit either
    assert chosen["plan"]["mesh"]["model"] > 1
    # Faster than the unmodified step with confidence, or the record says memory forced it.
    assert (chosen["measured"]["verdict"] == "faster") == (chosen["forced"] is False)
    assert_same_training(new_state, losses, reference)
    assert len(run.reports) == 1
    stored = _plan.find_plan(report.fingerprint, _plan.MachineKey.current(), tmp_path)[0]
    assert stored.layout["plan"] == chosen["plan"]

    # A fresh decorator in the enact phase recalls it: no search, the same layout.
    enacting = optimize_distributed(search=False, plan_dir=tmp_path, memory_limit_bytes=limit, **FAST)(step)
    enacted_state, enacted = train(enacting, state, batch)
    assert enacting.reports[0].layout["recalled"] and enacting.reports[0].applied
    assert_same_training(enacted_state, enacted, reference)
    specs = chosen["plan"]["parameters"]
    for path, x in jax.tree_util.tree_flatten_with_path(enacted_state.params)[0]:
        key = "[0][0].params" + jax.tree_util.keystr(path)
        assert tuple(x.sharding.spec) == tuple(specs[key]) + (None,) * (x.ndim - len(specs[key])), key

    # Under a limit the stored plan does not meet, it is not run: the one-axis step is, and says so.
    smaller = optimize_distributed(
        search=False, plan_dir=tmp_path, memory_limit_bytes=chosen["footprint_bytes"] - 1, **FAST
    )
    with pytest.warns(_plan.PlanWarning, match="over memory_limit_bytes"):
        smaller(step)(state, batch)


def test_a_stored_layout_is_stale_under_a_limit_it_does_not_meet_or_no_longer_needs():
    decided = {"footprint_bytes": 100, "memory_limit_bytes": 120, "forced": "memory"}
    assert mesh_plan.stale(decided, None, 500) is None and mesh_plan.stale(decided, 120, 500) is None
    assert "over memory_limit_bytes=99 (chosen under 120)" in mesh_plan.stale(decided, 99, 500)
    assert "memory forced it" in mesh_plan.stale(decided, 600, 500)  # the unmodified step fits now
    assert mesh_plan.stale({**decided, "forced": False}, 600, 500) is None  # faster: kept


def test_a_stored_layout_over_a_new_limit_is_chosen_again_from_its_measured_candidates():
    def candidate(label, footprint, ratio=None, verdict="faster", within=True):
        measured = {"ratio": ratio, "ratio_iqr": [ratio, ratio], "ratio_ci95": [ratio, ratio], "verdict": verdict}
        return {
            "label": label,
            "plan": {"mesh": {"data": 2, "model": 4}, "choices": {"blocks": "tp"}},
            "footprint_bytes": footprint,
            **({"measured": measured, "check": {"within_tolerance": within}} if ratio is not None else {}),
        }

    records = [
        candidate("2x4 fast", 100, 0.8),
        candidate("1x8 slower", 60, 1.2, "slower"),
        candidate("4x2 small, never measured", 40),
        candidate("2x4 wrong outputs", 50, 0.5, within=False),
    ]
    decided = {**records[0], "candidates": records, "memory_limit_bytes": 120, "forced": False}
    again = mesh_plan.rechoose(decided, 70)
    assert again["label"] == "1x8 slower" and again["forced"] == "memory" and again["memory_limit_bytes"] == 70
    assert again["stored_memory_limit_bytes"] == 120 and "chosen again from the recorded candidates" in again["reason"]
    assert mesh_plan.plan_from_json(again["plan"]).model == 4
    assert mesh_plan.rechoose(decided, 45) is None  # only an unmeasured or a wrong candidate fits


def _footprints(step, state, batch) -> tuple[int, int]:
    """(the smallest per-device peak of the FSDP at-use candidate, of the 1x8 TP plan), read from
    XLA's memory analysis of each compiled on the CPU devices; the search records the others."""
    from disco_jax.sharding import choice, mesh_step, update

    args = (state, batch)
    default = step.lower(*args).compile()
    layout, _ = update.find_layout(step, args, {}, args, {}, jax.tree.leaves(default.input_shardings), largest=True)
    lowered, _ = update.relower(step, layout.subset(layout.all_leaves(), at_use=True), args, {}, (args, {}), default)
    fsdp = choice.executable_peak(lowered.compile())
    found = mesh_step.structure(step, args)
    lowered, _, _ = mesh_step.relower(step, args, found, mesh_plan.forced_plan("tp", found))
    return fsdp, choice.executable_peak(lowered.compile())


def test_layout_option_parsing():
    assert mesh_plan.check_layout("2x4:fsdp_tp_sp,Embed=tp") == "2x4:fsdp_tp_sp,Embed=tp"
    plan = operators.OperatorPlan(2, 4, {"blocks": "tp"})
    assert mesh_plan.check_layout(plan) is plan and not mesh_plan.is_forced("search")
    for bad in ("2x4", "x:tp", "2x4:tp,Embed=nope", 3):
        with pytest.raises(ValueError):
            mesh_plan.check_layout(bad)


def test_an_offline_layout_is_measured_on_the_devices_at_hand_then_its_verdict_kept(tmp_path, reference):
    """A plan as `offline.plan_for_target(layouts=True)` records its chosen layout (here under this
    machine's key: no GPU machine to make it for), for the step's device count: the enact phase
    checks and measures it before applying it, and writes the verdict into the plan."""
    step, state, batch = gpt()
    probe = optimize_distributed(search=False, plan_dir=tmp_path, layout="data", **FAST)(step)
    with pytest.warns(_plan.PlanWarning, match="no plan"):
        probe(state, batch)
    chosen = {"plan": "1x8 Embed: tp, blocks: tp", "mesh": {"data": 1, "model": 8}}
    chosen["choices"] = {"blocks": "tp", "Embed": "tp"}
    fingerprint, machine = probe.reports[0].fingerprint, _plan.MachineKey.current()
    offline = _plan.Plan(
        fingerprint, "jit_step", machine, True, None, "offline", search={"offline": {"layout": {"chosen": chosen}}}
    )
    _plan.save_plan(offline, tmp_path)

    run = optimize_distributed(search=False, plan_dir=tmp_path, **FAST)(step)
    new_state, losses = train(run, state, batch)
    info = run.reports[0].layout
    assert info["from"] == "offline" and info["check"]["within_tolerance"] and info["measured"]["pairs"] >= 4
    stored = _plan.find_plan(fingerprint, machine, tmp_path)[0].layout
    assert stored["mode"] == info["mode"] and stored["measured"] == info["measured"]
    # Applied only when measured faster with confidence (no memory limit here).
    assert (info["mode"] == "mesh") == (info["measured"]["verdict"] == "faster") == run.reports[0].applied
    assert_same_training(new_state, losses, reference)
    again = optimize_distributed(search=False, plan_dir=tmp_path, **FAST)(step)
    again(state, batch)
    if info["mode"] == "mesh":  # the verdict read back, nothing measured
        assert again.reports[0].layout["recalled"] and "measured" in again.reports[0].layout
    else:
        assert again.reports[0].layout is None and not again.reports[0].applied


def test_an_offline_choice_written_by_hand_is_not_taken_for_an_operator_plan():
    """Offline, the cheapest candidate may be a configuration a user writes by hand
    (`eval.handwritten`); the decorator enacts operator plans only, so it runs the one-axis step."""
    by_hand = {"mesh": {operators.DATA: 2, operators.MODEL: 4}, "by_hand": "FSDP x TP", "fsdp": True}
    operator = {"mesh": {operators.DATA: 2, operators.MODEL: 4}, "plan": "2x4 fsdp_tp"}
    plan = lambda chosen: types.SimpleNamespace(layout={}, search={"offline": {"layout": {"chosen": chosen}}})  # noqa: E731
    assert mesh_plan.stored_layout(plan(by_hand), 8) == (None, False)
    decided, unmeasured = mesh_plan.stored_layout(plan(operator), 8)
    assert unmeasured and decided["from"] == "offline" and decided["plan"] is operator
