"""VGG19: five stacks of 3x3 convolutions (2, 2, 4, 4, 4 convs) each followed by 2x2 max pooling,
then three fully connected layers, ReLU throughout, softmax cross-entropy on class labels.

Sizes:
- ``paper``: configuration E of Simonyan & Zisserman, "Very Deep Convolutional Networks for
  Large-Scale Image Recognition" (ICLR 2015), Table 1: channels 64-128-256-512-512, FC 4096-4096-1000,
  224x224x3 images; 143.7M parameters. Batch 32 per device (global 256 on 8 devices, the paper's batch).
- ``tiny``: the same 16 convs and 5 pools with channels 4-8-8-16-16, FC 32-32-10, 32x32x3 images.

Dropout in the FC layers is left out so that steps are deterministic (and comparable across styles).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp

from ._common import ModelSpec, mean_cross_entropy, random_image_batch


@dataclasses.dataclass(frozen=True)
class VGGConfig:
    convs_per_stage: tuple[int, ...]
    stage_channels: tuple[int, ...]
    fc_width: int
    num_classes: int
    image_size: int
    global_batch: int


CONFIGS = {
    "tiny": VGGConfig((2, 2, 4, 4, 4), (4, 8, 8, 16, 16), 32, 10, 32, 16),
    "paper": VGGConfig((2, 2, 4, 4, 4), (64, 128, 256, 512, 512), 4096, 1000, 224, 256),
}


class VGG(nn.Module):
    config: VGGConfig

    @nn.compact
    def __call__(self, images: jax.Array) -> jax.Array:
        cfg = self.config
        x = images
        for convs, channels in zip(cfg.convs_per_stage, cfg.stage_channels):
            for _ in range(convs):
                x = nn.relu(nn.Conv(channels, (3, 3), padding="SAME")(x))
            x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(cfg.fc_width)(x))
        x = nn.relu(nn.Dense(cfg.fc_width)(x))
        return nn.Dense(cfg.num_classes)(x)


def _make_batch(cfg: VGGConfig, rng: jax.Array, global_batch_size: int):
    return random_image_batch(rng, global_batch_size, cfg.image_size, cfg.num_classes)


def spec_of(cfg: VGGConfig, config: str = "custom") -> ModelSpec:
    """The zoo spec of this model at size `cfg`; `config` names it (``'tiny'``, ``'paper'``, ...)."""
    model = VGG(cfg)

    def init(rng):
        dummy = jnp.zeros((1, cfg.image_size, cfg.image_size, 3), jnp.float32)
        return model.init(rng, dummy)["params"], {}

    def loss_fn(params, model_state, batch, axis_name=None):
        logits = model.apply({"params": params}, batch["images"])
        return mean_cross_entropy(logits, batch["labels"]), model_state

    return ModelSpec(
        name="vgg19",
        config=config,
        init=init,
        loss_fn=loss_fn,
        make_batch=partial(_make_batch, cfg),
        default_global_batch=cfg.global_batch,
        description=f"VGG19, {cfg.image_size}x{cfg.image_size} images, channels {cfg.stage_channels}",
    )


def make_spec(config: str) -> ModelSpec:
    return spec_of(CONFIGS[config], config)
