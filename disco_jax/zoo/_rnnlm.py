"""RNNLM: a word-level language model, token embedding -> 2 stacked LSTM layers -> dense softmax over
the vocabulary, next-token cross-entropy (the model in the RNNLM case study of the DisCo paper).

Sizes:
- ``paper``: the "large" model of Zaremba et al., "Recurrent Neural Network Regularization" (2014),
  section 4.1 (Penn Treebank): 2 layers of 1500 LSTM units, 10000-word vocabulary, unrolled for 35
  steps, batch 20 (per device here: global 160 on 8 devices); about 66M parameters.
- ``tiny``: 2 layers of 32 units, vocabulary 64, 8 steps.

The time loop is fully unrolled (as in static-graph RNNLM benchmarks), so every step's kernels are
separate HLO instructions that the fusion search can see, rather than one `while` body. The LSTM
state starts at zero each batch, and dropout is left out so that steps are deterministic.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp

from ._common import ModelSpec, mean_cross_entropy, random_tokens, shift_right


@dataclasses.dataclass(frozen=True)
class RNNLMConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    seq_len: int
    global_batch: int


CONFIGS = {
    "tiny": RNNLMConfig(64, 32, 2, 8, 16),
    "paper": RNNLMConfig(10000, 1500, 2, 35, 160),
}


class RNNLM(nn.Module):
    config: RNNLMConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.config
        x = nn.Embed(cfg.vocab_size, cfg.hidden_size)(tokens)
        for _ in range(cfg.num_layers):
            cell = nn.OptimizedLSTMCell(cfg.hidden_size)
            # A Python loop, not nn.RNN's scan: straight-line HLO, and no scan-carry type to match
            # under shard_map (a zero initial carry is unvarying, the next one varies over 'data').
            zeros = jnp.zeros((x.shape[0], cfg.hidden_size), x.dtype)
            carry = (zeros, zeros)
            outputs = []
            for t in range(x.shape[1]):
                carry, y = cell(carry, x[:, t])
                outputs.append(y)
            x = jnp.stack(outputs, axis=1)
        return nn.Dense(cfg.vocab_size)(x)


def _make_batch(cfg: RNNLMConfig, rng: jax.Array, global_batch_size: int):
    return {"tokens": random_tokens(rng, (global_batch_size, cfg.seq_len), cfg.vocab_size)}


def spec_of(cfg: RNNLMConfig, config: str = "custom") -> ModelSpec:
    """The zoo spec of this model at size `cfg`; `config` names it (``'tiny'``, ``'paper'``, ...)."""
    model = RNNLM(cfg)

    def init(rng):
        return model.init(rng, jnp.zeros((1, cfg.seq_len), jnp.int32))["params"], {}

    def loss_fn(params, model_state, batch, axis_name=None):
        logits = model.apply({"params": params}, shift_right(batch["tokens"]))
        return mean_cross_entropy(logits, batch["tokens"]), model_state

    return ModelSpec(
        name="rnnlm",
        config=config,
        init=init,
        loss_fn=loss_fn,
        make_batch=partial(_make_batch, cfg),
        default_global_batch=cfg.global_batch,
        description=(f"RNNLM {cfg.num_layers}x LSTM {cfg.hidden_size}, vocab {cfg.vocab_size}, {cfg.seq_len} steps"),
    )


def make_spec(config: str) -> ModelSpec:
    return spec_of(CONFIGS[config], config)
