"""`weight_update="search"` (the default): the per-parameter-group choice between the replicated
and the sharded weight update, by the simulator (which puts the sharded update's all-gathers and
reduce-scatters on the communication channel), within a per-device memory limit, stored in the
replicated program's plan and enacted from it."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from test_sharded_update import FAST, flax_adam_step, train

from disco_jax import _plan, _strategy, _validate, backends, optimize_distributed, targets, zoo
from disco_jax._compile import capture, capture_program
from disco_jax._device_timing import measure_scatter_gather_cost
from disco_jax.cost import AllReduceCostModel, sharded
from disco_jax.cost.allreduce import collective_ops, collective_time_us, communication_bytes, transfer_bytes
from disco_jax.cost.simulator import simulate
from disco_jax.eval import clusters
from disco_jax.sharding import apply, choice, update


def parameters_gathered(report, text: str) -> int:
    """The parameters a compiled sharded step all-gathers: its all-gathers, a grouped one
    (`grouped_all_gather`, applied at the hook on XLA:CPU) counting once per parameter it gathers."""
    grouped = [a for a in report.rules_applied if a["rule"] == "grouped_all_gather"]
    return update.collectives(text)["all-gather"] + sum(len(a["at"]) - 1 for a in grouped)


def layout_of(step, params, opt_state, batch):
    args = (params, opt_state, *batch)
    layout, _ = update.find_layout(step, args, {}, args, {}, [x.sharding for x in jax.tree.leaves(args)])
    return layout, args


def test_a_parameters_moments_form_one_group():
    step, params, opt_state, batches = flax_adam_step()
    layout, args = layout_of(step, params, opt_state, batches[0])
    paths = [[layout.paths[i] for i in g] for g in layout.groups]
    assert len(paths) == 5  # the five parameters with a dimension 8 divides
    for group in paths:  # mu and nu of one parameter
        assert len(group) == 2 and group[0].replace(".mu[", ".nu[") == group[1]
    sub = layout.subset(layout.groups[0])
    assert set(sub.inputs) == set(layout.groups[0]) and sub.groups == (layout.groups[0],)
    assert len(sub.outputs) == 2  # the two moments' new values; the parameter stays replicated


def test_update_leaf_groups_join_leaves_that_meet_in_an_output():
    origins = [frozenset({0, 1, 5}), frozenset({1}), frozenset({2, 3}), frozenset({4})]
    assert update.leaf_groups(origins, [1, 2, 3, 4, 5]) == ((1, 5), (2, 3), (4,))


def test_leaf_sets_under_a_limit_shard_the_largest_groups_first():
    step, params, opt_state, batches = flax_adam_step()
    layout, args = layout_of(step, params, opt_state, batches[0])
    held = {i: jax.typeof(x) for i, x in enumerate(jax.tree.leaves(args))}
    assert choice.leaf_sets(layout, held, None, 10**6) == [
        (),
        tuple(i for g in sorted(layout.groups, key=lambda g: -layout.subset(g).state_bytes(held)) for i in g),
    ]
    biggest = max(layout.groups, key=lambda g: layout.subset(g).state_bytes(held))
    saved = layout.subset(biggest).state_bytes(held) * 7
    sets = choice.leaf_sets(layout, held, 10**6 - saved, 10**6)
    assert len(sets) == 3 and set(sets[1]) == set(biggest)
    assert len(choice.leaf_sets(layout, held, 10**6 + 1, 10**6)) == 2  # fits replicated: no prefix


def test_other_collectives_cost_half_an_allreduce_line_or_their_measured_line():
    line = AllReduceCostModel(per_byte_us=2.0, latency_us=10.0)
    assert collective_time_us(line, "all-reduce", 100) == 210.0
    assert collective_time_us(line, "done", 0) == 0.0  # an async collective's second half
    assert collective_time_us(line, "all-gather", 100) == collective_time_us(line, "reduce-scatter", 100) == 110.0
    measured = AllReduceCostModel(per_byte_us=2.0, latency_us=10.0, scatter_gather=(0.5, 40.0))
    assert collective_time_us(measured, "all-gather", 100) == 90.0
    assert AllReduceCostModel.from_json(measured.to_json()) == measured
    # A datasheet cluster (cluster A) has no reduce-scatter of its own: half its all-reduce line.
    ring = clusters.get_cluster("clusterA-12x1080Ti").allreduce_model()
    nbytes = 64 << 20
    half = ring.time_us(0) + (ring.time_us(nbytes) - ring.time_us(0)) / 2
    assert collective_time_us(ring, "reduce-scatter", nbytes) == pytest.approx(half)
    # The H100 clusters' reduce-scatter is fitted to its own nccl-tests table.
    fitted = clusters.get_cluster("8xH100-NVLink").allreduce_model()
    assert collective_time_us(fitted, "reduce-scatter", nbytes) == fitted.collective_time_us("reduce-scatter", nbytes)


def test_the_simulator_puts_the_sharded_updates_all_gathers_on_the_channel():
    step, params, opt_state, batches = flax_adam_step()
    default = step.lower(params, opt_state, *batches[0]).compile()
    layout, args = layout_of(step, params, opt_state, batches[0])
    lowered, _ = update.relower(step, layout, args, {}, (args, {}), default)
    program = capture(lowered, backends.CPU, args, {}).program
    graph = program.graph
    gathers = {o: c for o, c in collective_ops(graph).items() if c[0] == "all-gather"}
    param_bytes = sorted(x.nbytes for x in jax.tree.leaves(params) if x.shape[0] % 8 == 0)
    assert sorted(nbytes for _, nbytes in gathers.values()) == param_bytes

    class Zero:
        def estimate(self, graph, kernels):
            return [0.0] * len(kernels)

    # XLA's plan: one bucket. The hook reduce-scatters its five split gradients (one collective at
    # the scatter/gather line) and keeps the loss and the 4-wide bias in the all-reduce (the line's
    # 7 us); the five all-gathers are one group: one latency.
    strategy = _strategy.xla_default(graph)
    (bucket,) = strategy.buckets
    assert len(sharded.scattered_gradients(program)) == len(gathers) == 5 < len(bucket)
    assert len(sharded.grouped_gathers(program)) == len(gathers) - 1
    cheap = simulate(program, strategy, Zero(), AllReduceCostModel(0.0, 7.0, scatter_gather=(0.0, 1.0)))
    dear = simulate(program, strategy, Zero(), AllReduceCostModel(0.0, 7.0, scatter_gather=(0.0, 1000.0)))
    assert cheap.comm_us == pytest.approx(7.0 + 1.0 + 1.0)
    assert dear.comm_us == pytest.approx(7.0 + 1000.0 + 1000.0)
    assert dear.iteration_us >= 2000.0
    assert any(
        lane == "comm" and "all-gather" in label
        for lane, label, *_ in simulate(program, strategy, Zero(), AllReduceCostModel(0.0, 7.0), record=True).events
    )


def test_scatter_gather_line_is_measured_on_the_devices():
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("all",))
    (per_byte, latency), points = measure_scatter_gather_cost(
        mesh, sizes_bytes=(4096, 1 << 16, 1 << 20), repeats=2, rounds=1, chain=1
    )
    assert per_byte >= 0 and latency >= 0 and [b for b, _ in points] == [4096, 1 << 16, 1 << 20]


def test_search_simulates_both_updates_and_records_state_bytes(tmp_path):
    step, params, opt_state, batches = flax_adam_step()
    _, _, reference = train(step, params, opt_state, batches)
    run = optimize_distributed(search=True, plan_dir=tmp_path, **FAST)(step)  # weight_update="search"
    _, new_state, losses = train(run, params, opt_state, batches)
    info = run.reports[0].weight_update
    # Replicated and all five groups sharded; between them, the search's own pick when it shards
    # fewer gradients (which it picks rests on the measured collectives: it may be none).
    labels = [c["label"] for c in info["candidates"]]
    assert info["requested"] == "search" and labels[0] == "replicated" and labels[-1] == "sharded (5 groups, 10 leaves)"
    assert len(labels) <= 3 and all(c["leaves"] and len(c["leaves"]) < 10 for c in info["candidates"][1:-1])
    replicated, sharded = info["candidates"][0], info["candidates"][-1]
    state_bytes = sum(x.nbytes for x in jax.tree.leaves((opt_state[0].mu, opt_state[0].nu)) if x.shape[0] % 8 == 0)
    assert replicated["state_bytes_per_device"] == state_bytes and sharded["state_bytes_per_device"] == state_bytes // 8
    # Five split parameters, one bucket: one reduce-scatter and one all-gather (the hook's rules).
    assert sharded["collectives"]["all-gather"] == sharded["collectives"]["reduce-scatter"] == 1
    assert replicated["collectives"]["all-gather"] == replicated["collectives"]["reduce-scatter"] == 0
    assert sharded["footprint_bytes"] < replicated["footprint_bytes"]
    assert replicated["simulated_us"] > 0 and sharded["simulated_us"] > 0
    # Measured against the replicated update exactly when the simulator prefers it.
    for c in info["candidates"][1:]:
        assert ("check" in c) == (c["simulated_us"] < replicated["simulated_us"])
    assert "check" not in replicated and "measured" not in replicated
    sharded_state = [x for x in jax.tree.leaves(new_state[0].mu) if not x.sharding.is_fully_replicated]
    assert bool(sharded_state) == (info["mode"] == "sharded")  # the step runs what was decided
    np.testing.assert_allclose(losses, reference, rtol=1e-5, atol=1e-7)


def test_a_memory_limit_shards_the_largest_groups_and_enactment_reuses_the_decision(tmp_path):
    step, params, opt_state, batches = flax_adam_step()
    _, _, reference = train(step, params, opt_state, batches)
    run = optimize_distributed(search=True, plan_dir=tmp_path, memory_limit_bytes=120_000, **FAST)(step)
    _, new_state, losses = train(run, params, opt_state, batches)
    info = run.reports[0].weight_update
    replicated = info["candidates"][0]
    assert replicated["footprint_bytes"] > 120_000 and replicated["within_limit"] is False
    assert info["mode"] == "sharded", info["reason"]
    assert "memory limit" in info["reason"] or "faster" in info["reason"]
    # The largest groups (Dense_0 and Dense_1's kernels: mu and nu) are what the limit needs; a
    # candidate sharding more (the biases, Dense_2) may be chosen when measured faster.
    chosen = next(c for c in info["candidates"] if c["leaves"] == sorted(info["leaves"]))
    assert chosen["footprint_bytes"] <= 120_000
    adam = new_state[0]
    for name in ("Dense_0", "Dense_1"):
        for moment in ("mu", "nu"):
            assert any(f"{moment}['params']['{name}']['kernel']" in p for p in info["leaves"])
        assert adam.mu["params"][name]["kernel"].sharding.spec == P("data")
    for name in ("Dense_0", "Dense_1", "Dense_2"):
        for part in ("kernel", "bias"):
            chosen_leaf = any(f"mu['params']['{name}']['{part}']" in p for p in info["leaves"])
            assert adam.mu["params"][name][part].sharding.is_fully_replicated != chosen_leaf
    # The sharded program's own search costs its all-gathers at the line the choice measured.
    line = run.reports[0].search["cost_model"]["allreduce"]["scatter_gather"]
    assert line == {k: info["scatter_gather"][k] for k in ("per_byte_us", "latency_us")}
    text = run.executable(params, opt_state, *batches[0]).as_text()
    # The plan is in the compiled module: one parameter gathered per sharded (mu, nu) pair.
    assert parameters_gathered(run.last_report, text) == len(info["leaves"]) // 2
    np.testing.assert_allclose(losses, reference, rtol=1e-5, atol=1e-7)

    args = (params, opt_state, *batches[0])
    replicated_program = capture(step.lower(*args), backends.CPU, args, {})
    decision, _ = _plan.find_plan(replicated_program.graph.fingerprint, replicated_program.machine, tmp_path)
    assert decision is not None and decision.use_default and decision.weight_update["program"] == info["program"]

    enacting = optimize_distributed(search=False, plan_dir=tmp_path, memory_limit_bytes=120_000, **FAST)(step)
    _, enacted_state, enacted = train(enacting, params, opt_state, batches)
    assert enacting.reports[0].weight_update["leaves"] == info["leaves"]
    assert enacting.reports[0].fingerprint == info["program"]
    assert enacted_state[0].mu["params"]["Dense_0"]["kernel"].sharding.spec == P("data")
    np.testing.assert_allclose(enacted, reference, rtol=1e-5, atol=1e-7)

    # Under the limit the replicated update exceeds, every candidate within it was measured.
    within = [c for c in info["candidates"] if c["footprint_bytes"] <= 120_000]
    assert within and all("check" in c for c in within)
    assert all("check" not in c for c in info["candidates"] if c["footprint_bytes"] > 120_000)
    # A tighter limit than the stored choice needs: chosen again from the recorded candidates,
    # among those measured only, with a warning.
    tighter = chosen["footprint_bytes"] - 1
    enacting = optimize_distributed(search=False, plan_dir=tmp_path, memory_limit_bytes=tighter, **FAST)(step)
    with pytest.warns(_plan.PlanWarning, match="chosen again"):
        _, again_state, again_losses = train(enacting, params, opt_state, batches)
    again = enacting.reports[0].weight_update
    picked = next(c for c in info["candidates"] if c["leaves"] == sorted(again["leaves"]))
    assert "measured" in picked
    if any("measured" in c and c["footprint_bytes"] <= tighter for c in info["candidates"]):
        assert picked["footprint_bytes"] <= tighter
    assert again["stored_memory_limit_bytes"] == 120_000 and again["memory_limit_bytes"] == tighter
    # The returned state is sharded as the new choice says, and its program gathers one parameter
    # per sharded (mu, nu) pair.
    assert sum(not x.sharding.is_fully_replicated for x in jax.tree.leaves(again_state)) == len(picked["leaves"])
    text = enacting.executable(params, opt_state, *batches[0]).as_text()
    assert parameters_gathered(enacting.last_report, text) == len(picked["leaves"]) // 2
    np.testing.assert_allclose(again_losses, reference, rtol=1e-5, atol=1e-7)

    # No limit: a sharding only the old limit forced gives way to the replicated update; one
    # measured faster stays.
    free = optimize_distributed(search=False, plan_dir=tmp_path, **FAST)(step)
    if info["forced"]:
        with pytest.warns(_plan.PlanWarning, match="chosen again"):
            _, free_state, free_losses = train(free, params, opt_state, batches)
        assert free.reports[0].weight_update["mode"] == "replicated"
        assert free_state[0].mu["params"]["Dense_0"]["kernel"].sharding.is_fully_replicated
    else:
        _, free_state, free_losses = train(free, params, opt_state, batches)
        assert sorted(free.reports[0].weight_update["leaves"]) == sorted(info["leaves"])
    np.testing.assert_allclose(free_losses, reference, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("value", [0, -5, 1.5, "1GB", True])
def test_bad_memory_limits_raise(value):
    with pytest.raises(ValueError, match="memory_limit_bytes must be a positive integer"):
        optimize_distributed(memory_limit_bytes=value)


def _timed(ratio: float, pairs: int = 20) -> dict:
    """A candidate's `measured` record: every pair at `ratio` of the replicated step's time."""
    return _validate.summarize([1000.0] * pairs, [1000.0 * ratio] * pairs).to_json()


def _record(leaves: list[str], footprint: int, ratio: float | None = None, simulated: float = 1.0) -> dict:
    """A recorded candidate (`Candidate.to_json`'s fields `pick` reads); `ratio`: measured at it."""
    record = {"label": f"{len(leaves)} leaves", "leaves": leaves, "footprint_bytes": footprint}
    record["simulated_us"] = simulated
    if ratio is not None:
        record.update(check={"within_tolerance": True}, measured=_timed(ratio))
    return record


def test_pick_takes_the_fastest_measured_faster_else_the_replicated_update_else_what_the_limit_leaves():
    replicated = _record([], 1000)
    a, b = _record(["a"], 600, ratio=0.8), _record(["a", "b"], 400, ratio=0.7)
    index, why, forced = choice.pick([replicated, a, b], None)
    assert index == 2 and not forced and "faster with confidence" in why
    slower = [replicated, _record(["a"], 600, ratio=1.2), _record(["a", "b"], 400, ratio=1.1)]
    assert choice.pick(slower, None)[0] == 0
    assert choice.pick(slower, 1500)[0] == 0
    index, why, forced = choice.pick(slower, 800)  # the replicated update exceeds it
    assert index == 2 and forced and "only kind within the memory limit" in why
    assert choice.pick(slower, 500)[0] == 2  # only the smaller fits


def test_pick_never_chooses_a_candidate_that_was_not_measured():
    replicated = _record([], 1000)
    unmeasured = _record(["a", "b"], 400, simulated=0.1)  # fits and simulates fastest
    failed = {**_record(["a"], 500), "check": {"within_tolerance": False}}  # outputs differed: not timed
    index, why, forced = choice.pick([replicated, failed, unmeasured], 800)
    assert index == 0 and not forced and "no sharded candidate was measured" in why
    measured = _record(["b"], 900, ratio=1.3)
    index, why, forced = choice.pick([replicated, failed, unmeasured, measured], 800)
    assert index == 3 and forced and "no measured candidate fits" in why  # the measured one that needs least
    index, why, forced = choice.pick([replicated, failed, unmeasured, measured], 950)
    assert index == 3 and forced and "only kind within the memory limit" in why


def _decision(mode_leaves: list[str], limit: int | None, candidates: list[dict], forced: bool) -> dict:
    return {
        "mode": "sharded" if mode_leaves else "replicated",
        "leaves": {path: True for path in mode_leaves},
        "forced": forced,
        "candidates": candidates,
        "memory_limit_bytes": limit,
    }


def test_rechoose_keeps_a_measured_choice_within_the_new_limit_without_a_warning(recwarn):
    candidates = [_record([], 1000), _record(["a"], 600, ratio=0.8), _record(["a", "b"], 400)]
    again = choice.rechoose(_decision(["a"], None, candidates, forced=False), 700)
    assert again["mode"] == "sharded" and list(again["leaves"]) == ["a"] and not again["forced"]
    assert again["stored_memory_limit_bytes"] is None and again["memory_limit_bytes"] == 700
    assert not [w for w in recwarn if issubclass(w.category, _plan.PlanWarning)]


def test_rechoose_falls_back_only_to_measured_candidates_or_the_replicated_update():
    # Forced by the old limit (measured slower): without a limit the replicated update returns.
    candidates = [_record([], 1000), _record(["a"], 600, ratio=1.2), _record(["a", "b"], 400, simulated=0.1)]
    with pytest.warns(_plan.PlanWarning, match="chosen again"):
        again = choice.rechoose(_decision(["a"], 700, candidates, forced=True), None)
    assert again["mode"] == "replicated" and not again["leaves"]
    # A limit the stored choice exceeds: the unmeasured candidate that fits is not taken; the
    # stored choice (measured, the one that needs least of those measured) stays, with a warning.
    with pytest.warns(_plan.PlanWarning, match="no measured candidate fits"):
        again = choice.rechoose(_decision(["a"], 700, candidates, forced=True), 500)
    assert list(again["leaves"]) == ["a"]
    # A measured candidate that fits is taken.
    candidates[2] = _record(["a", "b"], 400, ratio=1.1)
    with pytest.warns(_plan.PlanWarning, match="chosen again"):
        again = choice.rechoose(_decision(["a"], 700, candidates, forced=True), 500)
    assert sorted(again["leaves"]) == ["a", "b"] and again["forced"]


def test_rechoose_carries_the_regathered_choice_and_warns_when_only_that_changes():
    # Two records of the same leaves: gathered once (700 bytes) and gathered again for each use (500).
    once, again = _record(["a", "b"], 700, ratio=0.9), {**_record(["a", "b"], 500, ratio=1.1), "regather": True}
    candidates = [_record([], 1000), once, again]
    with pytest.warns(_plan.PlanWarning, match="chosen again"):
        tighter = choice.rechoose(_decision(["a", "b"], 800, candidates, forced=True), 600)
    assert tighter["regather"] and sorted(tighter["leaves"]) == ["a", "b"] and tighter["forced"]
    stored = {**_decision(["a", "b"], 600, candidates, forced=True), "regather": True}
    with pytest.warns(_plan.PlanWarning, match="chosen again"):
        looser = choice.rechoose(stored, 800)  # the faster one gathered once fits again
    assert "regather" not in looser and sorted(looser["leaves"]) == ["a", "b"]


@pytest.fixture
def prefers_sharded(monkeypatch):
    """The simulator made to prefer every sharded candidate to the replicated update (on XLA:CPU it
    prefers the replicated one for the tests' step) and the acceptance rule's timing replaced by a
    verdict the test sets (`verdict["ratio"]`); records which programs were timed."""
    timed: list[str] = []
    verdict = {"ratio": 0.5}

    def simulated_us(model, program):
        return 10.0 if update.collectives(program.default_compiled.as_text())["all-gather"] else 20.0

    def time_candidate(replicated, candidate, pairs, merge):
        timed.append(candidate.graph.fingerprint)
        return _validate.summarize([1000.0] * 20, [1000.0 * verdict["ratio"]] * 20)

    monkeypatch.setattr(choice, "simulated_us", simulated_us)
    monkeypatch.setattr(choice, "time_candidate", time_candidate)
    return timed, verdict


def test_a_sharded_update_the_simulator_prefers_is_measured_and_a_new_limit_never_takes_an_unmeasured_one(
    tmp_path, prefers_sharded
):
    timed, verdict = prefers_sharded
    step, params, opt_state, batches = flax_adam_step()
    _, _, reference = train(step, params, opt_state, batches)
    # No memory limit, the simulator prefers the sharded update, it measures slower: replicated.
    verdict["ratio"] = 1.3
    run = optimize_distributed(search=True, plan_dir=tmp_path, **FAST)(step)
    _, new_state, losses = train(run, params, opt_state, batches)
    info = run.reports[0].weight_update
    replicated, *sharded = info["candidates"]
    assert len(timed) == len(sharded) >= 1 and "measured" not in replicated
    assert all(c["measured"]["verdict"] == "slower" and c["check"]["within_tolerance"] for c in sharded)
    assert info["mode"] == "replicated" and "none measured faster" in info["reason"]
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(new_state))
    np.testing.assert_allclose(losses, reference, rtol=1e-5, atol=1e-7)

    # Enacted under a limit the replicated update exceeds: chosen again among the measured
    # candidates, measuring nothing, with a warning.
    limit = max(c["footprint_bytes"] for c in sharded)
    assert replicated["footprint_bytes"] > limit
    enacting = optimize_distributed(search=False, plan_dir=tmp_path, memory_limit_bytes=limit, **FAST)(step)
    with pytest.warns(_plan.PlanWarning, match="chosen again"):
        _, enacted_state, enacted = train(enacting, params, opt_state, batches)
    again = enacting.reports[0].weight_update
    assert again["mode"] == "sharded" and again["forced"] and again["stored_memory_limit_bytes"] is None
    assert sorted(again["leaves"]) in [c["leaves"] for c in sharded] and len(timed) == len(sharded)
    assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(enacted_state))
    np.testing.assert_allclose(enacted, reference, rtol=1e-5, atol=1e-7)

    # A search run under that limit measures again; measured faster, the sharded update is chosen
    # for its speed, not forced.
    verdict["ratio"] = 0.5
    searching = optimize_distributed(search=True, plan_dir=tmp_path, memory_limit_bytes=limit, **FAST)(step)
    _, new_state, losses = train(searching, params, opt_state, batches)
    info = searching.reports[0].weight_update
    assert len(timed) > len(sharded) and info["memory_limit_bytes"] == limit
    assert info["mode"] == "sharded" and not info["forced"] and "faster with confidence" in info["reason"]
    chosen = next(c for c in info["candidates"] if c["leaves"] == sorted(info["leaves"]))
    assert chosen["measured"]["ratio"] == 0.5 and chosen["measured"]["ratio_ci95"] == [0.5, 0.5]
    assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(new_state))
    np.testing.assert_allclose(losses, reference, rtol=1e-5, atol=1e-7)


def test_on_xla_gpu_the_sharded_update_reduce_scatters_and_sends_what_the_replicated_one_does():
    """Deviceless XLA:GPU (8 H100s): the sharded update's gradients are all-reduces only
    dynamic-sliced at the hook, which XLA:GPU makes reduce-scatters; the simulator counts their
    transfer as such, and a ring sends as many bytes as the replicated step's all-reduce."""
    spec, opt, mesh = zoo.get_model("mlp", "tiny"), optax.adam(1e-3), targets.mesh("h100-sxm", 8)
    args = zoo.abstract_state_and_batch(spec, opt, mesh)
    step = zoo.build_train_step(spec, opt, mesh, "jit")
    replicated, compiled = capture_program(step.lower(*args), backends.GPU)
    layout, _ = update.find_layout(step, args, {}, args, {}, jax.tree.leaves(compiled.input_shardings))
    lowered, _ = update.relower(step, layout, args, {}, (args, {}), compiled)
    sharded, sharded_compiled = capture_program(lowered, backends.GPU)
    assert update.collectives(sharded_compiled.as_text())["reduce-scatter"] >= 1
    # XLA:GPU forms the reduce-scatters itself: the hook applies none of the rules its own would
    # match (its one hook rule, own_block_of_all_gather, has no gathered parameter here).
    assert apply.REDUCE_SCATTER_RULE not in backends.GPU.hook_rules and sharded.rules_applied == ()
    assert len(apply.scatterable(sharded.graph.module)) == len(layout.groups)
    scattered = [g for g, moved in zip(sharded.graph.gradients, transfer_bytes(sharded)) if moved < g.nbytes]
    assert len(scattered) == len(layout.groups)  # one per sharded parameter
    assert all(moved == g.nbytes for g, moved in zip(replicated.graph.gradients, transfer_bytes(replicated)))
    before, after = communication_bytes(replicated, 8), communication_bytes(sharded, 8)
    assert after["reduce-scatter"] > 0 and after["all-gather"] == pytest.approx(after["reduce-scatter"])
    assert after["total"] == pytest.approx(before["total"])
