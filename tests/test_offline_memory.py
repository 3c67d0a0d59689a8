"""Offline plans under a per-device memory limit (`offline.plan_for_target(memory_limit_bytes=)`),
deviceless for 8 H100s: the zoo's GPT with one layer of width 1024 (`GPT`; what is checked, the
updates' peaks and their order, holds at any depth), Adam, its state donated. Every weight update
is compiled by XLA:GPU for the target, with the hook rules its program gets, and its peak read
from the executable's memory analysis; the plan is the chosen update's program, and a limit
between the replicated and the sharded peaks gives a plan that fits."""

import dataclasses

import optax
import pytest

from disco_jax import _compile, _plan, backends, offline, targets, zoo
from disco_jax._search import SearchConfig
from disco_jax.eval import clusters
from disco_jax.sharding import apply, update

# One layer of width 1024, bfloat16 compute: wide enough that gathering the parameters again for
# each use lowers XLA:GPU's peak (82.1 -> 73.9 MB per device); at width 256 in float32 it raises it
# (9.7 -> 11.4 MB: XLA:GPU's combiner merges small all-gathers at the step's start). The choice
# reads the peaks, so either way it takes the smaller.
GPT = {
    "d_model": 1024,
    "num_heads": 8,
    "num_layers": 1,
    "seq_len": 128,
    "vocab_size": 1024,
    "compute_dtype": "bfloat16",
}


@pytest.fixture(scope="module")
def gpt_step():
    spec, optimizer = zoo.resized("gpt", **GPT), optax.adam(1e-3)
    mesh = targets.mesh("h100-sxm", 8)
    state, batch = zoo.abstract_state_and_batch(spec, optimizer, mesh)
    return zoo.build_train_step(spec, optimizer, mesh, "jit", donate=True), (state, batch)


@pytest.fixture(scope="module")
def every_update(gpt_step):
    step, args = gpt_step
    costs = offline.program_costs(clusters.node_of("h100-sxm", 8))
    return {c.label: c for c in offline.weight_update_candidates(step, args, {}, costs)}


@pytest.fixture(scope="module")
def candidates(every_update):
    """The updates that apply to the GPT: every one but `SPLIT` (each leaf has a dimension 8 divides),
    `WHOLE_LAYERS`, `AT_USE_SPLIT` and `AT_USE_REMAT` (its layers are not scanned)."""
    return {label: c for label, c in every_update.items() if c.why_not is None}


def test_every_weight_update_is_compiled_for_the_target_with_its_peak(every_update, candidates):
    replicated = candidates[offline.REPLICATED]
    assert list(every_update)[0] == offline.REPLICATED and set(offline.SHARDED_UPDATES) <= set(every_update)
    scanned_only = {offline.AT_USE_SPLIT, *offline.AT_USE_REMAT.values()}
    assert set(every_update) - set(candidates) == {offline.SPLIT, offline.WHOLE_LAYERS, *scanned_only}
    assert "no leaf is split" in every_update[offline.SPLIT].why_not
    assert "no scanned loop" in every_update[offline.AT_USE_SPLIT].why_not
    assert "no leaf is stacked" in every_update[offline.WHOLE_LAYERS].why_not
    for c in candidates.values():
        assert c.xla is not None and c.xla.compiled is not None, c.why_not
        analysis = c.xla.compiled.memory_analysis()
        expected = (
            analysis.argument_size_in_bytes
            + analysis.output_size_in_bytes
            + analysis.temp_size_in_bytes
            - analysis.alias_size_in_bytes
        )
        assert c.peak_bytes == expected > 0
        assert c.memory["params_and_state_bytes_per_device"] > 0 and c.cost.iteration_us > 0
    # Sharding the optimizer state holds less per device: Adam's two moments are 2/3 of the state.
    sharded = candidates[offline.STATE_SHARDED]
    assert sharded.memory["params_and_state_bytes_per_device"] < replicated.memory["params_and_state_bytes_per_device"]
    assert sharded.peak_bytes < replicated.peak_bytes
    assert "reduce-scatter" in sharded.xla.text or "all-gather" in sharded.xla.text
    assert replicated.layout is None and sharded.layout is not None
    # Parameters sharded too hold less again: each device keeps 1/8 of parameters and state.
    everything = candidates[offline.ALL_SHARDED]
    held = everything.memory["params_and_state_bytes_per_device"]
    assert held < sharded.memory["params_and_state_bytes_per_device"]
    assert held * 4 < replicated.memory["params_and_state_bytes_per_device"]
    assert everything.layout.gathered and not sharded.layout.gathered
    # ... and XLA:GPU's program gathers them: the parameters arrive sharded.
    assert " all-gather" in everything.xla.text or "all-gather-start" in everything.xla.text
    assert everything.peak_bytes < replicated.peak_bytes


def test_parameters_sharded_read_their_shard_for_the_update_on_xla_gpu(candidates):
    """XLA:GPU's hook rule (`backends.GPU.hook_rules`, as the decorator captures the program): the
    update of a sharded parameter reads its shard, not its own block of the gathered value, so
    that the gathered parameter can die after its last use; the candidates are compiled with it."""
    everything = candidates[offline.ALL_SHARDED]
    assert apply.OWN_BLOCK_OF_ALL_GATHER_RULE in backends.GPU.hook_rules
    applied = {a["rule"] for a in everything.captured().program.rules_applied}  # as the decorator captures it
    assert apply.OWN_BLOCK_OF_ALL_GATHER_RULE in applied
    plain = _compile.compile_program(everything.lowered, None, "plain", None, {}).compiled.memory_analysis()
    with_rule = everything.xla.compiled.memory_analysis()
    assert with_rule.temp_size_in_bytes < plain.temp_size_in_bytes


def test_parameters_gathered_again_for_each_use_trade_all_gathers_for_memory(candidates):
    """The re-gathered update (`offline.REGATHERED`): each reader of a gathered (and
    converted) parameter beyond the first gets its own all-gather at the hook (`sharding.regather`),
    only in this candidate's program (`update.hook_backend`); XLA:GPU then frees each gathered copy
    after its reader (XLA's combiner merges all-gathers, so the compiled module's count says
    little): fewer temporaries, the same parameters and state held."""
    once, again = candidates[offline.ALL_SHARDED], candidates[offline.REGATHERED]
    assert again.layout.regather and not once.layout.regather and again.layout.gathered == once.layout.gathered
    assert apply.REGATHER_RULE not in backends.GPU.hook_rules
    assert apply.REGATHER_RULE in update.hook_backend(backends.GPU, again.layout).hook_rules
    assert again.to_json(None)["leaves"] == once.to_json(None)["leaves"]
    assert again.layout.to_json()["regather"] and "regather" not in once.layout.to_json()
    assert again.memory["params_and_state_bytes_per_device"] == once.memory["params_and_state_bytes_per_device"]
    assert again.memory["temp_size_in_bytes"] < once.memory["temp_size_in_bytes"]
    assert again.peak_bytes < once.peak_bytes
    # Its own program at the hook: captured with the rule, the rule recorded where it applied.
    assert apply.REGATHER_RULE in {a["rule"] for a in again.captured().program.rules_applied}
    assert apply.REGATHER_RULE not in {a["rule"] for a in once.captured().program.rules_applied}


def test_a_limit_between_the_replicated_and_the_sharded_peak_gives_a_plan_that_fits(gpt_step, candidates, tmp_path):
    step, args = gpt_step
    replicated = candidates[offline.REPLICATED]
    smallest = min(candidates.values(), key=lambda c: c.peak_bytes)
    limit = (replicated.peak_bytes + smallest.peak_bytes) // 2
    plan = offline.plan_for_target(
        step,
        *args,
        memory_limit_bytes=limit,
        plan_dir=tmp_path,
        config=SearchConfig(budget_s=1.0),
        ranked=1,
        weight_updates=list(candidates.values()),  # compiled once, by the fixture
        schedule=False,  # the weight update's choice alone (tests/test_schedule_options.py: the schedule's)
    )
    decided = plan.weight_update
    chosen = candidates[decided["chosen"]]
    assert decided["chosen"] != offline.REPLICATED and decided["mode"] == "sharded"
    assert chosen.peak_bytes <= limit < replicated.peak_bytes
    records = {r["label"]: r for r in decided["candidates"]}
    assert records[offline.REPLICATED]["within_limit"] is False
    assert records[decided["chosen"]]["within_limit"] is True
    assert records[decided["chosen"]]["footprint_bytes"] == chosen.peak_bytes
    assert all(r["compiled_us"] > 0 for r in records.values())
    # The plan is the chosen program's (its fingerprint), costed as compiled.
    assert plan.fingerprint == chosen.captured().program.graph.fingerprint
    assert plan.simulated["plan"]["compiled_us"] > 0 and decided["leaves"]
    assert plan.search["offline"]["seconds"]["capture"] > 0
    # The program the plan runs (XLA's, or a fusion plan's rewritten one) fits as compiled.
    ranked = {r["label"]: r for r in plan.search["offline"]["ranked"]}
    assert ranked[plan.search["offline"]["chosen"]]["footprint_bytes"] <= limit
    # The replicated program's plan (what the decorator looks up first) holds the decision.
    machine = plan.machine
    found, _ = _plan.find_plan(replicated.captured().program.graph.fingerprint, machine, tmp_path)
    assert found is not None and found.use_default and found.weight_update["program"] == plan.fingerprint
    assert found.weight_update["chosen"] == decided["chosen"]


def test_the_limit_decides_between_the_sharded_updates(candidates):
    """Under a limit only the smallest update meets, it is chosen whatever it costs."""
    smallest = min(candidates.values(), key=lambda c: c.peak_bytes)
    others = [c.peak_bytes for c in candidates.values() if c is not smallest]
    assert smallest.peak_bytes < min(others)
    decided = offline.choose_weight_update(list(candidates.values()), smallest.peak_bytes)
    assert decided["chosen"] == smallest.label and decided["forced"]
    assert [r["within_limit"] for r in decided["candidates"]].count(True) == 1


def test_no_plan_when_nothing_fits_and_the_smallest_peak_is_named(candidates):
    smallest = min(candidates.values(), key=lambda c: c.peak_bytes)
    with pytest.raises(offline.NothingFits, match=f"{smallest.label}'s, {smallest.peak_bytes} bytes"):
        offline.choose_weight_update(list(candidates.values()), smallest.peak_bytes - 1)
    # Without pressure, the cheapest update as compiled is chosen, whichever it is.
    decided = offline.choose_weight_update(list(candidates.values()), 1 << 40)
    cheapest = min(candidates.values(), key=lambda c: c.cost.iteration_us)
    assert decided["chosen"] == cheapest.label and not decided["forced"]


def test_without_a_limit_the_weight_update_is_the_cheapest_as_compiled(gpt_step, candidates, tmp_path):
    """`weight_update=True` chooses the update without a memory limit too: every candidate fits,
    the cheapest compiled program is the plan's, and two updates compiled alike read as one
    program (`same_program_as`)."""
    step, args = gpt_step
    twin = dataclasses.replace(candidates[offline.STATE_SHARDED], label="the same update again")
    decided = offline.choose_weight_update([*candidates.values(), twin], None)
    cheapest = min(candidates.values(), key=lambda c: c.cost.iteration_us)
    assert decided["chosen"] == cheapest.label and decided["memory_limit_bytes"] is None
    records = {r["label"]: r for r in decided["candidates"]}
    assert all(r["within_limit"] is None for r in records.values())
    assert records[twin.label]["same_program_as"] == offline.STATE_SHARDED
    assert [r["label"] for r in records.values() if r["same_program_as"] is None] == list(candidates)
    plan = offline.plan_for_target(
        step,
        *args,
        plan_dir=tmp_path,
        config=SearchConfig(budget_s=1.0),
        ranked=1,
        weight_updates=list(candidates.values()),
        schedule=False,
        weight_update=True,
    )
    assert plan.weight_update["chosen"] == cheapest.label
    assert plan.fingerprint == cheapest.captured().program.graph.fingerprint
