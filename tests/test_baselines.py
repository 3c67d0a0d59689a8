"""Each baseline compiles the way its name says (asserted on compiled HLO text), bucket builders
follow DDP's and Horovod's rules, and the clusters' all-reduce formulas give textbook numbers."""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gnn_estimator
from disco_jax import (
    AnalyticalEstimator,
    _capture,
    _compile,
    _graph,
    _hlo,
    _program,
    _strategy,
    _validate,
    backends,
    cost,
    zoo,
)
from disco_jax.eval import baselines, clusters, gpus

KiB = 1 << 10


@pytest.fixture(scope="module")
def mlp():
    """The zoo's tiny MLP (9 gradients, 4 KiB to 16 KiB each) in the jit style, captured."""
    spec = zoo.get_model("mlp", "tiny")
    step, state, batch = zoo.make_train_step(spec, optax.adam(1e-3), zoo.data_mesh(8), "jit")
    lowered = step.lower(state, batch)
    text, default = _capture.capture(lowered)
    program = _program.build_program(text, backends.CPU)
    return lowered, program, default, (state, batch), default(state, batch)


def _entry_allreduces(text: str) -> list[_hlo.Instruction]:
    return [i for i in _hlo.parse_module(text).entry.instructions if i.opcode == "all-reduce"]


def _loop_fusion_sizes(text: str) -> list[int]:
    """Compute instructions in each kLoop fusion of the entry computation."""
    module = _hlo.parse_module(text)
    sizes = []
    for inst in module.entry.instructions:
        if inst.opcode == "fusion" and inst.attr("kind") == "kLoop":
            comp = module.computation(inst.attr("calls").lstrip("%"))
            sizes.append(
                sum(
                    1
                    for i in comp.instructions
                    if i.opcode not in ("parameter", "constant", "tuple", "get-tuple-element", "bitcast")
                )
            )
    return sizes


def _compiled(lowered, program, default, baseline):
    if baseline.compiler_options is None:
        compiled, status = _compile.compile_strategy(lowered, program, baseline.strategy)
        assert status in ("rewritten", "cached")
        return compiled
    if not baseline.compiler_options:
        return default
    return lowered.compile(compiler_options=baseline.compiler_options)


# --------------------------------------------------------------------------- compile configurations


def test_jax_no_fusion_has_no_op_fusion_and_one_allreduce_per_gradient(mlp):
    lowered, program, default, args, reference = mlp
    graph = program.graph
    b = baselines.jax_no_fusion(program)
    text = _compiled(lowered, program, default, b).as_text()
    sizes = _loop_fusion_sizes(text)
    assert sizes and max(sizes) == 1, "a loop fusion holds more than one instruction"
    assert max(_loop_fusion_sizes(default.as_text())) > 1  # the default does fuse
    allreduces = _entry_allreduces(text)
    assert len(allreduces) == len(graph.gradients) > 1
    assert all(len(i.operands) == 1 for i in allreduces)
    # The simulated strategy says the same.
    assert not b.strategy.fused_groups and len(b.strategy.buckets) == len(graph.gradients)


def test_jax_op_fusion_fuses_ops_but_does_not_combine_allreduces(mlp):
    lowered, program, default, args, reference = mlp
    graph = program.graph
    b = baselines.jax_op_fusion(program)
    text = _compiled(lowered, program, default, b).as_text()
    assert max(_loop_fusion_sizes(text)) > 1
    assert sorted(_loop_fusion_sizes(text)) == sorted(_loop_fusion_sizes(default.as_text()))
    allreduces = _entry_allreduces(text)
    assert len(allreduces) == len(graph.gradients) and all(len(i.operands) == 1 for i in allreduces)
    assert b.strategy.key()[0] == _strategy.xla_default(graph).key()[0]
    assert len(b.strategy.buckets) == len(graph.gradients)


def test_jax_allreduce_fusion_combines_allreduces_but_does_not_fuse_ops(mlp):
    lowered, program, default, args, reference = mlp
    graph = program.graph
    b = baselines.jax_allreduce_fusion(program)
    text = _compiled(lowered, program, default, b).as_text()
    assert max(_loop_fusion_sizes(text)) == 1
    allreduces = _entry_allreduces(text)
    assert len(allreduces) == len(graph.xla_buckets) < len(graph.gradients)
    assert sum(len(i.operands) for i in allreduces) == len(graph.gradients)
    assert not b.strategy.fused_groups and len(b.strategy.buckets) == len(graph.xla_buckets)


def test_jax_default_is_xla_unchanged(mlp):
    lowered, program, default, args, reference = mlp
    graph = program.graph
    b = baselines.jax_default(program)
    assert b.compiler_options == {}
    assert b.strategy.buckets == tuple(backends.CPU.xla_buckets(graph))
    text = default.as_text()
    assert len(_entry_allreduces(text)) == len(graph.xla_buckets) == len(b.strategy.buckets)
    assert b.strategy.key()[0] == _strategy.xla_default(graph).key()[0]


def test_compile_option_baselines_compute_the_same_step(mlp):
    lowered, program, default, args, reference = mlp
    floor = _validate.sensitivity(reference, default(*_validate.nudge(args)))
    for b in (
        baselines.jax_no_fusion(program),
        baselines.jax_op_fusion(program),
        baselines.jax_allreduce_fusion(program),
    ):
        out = _compiled(lowered, program, default, b)(*args)
        bitwise = b.name == "JAX_op_fusion"  # same fusions: only the all-reduces are regrouped
        assert _validate.compare_outputs(reference, out, bitwise=bitwise, floor=floor).within_tolerance, b.name


def test_compiled_hlo_stats_counts_what_the_names_say(mlp):
    lowered, program, default, args, reference = mlp
    graph = program.graph
    stats = {
        b.name: _compile.compiled_stats(_compiled(lowered, program, default, b).as_text())
        for b in (baselines.jax_no_fusion(program), baselines.jax_allreduce_fusion(program))
    }
    assert stats["JAX_no_fusion"]["multi_op_loop_fusions"] == 0
    assert stats["JAX_no_fusion"]["all-reduce"] == len(graph.gradients)
    assert stats["JAX_AllReduce_fusion"]["all-reduce-operands"] == len(graph.gradients)


# --------------------------------------------------------------------------- DDP and Horovod buckets


def _ready_order_bytes(graph):
    order = baselines.gradient_ready_order(graph)
    return order, [graph.gradients[g].nbytes for g in order]


def _expected_ddp(sizes, first, cap):
    buckets, current, total = [], [], 0
    for i, n in enumerate(sizes):
        current.append(i)
        total += n
        if total >= (first if not buckets else cap):
            buckets.append(current)
            current, total = [], 0
    return buckets + ([current] if current else [])


def test_ddp_buckets_follow_ready_order_with_a_small_first_bucket(mlp):
    lowered, program, default, args, reference = mlp
    graph = program.graph
    order, sizes = _ready_order_bytes(graph)
    first, cap = 12 * KiB, 24 * KiB  # scaled down from 1 MiB / 25 MiB so the tiny MLP splits
    b = baselines.pytorch_ddp(program, bucket_cap_bytes=cap, first_bucket_bytes=first)
    expected = [tuple(order[i] for i in bucket) for bucket in _expected_ddp(sizes, first, cap)]
    assert list(b.strategy.buckets) == expected
    assert len(expected) >= 3
    assert sum(graph.gradients[g].nbytes for g in expected[0]) >= first
    # Enacted by rewrite as DDP runs it: one all-reduce of one flat buffer per bucket (the
    # gradients concatenated, split after), and outputs equal bit for bit.
    assert b.strategy.packed and "packed into flat buffers" in b.description
    compiled = _compiled(lowered, program, default, b)
    allreduces = _entry_allreduces(compiled.as_text())
    assert [len(i.outputs) for i in allreduces] == [1] * len(expected)
    assert all(len(i.outputs[0].dims) == 1 for i in allreduces)  # a flat buffer
    assert sorted(i.outputs[0].bytes for i in allreduces) == sorted(
        sum(graph.gradients[g].nbytes for g in bk) for bk in expected
    )
    assert _validate.compare_outputs(reference, compiled(*args), bitwise=True).bitwise_equal
    # The same buckets unpacked: one variadic all-reduce of the bucket's tensors each.
    variadic = dataclasses.replace(b, strategy=dataclasses.replace(b.strategy, packed=False))
    allreduces = _entry_allreduces(_compiled(lowered, program, default, variadic).as_text())
    assert sorted(len(i.outputs) for i in allreduces) == sorted(len(bk) for bk in expected)


def test_horovod_buckets_never_exceed_the_threshold(mlp):
    lowered, program, default, args, reference = mlp
    graph = program.graph
    threshold = 20 * KiB
    b = baselines.horovod(program, threshold_bytes=threshold)
    sizes = [sum(graph.gradients[g].nbytes for g in bk) for bk in b.strategy.buckets]
    assert len(sizes) > 1
    assert all(s <= threshold or len(bk) == 1 for s, bk in zip(sizes, b.strategy.buckets))
    assert sorted(g for bk in b.strategy.buckets for g in bk) == list(range(len(graph.gradients)))
    # Consecutive in production order: each bucket is a run of the ready order.
    order = baselines.gradient_ready_order(graph)
    assert [g for bk in b.strategy.buckets for g in bk] == order
    compiled = _compiled(lowered, program, default, b)
    assert len(_entry_allreduces(compiled.as_text())) == len(b.strategy.buckets)
    assert _validate.compare_outputs(reference, compiled(*args), bitwise=True).bitwise_equal


def test_horovod_cycles_split_fusion_by_ready_time(mlp):
    lowered, program, default, args, reference = mlp
    graph = program.graph
    order = baselines.gradient_ready_order(graph)
    ready = [0.0] * len(graph.gradients)
    for rank, g in enumerate(order):
        ready[g] = 10.0 * rank  # one gradient every 10 us
    one_cycle = baselines.horovod_buckets(graph, 1 << 30, ready, cycle_us=1e6)
    assert len(one_cycle) == 1
    per_gradient = baselines.horovod_buckets(graph, 1 << 30, ready, cycle_us=10.0)
    assert len(per_gradient) == len(graph.gradients)
    pairs = baselines.horovod_buckets(graph, 1 << 30, ready, cycle_us=20.0)
    assert [len(b) for b in pairs][:-1] == [2] * (len(pairs) - 1)


def test_gradient_ready_times_follow_the_backward_pass(mlp):
    lowered, program, default, args, reference = mlp
    graph = program.graph
    estimator = AnalyticalEstimator()
    s = _strategy.with_buckets(_strategy.xla_default(graph), baselines.per_gradient(graph), "t")
    ready = baselines.gradient_ready_times(program, s, lambda ks: estimator.estimate(graph, ks))
    assert all(t > 0 for t in ready)
    order = baselines.gradient_ready_order(graph, ready)
    assert [ready[g] for g in order] == sorted(ready)


def test_bucket_builders_never_make_allreduces_wait_for_each_other():
    """A forward all-reduce (a batch statistic) feeds the gradients: however large the
    thresholds, it must not share a bucket with a gradient that depends on it."""
    mesh = jax.make_mesh((8,), ("data",))
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    w1 = jax.device_put(jnp.ones((8, 16)) * 0.1, replicated)
    w2 = jax.device_put(jnp.ones((16, 4)) * 0.1, replicated)
    x = jax.device_put(jnp.arange(64 * 8, dtype=jnp.float32).reshape(64, 8) / 512, sharded)

    def loss(params, x):
        h = jnp.tanh(x @ params[0])
        h = h - jnp.mean(h, axis=0)  # mean over the sharded batch: an all-reduce in the forward pass
        return jnp.mean((h @ params[1]) ** 2)

    step = jax.jit(jax.grad(loss))
    program = _program.build_program(_capture.capture(step.lower((w1, w2), x))[0], backends.CPU)
    graph = program.graph
    assert len(graph.gradients) >= 3
    for buckets in (
        baselines.fit_buckets(graph, baselines.gradient_ready_order(graph), 1 << 30),
        baselines.ddp_buckets(graph, baselines.gradient_ready_order(graph), 1 << 30, 1 << 30),
        baselines.xla_gpu_buckets(graph),
    ):
        s = _strategy.with_buckets(_strategy.xla_default(graph), buckets, "t")
        assert _strategy.is_valid(program, s), buckets
        assert len(buckets) >= 2


def test_gpu_combining_rule_combines_up_to_xla_gpu_threshold(mlp):
    lowered, program, default, args, reference = mlp
    graph = program.graph
    gpu = baselines.jax_default(program, baselines.xla_gpu_buckets).strategy.buckets
    assert gpu == tuple(baselines.xla_gpu_buckets(graph))
    small = baselines.xla_gpu_buckets(graph, threshold_bytes=16 * KiB)
    assert all(sum(graph.gradients[g].nbytes for g in b) <= 16 * KiB or len(b) == 1 for b in small)
    assert len(small) > len(gpu)


def test_all_baselines_are_valid_strategies(mlp):
    lowered, program, default, args, reference = mlp
    graph = program.graph
    estimator = AnalyticalEstimator()
    for combine in (backends.CPU.xla_buckets, baselines.xla_gpu_buckets):
        candidates = baselines.all_baselines(
            program, combine=combine, kernel_time_us=lambda ks: estimator.estimate(graph, ks)
        )
        assert [b.name for b in candidates] == list(baselines.BASELINES)
        for b in candidates:
            assert _strategy.is_valid(program, b.strategy), (combine.__name__, b.name)


# --------------------------------------------------------------------------- clusters


def test_ring_allreduce_gives_the_textbook_time():
    # 1 GB over 8 devices at 100 GB/s: each device sends and receives 2 * 7/8 GB -> 17.5 ms.
    assert clusters.ring_allreduce_us(1e9, 8, 100e9) == pytest.approx(17_500.0)
    assert clusters.ring_allreduce_us(1e9, 2, 100e9, latency_us=5.0) == pytest.approx(10_005.0)
    assert clusters.ring_allreduce_us(1e9, 1, 100e9) == 0.0


def test_hierarchical_allreduce_reduces_to_the_ring():
    assert clusters.hierarchical_allreduce_us(1e9, 8, 1, 100e9, 10e9) == pytest.approx(
        clusters.ring_allreduce_us(1e9, 8, 100e9)
    )
    assert clusters.hierarchical_allreduce_us(1e9, 1, 4, 100e9, 10e9) == pytest.approx(
        clusters.ring_allreduce_us(1e9, 4, 10e9)
    )
    # 2 nodes x 4 GPUs: intra 2*3/4 * S / B_intra, inter 2*1/2 * (S/4) / B_inter.
    assert clusters.hierarchical_allreduce_us(4e9, 4, 2, 100e9, 10e9) == pytest.approx(
        (2 * 3 / 4 * 4e9 / 100e9 + 1 * 1e9 / 10e9) * 1e6
    )


def test_datasheet_allreduce_takes_the_faster_nccl_protocol():
    # The datasheet model (cluster A and A100 nodes use it; the H100 clusters now take the model
    # fitted to nccl-tests tables, tests/test_collectives.py), on an H100 node's datasheet links.
    model = clusters.H100_NVLINK_8.datasheet_allreduce()
    assert model.num_devices == 8
    small, large = model.protocol_times_us(4), model.protocol_times_us(256 << 20)
    assert small["LL"] < small["Simple"] and large["Simple"] < large["LL"]
    assert model.time_us(4) == pytest.approx(small["LL"])
    # NCCL 2.7's ring LL latency on one NVLink node of 8: 3.6 + 14 x 0.47 us.
    assert model.latency_ll_us == pytest.approx(3.6 + 14 * 0.47)
    # Large messages approach the ring bandwidth bound at the achieved NVLink bandwidth.
    bound = clusters.ring_allreduce_us(256 << 20, 8, 450e9 * 0.8)
    assert model.time_us(256 << 20) == pytest.approx(bound + model.latency_simple_us)


def test_every_cluster_number_has_a_source():
    assert {c.num_devices for c in clusters.CLUSTERS.values()} == {12, 8, 32}
    for c in clusters.CLUSTERS.values():
        for key, q in c.sources().items():
            if isinstance(q, dict):
                assert q["source"] and q["value"] > 0, (c.name, key)
        assert c.allreduce_model().time_us(1 << 20) > c.allreduce_model().time_us(4) > 0


def test_roofline_counts_convolution_flops_inside_library_fusions():
    x = jnp.ones((8, 16, 16, 4))
    w = jnp.ones((3, 3, 4, 32))
    conv = jax.jit(
        lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    )
    graph = _graph.build_graph(_capture.capture(conv.lower(x, w))[0], backends.CPU.fusible)
    work = [gpus.opaque_op_work(graph, o) for o in graph.opaque_ops]
    expected = 2.0 * 8 * 16 * 16 * 32 * (3 * 3 * 4)
    assert any(f == pytest.approx(expected) for _, _, f in work), work
    estimator = clusters.RooflineEstimator(clusters.H100_SXM)
    [t] = estimator.estimate(graph, [frozenset(graph.opaque_ops[:1])])
    assert t >= clusters.H100_SXM.launch_us.value


def test_no_fusion_pass_name_is_real():
    """An unknown pass name would be silently ignored: check the no-fusion lever (the options of
    JAX_AllReduce_fusion: the `fusion` pass disabled) changes HLO."""
    f = jax.jit(lambda x: jnp.tanh(x * 2.0 + 1.0) * 3.0)
    lowered = f.lower(jnp.ones((128,)))
    fused = lowered.compile().as_text()
    unfused = lowered.compile(compiler_options=baselines.compiler_options("JAX_AllReduce_fusion")).as_text()
    assert max(_loop_fusion_sizes(fused)) > 1 and max(_loop_fusion_sizes(unfused)) == 1
    assert len(re.findall(r"kind=kLoop", unfused)) > len(re.findall(r"kind=kLoop", fused))
    np.testing.assert_allclose(lowered.compile()(jnp.ones((128,))), np.tanh(3.0) * 3.0, rtol=1e-6)


def test_h100_clusters_cost_fusible_kernels_with_the_h100_gnn_and_the_rest_with_the_roofline():
    """The H100's shipped weights (kernels timed on an H100) answer the fusible kernels at the
    GNN's time (its training times hold each kernel's fixed cost, the roofline's fitted launch);
    opaque ops and a GPU without weights (the 1080 Ti of cluster A) get the roofline."""
    lowered = zoo.lower_abstract(zoo.get_model("mlp", "tiny"), optax.adam(1e-3), zoo.data_mesh(1), "jit")
    graph = _graph.build_graph(_capture.capture(lowered)[0], backends.CPU.fusible)
    fusible = [frozenset(g) for g in graph.xla_groups if len(g) > 1][:3] + [frozenset(graph.fusible_ops[-1:])]
    assert graph.opaque_ops
    opaque = [frozenset(graph.opaque_ops[:1])]
    gnn = gnn_estimator.load_estimator(clusters.H100_SXM.device_kind)
    assert gnn is not None, "no H100 weights shipped"
    h100 = clusters.CLUSTERS["8xH100-NVLink"].kernel_estimator()
    assert h100.name == "gnn+analytical-scaled"
    roofline = clusters.RooflineEstimator(clusters.H100_SXM)
    # The GNN's answers made dtype-true, with the reductions' fitted bias (`gpus.DtypeTrueEstimator`).
    expected = gpus.DtypeTrueEstimator(gnn, clusters.H100_SXM).estimate(graph, fusible) + roofline.estimate(
        graph, opaque
    )
    assert h100.estimate(graph, fusible + opaque) == pytest.approx(expected)
    assert expected[:4] != pytest.approx(roofline.estimate(graph, fusible))  # the GNN, not the roofline
    cluster_a = clusters.CLUSTERS["clusterA-12x1080Ti"].kernel_estimator()
    assert cluster_a.name == "analytical-scaled"
    assert cluster_a.estimate(graph, fusible) == clusters.RooflineEstimator(clusters.GTX_1080_TI).estimate(
        graph, fusible
    )
    json.dumps(h100.to_json())


def test_overhead_estimator_adds_its_overhead_and_passes_unknown_kernels_on():
    class Half:
        name = "half"

        def estimate(self, graph, kernels):
            return [None if len(k) > 1 else 2.0 for k in kernels]

    wrapped = cost.OverheadEstimator(Half(), 5.0)
    assert wrapped.name == "half+launch"
    assert wrapped.estimate(None, [frozenset([1]), frozenset([1, 2])]) == [7.0, None]
