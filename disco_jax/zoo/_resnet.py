"""ResNet-50: a 7x7/2 convolution stem with batch norm and 3x3/2 max pooling, four stages of
bottleneck blocks (1x1 reduce, 3x3, 1x1 expand x4, each conv followed by batch norm; projection
shortcut where the shape changes; stride 2 at the start of stages 2-4), global average pooling and
a dense classifier; softmax cross-entropy on class labels.

Sizes:
- ``paper``: He et al., "Deep Residual Learning for Image Recognition" (CVPR 2016), Table 1, 50-layer:
  stages of 3, 4, 6, 3 blocks, widths 64-128-256-512 (outputs x4), 1000 classes, 224x224x3 images;
  25.6M parameters. Batch 32 per device (global 256 on 8 devices, the paper's batch).
- ``tiny``: one bottleneck block per stage, widths 4-8-16-32, 10 classes, 16x16x3 images.

Batch norm: statistics over the global batch (see `_common`: Flax's BatchNorm pmeans them over the
data axis under shard_map), momentum 0.9, epsilon 1e-5, as in Flax's ImageNet example. The running
averages are model state (``{'batch_stats': ...}``), updated by the training step.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp

from ._common import ModelSpec, mean_cross_entropy, random_image_batch


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    stage_sizes: tuple[int, ...]
    stage_widths: tuple[int, ...]
    num_classes: int
    image_size: int
    global_batch: int


CONFIGS = {
    "tiny": ResNetConfig((1, 1, 1, 1), (4, 8, 16, 32), 10, 16, 16),
    "paper": ResNetConfig((3, 4, 6, 3), (64, 128, 256, 512), 1000, 224, 256),
}


class BottleneckBlock(nn.Module):
    width: int
    strides: int
    norm: partial

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        y = nn.relu(self.norm()(nn.Conv(self.width, (1, 1), use_bias=False)(x)))
        y = nn.Conv(self.width, (3, 3), (self.strides, self.strides), padding="SAME", use_bias=False)(y)
        y = nn.relu(self.norm()(y))
        y = self.norm()(nn.Conv(self.width * 4, (1, 1), use_bias=False)(y))
        if x.shape != y.shape:
            x = nn.Conv(self.width * 4, (1, 1), (self.strides, self.strides), use_bias=False)(x)
            x = self.norm()(x)
        return nn.relu(x + y)


class ResNet(nn.Module):
    config: ResNetConfig
    batch_norm_axis_name: str | None = None

    @nn.compact
    def __call__(self, images: jax.Array, train: bool = True) -> jax.Array:
        cfg = self.config
        norm = partial(
            nn.BatchNorm,
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            axis_name=self.batch_norm_axis_name,
        )
        x = nn.Conv(cfg.stage_widths[0], (7, 7), (2, 2), padding=[(3, 3), (3, 3)], use_bias=False)(images)
        x = nn.relu(norm()(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for stage, (blocks, width) in enumerate(zip(cfg.stage_sizes, cfg.stage_widths)):
            for block in range(blocks):
                strides = 2 if stage > 0 and block == 0 else 1
                x = BottleneckBlock(width, strides, norm)(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(cfg.num_classes)(x)


def _make_batch(cfg: ResNetConfig, rng: jax.Array, global_batch_size: int):
    return random_image_batch(rng, global_batch_size, cfg.image_size, cfg.num_classes)


def spec_of(cfg: ResNetConfig, config: str = "custom") -> ModelSpec:
    """The zoo spec of this model at size `cfg`; `config` names it (``'tiny'``, ``'paper'``, ...)."""

    def init(rng):
        dummy = jnp.zeros((1, cfg.image_size, cfg.image_size, 3), jnp.float32)
        variables = ResNet(cfg).init(rng, dummy, train=False)
        return variables["params"], {"batch_stats": variables["batch_stats"]}

    def loss_fn(params, model_state, batch, axis_name=None):
        model = ResNet(cfg, batch_norm_axis_name=axis_name)
        logits, new_state = model.apply(
            {"params": params, **model_state}, batch["images"], train=True, mutable=["batch_stats"]
        )
        return mean_cross_entropy(logits, batch["labels"]), dict(new_state)

    return ModelSpec(
        name="resnet50",
        config=config,
        init=init,
        loss_fn=loss_fn,
        make_batch=partial(_make_batch, cfg),
        default_global_batch=cfg.global_batch,
        description=f"ResNet-50 (stages {cfg.stage_sizes}), {cfg.image_size}x{cfg.image_size} images",
    )


def make_spec(config: str) -> ModelSpec:
    return spec_of(CONFIGS[config], config)
