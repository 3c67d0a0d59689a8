import os

# Harmless when tests/conftest.py already did it; must precede the first jax import.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from _trees import assert_trees_close  # noqa: E402

from disco_jax import zoo  # noqa: E402

MODEL_NAMES = sorted(zoo.MODELS)
# That every tiny model trains one step in both styles and the styles agree is checked end to end,
# each style with a plan enacted by the decorator, in test_bench.py (one compile of each program).
OPTIMIZER = optax.sgd(0.1, momentum=0.9)

# Paper sizes (trainable parameters) from the papers; the zoo's counts must be within 5%.
PAPER_PARAMETERS = {
    "vgg19": 143.7e6,  # Simonyan & Zisserman, configuration E
    "resnet50": 25.6e6,  # He et al.
    "transformer": 65e6,  # Vaswani et al., Table 3, base
    "rnnlm": 66e6,  # Zaremba et al., large
    "bert": 110e6,  # Devlin et al., BERT-base
    "reformer": 139.7e6,  # our enwik8-64K configuration (the paper gives no count)
    "mlp": 16 * (8192 * 8192 + 8192),  # Unity: 16 dense layers of 8192
    "dlrm": 33_762_577 * 16 + 475_985,  # Criteo Kaggle tables x dim 16, plus the MLPs
    "gpt": 6.7e9,  # Brown et al., Table 2.1, GPT-3 6.7B
}


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    # jax.make_mesh gives Explicit axes in JAX 0.10; the zoo must cope with them.
    return jax.make_mesh((8,), ("data",))


@pytest.mark.parametrize("style", zoo.STYLES)
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_paper_config_lowers_from_shapes_without_allocating(name, style, mesh):
    spec = zoo.get_model(name, "paper")
    assert spec.default_global_batch % 8 == 0
    live_bytes_before = sum(x.nbytes for x in jax.live_arrays())
    lowered = zoo.lower_abstract(spec, OPTIMIZER, mesh, style)
    live_bytes_after = sum(x.nbytes for x in jax.live_arrays())
    assert isinstance(lowered, jax.stages.Lowered)
    assert live_bytes_after - live_bytes_before < 1 << 20
    # the lowered step takes the full (global) batch
    batch = spec.batch_spec()
    args_info = jax.tree.leaves(lowered.args_info[0][1])
    assert [a.shape for a in args_info] == [b.shape for b in jax.tree.leaves(batch)]


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_paper_parameter_counts_match_the_papers(name):
    count = zoo.get_model(name, "paper").param_count()
    assert count == pytest.approx(PAPER_PARAMETERS[name], rel=0.05)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_batch_spec_describes_make_batch(name):
    spec = zoo.get_model(name, "tiny")
    batch = spec.make_batch(jax.random.key(0), 8)
    described = spec.batch_spec(8)
    assert jax.tree.structure(batch) == jax.tree.structure(described)
    for real, shape in zip(jax.tree.leaves(batch), jax.tree.leaves(described)):
        assert (real.shape, real.dtype) == (shape.shape, shape.dtype)
        assert real.shape[0] == 8


def test_get_model_rejects_unknown_names():
    with pytest.raises(KeyError):
        zoo.get_model("alexnet")
    with pytest.raises(KeyError):
        zoo.get_model("bert", "huge")
    assert zoo.get_model("bert") is zoo.get_model("bert", "tiny")


def test_resized_model_has_the_changed_config_and_says_so():
    spec = zoo.resized("transformer", num_encoder_layers=1, num_decoder_layers=1)
    assert spec.config == "tiny:num_encoder_layers=1,num_decoder_layers=1"
    assert (
        spec.description.startswith("Transformer 1+1 layers")
        and spec.param_count() < zoo.get_model("transformer").param_count()
    )
    with pytest.raises(TypeError):
        zoo.resized("rnnlm", layers=1)
    with pytest.raises(KeyError):
        zoo.resized("alexnet", num_layers=1)


def test_a_variant_is_named_as_a_model_and_built_as_resized():
    """`zoo.get_model("transformer:scan_layers=True")`: the benchmark's name of a variant, the
    spec `resized` builds, one object per name and size (JAX's caches see the same functions)."""
    spec = zoo.get_model("transformer:scan_layers=True", "paper")
    assert spec is zoo.get_model("transformer:scan_layers=True", "paper")
    assert spec.config == "paper:scan_layers=True" and spec.description.endswith("scanned layers")
    assert spec.param_count() == zoo.get_model("transformer", "paper").param_count()
    assert zoo.base_model("transformer:scan_layers=True") == zoo.base_model("transformer") == "transformer"
    with pytest.raises(TypeError):
        zoo.get_model("transformer:layers=1")


def test_batch_not_divisible_by_devices_is_rejected(mesh):
    with pytest.raises(ValueError, match="divisible"):
        zoo.make_train_step(zoo.get_model("mlp"), OPTIMIZER, mesh, "jit", global_batch_size=12)


def test_reformer_reversible_backward_matches_plain_autodiff():
    from disco_jax.zoo import _reformer

    spec = zoo.get_model("reformer", "tiny")
    cfg = _reformer.CONFIGS["tiny"]
    params, model_state = jax.jit(spec.init)(jax.random.key(0, impl="rbg"))
    layers = [
        {"attention": params[f"layer_{i}_attention"], "feed_forward": params[f"layer_{i}_feed_forward"]}
        for i in range(cfg.num_layers)
    ]
    rotations = [model_state["lsh_rotations"][f"layer_{i}"] for i in range(cfg.num_layers)]
    x = jax.random.normal(jax.random.key(1, impl="rbg"), (2, cfg.seq_len, cfg.d_model))

    def reversible_stack(layers, x1, x2):
        return _reformer.reversible_stack(cfg, layers, rotations, x1, x2)

    def plain_stack(layers, x1, x2):
        for layer, layer_rotations in zip(layers, rotations):
            x1, x2 = _reformer._reversible_layer(cfg, layer, layer_rotations, x1, x2)
        return x1, x2

    def grads(stack):
        def loss(layers, x):
            y1, y2 = stack(layers, x, x)
            return jax.numpy.sum(jax.numpy.sin(y1) * y2)

        return jax.jit(jax.grad(loss, argnums=(0, 1)))(layers, x)

    # Inputs are recomputed from outputs, so agreement is up to float32 rounding, not bitwise.
    assert_trees_close(grads(reversible_stack), grads(plain_stack), 1e-4, 1e-5, "grad")


# Per model: where `nn.scan` keeps the scanned layers' parameters, and the unrolled layers stacked there.
SCANNED_LAYERS = {
    "gpt": {"blocks/block": ["Block_0", "Block_1"]},
    "transformer": {
        "encoder/layer": ["EncoderLayer_0", "EncoderLayer_1"],
        "decoder/layer": ["DecoderLayer_0", "DecoderLayer_1"],
    },
}


def _stacked(tree: dict, layers: dict[str, list[str]]) -> dict:
    """An unrolled model's parameters (or gradients) as `nn.scan` holds them: the unrolled layers'
    trees stacked on a new leading axis, under each scanned name's `outer/inner` path."""
    out = {k: v for k, v in tree.items() if not any(k in names for names in layers.values())}
    for scanned, names in layers.items():
        outer, inner = scanned.split("/")
        out[outer] = {inner: jax.tree.map(lambda *xs: jax.numpy.stack(xs), *[tree[n] for n in names])}
    return out


@pytest.mark.parametrize("name", sorted(SCANNED_LAYERS))
def test_scanned_layers_compute_the_unrolled_model_on_stacked_parameters(name):
    """`scan_layers=True` (`nn.scan` over the blocks: a `while` loop in the step) is the same
    model: the unrolled form's parameters stacked on a leading layer axis give the same loss and
    gradients (stacked the same way), and its gradient compiles to one loop per stack and pass."""
    scanned, unrolled = zoo.resized(name, scan_layers=True), zoo.get_model(name)
    params, _ = jax.jit(unrolled.init)(jax.random.key(0, impl="rbg"))
    stacked = _stacked(params, SCANNED_LAYERS[name])
    shapes = jax.eval_shape(scanned.init, jax.random.key(0))[0]
    assert jax.tree.map(lambda x: x.shape, stacked) == jax.tree.map(lambda x: x.shape, shapes)
    batch = unrolled.make_batch(jax.random.key(1, impl="rbg"), 4)

    def loss_and_grads(spec):
        return jax.jit(jax.value_and_grad(lambda p: spec.loss_fn(p, {}, batch)[0]))

    loss, grads = loss_and_grads(unrolled)(params)
    scanned_loss, scanned_grads = loss_and_grads(scanned)(stacked)
    assert float(scanned_loss) == pytest.approx(float(loss), rel=1e-5)
    # atol from the largest gradient: some are zero but for rounding (attention's key bias).
    expected = _stacked(grads, SCANNED_LAYERS[name])
    scale = max(float(jax.numpy.max(jax.numpy.abs(g))) for g in jax.tree.leaves(expected))
    jax.tree.map(lambda a, e: np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-6 * scale), scanned_grads, expected)
    text = loss_and_grads(scanned).lower(stacked).compile().as_text()
    assert text.count(" while(") == 2 * len(SCANNED_LAYERS[name])


def test_remat_recomputes_the_blocks_scanned_and_unrolled(mesh):
    """`remat="full"` rematerializes each block in both forms: the compiled step runs more dots than
    the step without remat. Unrolled, the recomputation needs `prevent_cse` (without it XLA's CSE
    merges it into the forward pass and the step compiles to the one without remat)."""
    for scan in (False, True):
        dots = {}
        for remat in ("none", "full"):
            spec = zoo.resized("gpt", scan_layers=scan, remat=remat)
            step, state, batch = zoo.make_train_step(spec, optax.adam(1e-3), mesh, "jit")
            text = step.lower(state, batch).compile().as_text()
            dots[remat] = text.count(" dot(")
        assert dots["full"] > dots["none"] > 0, (scan, dots)
