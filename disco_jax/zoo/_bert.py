"""BERT: a bidirectional Transformer encoder (word + position + segment embeddings, post-layer-norm
layers with GELU feed-forward) with the masked-language-model head (dense + GELU + layer norm, then
the word embeddings transposed plus a bias), trained by cross-entropy on the masked positions.

Sizes:
- ``paper``: BERT-base of Devlin et al., "BERT: Pre-training of Deep Bidirectional Transformers for
  Language Understanding" (NAACL 2019): 12 layers, hidden 768, 12 heads, d_ff 3072, 30522-token
  WordPiece vocabulary, 512 positions; about 110M parameters. Pre-training phase 1 (90% of the
  steps): sequences of 128 tokens, 20 masked predictions per sequence (max_predictions_per_seq of the
  reference implementation), 32 sequences per device: 256 on 8 devices, the paper's batch.
- ``tiny``: 2 layers, hidden 32, 2 heads, d_ff 64, vocabulary 64, 16 tokens, 3 predictions.

The next-sentence-prediction head is left out (only the MLM loss), and so is dropout. Every sequence
has the same number of masked positions, so the loss is a plain mean and averages over devices
exactly.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp

from ._common import ModelSpec, mean_cross_entropy, random_tokens
from ._transformer import EncoderLayer

MASK_TOKEN = 1


@dataclasses.dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_heads: int
    d_ff: int
    num_layers: int
    max_positions: int
    seq_len: int
    num_predictions: int
    global_batch: int


CONFIGS = {
    "tiny": BertConfig(64, 32, 2, 64, 2, 16, 16, 3, 16),
    "paper": BertConfig(30522, 768, 12, 3072, 12, 512, 128, 20, 256),
}


class Bert(nn.Module):
    config: BertConfig

    @nn.compact
    def __call__(self, input_ids, segment_ids, masked_positions) -> jax.Array:
        cfg = self.config
        init = nn.initializers.truncated_normal(0.02)
        word_embeddings = nn.Embed(cfg.vocab_size, cfg.hidden_size, embedding_init=init)
        position_table = self.param("position_embeddings", init, (cfg.max_positions, cfg.hidden_size))
        x = word_embeddings(input_ids) + position_table[: input_ids.shape[1]]
        x = x + nn.Embed(2, cfg.hidden_size, embedding_init=init, name="segment_embeddings")(segment_ids)
        x = nn.LayerNorm(1e-12)(x)
        for _ in range(cfg.num_layers):
            x = EncoderLayer(cfg.num_heads, cfg.d_ff, nn.gelu, layer_norm_epsilon=1e-12)(x)
        # The MLM head only runs on the masked positions.
        x = jnp.take_along_axis(x, masked_positions[..., None], axis=1)
        x = nn.LayerNorm(1e-12)(nn.gelu(nn.Dense(cfg.hidden_size, kernel_init=init)(x)))
        output_bias = self.param("output_bias", nn.initializers.zeros, (cfg.vocab_size,))
        return word_embeddings.attend(x) + output_bias


def _make_batch(cfg: BertConfig, rng: jax.Array, global_batch_size: int):
    token_rng, position_rng = jax.random.split(rng)
    tokens = random_tokens(token_rng, (global_batch_size, cfg.seq_len), cfg.vocab_size)
    # distinct positions per sequence: the first num_predictions of a random permutation
    order = jnp.argsort(jax.random.uniform(position_rng, tokens.shape), axis=1)
    masked_positions = order[:, : cfg.num_predictions].astype(jnp.int32)
    rows = jnp.arange(global_batch_size)[:, None]
    half = cfg.seq_len // 2
    return {
        "input_ids": tokens.at[rows, masked_positions].set(MASK_TOKEN),
        "segment_ids": jnp.broadcast_to((jnp.arange(cfg.seq_len) >= half).astype(jnp.int32), tokens.shape),
        "masked_positions": masked_positions,
        "masked_labels": tokens[rows, masked_positions],
    }


def spec_of(cfg: BertConfig, config: str = "custom") -> ModelSpec:
    """The zoo spec of this model at size `cfg`; `config` names it (``'tiny'``, ``'paper'``, ...)."""
    model = Bert(cfg)

    def init(rng):
        dummy = jnp.zeros((1, cfg.seq_len), jnp.int32)
        return model.init(rng, dummy, dummy, dummy[:, : cfg.num_predictions])["params"], {}

    def loss_fn(params, model_state, batch, axis_name=None):
        logits = model.apply({"params": params}, batch["input_ids"], batch["segment_ids"], batch["masked_positions"])
        return mean_cross_entropy(logits, batch["masked_labels"]), model_state

    return ModelSpec(
        name="bert",
        config=config,
        init=init,
        loss_fn=loss_fn,
        make_batch=partial(_make_batch, cfg),
        default_global_batch=cfg.global_batch,
        description=(
            f"BERT {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, length {cfg.seq_len}"
        ),
    )


def make_spec(config: str) -> ModelSpec:
    return spec_of(CONFIGS[config], config)
