"""GPT: a decoder-only transformer language model. Token and learned position embeddings, pre-layer-norm
blocks (causal self-attention, then a GELU feed-forward of 4x the width, each inside a residual),
a final layer norm and the output projection tied to the token embedding; next-token
cross-entropy.

Parameters are float32. ``compute_dtype`` is the dtype the dense layers, attention and GELU compute
in (Flax's ``dtype``, parameters cast at use): the ``paper`` size computes in bfloat16, as
models of that size are trained (mixed precision); the layer norms and the loss stay float32.
The ``tiny`` size computes in float32 so that the zoo's checks (the two styles agree within
float32 tolerances) hold for it as for every other model.

Sizes:
- ``paper``: GPT-3 6.7B of Brown et al., "Language Models are Few-Shot Learners" (NeurIPS 2020),
  Table 2.1: 32 layers, d_model 4096, 32 heads of 128, context 2048, the GPT-2 vocabulary of
  50257 tokens; about 6.66B parameters. Its parameters (26.6 GB in float32) plus Adam's two
  moments (53.3 GB) alone exceed one 80 GB GPU: replicated data parallelism cannot hold it. One
  sequence of 2048 tokens per device (8 on 8 devices); the paper's 2M-token batch is reached by
  accumulating such steps, which is not modelled here.
- ``tiny``: 2 layers, d_model 32, 2 heads, vocabulary 64, length 8.

`spec_of(GPTConfig(...))` builds any other size (the GPU memory check's mid-size decoder,
`scripts/gpu_memory_check.py`; shorter stacks for `scripts/offline_decoder_plan.py --layers`).
``scan_layers=True`` (`zoo.resized("gpt", scan_layers=True)`) runs the blocks under `nn.scan`, as
MaxText's ``scan_layers`` does: one `while` loop per pass, the blocks' parameters stacked
`(num_layers, ...)` under ``params["blocks"]["block"]`` (DESIGN.md point 22). ``remat="dots"`` or
``"full"`` rematerializes each block (`nn.remat` with a `jax.checkpoint_policies` policy, as
MaxText's ``remat_policy``); the parameter tree is the same.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp

from ._common import ModelSpec, mean_cross_entropy, random_tokens, shift_right


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    d_model: int
    num_heads: int
    num_layers: int
    seq_len: int
    global_batch: int
    # A jnp dtype name ("bfloat16" for mixed precision), or "params": every op in the parameters'
    # dtype, no cast written in the model (Flax's dtype=None), so that the step run in float64 is
    # float64 throughout and the output check can judge a plan against it (docs/output-check.md).
    compute_dtype: str = "float32"
    # jax.nn.dot_product_attention's implementation: "xla" (every backend compiles the same ops) or
    # "cudnn" (cuDNN's fused flash attention, 16-bit compute on a real GPU only).
    attention: str = "xla"
    # The blocks under one `nn.scan` (a `while` loop over stacked `(num_layers, ...)` parameters),
    # as large models are written, rather than unrolled one after the other.
    scan_layers: bool = False
    # Rematerialization of each block (`nn.remat`), as MaxText's `remat_policy`: "none" keeps every
    # activation the backward pass reads; "dots" saves the dots' outputs (without batch dimensions)
    # and recomputes the rest; "full" saves only the block's input and recomputes the block.
    remat: str = "none"


REMAT_POLICIES = {
    "none": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}


def _rematerialized(module: type[nn.Module], remat: str, scanned: bool) -> type[nn.Module]:
    """`module` under `nn.remat` with the policy named `remat` (`REMAT_POLICIES`); itself for "none"."""
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat must be one of {', '.join(REMAT_POLICIES)}, got {remat!r}")
    if remat == "none":
        return module
    # prevent_cse=False under scan only, as Flax advises: the loop already keeps XLA from merging
    # the recomputation with the forward pass. Unrolled, without the barrier XLA's CSE merges them
    # and nothing is rematerialized (the compiled step equals the one without remat).
    return nn.remat(module, policy=REMAT_POLICIES[remat], prevent_cse=not scanned)


CONFIGS = {
    "tiny": GPTConfig(64, 32, 2, 2, 8, 16),
    "paper": GPTConfig(50257, 4096, 32, 32, 2048, 8, "bfloat16"),
}


class CausalSelfAttention(nn.Module):
    num_heads: int
    dtype: jnp.dtype
    implementation: str = "xla"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        batch, length, width = x.shape
        qkv = nn.Dense(3 * width, dtype=self.dtype, name="qkv")(x)
        query, key, value = jnp.moveaxis(qkv.reshape(batch, length, 3, self.num_heads, -1), 2, 0)
        if self.dtype is None:  # written out: jax.nn's attention computes its softmax in float32
            logits = jnp.einsum("bqhd,bkhd->bhqk", query, key) * query.shape[-1] ** -0.5
            causal = jnp.tril(jnp.ones((length, length), bool))
            logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
            attended = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), value)
        else:
            # XLA's own attention by default (no cuDNN fused kernel), so that every backend compiles the same ops.
            attended = jax.nn.dot_product_attention(
                query, key, value, is_causal=True, implementation=self.implementation
            )
        return nn.Dense(width, dtype=self.dtype, name="out")(attended.reshape(batch, length, width))


class Block(nn.Module):
    num_heads: int
    dtype: jnp.dtype
    attention: str = "xla"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        width = x.shape[-1]
        x = x + CausalSelfAttention(self.num_heads, self.dtype, self.attention)(nn.LayerNorm(1e-5)(x))
        hidden = nn.gelu(nn.Dense(4 * width, dtype=self.dtype)(nn.LayerNorm(1e-5)(x)))
        return x + nn.Dense(width, dtype=self.dtype)(hidden)


class _ScannedBlock(nn.Module):
    """One `Block` as `nn.scan` runs it: the activations are the carry, nothing is stacked out."""

    num_heads: int
    dtype: jnp.dtype
    attention: str = "xla"

    @nn.compact
    def __call__(self, x: jax.Array, _) -> tuple[jax.Array, None]:
        return Block(self.num_heads, self.dtype, self.attention, name="block")(x), None


class GPT(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.config
        dtype = None if cfg.compute_dtype == "params" else jnp.dtype(cfg.compute_dtype)
        embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, embedding_init=nn.initializers.normal(0.02))
        positions = self.param("positions", nn.initializers.normal(0.01), (cfg.seq_len, cfg.d_model))
        x = embed(tokens) + positions[: tokens.shape[1]]
        if cfg.scan_layers:
            blocks = nn.scan(
                _rematerialized(_ScannedBlock, cfg.remat, scanned=True),
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=cfg.num_layers,
            )
            x, _ = blocks(cfg.num_heads, dtype, cfg.attention, name="blocks")(x, None)
        else:
            block = _rematerialized(Block, cfg.remat, scanned=False)
            for i in range(cfg.num_layers):  # named as unwrapped `Block`s are: remat keeps the parameter tree
                x = block(cfg.num_heads, dtype, cfg.attention, name=f"Block_{i}")(x)
        x = nn.LayerNorm(1e-5)(x)
        if dtype is None:
            return embed.attend(x)
        # Logits in the compute dtype, the loss in float32.
        return embed.attend(x.astype(dtype)).astype(jnp.float32)


def _make_batch(cfg: GPTConfig, rng: jax.Array, global_batch_size: int):
    return {"tokens": random_tokens(rng, (global_batch_size, cfg.seq_len), cfg.vocab_size)}


def spec_of(cfg: GPTConfig, config: str = "custom") -> ModelSpec:
    """The zoo spec of a GPT of size `cfg`; `config` names it (``'tiny'``, ``'paper'``, ...)."""
    model = GPT(cfg)

    def init(rng):
        return model.init(rng, jnp.zeros((1, cfg.seq_len), jnp.int32))["params"], {}

    def loss_fn(params, model_state, batch, axis_name=None):
        tokens = batch["tokens"]
        logits = model.apply({"params": params}, shift_right(tokens))
        return mean_cross_entropy(logits, tokens), model_state

    return ModelSpec(
        name="gpt",
        config=config,
        init=init,
        loss_fn=loss_fn,
        make_batch=partial(_make_batch, cfg),
        default_global_batch=cfg.global_batch,
        description=(
            f"GPT decoder, {cfg.num_layers} layers, d_model {cfg.d_model}, {cfg.num_heads} heads, "
            f"vocab {cfg.vocab_size}, length {cfg.seq_len}, {cfg.compute_dtype} compute"
            + ("" if cfg.attention == "xla" else f", {cfg.attention} attention")
            + (", scanned layers" if cfg.scan_layers else "")
            + ("" if cfg.remat == "none" else f", remat {cfg.remat}")
        ),
    )


def make_spec(config: str) -> ModelSpec:
    return spec_of(CONFIGS[config], config)
