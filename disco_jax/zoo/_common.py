"""Model specs and data-parallel training steps shared by every zoo model.

A `ModelSpec` is what the rest of disco-jax needs from a model: how to initialise it, its loss, and
how to make (or describe) a batch. `make_train_step` turns a spec into a jitted data-parallel step in
one of two styles, and `lower_abstract` lowers that step from shapes alone (for the `paper` configs,
which are far too big to materialise on a CPU).

The two styles compute the same step:

- ``"jit"``: `jax.jit` of the whole-batch step, params replicated (``P()``), batch sharded on its
  leading axis (``P('data')``). XLA's SPMD partitioner inserts the gradient all-reduces.
- ``"shard_map"``: `jax.jit` of `jax.shard_map` of a per-device step (``check_vma=True``). Each device
  takes the mean loss of its shard and `lax.pmean`s it over ``'data'``; the gradient of that pmean
  with respect to the replicated (unvarying) params is already the global mean gradient, because
  the transpose of the implicit replicated-to-varying cast is a psum. So no extra pmean of the
  gradients (it would be a no-op on unvarying values anyway; a psum would double-count). Checked
  numerically against the jit style in tests/test_zoo.py.

Batch normalisation (ResNet-50) uses the statistics of the global batch in both styles: the jit style
gets that for free (the mean over a sharded axis), the shard_map style passes ``axis_name='data'``
so that Flax's BatchNorm pmeans its statistics (as Flax's ImageNet example does). Running averages
are model state, replicated and updated in the step.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

PyTree = Any
Batch = PyTree
Style = Literal["jit", "shard_map"]
STYLES: tuple[Style, ...] = ("jit", "shard_map")
DATA_AXIS = "data"


class TrainState(NamedTuple):
    """Everything a training step carries from one step to the next (all replicated)."""

    params: PyTree
    opt_state: PyTree
    model_state: PyTree  # non-trainable variables, e.g. {'batch_stats': ...}; {} when none


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One model at one size, as the zoo hands it out.

    Attributes:
      name: registry name, e.g. ``'resnet50'``.
      config: ``'tiny'`` or ``'paper'``.
      init: ``init(rng) -> (params, model_state)``; traceable, so `jax.eval_shape` gives shapes only.
      loss_fn: ``loss_fn(params, model_state, batch, axis_name=None) -> (loss, new_model_state)``;
        the mean loss over ``batch``. ``axis_name`` is the mapped data axis inside `shard_map` (only
        models with cross-example state, i.e. batch norm, use it) and ``None`` under plain jit.
      make_batch: ``make_batch(rng, global_batch_size) -> batch`` of real (random) arrays, every leaf
        with the batch on its leading axis; traceable.
      default_global_batch: the global batch size for 8 devices (divisible by 8).
      description: one line: architecture and size.
    """

    name: str
    config: str
    init: Callable[[jax.Array], tuple[PyTree, PyTree]]
    loss_fn: Callable[..., tuple[jax.Array, PyTree]]
    make_batch: Callable[[jax.Array, int], Batch]
    default_global_batch: int
    description: str = ""

    def batch_spec(self, global_batch_size: int | None = None) -> Batch:
        """The batch as a pytree of `jax.ShapeDtypeStruct` (nothing is allocated)."""
        size = self.default_global_batch if global_batch_size is None else global_batch_size
        return jax.eval_shape(lambda: self.make_batch(jax.random.key(0), size))

    def param_count(self) -> int:
        """Number of trainable parameters, from shapes only."""
        params, _ = jax.eval_shape(self.init, jax.random.key(0))
        return sum(leaf.size for leaf in jax.tree.leaves(params))


def data_mesh(num_devices: int | None = None, axis_name: str = DATA_AXIS) -> Mesh:
    """A 1-D mesh over the first ``num_devices`` devices (all by default), with an Auto axis."""
    devices = jax.devices()[: num_devices or len(jax.devices())]
    return jax.make_mesh((len(devices),), (axis_name,), axis_types=(AxisType.Auto,), devices=devices)


def _auto_axes(mesh: Mesh) -> Mesh:
    # `jax.make_mesh` defaults to Explicit axes, which put shardings into the types and make many
    # ops (convs, gathers) demand out_sharding arguments. Data parallelism needs none of that.
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def _check_batch_size(global_batch_size: int, mesh: Mesh, data_axis: str) -> None:
    devices = mesh.shape[data_axis]
    if global_batch_size % devices:
        raise ValueError(f"global batch {global_batch_size} is not divisible by {devices} devices")


def _step_fn(spec: ModelSpec, optimizer: optax.GradientTransformation, axis_name: str | None):
    def step(state: TrainState, batch: Batch) -> tuple[TrainState, jax.Array]:
        def objective(params):
            loss, model_state = spec.loss_fn(params, state.model_state, batch, axis_name=axis_name)
            if axis_name is not None:
                loss = jax.lax.pmean(loss, axis_name)
            return loss, model_state

        (loss, model_state), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return TrainState(params, opt_state, model_state), loss

    return step


def build_train_step(
    spec: ModelSpec,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    style: Style = "jit",
    *,
    data_axis: str = DATA_AXIS,
    donate: bool = False,
) -> Callable[[TrainState, Batch], tuple[TrainState, jax.Array]]:
    """The jitted data-parallel step ``step(state, batch) -> (new_state, loss)``.

    ``state`` must be replicated over ``mesh`` and ``batch`` sharded on ``data_axis`` (see
    `shard_state_and_batch`). ``donate=True`` donates the state buffers.
    """
    mesh = _auto_axes(mesh)
    replicated = NamedSharding(mesh, P())
    batch_sharded = NamedSharding(mesh, P(data_axis))
    if style == "jit":
        step = _step_fn(spec, optimizer, axis_name=None)
    elif style == "shard_map":
        step = jax.shard_map(
            _step_fn(spec, optimizer, axis_name=data_axis),
            mesh=mesh,
            in_specs=(P(), P(data_axis)),
            out_specs=(P(), P()),
        )
    else:
        raise ValueError(f"unknown style {style!r}; expected one of {STYLES}")
    return jax.jit(
        step,
        in_shardings=(replicated, batch_sharded),
        out_shardings=(replicated, replicated),
        donate_argnums=(0,) if donate else (),
    )


def _init_state(spec: ModelSpec, optimizer: optax.GradientTransformation, rng: jax.Array) -> TrainState:
    params, model_state = spec.init(rng)
    return TrainState(params, optimizer.init(params), model_state)


def make_train_step(
    spec: ModelSpec,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    style: Style = "jit",
    *,
    global_batch_size: int | None = None,
    seed: int = 0,
    data_axis: str = DATA_AXIS,
    donate: bool = False,
) -> tuple[Callable[[TrainState, Batch], tuple[TrainState, jax.Array]], TrainState, Batch]:
    """The jitted step plus a replicated initial state and a sharded random batch.

    Usage: ``step, state, batch = make_train_step(spec, optax.adam(1e-3), mesh, "jit")`` then
    ``state, loss = step(state, batch)``. The same ``seed`` gives the same state and batch in both
    styles. Random numbers come from an ``'rbg'`` key.
    """
    mesh = _auto_axes(mesh)
    size = spec.default_global_batch if global_batch_size is None else global_batch_size
    _check_batch_size(size, mesh, data_axis)
    # RBG keys: XLA:CPU compiles threefry (one inlined copy per parameter) several times slower.
    init_rng, batch_rng = jax.random.split(jax.random.key(seed, impl="rbg"))
    # Build directly in their shardings so nothing global is ever held on one device.
    state = jax.jit(lambda rng: _init_state(spec, optimizer, rng), out_shardings=NamedSharding(mesh, P()))(init_rng)
    batch = jax.jit(lambda rng: spec.make_batch(rng, size), out_shardings=NamedSharding(mesh, P(data_axis)))(batch_rng)
    step = build_train_step(spec, optimizer, mesh, style, data_axis=data_axis, donate=donate)
    return step, state, batch


def abstract_state_and_batch(
    spec: ModelSpec,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    global_batch_size: int | None = None,
    data_axis: str = DATA_AXIS,
) -> tuple[TrainState, Batch]:
    """The train state and batch as `jax.ShapeDtypeStruct` pytrees carrying their shardings
    (immutable; remembered per arguments, so both styles of a model trace its init once)."""
    size = spec.default_global_batch if global_batch_size is None else global_batch_size
    _check_batch_size(size, _auto_axes(mesh), data_axis)
    arguments = (spec, optimizer, mesh, size, data_axis)
    try:
        hash(arguments)
    except TypeError:  # an optimizer holding something unhashable: traced every time
        return _abstract_state_and_batch.__wrapped__(*arguments)
    return _abstract_state_and_batch(*arguments)


@functools.lru_cache(maxsize=32)
def _abstract_state_and_batch(
    spec: ModelSpec, optimizer: optax.GradientTransformation, mesh: Mesh, size: int, data_axis: str
) -> tuple[TrainState, Batch]:
    mesh = _auto_axes(mesh)

    def with_sharding(tree, sharding):
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), tree)

    state = jax.eval_shape(lambda rng: _init_state(spec, optimizer, rng), jax.random.key(0))
    return (
        with_sharding(state, NamedSharding(mesh, P())),
        with_sharding(spec.batch_spec(size), NamedSharding(mesh, P(data_axis))),
    )


def lower_abstract(
    spec: ModelSpec,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    style: Style = "jit",
    *,
    global_batch_size: int | None = None,
    data_axis: str = DATA_AXIS,
    donate: bool = False,
) -> jax.stages.Lowered:
    """Lower the data-parallel step from shapes only; no array of the model is allocated.

    Meant for the `paper` configs: ``lower_abstract(get_model('bert', 'paper'), optax.adam(1e-4),
    mesh).compile()`` compiles BERT-base for ``mesh`` without ever initialising it.
    """
    state, batch = abstract_state_and_batch(
        spec, optimizer, mesh, global_batch_size=global_batch_size, data_axis=data_axis
    )
    step = build_train_step(spec, optimizer, mesh, style, data_axis=data_axis, donate=donate)
    return step.lower(state, batch)


# Small helpers the models share.


def mean_cross_entropy(logits: jax.Array, labels: jax.Array, label_smoothing: float = 0.0) -> jax.Array:
    """Mean softmax cross-entropy over all leading axes, with optional label smoothing."""
    if label_smoothing:
        targets = optax.smooth_labels(jax.nn.one_hot(labels, logits.shape[-1]), label_smoothing)
        return jnp.mean(optax.softmax_cross_entropy(logits, targets))
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def random_image_batch(rng: jax.Array, global_batch_size: int, image_size: int, num_classes: int) -> dict:
    """NHWC float32 images and int32 class labels, for the image classifiers."""
    image_rng, label_rng = jax.random.split(rng)
    shape = (global_batch_size, image_size, image_size, 3)
    return {
        "images": jax.random.normal(image_rng, shape, jnp.float32),
        "labels": jax.random.randint(label_rng, (global_batch_size,), 0, num_classes, jnp.int32),
    }


def random_tokens(rng: jax.Array, shape: tuple[int, ...], vocab_size: int) -> jax.Array:
    return jax.random.randint(rng, shape, 0, vocab_size, dtype=jnp.int32)


def shift_right(tokens: jax.Array) -> jax.Array:
    """Teacher-forcing inputs: prepend token 0 (BOS) and drop the last token."""
    return jnp.pad(tokens, ((0, 0), (1, 0)))[:, :-1]
