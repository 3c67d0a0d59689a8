"""The Fused Op Estimator network (DisCo section 4.3): graph attention over a kernel's ops, a
summed readout, a regression MLP. Written in Flax on `jax.ops.segment_sum` (no DGL: jax, flax and
optax only).

Data flow: a list of `KernelFeatures` -> `batch_graphs` packs them into one padded `GraphBatch`
(nodes of all kernels concatenated, edges re-indexed, sizes rounded up to buckets so a few jitted
shapes serve every call) -> `FusedOpEstimator` -> one predicted log(microseconds) per kernel.

Model, per kernel:
  h_i = Dense(x_i)                                   input projection of the normalized features
  h_i = LayerNorm(h_i + GAT_l(h)_i)   for l = 1..L   multi-head attention layers (eq. 1), residual
  y = relu(sum_i Dense(h_i))                         summed readout into the kernel embedding (eq. 2)
  t = MLP([y, Dense(kernel features)])               3 dense layers -> log(time in us)
      + Dense(kernel features)                       plus a linear path from the kernel features
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from gnn_estimator._features import KERNEL_FEATURES, NODE_FEATURES, KernelFeatures


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes of the network; stored with the weights."""

    hidden: int = 64
    heads: int = 4
    layers: int = 6
    mlp: tuple[int, ...] = (128, 64)  # hidden widths of the regression MLP (plus the output layer)
    members: int = 1  # networks trained from different seeds; the prediction is their mean log time

    def to_json(self) -> dict:
        return {
            "hidden": self.hidden,
            "heads": self.heads,
            "layers": self.layers,
            "mlp": list(self.mlp),
            "members": self.members,
        }

    @classmethod
    def from_json(cls, d: dict) -> ModelConfig:
        return cls(
            int(d["hidden"]),
            int(d["heads"]),
            int(d["layers"]),
            tuple(int(x) for x in d["mlp"]),
            int(d.get("members", 1)),
        )


class GraphBatch(NamedTuple):
    """Padded kernels: `nodes` [N, F], `kernel` [B, G], edges `senders`/`receivers` [E] (padding
    edges point at the last node, a padding node), `node_graph` [N] (padding nodes belong to the
    last graph, a padding graph), masks for real nodes/edges/graphs."""

    nodes: jax.Array
    kernel: jax.Array
    senders: jax.Array
    receivers: jax.Array
    node_graph: jax.Array
    node_mask: jax.Array
    edge_mask: jax.Array
    graph_mask: jax.Array


def _bucket(n: int, minimum: int) -> int:
    """Round up to a power of two, or to a multiple of the largest power of two below 4096."""
    size = minimum
    while size < n and size < 4096:
        size *= 2
    if size < n:
        size = -(-n // 4096) * 4096
    return size


def level_sizes(level: int) -> tuple[int, int, int]:
    """The padded (nodes, edges, graphs) of one shape level: 64 x 2^level nodes, 4 edges and a
    quarter graph per node, so one compiled shape per level serves every batch that fits it."""
    nodes = 64 << level
    return nodes, 4 * nodes, max(16, nodes // 4)


def shape_level(num_nodes: int, num_edges: int, num_graphs: int) -> int:
    """The smallest level whose sizes hold a batch (one padding node and one padding graph)."""
    level = 0
    while True:
        n, e, b = level_sizes(level)
        if n >= num_nodes + 1 and e >= num_edges and b >= num_graphs + 1:
            return level
        level += 1


def batch_graphs(
    features: Sequence[KernelFeatures],
    node_mean: np.ndarray,
    node_std: np.ndarray,
    kernel_mean: np.ndarray,
    kernel_std: np.ndarray,
    sizes: tuple[int, int, int] | None = None,
) -> GraphBatch:
    """Normalize and pack kernels into one padded batch; sizes are bucketed (at least one padding
    node and one padding graph), so repeated calls reuse a handful of compiled shapes. `sizes`:
    (nodes, edges, graphs) to pad to instead (`shape_level`), each large enough."""
    n_nodes = sum(f.num_nodes for f in features)
    n_edges = sum(f.num_edges for f in features)
    if sizes is None:
        N, E, B = _bucket(n_nodes + 1, 64), _bucket(n_edges, 128), _bucket(len(features) + 1, 8)
    else:
        N, E, B = sizes
        if N < n_nodes + 1 or E < n_edges or B < len(features) + 1:
            raise ValueError(f"batch of {n_nodes} nodes, {n_edges} edges, {len(features)} kernels exceeds {sizes}")
    nodes = np.zeros((N, len(NODE_FEATURES)), np.float32)
    kernel = np.zeros((B, len(KERNEL_FEATURES)), np.float32)
    senders = np.full((E,), N - 1, np.int32)
    receivers = np.full((E,), N - 1, np.int32)
    node_graph = np.full((N,), B - 1, np.int32)
    node_mask = np.zeros((N,), np.float32)
    edge_mask = np.zeros((E,), np.float32)
    graph_mask = np.zeros((B,), np.float32)
    n = e = 0
    for g, f in enumerate(features):
        nodes[n : n + f.num_nodes] = (f.nodes - node_mean) / node_std
        senders[e : e + f.num_edges] = f.senders + n
        receivers[e : e + f.num_edges] = f.receivers + n
        node_graph[n : n + f.num_nodes] = g
        node_mask[n : n + f.num_nodes] = 1.0
        edge_mask[e : e + f.num_edges] = 1.0
        kernel[g] = (f.kernel - kernel_mean) / kernel_std
        graph_mask[g] = 1.0
        n += f.num_nodes
        e += f.num_edges
    # NumPy arrays: every consumer is jitted, and handing them over in the call costs less than
    # eight separate transfers (the search predicts a few kernels at a time).
    return GraphBatch(nodes, kernel, senders, receivers, node_graph, node_mask, edge_mask, graph_mask)


class GraphAttention(nn.Module):
    """One multi-head graph attention layer (GAT, eq. 1): each op attends over its neighbours in
    the kernel (producers, consumers, itself); heads are concatenated."""

    features: int
    heads: int

    @nn.compact
    def __call__(self, h: jax.Array, batch: GraphBatch) -> jax.Array:
        num_nodes = h.shape[0]
        per_head = self.features // self.heads
        z = nn.Dense(self.heads * per_head, use_bias=False)(h).reshape(num_nodes, self.heads, per_head)
        a_src = self.param("attn_src", nn.initializers.lecun_normal(), (self.heads, per_head))
        a_dst = self.param("attn_dst", nn.initializers.lecun_normal(), (self.heads, per_head))
        score_src = jnp.sum(z * a_src, axis=-1)  # [N, H]
        score_dst = jnp.sum(z * a_dst, axis=-1)
        logits = nn.leaky_relu(score_src[batch.senders] + score_dst[batch.receivers], 0.2)  # [E, H]
        logits = jnp.where(batch.edge_mask[:, None] > 0, logits, -1e9)
        peak = jax.ops.segment_max(logits, batch.receivers, num_segments=num_nodes)
        weights = jnp.exp(logits - peak[batch.receivers]) * batch.edge_mask[:, None]
        total = jax.ops.segment_sum(weights, batch.receivers, num_segments=num_nodes)
        alpha = weights / (total[batch.receivers] + 1e-9)
        messages = z[batch.senders] * alpha[..., None]
        out = jax.ops.segment_sum(messages, batch.receivers, num_segments=num_nodes)
        return nn.elu(out.reshape(num_nodes, self.heads * per_head))


class FusedOpEstimator(nn.Module):
    """Kernels in a `GraphBatch` -> predicted log(time in microseconds), one per graph slot
    (padding slots give values to be ignored)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, batch: GraphBatch) -> jax.Array:
        cfg = self.config
        mask = batch.node_mask[:, None]
        h = nn.Dense(cfg.hidden)(batch.nodes) * mask
        for _ in range(cfg.layers):
            h = nn.LayerNorm()(h + GraphAttention(cfg.hidden, cfg.heads)(h, batch)) * mask
        num_graphs = batch.kernel.shape[0]
        readout = jax.ops.segment_sum(nn.Dense(cfg.hidden)(h) * mask, batch.node_graph, num_segments=num_graphs)
        y = nn.relu(readout)
        x = jnp.concatenate([y, nn.relu(nn.Dense(cfg.hidden)(batch.kernel))], axis=-1)
        for width in cfg.mlp:
            x = nn.relu(nn.Dense(width)(x))
        # A linear path from the kernel features: log(sum of known own times) and log(bytes) carry
        # most of the answer on their own; the network learns the correction.
        return nn.Dense(1)(x)[:, 0] + nn.Dense(1)(batch.kernel)[:, 0]


def init_ensemble(config: ModelConfig, seed: int = 0) -> list:
    """Fresh parameters of every member (member m from seed + m)."""
    return [init_params(config, seed + m) for m in range(config.members)]


def init_params(config: ModelConfig, seed: int = 0):
    """Fresh parameters of one network of `config` (shapes do not depend on the batch)."""
    from gnn_estimator._features import featurize

    example = featurize(
        {
            "nodes": [
                {"op": "add", "dtype": "f32", "shape": [4], "operands": [], "dims": None, "flops": 4.0, "time_us": None}
            ],
            "exports": [0],
        }
    )
    ones_n, ones_k = np.ones(len(NODE_FEATURES), np.float32), np.ones(len(KERNEL_FEATURES), np.float32)
    batch = batch_graphs([example], 0 * ones_n, ones_n, 0 * ones_k, ones_k)
    return _init(config, jax.random.key(seed), batch)


@functools.partial(jax.jit, static_argnums=0)
def _init(config: ModelConfig, key: jax.Array, batch: GraphBatch):
    """The network's initialization as one program per config (members and later trainings of the
    config reuse it); run op by op it compiled each of its few dozen ops alone."""
    return FusedOpEstimator(config).init(key, batch)["params"]
