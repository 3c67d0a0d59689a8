"""Reformer: a causal language model of reversible layers with LSH attention (Kitaev, Kaiser and
Levskaya, "Reformer: The Efficient Transformer", ICLR 2020).

- Embeddings: tokens plus axial positional embeddings; the activations are duplicated into the two
  halves (x1, x2) of the reversible stack, and at the end concatenated, layer-normed and projected
  to the vocabulary.
- Reversible layers (section 3): ``y1 = x1 + Attention(x2); y2 = x2 + FeedForward(y1)``. The
  backward pass (a `jax.custom_vjp`) keeps only the stack's outputs and recomputes each layer's
  inputs from its outputs, so activation memory does not grow with depth.
- LSH attention (section 2): shared query/key projection; each position is hashed n_hashes times
  by random rotations (angular LSH), positions are sorted by (hash round, bucket, position), cut
  into chunks, and each chunk attends to itself and the chunk before it (causal, not to itself
  unless nothing else is visible, keys unit-normalised); the rounds are combined with weights from
  their softmax normalisers.

Sizes:
- ``paper``: the enwik8-64K model of the paper's section 5: 12 layers, d_model 1024, d_ff 4096,
  8 heads, byte vocabulary (256), sequences of 65536 tokens, batch 1 per device (global 8). LSH
  chunk 64, 2 hashes, axial positions (128, 512) with dims (256, 768), as in trax's Reformer
  configurations; buckets = length / chunk (average bucket size one chunk). About 140M parameters.
- ``tiny``: 2 layers, d_model 32, d_ff 64, 2 heads, vocabulary 32, 32 tokens, chunk 8, 2 hashes.

Simplifications: the hash rotations are drawn once at init and kept as model state
(``{'lsh_rotations': ...}``) rather than redrawn every step (they must be the same in the forward
and the recomputing backward pass either way); feed-forward chunking and dropout are left out.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp

from ._common import ModelSpec, mean_cross_entropy, random_tokens, shift_right


@dataclasses.dataclass(frozen=True)
class ReformerConfig:
    vocab_size: int
    d_model: int
    d_ff: int
    num_heads: int
    num_layers: int
    seq_len: int
    axial_shape: tuple[int, int]  # product = seq_len
    axial_dims: tuple[int, int]  # sum = d_model
    chunk_len: int
    num_hashes: int
    global_batch: int

    @property
    def num_buckets(self) -> int:
        return self.seq_len // self.chunk_len


CONFIGS = {
    "tiny": ReformerConfig(32, 32, 64, 2, 2, 32, (4, 8), (8, 24), 8, 2, 16),
    "paper": ReformerConfig(256, 1024, 4096, 8, 12, 65536, (128, 512), (256, 768), 64, 2, 8),
}


def _layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    variance = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(variance + 1e-6) * scale + bias


def _sort_indices(keys: jax.Array) -> jax.Array:
    """Indices that sort ``keys`` along the last axis."""
    iota = jax.lax.broadcasted_iota(jnp.int32, keys.shape, keys.ndim - 1)
    return jax.lax.sort_key_val(keys, iota, dimension=keys.ndim - 1)[1]


def _look_one_back(x: jax.Array) -> jax.Array:
    """Each chunk (axis 2) followed by the chunk before it, along axis 3."""
    return jnp.concatenate([x, jnp.roll(x, 1, axis=2)], axis=3)


def lsh_attention(params, rotations: jax.Array, x: jax.Array, cfg: ReformerConfig) -> jax.Array:
    """Causal multi-round LSH self-attention of ``x`` [batch, length, d_model] (pre-layer-norm)."""
    batch, length, d_model = x.shape
    heads, rounds, chunk = cfg.num_heads, cfg.num_hashes, cfg.chunk_len
    head_dim = d_model // heads
    h = _layer_norm(x, params["norm_scale"], params["norm_bias"])

    def split_heads(kernel):  # -> [batch, heads, length, head_dim]
        return (h @ kernel).reshape(batch, length, heads, head_dim).transpose(0, 2, 1, 3)

    query_key, value = split_heads(params["query_key"]), split_heads(params["value"])

    rotated = jnp.einsum("bhld,dnr->bhnlr", jax.lax.stop_gradient(query_key), rotations)
    buckets = jnp.argmax(jnp.concatenate([rotated, -rotated], axis=-1), axis=-1)  # [b, h, round, l]
    positions = jnp.arange(length)
    round_offset = jnp.arange(rounds)[:, None] * (cfg.num_buckets * length)
    order = _sort_indices((round_offset + buckets * length + positions).reshape(batch, heads, -1))
    undo_order = _sort_indices(order)
    sorted_positions = order % length  # [b, h, rounds * length]

    def gather_sorted(t):
        return jnp.take_along_axis(t, sorted_positions[..., None], axis=2)

    def chunked(t):
        return t.reshape(batch, heads, rounds * length // chunk, chunk, *t.shape[3:])

    queries = gather_sorted(query_key)
    keys = queries * jax.lax.rsqrt(jnp.sum(jnp.square(queries), axis=-1, keepdims=True) + 1e-6)
    query_positions = chunked(sorted_positions)
    key_positions = _look_one_back(query_positions)
    dots = jnp.einsum("bhcqd,bhckd->bhcqk", chunked(queries), _look_one_back(chunked(keys)))
    dots = dots * head_dim**-0.5
    dots = jnp.where(query_positions[..., :, None] < key_positions[..., None, :], -1e9, dots)
    dots = jnp.where(query_positions[..., :, None] == key_positions[..., None, :], -1e5, dots)
    normaliser = jax.nn.logsumexp(dots, axis=-1, keepdims=True)
    values = _look_one_back(chunked(gather_sorted(value)))
    out = jnp.einsum("bhcqk,bhckd->bhcqd", jnp.exp(dots - normaliser), values)

    # Back to (round, position) order; combine rounds weighted by their share of softmax mass.
    out = jnp.take_along_axis(out.reshape(batch, heads, -1, head_dim), undo_order[..., None], axis=2)
    normaliser = jnp.take_along_axis(normaliser.reshape(batch, heads, -1), undo_order, axis=2)
    out = out.reshape(batch, heads, rounds, length, head_dim)
    normaliser = normaliser.reshape(batch, heads, rounds, length, 1)
    out = jnp.sum(out * jax.nn.softmax(normaliser, axis=2), axis=2)
    return out.transpose(0, 2, 1, 3).reshape(batch, length, d_model) @ params["output"]


def feed_forward(params, x: jax.Array) -> jax.Array:
    h = _layer_norm(x, params["norm_scale"], params["norm_bias"])
    return nn.gelu(h @ params["wi"] + params["bi"]) @ params["wo"] + params["bo"]


def _attention_with(rotations, cfg, params, x):
    return lsh_attention(params, rotations, x, cfg)


def _reversible_layer(cfg, params, rotations, x1, x2):
    y1 = x1 + lsh_attention(params["attention"], rotations, x2, cfg)
    return y1, x2 + feed_forward(params["feed_forward"], y1)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def reversible_stack(cfg: ReformerConfig, layers: list, rotations: list, x1: jax.Array, x2: jax.Array):
    """Apply the reversible layers in order; the backward pass recomputes inputs from outputs."""
    for params, layer_rotations in zip(layers, rotations):
        x1, x2 = _reversible_layer(cfg, params, layer_rotations, x1, x2)
    return x1, x2


def _reversible_stack_forward(cfg, layers, rotations, x1, x2):
    y1, y2 = reversible_stack(cfg, layers, rotations, x1, x2)
    return (y1, y2), (layers, rotations, y1, y2)  # no per-layer activations


def _reversible_stack_backward(cfg, residuals, output_grads):
    layers, rotations, y1, y2 = residuals
    dy1, dy2 = output_grads
    layer_grads = []
    for params, layer_rotations in reversed(list(zip(layers, rotations))):
        # y2 = x2 + G(y1): recover x2, and push dy2 through G.
        g_out, g_vjp = jax.vjp(feed_forward, params["feed_forward"], y1)
        x2 = y2 - g_out
        g_param_grads, dy1_from_g = g_vjp(dy2)
        dy1 = dy1 + dy1_from_g
        # y1 = x1 + F(x2): recover x1, and push dy1 through F.
        attention = partial(_attention_with, layer_rotations, cfg)
        f_out, f_vjp = jax.vjp(attention, params["attention"], x2)
        x1 = y1 - f_out
        f_param_grads, dx2_from_f = f_vjp(dy1)
        dy2 = dy2 + dx2_from_f
        y1, y2 = x1, x2
        layer_grads.append({"attention": f_param_grads, "feed_forward": g_param_grads})
    return layer_grads[::-1], jax.tree.map(jnp.zeros_like, rotations), dy1, dy2


reversible_stack.defvjp(_reversible_stack_forward, _reversible_stack_backward)


class _AttentionParams(nn.Module):
    d_model: int

    @nn.compact
    def __call__(self):
        d, kernel = self.d_model, nn.initializers.lecun_normal()
        return {
            "norm_scale": self.param("norm_scale", nn.initializers.ones, (d,)),
            "norm_bias": self.param("norm_bias", nn.initializers.zeros, (d,)),
            "query_key": self.param("query_key", kernel, (d, d)),
            "value": self.param("value", kernel, (d, d)),
            "output": self.param("output", kernel, (d, d)),
        }


class _FeedForwardParams(nn.Module):
    d_model: int
    d_ff: int

    @nn.compact
    def __call__(self):
        d, kernel = self.d_model, nn.initializers.lecun_normal()
        return {
            "norm_scale": self.param("norm_scale", nn.initializers.ones, (d,)),
            "norm_bias": self.param("norm_bias", nn.initializers.zeros, (d,)),
            "wi": self.param("wi", kernel, (d, self.d_ff)),
            "bi": self.param("bi", nn.initializers.zeros, (self.d_ff,)),
            "wo": self.param("wo", kernel, (self.d_ff, d)),
            "bo": self.param("bo", nn.initializers.zeros, (d,)),
        }


class ReformerLM(nn.Module):
    config: ReformerConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.config
        x = nn.Embed(cfg.vocab_size, cfg.d_model)(tokens)
        (rows, cols), (rows_dim, cols_dim) = cfg.axial_shape, cfg.axial_dims
        position_init = nn.initializers.normal(0.02)
        by_row = self.param("axial_positions_0", position_init, (rows, 1, rows_dim))
        by_col = self.param("axial_positions_1", position_init, (1, cols, cols_dim))
        by_row = jnp.broadcast_to(by_row, (rows, cols, rows_dim))
        by_col = jnp.broadcast_to(by_col, (rows, cols, cols_dim))
        positions = jnp.concatenate([by_row, by_col], axis=-1).reshape(rows * cols, cfg.d_model)
        x = x + positions[: tokens.shape[1]]

        layers, rotations = [], []
        head_dim = cfg.d_model // cfg.num_heads
        for i in range(cfg.num_layers):
            attention = _AttentionParams(cfg.d_model, name=f"layer_{i}_attention")
            ff = _FeedForwardParams(cfg.d_model, cfg.d_ff, name=f"layer_{i}_feed_forward")
            layers.append({"attention": attention(), "feed_forward": ff()})
            rotation_shape = (head_dim, cfg.num_hashes, cfg.num_buckets // 2)
            rotations.append(
                self.variable(
                    "lsh_rotations",
                    f"layer_{i}",
                    lambda shape=rotation_shape: jax.random.normal(self.make_rng("params"), shape),
                ).value
            )
        y1, y2 = reversible_stack(cfg, layers, rotations, x, x)
        y = nn.LayerNorm(1e-6)(jnp.concatenate([y1, y2], axis=-1))
        return nn.Dense(cfg.vocab_size)(y)


def _make_batch(cfg: ReformerConfig, rng: jax.Array, global_batch_size: int):
    return {"tokens": random_tokens(rng, (global_batch_size, cfg.seq_len), cfg.vocab_size)}


def spec_of(cfg: ReformerConfig, config: str = "custom") -> ModelSpec:
    """The zoo spec of this model at size `cfg`; `config` names it (``'tiny'``, ``'paper'``, ...)."""
    assert cfg.axial_shape[0] * cfg.axial_shape[1] == cfg.seq_len
    assert sum(cfg.axial_dims) == cfg.d_model and cfg.seq_len % cfg.chunk_len == 0
    model = ReformerLM(cfg)

    def init(rng):
        variables = model.init(rng, jnp.zeros((1, cfg.seq_len), jnp.int32))
        return variables["params"], {"lsh_rotations": variables["lsh_rotations"]}

    def loss_fn(params, model_state, batch, axis_name=None):
        logits = model.apply({"params": params, **model_state}, shift_right(batch["tokens"]))
        return mean_cross_entropy(logits, batch["tokens"]), model_state

    return ModelSpec(
        name="reformer",
        config=config,
        init=init,
        loss_fn=loss_fn,
        make_batch=partial(_make_batch, cfg),
        default_global_batch=cfg.global_batch,
        description=(
            f"Reformer {cfg.num_layers} reversible layers, d_model {cfg.d_model}, length {cfg.seq_len}, "
            f"{cfg.num_hashes} hashes"
        ),
    )


def make_spec(config: str) -> ModelSpec:
    return spec_of(CONFIGS[config], config)
