"""The mesh and layout search on compiled programs (`layout_search`), deviceless for 8 H100s: a
tiny scanned GPT's plans lowered on their meshes, compiled by XLA:GPU, costed by the compiled-
program model with collectives per replica group (`eval.clusters.GroupedCollectives`), their
peaks from XLA's memory analysis; plans that compile to one program are costed once; the choice
respects the memory limit. The graph simulator's step time of each distinct program against its
compiled cost (`eval.layout_ranks`) and the rank correlations between them (`eval.ranks`)."""

import dataclasses
import math

import optax
import pytest

from disco_jax import cost, layout_search, targets, zoo
from disco_jax.eval import clusters, handwritten, layout_ranks, ranks
from disco_jax.sharding import constrain, mesh_step, operators

GPT = {
    "d_model": 128,
    "num_heads": 8,
    "num_layers": 2,
    "seq_len": 64,
    "vocab_size": 256,
    "compute_dtype": "bfloat16",
    "scan_layers": True,
}


def test_a_collective_over_part_of_the_cluster_costs_its_group():
    node = clusters.get_cluster("8xH100-NVLink").grouped_collectives()
    nbytes = 64 << 20
    whole, four = node.for_group(range(8)), node.for_group((0, 1, 2, 3))
    assert whole is node.whole
    assert four.collective_time_us("all-reduce", nbytes) < whole.collective_time_us("all-reduce", nbytes)
    four_nodes = clusters.get_cluster("4x8xH100-IB400").grouped_collectives()
    across, inside = four_nodes.for_group((0, 8, 16, 24)), four_nodes.for_group((0, 1, 2, 3))
    # The same 4 GPUs, over InfiniBand rather than NVLink: slower.
    assert across.collective_time_us("all-reduce", nbytes) > inside.collective_time_us("all-reduce", nbytes)


@pytest.fixture(scope="module")
def tiny():
    spec, optimizer = zoo.resized("gpt", "paper", **GPT), optax.adamw(1e-3)
    mesh = targets.mesh("h100-sxm", 8)
    step = zoo.build_train_step(spec, optimizer, mesh, "jit", donate=True)
    args = zoo.abstract_state_and_batch(spec, optimizer, mesh)
    return step, args, mesh_step.structure(step, args)


@pytest.fixture(scope="module")
def searched(tiny):
    step, args, found = tiny
    plans = [
        operators.OperatorPlan(8, 1, {"blocks": "replicated", "Embed": "replicated"}),
        operators.OperatorPlan(8, 1, {"blocks": "tp", "Embed": "tp"}),  # no model axis: the same program
        operators.OperatorPlan(2, 4, {"blocks": "fsdp_tp_sp", "Embed": "fsdp_tp"}),
    ]
    cluster = clusters.node_of("h100-sxm", 8)
    free = layout_search.search_layouts(step, args, found, cluster, None, plans, say=None)
    smallest = min(c.peak_bytes for c in free.candidates)
    return found, plans, free, free.within(smallest), smallest


def test_candidates_are_compiled_costed_deduplicated_and_the_limit_respected(searched):
    found, plans, free, tight, smallest = searched
    replicated, no_model_axis, two_d = free.candidates
    assert all(c.cost is not None and c.peak_bytes > 0 for c in free.candidates)
    assert replicated.fingerprint == no_model_axis.fingerprint != two_d.fingerprint
    assert no_model_axis.plan.label in replicated.same_program
    assert two_d.peak_bytes < replicated.peak_bytes  # FSDP x TP holds 1/8 of parameters and state
    assert free.chosen is not None and free.chosen.iteration_us == min(
        c.iteration_us for c in free.candidates if not c.same_program or c is replicated
    )
    assert tight.chosen is not None and tight.chosen.peak_bytes <= smallest
    assert tight.chosen.plan == plans[2]
    record = tight.to_json(found)
    assert (
        record["chosen"]["mesh"] == {"data": 2, "model": 4}
        and "row_parallel_dot" in record["chosen"]["layout"]["rules"]
    )
    assert "distinct programs" in tight.reason


def test_collectives_of_a_two_dimensional_program_are_costed_for_their_groups(searched):
    _, _, free, _, _ = searched
    program = free.candidates[2].program
    # The program's collectives carry their groups: 4 (the model axis) and 2 (the data axis).
    sizes = {len(k.group) for k in program.collectives if k.group}
    assert {2, 4} <= sizes, sizes
    cluster = clusters.node_of("h100-sxm", 8)
    grouped = cost.cost_program(program, cluster.kernel_estimator(), cluster.grouped_collectives())
    whole = cost.cost_program(program, cluster.kernel_estimator(), cluster.allreduce_model())
    assert grouped.comm_us < whole.comm_us  # groups of 2 and 4 move less than all 8 would


def test_candidate_plans_cover_every_mesh_shape_and_choose_for_the_blocks_first(searched):
    found = searched[0]
    assert layout_search.dot_groups(found) == ["blocks", "Embed"]
    plans = layout_search.candidate_plans(found, 8)
    assert {(p.data, p.model) for p in plans} == {(8, 1), (4, 2), (2, 4), (1, 8)}
    labels = {p.label for p in plans}
    assert "1x8 Embed: tp, blocks: tp_sp" in labels and "2x4 Embed: fsdp_tp, blocks: fsdp_tp_sp" in labels
    ours = [p for p in plans if isinstance(p, operators.OperatorPlan)]
    assert not any(p.data == 1 and any(operators.uses_fsdp(c) for c in p.choices.values()) for p in ours)
    assert len(labels) == len(plans) == 22 + 5
    hand = [p for p in plans if isinstance(p, handwritten.HandPlan)]
    assert {p.name for p in hand} == {"data parallel", "FSDP", "TP over 8", "data x TP (2x4)", "FSDP x TP (2x4)"}
    assert len(layout_search.candidate_plans(found, 8, hand=False)) == 22


def test_hand_written_configurations_are_candidates_and_never_beaten_by_the_choice(tiny):
    step, args, found = tiny
    cluster = clusters.node_of("h100-sxm", 8)
    # The one-axis configurations and TP over 8 (the two 2x4 ones are listed by
    # `candidate_plans`, test above; compiling them too would add two minutes, not a check).
    hand = [p for p in handwritten.hand_plans(8, 8) if 1 in (p.data, p.model)]
    ours = [
        operators.OperatorPlan(8, 1, {"blocks": "replicated", "Embed": "replicated"}),
        operators.OperatorPlan(4, 2, {"blocks": "fsdp_tp_sp", "Embed": "fsdp_tp"}),
    ]
    free = layout_search.search_layouts(step, args, found, cluster, None, ours + hand, say=None)
    by_label = {c.plan.label: c for c in free.candidates}
    assert all(c.cost is not None and c.peak_bytes > 0 for c in free.candidates), [c.why_not for c in free.candidates]
    # The user's layouts are compiled as written: data parallel all-reduces its gradients and
    # gathers nothing; FSDP all-gathers its parameters.
    dp = by_label["8x1 by hand: data parallel"]
    kinds = {c.plan.label: {k.collective for k in c.program.collectives} for c in free.candidates}
    assert "all-reduce" in kinds[dp.plan.label] and "all-gather" not in kinds[dp.plan.label]
    assert "all-gather" in kinds["8x1 by hand: FSDP"]
    # The user's layouts are enacted: FSDP splits the stacked kernels over "data", TP over "model".
    fsdp, tp = by_label["8x1 by hand: FSDP"], by_label["1x8 by hand: TP over 8"]
    qkv = next(p for p, path in found.parameters.items() if path.endswith("['qkv']['kernel']"))
    assert "data" in fsdp.enacted.input_specs[qkv] and "model" in tp.enacted.input_specs[qkv]
    assert fsdp.peak_bytes < dp.peak_bytes
    hand_costs = [by_label[p.label].iteration_us for p in hand]
    assert free.chosen.iteration_us <= min(hand_costs)
    # Under a limit only the smallest fits: the choice fits it and is no costlier than any hand
    # configuration within it.
    limit = sorted(c.peak_bytes for c in free.candidates)[1]
    tight = free.within(limit)
    fitting = [by_label[p.label] for p in hand if by_label[p.label].peak_bytes <= limit]
    assert tight.chosen is not None and tight.chosen.peak_bytes <= limit
    assert all(tight.chosen.iteration_us <= c.iteration_us for c in fitting)
    assert "by_hand" in tight.to_json(found)["candidates"][len(ours)]


def test_hand_written_configurations_constrain_activations_as_the_flax_guide_writes(tiny):
    # The Flax guide's DotReluDot: the batch over "data" after every dense of the forward pass, a
    # column dense's output split over "model"; nothing on the backward's dots. Without them
    # (`constrained=False`) the user's FSDP of a 1.3B GPT costs 1.56x disco-jax's on 32 GPUs:
    # XLA's partitioner then gathers activations, not weights (docs/operator-parallelism.md).
    step, args, found = tiny
    dots = constrain.dots_reading_parameters(step.__wrapped__, args)
    by_name = {p.name: p for p in handwritten.hand_plans(8, 8)}
    for name, axis, absent in (("FSDP", "data", "model"), ("TP over 8", "model", "data")):
        plan = by_name[name]
        lowered, _, enacted = handwritten.relower(step, args, found, plan)
        rule = handwritten.guide_rule(found, enacted.input_specs, plan.data, plan.model)
        specs = [rule(d) for d in dots]
        forward = [s for s in specs if s is not None]
        assert forward and len(forward) < len(specs)  # the backward's dots are left alone
        assert any(axis in s for s in forward) and not any(absent in s for s in forward)
        bare = dataclasses.replace(plan, constrained=False)
        assert bare.label == plan.label + " (no constraint)"
        bare_text = handwritten.relower(step, args, found, bare)[0].as_text()
        constraints = lowered.as_text().count("sharding_constraint")
        assert constraints >= bare_text.count("sharding_constraint") + len(forward)


def test_meshes_of_32_gpus_keep_the_model_axis_inside_a_node():
    assert operators.mesh_shapes(32, 8) == [(32, 1), (16, 2), (8, 4), (4, 8)]
    assert {(p.data, p.model) for p in handwritten.hand_plans(32, 8)} == {(32, 1), (4, 8), (8, 4)}
    devices = list(targets.mesh("h100-sxm", 32).devices.flat)
    grouped = clusters.get_cluster("4x8xH100-IB400").grouped_collectives()
    for data, model in operators.mesh_shapes(32, 8):
        grid = operators.build_mesh(devices, data, model).devices
        for group in grid:  # one row: the devices of one model-axis group
            ids = [d.id for d in group]
            assert len({i // 8 for i in ids}) == 1, (data, model, ids)
            assert grouped.for_group(ids).nodes == 1
        if data > 1:  # a data-axis group spans the nodes
            assert len({d.id // 8 for d in grid[:, 0]}) == min(4, data)


def test_where_no_plan_fits_the_cheapest_are_compiled_again_with_their_loops_rematerialized(tiny):
    step, args, found = tiny
    plans = [operators.OperatorPlan(8, 1, {"blocks": "fsdp", "Embed": "fsdp"})]
    cluster = clusters.node_of("h100-sxm", 8)
    free = layout_search.search_layouts(step, args, found, cluster, None, plans, say=None)
    limit = free.candidates[0].peak_bytes - 1
    tight = layout_search.search_layouts(step, args, found, cluster, limit, plans, say=None)
    assert [c.plan.remat for c in tight.candidates] == ["", "dots", "full"]
    assert tight.chosen is not None and tight.chosen.plan.remat and tight.chosen.peak_bytes <= limit
    assert tight.to_json()["chosen"]["remat"] == tight.chosen.plan.remat
    # "full" recomputes the dots too: costlier than "dots" (which, at this size, the model costs
    # below the program kept whole: no residual stacked per iteration), so "dots" is the choice.
    dots, full = tight.candidates[1:]
    assert full.iteration_us > dots.iteration_us and tight.chosen is dots


def test_rank_correlations_on_hand_computed_examples():
    # x ranks 0 1 2 3, y ranks 0 2 1 3: d = 0 1 1 0, rho = 1 - 6 * 2 / (4 * 15) = 0.8; of the 6
    # pairs one is discordant, tau = (5 - 1) / 6.
    x, y = [1.0, 2.0, 3.0, 4.0], [10.0, 30.0, 20.0, 40.0]
    assert ranks.spearman(x, y) == pytest.approx(0.8)
    assert ranks.kendall_tau(x, y) == pytest.approx(4 / 6)
    assert ranks.spearman(x, y[::-1]) == pytest.approx(-0.8)
    # Ties share their mean rank: y ranks 0.5 0.5 2, rho = Pearson of (0 1 2) and (0.5 0.5 2).
    assert ranks.spearman([1, 2, 3], [5, 5, 7]) == pytest.approx(math.sqrt(3) / 2)
    # tau-b: 2 concordant pairs, none discordant, one tied in y: 2 / sqrt(3 * 2).
    assert ranks.kendall_tau([1, 2, 3], [5, 5, 7]) == pytest.approx(2 / math.sqrt(6))
    assert ranks.spearman([1, 2], [2, 1]) is None and ranks.kendall_tau([1, 2, 3], [4, 4, 4]) is None


def test_the_graph_simulator_times_each_distinct_program_of_a_search(tiny, searched):
    # The searched plans (two of them one program) and a third program, 1x8 TP: three points.
    step, args, found = tiny
    _, plans, free, _, _ = searched
    cluster = clusters.node_of("h100-sxm", 8)
    tp = layout_search.compile_candidate(
        step, args, found, operators.OperatorPlan(1, 8, {"blocks": "tp", "Embed": "tp"}), cluster
    )
    assert tp.fingerprint not in {c.fingerprint for c in free.candidates}
    result = layout_ranks.layout_ranks(step, args, found, [*free.candidates, tp], cluster, say=None)
    assert [p.label for p in result.points] == [plans[0].label, plans[2].label, tp.plan.label]
    assert result.points[0].same_program == [plans[1].label] and result.not_compiled == 0
    for p, c in zip(result.points, [free.candidates[0], free.candidates[2], tp], strict=True):
        assert p.compiled_us == c.iteration_us
        assert p.why_not is None and p.graph_us is not None, p.why_not
        assert math.isfinite(p.graph_us) and p.graph_us > 0
    compiled, graph = [p.compiled_us for p in result.points], [p.graph_us for p in result.points]
    assert result.spearman == pytest.approx(ranks.spearman(compiled, graph))
    assert result.kendall == pytest.approx(ranks.kendall_tau(compiled, graph))
    assert -1 <= result.spearman <= 1 and -1 <= result.kendall <= 1
    assert 1 <= result.graph_rank_of_compiled_best() <= 3
    record = result.to_json()
    assert record["programs"] == record["simulated"] == 3 and record["left_out"] == 0
