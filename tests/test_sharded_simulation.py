"""The sharded weight update inside the search's strategy (`Strategy.sharded`): update regions of
the replicated graph, how the simulator costs a sharded bucket (`cost.sharded`), the
`shard_update` move, and how the choice ties gradients to the layout's optimizer-state leaves."""

import dataclasses
import random

import jax
import optax
import pytest
from test_sharded_update import flax_adam_step
from test_weight_update_choice import layout_of

from disco_jax import _strategy, backends, targets, zoo
from disco_jax._compile import capture, capture_program
from disco_jax.cost import AllReduceCostModel, AnalyticalEstimator, chain, kernel_state, kernels, sharded, simulate
from disco_jax.cost.allreduce import collective_time_us, transfer_bytes
from disco_jax.eval import clusters
from disco_jax.sharding import state_search, update


@pytest.fixture(scope="module")
def flax_step():
    step, params, opt_state, batches = flax_adam_step()
    layout, args = layout_of(step, params, opt_state, batches[0])
    return capture(step.lower(*args), backends.CPU, args, {}), layout


def all_sharded(graph, shardable):
    return _strategy.sharding_all(_strategy.xla_default(graph), shardable)


def test_update_regions_find_each_gradients_adam_moments(flax_step):
    captured, _ = flax_step
    graph = captured.graph
    regions = sharded.regions_of(graph)
    assert regions.num_shards == 8
    params = [x for x in jax.tree.leaves(captured.args[0]) if x.shape[0] % 8 == 0]
    assert len(regions.shardable) == len(params) == 5  # Dense_2's bias (4 wide) cannot be split
    for g in regions.shardable:
        names = sorted(graph.ops[o].inst.attr("metadata") for o in regions.state[g])
        assert len(names) == 2 and ".mu[" in names[0] and ".nu[" in names[1]
        assert names[0].split(".mu", 1)[1] == names[1].split(".nu", 1)[1]  # one parameter's moments
        assert regions.state_bytes[g] == 2 * graph.gradients[g].nbytes
        assert len(regions.outputs[g]) == 3  # the new parameter, mu and nu
    assert regions.saved_bytes(regions.shardable) == sum(regions.state_bytes[g] for g in regions.shardable) * 7 // 8


def test_a_sharded_bucket_gathers_after_its_update_and_updates_one_nth(flax_step):
    program = flax_step[0].program
    graph = program.graph
    regions = sharded.regions_of(graph)
    estimator, line = chain(AnalyticalEstimator()), AllReduceCostModel(1e-3, 20.0)
    plain = _strategy.xla_default(graph)
    shard = all_sharded(graph, regions.shardable)
    replicated = simulate(program, dataclasses.replace(shard, sharded=frozenset()), estimator, line, record=True)
    split = simulate(program, shard, estimator, line, record=True)
    assert simulate(program, plain, estimator, line) is not None
    gathers = [(a, b) for lane, label, a, b in split.events if label.startswith("all-gather")]
    assert len(gathers) == sum(1 for b in shard.buckets if b[0] in shard.sharded)
    # XLA:CPU reduce-scatters a sharded bucket (the hook's rule, `sharding.apply`): one
    # reduce-scatter per sharded bucket, at the line's scatter cost; the others stay all-reduces.
    assert program.backend.forms_reduce_scatter
    scatters = sorted(b - a for _, label, a, b in split.events if label.startswith("reduce-scatter"))
    per_scatter = [sum(transfer_bytes(program)[g] for g in b) for b in shard.buckets if b[0] in shard.sharded]
    assert scatters == pytest.approx(sorted(line.collective_time_us("reduce-scatter", n) for n in per_scatter))
    gathered = sum(graph.gradients[g].nbytes for g in shard.sharded)
    per_bucket = [sum(graph.gradients[g].nbytes for g in b) for b in shard.buckets if b[0] in shard.sharded]
    assert sum(per_bucket) == gathered
    assert sorted(b - a for a, b in gathers) == pytest.approx(
        sorted(line.collective_time_us("all-gather", n) for n in per_bucket)
    )
    # The update's kernels cost 1/8: the compute saved is 7/8 of what they cost replicated.
    state = kernel_state(program, shard)
    kernels.estimate_missing(graph, [state], estimator)
    update_kernels = [
        k
        for k in state.alive()
        if state.kinds[k] == "group" and all(regions.region_of[o] in shard.sharded for o in state.members[k])
    ]
    assert update_kernels
    saved = sum(state.estimate[k] for k in update_kernels) * 7 / 8
    assert replicated.compute_us - split.compute_us == pytest.approx(saved, rel=1e-6)


def test_on_xla_gpu_a_sharded_bucket_reduce_scatters():
    lowered = zoo.lower_abstract(zoo.get_model("mlp", "tiny"), optax.adam(1e-3), targets.mesh("h100-sxm", 8))
    program, _ = capture_program(lowered, backends.GPU)
    graph = program.graph
    regions = sharded.regions_of(graph)
    assert regions.shardable and regions.num_shards == 8
    shard = all_sharded(graph, regions.shardable)
    line = AllReduceCostModel(1e-3, 20.0)
    sim = simulate(program, shard, chain(AnalyticalEstimator()), line, record=True)
    scatters = [(label, b - a) for lane, label, a, b in sim.events if label.startswith("reduce-scatter")]
    assert len(scatters) == len({b for b in shard.buckets if b[0] in shard.sharded})
    replicated = simulate(program, dataclasses.replace(shard, sharded=frozenset()), chain(AnalyticalEstimator()), line)
    assert sim.comm_us != replicated.comm_us


def test_a_simulated_gpu_cluster_reduce_scatters_on_xla_cpus_graph(flax_step):
    """The report's cluster rows cost XLA:CPU's module for GPU clusters: the cluster's NCCL, not
    the capturing backend, decides that a sharded bucket reduce-scatters."""
    program = flax_step[0].program
    graph = program.graph
    shard = all_sharded(graph, sharded.regions_of(graph).shardable)
    cluster = clusters.get_cluster("clusterA-12x1080Ti").allreduce_model()
    estimator = chain(AnalyticalEstimator())
    sim = simulate(program, shard, estimator, cluster, record=True)
    scatters = sorted(b - a for _, label, a, b in sim.events if label.startswith("reduce-scatter"))
    buckets = [b for b in shard.buckets if b[0] in shard.sharded]
    reduces = [e for e in sim.events if e[1].startswith("all-reduce")]
    assert len(scatters) == len(buckets) and len(reduces) == len(shard.buckets) - len(buckets)
    expected = [
        collective_time_us(cluster, "reduce-scatter", sum(graph.gradients[g].nbytes for g in b)) for b in buckets
    ]
    assert scatters == pytest.approx(sorted(expected))
    # A backend that neither forms reduce-scatters nor applies the rule keeps the all-reduce.
    keeps = dataclasses.replace(program, backend=dataclasses.replace(program.backend, hook_rules=frozenset()))
    plain = simulate(keeps, shard, estimator, AllReduceCostModel(1e-3, 20.0), record=True)
    assert not [e for e in plain.events if e[1].startswith("reduce-scatter")]


def test_the_shard_move_toggles_whole_buckets_and_merges_keep_buckets_alike(flax_step):
    program = flax_step[0].program
    graph = program.graph
    shardable = sharded.regions_of(graph).shardable
    rng = random.Random(0)
    s = all_sharded(graph, shardable)
    for _ in range(50):
        move = _strategy.with_sharding(shardable)[rng.choice(["shard_update", "merge_allreduce", "split"])]
        s = move(program, s, rng) or s
        assert s.sharded <= shardable and _strategy.is_valid(program, s)
    mixed = dataclasses.replace(s, buckets=(tuple(range(len(graph.gradients))),), sharded=frozenset([0]))
    assert not _strategy.is_valid(program, mixed)
    again = _strategy.Strategy.from_json(graph, s.to_json(graph))
    assert again.sharded == s.sharded


def test_the_choice_ties_each_gradient_to_its_parameters_moments(flax_step):
    captured, layout = flax_step
    leaves_of = state_search.gradient_leaves(captured.graph, layout, update.held_leaves(captured))
    assert len(leaves_of) == 5
    for leaves in leaves_of.values():
        paths = sorted(layout.paths[i] for i in leaves)
        assert len(paths) == 2 and paths[0].replace(".mu", ".nu") == paths[1]
    assert sorted(i for leaves in leaves_of.values() for i in leaves) == sorted(layout.inputs)
