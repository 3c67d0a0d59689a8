"""DLRM: a deep learning recommendation model. Dense features go through a bottom MLP; each sparse
feature looks up one row of its own embedding table; the pairwise dot products of the bottom-MLP
output and the embeddings (strictly lower triangle), concatenated with the bottom-MLP output, go
through a top MLP to one click logit; binary cross-entropy.

Sizes:
- ``paper``: Naumov et al., "Deep Learning Recommendation Model for Personalization and
  Recommendation Systems" (2019), with the Criteo Kaggle configuration of the reference
  implementation (facebookresearch/dlrm: 13 dense features, 26 tables of the Kaggle cardinalities,
  33.76M rows in all, embedding dimension 16, bottom MLP 512-256-64-16, top MLP 512-256-1), about
  540M parameters; per-device batch 1024 as in Unity's DLRM evaluation (global 8192 on 8 devices).
  The tables are replicated (plain data parallelism): their dense gradients are all-reduced.
- ``tiny``: the same 26 tables with cardinalities capped at 32, embedding dimension 4, bottom MLP
  16-4, top MLP 16-1.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ._common import ModelSpec

CRITEO_KAGGLE_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
NUM_DENSE_FEATURES = 13


@dataclasses.dataclass(frozen=True)
class DLRMConfig:
    table_sizes: tuple[int, ...]
    embedding_dim: int
    bottom_mlp: tuple[int, ...]  # the last width must equal embedding_dim
    top_mlp: tuple[int, ...]  # the last width is 1 (the logit)
    global_batch: int


CONFIGS = {
    "tiny": DLRMConfig(tuple(min(n, 32) for n in CRITEO_KAGGLE_CARDINALITIES), 4, (16, 4), (16, 1), 16),
    "paper": DLRMConfig(CRITEO_KAGGLE_CARDINALITIES, 16, (512, 256, 64, 16), (512, 256, 1), 8192),
}


def _symmetric_uniform(limit: float):
    """U(-limit, limit), the reference implementation's table init (limit 1/sqrt(rows))."""

    def init(rng, shape, dtype=jnp.float32):
        return jax.random.uniform(rng, shape, dtype, -limit, limit)

    return init


class DLRM(nn.Module):
    config: DLRMConfig

    @nn.compact
    def __call__(self, dense: jax.Array, sparse: jax.Array) -> jax.Array:
        cfg = self.config
        x = dense
        for width in cfg.bottom_mlp:
            x = nn.relu(nn.Dense(width)(x))
        embedded = [
            nn.Embed(rows, cfg.embedding_dim, embedding_init=_symmetric_uniform(1 / np.sqrt(rows)))(sparse[:, table])
            for table, rows in enumerate(cfg.table_sizes)
        ]
        features = jnp.stack([x, *embedded], axis=1)  # [batch, 1 + tables, dim]
        dots = jnp.einsum("bid,bjd->bij", features, features)
        rows, cols = np.tril_indices(features.shape[1], k=-1)
        z = jnp.concatenate([x, dots[:, rows, cols]], axis=1)
        for layer, width in enumerate(cfg.top_mlp):
            z = nn.Dense(width)(z)
            if layer < len(cfg.top_mlp) - 1:
                z = nn.relu(z)
        return z[:, 0]


def _make_batch(cfg: DLRMConfig, rng: jax.Array, global_batch_size: int):
    dense_rng, sparse_rng, label_rng = jax.random.split(rng, 3)
    table_sizes = jnp.asarray(cfg.table_sizes, jnp.int32)
    return {
        "dense": jax.random.normal(dense_rng, (global_batch_size, NUM_DENSE_FEATURES), jnp.float32),
        "sparse": jax.random.randint(sparse_rng, (global_batch_size, len(cfg.table_sizes)), 0, table_sizes, jnp.int32),
        "labels": jax.random.bernoulli(label_rng, 0.25, (global_batch_size,)).astype(jnp.float32),
    }


def spec_of(cfg: DLRMConfig, config: str = "custom") -> ModelSpec:
    """The zoo spec of this model at size `cfg`; `config` names it (``'tiny'``, ``'paper'``, ...)."""
    model = DLRM(cfg)

    def init(rng):
        dense = jnp.zeros((1, NUM_DENSE_FEATURES), jnp.float32)
        sparse = jnp.zeros((1, len(cfg.table_sizes)), jnp.int32)
        return model.init(rng, dense, sparse)["params"], {}

    def loss_fn(params, model_state, batch, axis_name=None):
        logits = model.apply({"params": params}, batch["dense"], batch["sparse"])
        return jnp.mean(optax.sigmoid_binary_cross_entropy(logits, batch["labels"])), model_state

    return ModelSpec(
        name="dlrm",
        config=config,
        init=init,
        loss_fn=loss_fn,
        make_batch=partial(_make_batch, cfg),
        default_global_batch=cfg.global_batch,
        description=(f"DLRM, {len(cfg.table_sizes)} tables ({sum(cfg.table_sizes)} rows) of dim {cfg.embedding_dim}"),
    )


def make_spec(config: str) -> ModelSpec:
    return spec_of(CONFIGS[config], config)
