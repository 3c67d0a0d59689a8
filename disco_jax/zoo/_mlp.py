"""Unity's MLP: a stack of equally wide dense layers (ReLU between them) regressing a synthetic
target with mean squared error.

Sizes:
- ``paper``: Unger, Jia et al., "Unity: Accelerating DNN Training Through Joint Optimization of
  Algebraic Transformations and Parallelization" (OSDI 2022), section 6: "16 dense layers, each of
  which has a hidden dimension of 8192", synthetic data, per-GPU batch 256 (global 2048 on 8
  devices); about 1.07B parameters.
- ``tiny``: 4 dense layers of width 64.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp

from ._common import ModelSpec


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    num_layers: int
    width: int
    global_batch: int


CONFIGS = {
    "tiny": MLPConfig(4, 64, 16),
    "paper": MLPConfig(16, 8192, 2048),
}


class MLP(nn.Module):
    config: MLPConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in range(self.config.num_layers):
            if layer:
                x = nn.relu(x)
            x = nn.Dense(self.config.width)(x)
        return x


def _make_batch(cfg: MLPConfig, rng: jax.Array, global_batch_size: int):
    input_rng, target_rng = jax.random.split(rng)
    shape = (global_batch_size, cfg.width)
    return {
        "inputs": jax.random.normal(input_rng, shape, jnp.float32),
        "targets": jax.random.normal(target_rng, shape, jnp.float32),
    }


def spec_of(cfg: MLPConfig, config: str = "custom") -> ModelSpec:
    """The zoo spec of this model at size `cfg`; `config` names it (``'tiny'``, ``'paper'``, ...)."""
    model = MLP(cfg)

    def init(rng):
        return model.init(rng, jnp.zeros((1, cfg.width), jnp.float32))["params"], {}

    def loss_fn(params, model_state, batch, axis_name=None):
        outputs = model.apply({"params": params}, batch["inputs"])
        return jnp.mean(jnp.square(outputs - batch["targets"])), model_state

    return ModelSpec(
        name="mlp",
        config=config,
        init=init,
        loss_fn=loss_fn,
        make_batch=partial(_make_batch, cfg),
        default_global_batch=cfg.global_batch,
        description=f"Unity MLP, {cfg.num_layers} dense layers of width {cfg.width}",
    )


def make_spec(config: str) -> ModelSpec:
    return spec_of(CONFIGS[config], config)
