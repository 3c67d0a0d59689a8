"""Transformer (encoder-decoder) for translation: token embeddings shared by source, target and the
output projection (scaled by sqrt(d_model)), sinusoidal positions, post-layer-norm encoder layers
(self-attention, ReLU feed-forward) and decoder layers (causal self-attention, cross-attention,
feed-forward); label-smoothed (0.1) cross-entropy with teacher forcing.

Sizes:
- ``paper``: Transformer-base of Vaswani et al., "Attention Is All You Need" (NeurIPS 2017), Table 3:
  6+6 layers, d_model 512, 8 heads, d_ff 2048, shared 37000-token BPE vocabulary (WMT14 EN-DE);
  about 63M parameters. Source and target length 128, 24 sentence pairs per device: 192 pairs,
  about 25000 source and 25000 target tokens on 8 devices, the paper's batch (section 5.1).
- ``tiny``: 2+2 layers, d_model 32, 2 heads, d_ff 64, vocabulary 64, length 8.

Dropout is left out so that steps are deterministic. `EncoderLayer` is reused by BERT.
``scan_layers=True`` (`zoo.resized("transformer", scan_layers=True)`) runs each stack under
`nn.scan`, as large models are written: one `while` loop per stack and pass, its parameters
stacked `(layers, ...)` (DESIGN.md point 22).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ._common import ModelSpec, mean_cross_entropy, random_tokens, shift_right


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    vocab_size: int
    d_model: int
    num_heads: int
    d_ff: int
    num_encoder_layers: int
    num_decoder_layers: int
    seq_len: int
    global_batch: int
    label_smoothing: float = 0.1
    # Each stack under one `nn.scan` (a `while` loop over `(layers, ...)` parameters) rather than unrolled.
    scan_layers: bool = False


CONFIGS = {
    "tiny": TransformerConfig(64, 32, 2, 64, 2, 2, 8, 16),
    "paper": TransformerConfig(37000, 512, 8, 2048, 6, 6, 128, 192),
}


def sinusoidal_positions(length: int, d_model: int) -> np.ndarray:
    # numpy, so that it becomes a constant rather than ops in the step
    position = np.arange(length)[:, None]
    scale = np.exp(-np.log(10000.0) * np.arange(0, d_model, 2) / d_model)
    table = np.zeros((length, d_model), np.float32)
    table[:, 0::2] = np.sin(position * scale)
    table[:, 1::2] = np.cos(position * scale)
    return table


class FeedForward(nn.Module):
    d_ff: int
    activation: Callable[[jax.Array], jax.Array] = nn.relu

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(x.shape[-1])(self.activation(nn.Dense(self.d_ff)(x)))


class EncoderLayer(nn.Module):
    num_heads: int
    d_ff: int
    activation: Callable[[jax.Array], jax.Array] = nn.relu
    layer_norm_epsilon: float = 1e-6

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        attention = nn.MultiHeadDotProductAttention(self.num_heads, deterministic=True)
        x = nn.LayerNorm(self.layer_norm_epsilon)(x + attention(x, x, mask=mask))
        return nn.LayerNorm(self.layer_norm_epsilon)(x + FeedForward(self.d_ff, self.activation)(x))


class DecoderLayer(nn.Module):
    num_heads: int
    d_ff: int

    @nn.compact
    def __call__(self, x: jax.Array, encoded: jax.Array, causal_mask: jax.Array) -> jax.Array:
        self_attention = nn.MultiHeadDotProductAttention(self.num_heads, deterministic=True)
        cross_attention = nn.MultiHeadDotProductAttention(self.num_heads, deterministic=True)
        x = nn.LayerNorm(1e-6)(x + self_attention(x, x, mask=causal_mask))
        x = nn.LayerNorm(1e-6)(x + cross_attention(x, encoded))
        return nn.LayerNorm(1e-6)(x + FeedForward(self.d_ff)(x))


class _ScannedEncoderLayer(nn.Module):
    """One `EncoderLayer` as `nn.scan` runs it: the activations are the carry."""

    num_heads: int
    d_ff: int

    @nn.compact
    def __call__(self, x: jax.Array, _) -> tuple[jax.Array, None]:
        return EncoderLayer(self.num_heads, self.d_ff, name="layer")(x), None


class _ScannedDecoderLayer(nn.Module):
    """One `DecoderLayer` as `nn.scan` runs it: the encoder's output and the mask broadcast."""

    num_heads: int
    d_ff: int

    @nn.compact
    def __call__(self, y: jax.Array, encoded: jax.Array, causal_mask: jax.Array) -> tuple[jax.Array, None]:
        return DecoderLayer(self.num_heads, self.d_ff, name="layer")(y, encoded, causal_mask), None


def _scanned(layer: type[nn.Module], length: int, broadcast: int) -> type[nn.Module]:
    """`layer` under `nn.scan` over `length` layers: parameters stacked on a leading axis, the
    `broadcast` arguments after the carry the same for every layer."""
    return nn.scan(
        layer,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        in_axes=(nn.broadcast,) * broadcast,
        length=length,
    )


class Transformer(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, source: jax.Array, target_inputs: jax.Array) -> jax.Array:
        cfg = self.config
        embedding_init = nn.initializers.normal(cfg.d_model**-0.5)
        embed = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=embedding_init)
        positions = sinusoidal_positions(cfg.seq_len, cfg.d_model)

        def embed_tokens(tokens):
            return embed(tokens) * np.sqrt(cfg.d_model) + positions[: tokens.shape[1]]

        x = embed_tokens(source)
        y = embed_tokens(target_inputs)
        causal_mask = nn.make_causal_mask(target_inputs)
        if cfg.scan_layers:
            encoder = _scanned(_ScannedEncoderLayer, cfg.num_encoder_layers, 1)
            x, _ = encoder(cfg.num_heads, cfg.d_ff, name="encoder")(x, None)
            decoder = _scanned(_ScannedDecoderLayer, cfg.num_decoder_layers, 2)
            y, _ = decoder(cfg.num_heads, cfg.d_ff, name="decoder")(y, x, causal_mask)
            return embed.attend(y)
        for _ in range(cfg.num_encoder_layers):
            x = EncoderLayer(cfg.num_heads, cfg.d_ff)(x)
        for _ in range(cfg.num_decoder_layers):
            y = DecoderLayer(cfg.num_heads, cfg.d_ff)(y, x, causal_mask)
        return embed.attend(y)


def _make_batch(cfg: TransformerConfig, rng: jax.Array, global_batch_size: int):
    source_rng, target_rng = jax.random.split(rng)
    shape = (global_batch_size, cfg.seq_len)
    return {
        "source": random_tokens(source_rng, shape, cfg.vocab_size),
        "target": random_tokens(target_rng, shape, cfg.vocab_size),
    }


def spec_of(cfg: TransformerConfig, config: str = "custom") -> ModelSpec:
    """The zoo spec of this model at size `cfg`; `config` names it (``'tiny'``, ``'paper'``, ...)."""
    model = Transformer(cfg)

    def init(rng):
        dummy = jnp.zeros((1, cfg.seq_len), jnp.int32)
        return model.init(rng, dummy, dummy)["params"], {}

    def loss_fn(params, model_state, batch, axis_name=None):
        logits = model.apply({"params": params}, batch["source"], shift_right(batch["target"]))
        return mean_cross_entropy(logits, batch["target"], cfg.label_smoothing), model_state

    return ModelSpec(
        name="transformer",
        config=config if isinstance(config, str) else "custom",
        init=init,
        loss_fn=loss_fn,
        make_batch=partial(_make_batch, cfg),
        default_global_batch=cfg.global_batch,
        description=(
            f"Transformer {cfg.num_encoder_layers}+{cfg.num_decoder_layers} layers, d_model {cfg.d_model}, "
            f"vocab {cfg.vocab_size}, length {cfg.seq_len}" + (", scanned layers" if cfg.scan_layers else "")
        ),
    )


def make_spec(config: str) -> ModelSpec:
    return spec_of(CONFIGS[config], config)
