import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses
import importlib.metadata
import json
import random
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gnn_estimator
from disco_jax import _capture, _graph, _program, backends, cost
from gnn_estimator import (
    FEATURE_VERSION,
    METADATA_FILE,
    WEIGHTS_FILE,
    GnnEstimator,
    GnnWeightsWarning,
    ModelConfig,
    WeightsError,
    _kernels,
    _measure,
    _train,
    describe_kernel,
    estimator_for_device,
    featurize,
    kernel_features,
    load_estimator,
    read_weights,
    train,
    write_weights,
)

TINY = ModelConfig(hidden=16, heads=2, layers=2, mlp=(16, 16))


def _step_text() -> str:
    def loss(params, x):
        h = jnp.tanh(x @ params[0] + 0.5)
        h = jax.nn.gelu(h @ params[1])
        return jnp.mean(jax.nn.log_softmax(h) ** 2)

    def step(params, x):
        grads = jax.grad(loss)(params, x)
        return [p - 0.1 * jnp.sqrt(jnp.abs(g) + 1e-6) * jnp.sign(g) for p, g in zip(params, grads)]

    params = [jnp.full((32, 32), 0.01), jnp.full((32, 32), 0.02)]
    text, _ = _capture.capture(jax.jit(step).lower(params, jnp.ones((16, 32))))
    return text


@pytest.fixture(scope="module")
def step_text() -> str:
    return _step_text()


@pytest.fixture(scope="module")
def program(step_text):
    return _program.build_program(step_text, backends.CPU)


@pytest.fixture(scope="module")
def graph(program):
    return program.graph


def _fused_kernels(program, count: int, seed: int = 0) -> list[frozenset[int]]:
    graph, rng = program.graph, random.Random(seed)
    out, seen = [], set()
    for _ in range(50 * count):
        k = _kernels.random_kernel(program, rng, rng.randint(1, 8))
        if not _kernels.measurable(graph, k) or not _kernels.is_convex(graph, k):
            continue
        key = (graph.kernel_signature(k), tuple(_kernels.default_exports(graph, k)))
        if key in seen:  # structurally equal kernels have equal features
            continue
        seen.add(key)
        out.append(k)
        if len(out) == count:
            break
    return out


def _tiny_dataset(program, count: int = 16) -> list[dict]:
    """Kernels of the test step with made-up times spanning three orders of magnitude."""
    graph, rng = program.graph, np.random.default_rng(0)
    samples, seen = [], set()
    for i, k in enumerate(_fused_kernels(program, 3 * count)):
        description = describe_kernel(graph, k, {o: 1.0 for o in k})
        f = featurize(description)
        if (f.nodes.tobytes(), f.senders.tobytes()) in seen:  # kernels the features cannot tell apart
            continue
        seen.add((f.nodes.tobytes(), f.senders.tobytes()))
        samples.append(
            {
                "kernel": description,
                "time_us": float(10 ** rng.uniform(0, 3)),
                "key": graph.kernel_signature(k) + str(i),
                "model": "test",
                "family": "test",
                "read_bytes": 0,
                "written_bytes": 0,
                "flops": 0.0,
            }
        )
        if len(samples) == count:
            break
    return samples


def test_features_are_deterministic_for_the_same_kernel(step_text, graph):
    kernel = max(graph.xla_groups, key=len)
    times = {o: 1.5 for o in kernel}
    a = kernel_features(graph, kernel, times)
    b = kernel_features(graph, kernel, dict(times))
    rebuilt = _graph.build_graph(step_text, backends.CPU.fusible)  # same module text, a fresh graph
    c = kernel_features(rebuilt, frozenset(kernel), times)
    # Through the JSON description the dataset stores: the same arrays again.
    d = featurize(json.loads(json.dumps(describe_kernel(graph, kernel, times))))
    for other in (b, c, d):
        np.testing.assert_array_equal(a.nodes, other.nodes)
        np.testing.assert_array_equal(a.senders, other.senders)
        np.testing.assert_array_equal(a.receivers, other.receivers)
        np.testing.assert_array_equal(a.kernel, other.kernel)
    assert a.num_nodes == len(kernel)
    assert a.nodes.dtype == np.float32 and np.isfinite(a.nodes).all()


def test_the_featurizer_of_a_graph_equals_kernel_features_to_the_bit(program, graph):
    """What the estimator computes per search kernel (`KernelFeaturizer`: each op's own columns
    once per graph) equals the reference path, description then `featurize`, that training takes."""
    rng = random.Random(1)
    kernels = list(graph.xla_groups) + [_kernels.random_kernel(program, rng, rng.randint(1, 12)) for _ in range(200)]
    featurizer = gnn_estimator.KernelFeaturizer()
    spread = 0
    for i, k in enumerate(kernels):
        times = {o: 0.5 + o % 7 for o in k if o % 3} if i % 2 else None
        expected, got = kernel_features(graph, k, times), featurizer.features(graph, k, times)
        if i % 3 == 0:  # with the exports by position, as the estimator passes them from its key
            order = sorted(k)
            got = featurizer.features(graph, k, times, [order.index(o) for o in _kernels.default_exports(graph, k)])
        for a, b in ((got.nodes, expected.nodes), (got.senders, expected.senders), (got.receivers, expected.receivers)):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(got.kernel, expected.kernel)
        spread += any(graph.ops[o].opcode in ("reduce", "concatenate", "pad") for o in k) and len(k) > 1
    assert spread >= 5  # kernels whose evaluations scale through a reduce were compared


def test_unknown_own_time_is_zero_with_a_known_flag(graph):
    from gnn_estimator import NODE_FEATURES

    kernel = max(graph.xla_groups, key=len)
    known = kernel_features(graph, kernel, {o: 2.0 for o in kernel}).nodes
    unknown = kernel_features(graph, kernel).nodes
    flag, time = NODE_FEATURES.index("own_time_known"), NODE_FEATURES.index("log_own_time_us")
    assert (known[:, flag] == 1).all() and (unknown[:, flag] == 0).all() and (unknown[:, time] == 0).all()


def _connected(graph, kernel: frozenset[int]) -> bool:
    """The kernel's ops form one piece along data edges inside it (either direction)."""
    seen, stack = set(), [min(kernel)]
    while stack:
        o = stack.pop()
        if o not in seen:
            seen.add(o)
            stack.extend(x for x in (*graph.ops[o].operands, *graph.users[o]) if x in kernel)
    return seen == kernel


def test_random_kernels_are_connected_fusible_and_convex(program, graph):
    for k in _fused_kernels(program, 20, seed=1):
        assert all(graph.ops[o].kind == "fusible" for o in k)
        assert _connected(graph, k)
        assert _kernels.is_convex(graph, k)


def test_a_kernel_compiles_alone_and_is_timed(program, graph):
    kernel = max(graph.xla_groups, key=len)
    single = frozenset([next(op.id for op in graph.ops if op.kind == "fusible" and op.opcode == "tanh")])
    fused = _measure.compile_kernel(program, kernel, np.random.default_rng(0))
    lone = _measure.compile_kernel(program, single, np.random.default_rng(0))
    assert "kernel_computation" in fused.compiled.as_text()
    # A lone op may be renamed by XLA (jaxlib 0.12 wraps it in a one-op fusion): the timing must
    # follow the name the compiled module, and so the trace, gives it.
    assert all(f"%{name} = " in lone.compiled.as_text() for name in lone.instructions)
    timings = _measure.time_kernels([fused, lone], rounds=2, extra_rounds=0, min_runs=3, max_runs=3)
    for timing in timings:
        assert timing is not None and timing.time_us > 0 and len(timing.round_us) == 2


@pytest.fixture(scope="module")
def overfitted(program):
    """(samples, trained, history): the TINY network trained 150 epochs on the 16 kernels of
    `_tiny_dataset`, all in one batch. Its fit is what test_model_overfits_a_tiny_dataset checks;
    the tests that need some trained network read it through `trained_tiny` (one training and
    one compile of the step for the module)."""
    samples = _tiny_dataset(program)
    trained, history = train(samples, config=TINY, **OVERFIT)
    return samples, trained, history


# The training of `overfitted`: all 16 samples in one batch, own times always known.
OVERFIT = dict(epochs=150, batch_size=16, learning_rate=1e-2, drop_times=0.0)


def test_model_overfits_a_tiny_dataset(overfitted):
    samples, trained, history = overfitted
    first, last = history[0]["train_loss"], history[-1]["train_loss"]
    assert last < first / 100, (first, last)
    predicted = trained.predict_us(_train.sample_features(samples))
    measured = np.array([s["time_us"] for s in samples])
    assert np.median(np.abs(predicted - measured) / measured) < 0.1


@pytest.fixture(scope="module")
def trained_tiny(overfitted):
    """The overfitted network with the metadata of CPU weights (a copy: the tests may change it)."""
    return dataclasses.replace(overfitted[1], metadata={"device_kind": "cpu"})


def test_weights_round_trip_through_the_file_format(program, tmp_path, graph, trained_tiny):
    write_weights(tmp_path, trained_tiny)
    assert (tmp_path / WEIGHTS_FILE).exists() and (tmp_path / METADATA_FILE).exists()
    restored = read_weights(tmp_path)
    assert restored.config == trained_tiny.config
    assert restored.metadata["feature_version"] == FEATURE_VERSION
    features = [kernel_features(graph, k) for k in _fused_kernels(program, 5)]
    np.testing.assert_allclose(restored.predict_us(features), trained_tiny.predict_us(features), rtol=1e-6)
    # msgpack only: the weights file is not a pickle.
    assert not (tmp_path / WEIGHTS_FILE).read_bytes().startswith(b"\x80")


def test_an_ensemble_round_trips_and_averages_its_members(program, tmp_path, graph, overfitted):
    # Trained as `overfitted` is: its compiled step serves both members, and member 0 (seed 0) is
    # that network to the bit.
    config = dataclasses.replace(TINY, members=2)
    trained, history = train(_tiny_dataset(program), config=config, **OVERFIT)
    assert len(trained.params) == 2 and {h["member"] for h in history} == {0, 1}
    for a, b in zip(jax.tree.leaves(trained.params[0]), jax.tree.leaves(overfitted[1].params[0])):
        np.testing.assert_array_equal(a, b)
    write_weights(tmp_path, trained)
    restored = read_weights(tmp_path)
    features = [kernel_features(graph, k) for k in _fused_kernels(program, 4)]
    np.testing.assert_allclose(restored.predict_us(features), trained.predict_us(features), rtol=1e-6)
    singles = [
        _train.TrainedEstimator(dataclasses.replace(config, members=1), [p], trained.normalization)
        for p in trained.params
    ]
    mean_log = np.mean([np.log(m.predict_us(features)) for m in singles], axis=0)
    np.testing.assert_allclose(np.log(trained.predict_us(features)), mean_log, rtol=1e-5, atol=1e-5)


def test_wrong_version_or_corrupt_weights_are_refused(tmp_path, trained_tiny):
    directory = tmp_path / "cpu"
    write_weights(directory, trained_tiny)
    meta = json.loads((directory / METADATA_FILE).read_text())
    (directory / METADATA_FILE).write_text(json.dumps({**meta, "feature_version": FEATURE_VERSION + 1}))
    with pytest.raises(WeightsError, match="feature version"):
        read_weights(directory)
    with pytest.warns(GnnWeightsWarning, match="feature version"):
        assert load_estimator("cpu", tmp_path) is None
    (directory / METADATA_FILE).write_text(json.dumps({**meta, "node_features": meta["node_features"][:-1]}))
    with pytest.raises(WeightsError):
        read_weights(directory)
    (directory / METADATA_FILE).write_text(json.dumps(meta))
    (directory / WEIGHTS_FILE).write_bytes(b"not msgpack")
    with pytest.warns(GnnWeightsWarning):
        assert load_estimator("cpu", tmp_path) is None


def test_search_uses_the_gnn_only_when_weights_exist_for_the_device_kind(tmp_path, graph, trained_tiny):
    fallback = object()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no weights is not worth a warning
        assert load_estimator("cpu", tmp_path) is None
        assert estimator_for_device("cpu", fallback, tmp_path) is fallback
    write_weights(tmp_path / "cpu", trained_tiny)
    estimator = estimator_for_device("cpu", fallback, tmp_path)
    assert isinstance(estimator, GnnEstimator) and estimator.name == "gnn"
    assert estimator_for_device("NVIDIA H100 80GB HBM3", fallback, tmp_path) is fallback


def test_gnn_estimator_batches_caches_and_skips_opaque_kernels(program, tmp_path, graph, trained_tiny, monkeypatch):
    estimator = GnnEstimator(trained_tiny)
    kernels = _fused_kernels(program, 12) + [frozenset([graph.opaque_ops[0]])]
    calls = []
    predict = trained_tiny.predict_us
    monkeypatch.setattr(trained_tiny, "predict_us", lambda f, chunk=256: calls.append(len(f)) or predict(f, chunk))
    distinct = len({estimator._key(graph, k) for k in kernels[:-1]})  # structurally equal kernels share one
    times = estimator.estimate(graph, kernels + kernels[:3])
    assert times[len(kernels) - 1] is None  # a dot: left to the next estimator of a chain
    assert all(isinstance(t, float) and t > 0 for i, t in enumerate(times) if i != len(kernels) - 1)
    assert times[:3] == times[len(kernels) :]
    assert calls == [distinct]  # one batched call for all distinct fusible kernels
    assert estimator.estimate(graph, kernels[:5]) == times[:5]
    assert calls == [distinct]  # served from the cache


def test_the_shipped_gnn_declines_kernels_holding_region_ops_it_never_trained_on():
    """A scanned layer's dynamic slices and in-place updates: the shipped H100 weights record
    their training opcodes, none of which is one, so such kernels are left to the roofline; an
    elementwise kernel of the same module is predicted."""
    from test_cost import REGIONS

    estimator = load_estimator("NVIDIA H100 80GB HBM3")
    assert estimator is not None and estimator.untrained_region_ops == {"dynamic-slice", "dynamic-update-slice"}
    graph = _graph.build_graph(REGIONS, backends.GPU.fusible, merge_duplicates=False)
    kernels = dict(zip(graph.xla_kernel_names, graph.xla_groups))
    store, load, whole = estimator.estimate(graph, [kernels["store"], kernels["load"], kernels["whole"]])
    assert store is None and load is None and whole is not None and whole > 0


def test_the_core_finds_the_gnn_through_its_entry_point(tmp_path, graph):
    """`gnn = "gnn_estimator:load_estimator"` in the `disco_jax.estimators` entry-point group: the
    core's plugin registry finds and loads it, and it is the shipped CPU network."""
    factories = cost.estimator_factories()
    assert "gnn" in factories
    [gnn] = [e for e in cost.plugin_estimators("cpu") if e.name == "gnn"]
    assert isinstance(gnn, GnnEstimator) and gnn.metadata["feature_version"] == FEATURE_VERSION
    assert factories["gnn"]("no-such-device") is None  # no weights: no estimator, no warning
    # Given the profile's table, it reads its ops' own times (`cost.with_op_times`).
    single = frozenset([graph.fusible_ops[0]])
    table = {graph.kernel_signature(single): 4.0}
    timed = cost.with_op_times(gnn, table)
    assert timed.op_times_us == table and timed._own_times(graph, single) == {graph.fusible_ops[0]: 4.0}
    [entry_point] = [e for e in importlib.metadata.entry_points(group=cost.ENTRY_POINT_GROUP) if e.name == "gnn"]
    assert entry_point.load() is gnn_estimator.load_estimator


def test_a_gpu_kernel_is_bare_ops_that_xla_gpu_compiles_deviceless():
    """On XLA:GPU a multi-op kernel is its ops bare (XLA fuses them itself; a hand-written fusion
    with an unlaid signature made XLA:GPU abort the process), and it compiles for an H100."""
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from disco_jax import _compile, targets, zoo
    from gnn_estimator import _kernels, _measure

    mesh = targets.mesh("h100-sxm", 1)
    lowered = zoo.lower_abstract(zoo.get_model("mlp", "tiny"), optax.adam(1e-3), mesh)
    program, _ = _compile.capture_program(lowered, backends.GPU)
    graph = program.graph
    kernels = [g for g in graph.xla_groups if len(g) > 2 and _kernels.measurable(graph, g)]
    kernels = [k for k in kernels if _kernels.external_inputs(graph, k)][:3]
    assert kernels, "the tiny MLP has XLA fusions of several ops"
    for kernel in kernels:
        text, params, exports = _kernels.kernel_module_text(program, kernel, "HloModule probe")
        assert " fusion(" not in text
        in_specs, out_specs = _kernels.kernel_boundary_specs(graph, params, exports)
        outputs = [(tuple(s.dims), _measure.numpy_dtype(s.dtype)) for s in out_specs]

        def dummy(*args, outputs=outputs):
            results = tuple(jnp.zeros(shape, dtype) for shape, dtype in outputs)
            return results if len(results) > 1 else results[0]

        args = [
            jax.ShapeDtypeStruct(tuple(s.dims), _measure.numpy_dtype(s.dtype), sharding=NamedSharding(mesh, P()))
            for s in in_specs
        ]
        probe = jax.jit(dummy, keep_unused=True).lower(*args)
        compiled = _capture.compile_with_hook(
            probe,
            lambda t, kernel=kernel: _kernels.kernel_module_text(program, kernel, t.splitlines()[0])[0],
            platform="cuda",
        )
        assert " fusion(" in compiled.as_text()  # XLA:GPU fused the ops itself


def test_shipped_h100_weights_load_for_the_h100_device_kind():
    estimator = load_estimator("NVIDIA H100 80GB HBM3")
    assert estimator is not None and estimator.name == "gnn"


def test_kernels_outside_the_training_range_are_left_to_the_next_estimator(program, graph, trained_tiny):
    """More ops than the largest training kernel, or a prediction past twice the longest training
    time, is extrapolation: None, so a chain's next estimator answers."""
    kernels = _fused_kernels(program, 12)
    free = GnnEstimator(trained_tiny).estimate(graph, kernels)  # no ranges recorded: no limit
    assert all(t is not None for t in free)
    max_ops = max(len(k) for k in kernels) - 1
    longest = float(np.median(free)) / 2  # predictions above twice this are declined
    trained = dataclasses.replace(
        trained_tiny, metadata={"training": {"kernel_ops_range": [1, max_ops], "time_us_range": [0.1, longest]}}
    )
    limited = GnnEstimator(trained).estimate(graph, kernels)
    for k, t, f in zip(kernels, limited, free):
        assert (t is None) == (len(k) > max_ops or f > 2 * longest), (len(k), f)
        assert t is None or t == f
    by_ops = [len(k) > max_ops for k in kernels]
    by_time = [f > 2 * longest and len(k) <= max_ops for k, f in zip(kernels, free)]
    assert any(by_ops) and any(by_time) and any(t is not None for t in limited)
