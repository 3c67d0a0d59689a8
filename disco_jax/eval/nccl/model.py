"""Collective costs fitted to published nccl-tests tables (`tables.TABLES`), per fabric.

A collective costs the fastest of a few NCCL *regimes*, each ``latency + bytes x us_per_byte``
(`Regime`; `fit.fit_lines` finds them in a table, in relative error). The regimes come from the
tables measured at one shape (8 GPUs on one node over NVLink; 2 nodes of 8 over a network) and
are carried to another shape by NCCL's own structure, never refitted:

* **Latency** grows by the hops the algorithm adds, at NCCL's per-hop latencies
  (`HOP_LATENCY_US`, from NCCL's tuning model): a ring all-reduce crosses 2(N-1) hops, 2(M-1) of
  them between nodes (N GPUs, M nodes); a reduce-scatter or all-gather ring N-1 and M-1; the
  default multi-node all-reduce (NVLSTree / Tree, as NCCL picks on H100 nodes) climbs and
  descends 2 log2(M) network levels. A fit's lines are NCCL's protocols by increasing latency
  (LL, [LL128,] Simple; a single line is Simple, with an LL twin at LL's bandwidth) and scale
  with that protocol's hop latencies.
* **Bandwidth**: a ring's bus bandwidth (nccl-tests' busbw) does not depend on N: its time is
  ``factor(N) x bytes / busbw`` (`BUS_FACTOR`). Across nodes it is capped by the node's network
  bandwidth `node_bandwidth` (bytes a node's NICs move per second, times the protocol's data
  share of the wire; for InfiniBand measured: the bus bandwidth of the two-node NCCL_ALGO=Ring
  table, whose every ring leaves each node once), and LL by NCCL's multi-node LL cap. The
  default multi-node all-reduce is network-bound: NCCL's tuner runs Tree and NVLSTree at the
  network bandwidth beyond two nodes and doubles NVLSTree's on two (a two-node tree sends the
  buffer once per node, a larger double binary tree twice), so its regimes' time per byte
  doubles beyond two nodes.

One node: the all-reduce is the faster of ring and NVLS (NCCL enables NVLS by default on H100
NVSwitch nodes and takes it for large messages; XLA calls ncclAllReduce and leaves the choice to
NCCL). Multi-node: the faster of the two-node default regimes and the ring regimes carried to M
nodes. Reduce-scatter and all-gather run rings (NVLS / CollNet variants need NVLS multicast
across nodes or a CollNet network). All-to-all and collective-permute have no fitted table; they
are derived from the all-gather's regimes, which move the same bytes per device: an all-to-all
sends (N-1)/N of each device's buffer, all peers at once (one network hop; across nodes each GPU's
share of the node bandwidth carries the (N-G)/N that leaves the node); a collective-permute sends
each device's buffer to one peer at a ring step's link rate (across nodes, assume a pair crosses
the network at one GPU's share of it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import ClassVar

import numpy as np

from disco_jax.eval.gpus import Quantity
from disco_jax.eval.nccl import fit
from disco_jax.eval.nccl.tables import BY_FILE, TABLES, Table

AR, RS, AG, A2A, PERMUTE = "all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute"

# nccl-tests' bus bandwidth = algorithm bandwidth x factor (its src/*.cu, `*GetBw`): the bytes each
# device sends per byte of the size column.
BUS_FACTOR = {
    AR: lambda n: 2.0 * (n - 1) / n,
    RS: lambda n: (n - 1) / n,
    AG: lambda n: (n - 1) / n,
    A2A: lambda n: (n - 1) / n,
    PERMUTE: lambda n: 1.0,
}

_TUNING = "NVIDIA/nccl src/graph/tuning.cc @5067397 (master, 2026), ncclTunerConstantsDefaults.hwLatencies"
# LL moves 8 bytes of data per 16 on the wire: NCCL's tuner halves its bus bandwidth.
LL_BANDWIDTH_FRACTION = Quantity(0.5, "fraction", "NVIDIA/nccl src/graph/tuning.cc @5067397: ring LL busBw * .5")
# NCCL's tuner caps LL's bus bandwidth across nodes (Intel hosts, as DGX/HGX H100): it runs LL
# only where that still wins, so a regime tagged LL gets the cap on more than one node.
LL_MAX_BUS_BW = {
    2: Quantity(39.0, "GB/s", "NVIDIA/nccl src/graph/tuning.cc @5067397: llMaxBws, Intel-N2"),
    3: Quantity(20.4, "GB/s", "NVIDIA/nccl src/graph/tuning.cc @5067397: llMaxBws, Intel-N4 (more than 2 nodes)"),
}
# Data bytes per byte on the wire, by protocol (NCCL: LL 8 of 16, LL128 120 of 128).
WIRE_EFFICIENCY = {"LL": 0.5, "LL128": 120.0 / 128.0, "Simple": 1.0}
# Per-hop latency (us) of (link, algorithm, protocol); NVLSTree's network hop for the tree's Simple.
HOP_LATENCY_US: dict[tuple[str, str, str], Quantity] = {
    ("nvlink", "ring", "LL"): Quantity(0.6, "us", _TUNING + ": NVLINK Ring LL"),
    ("nvlink", "ring", "LL128"): Quantity(1.9, "us", _TUNING + ": NVLINK Ring LL128"),
    ("nvlink", "ring", "Simple"): Quantity(3.4, "us", _TUNING + ": NVLINK Ring Simple"),
    ("nvlink", "tree", "LL"): Quantity(0.6, "us", _TUNING + ": NVLINK Tree LL"),
    ("nvlink", "tree", "LL128"): Quantity(1.25, "us", _TUNING + ": NVLINK Tree LL128"),
    ("nvlink", "tree", "Simple"): Quantity(4.0, "us", _TUNING + ": NVLINK Tree Simple"),
    ("net", "ring", "LL"): Quantity(2.7, "us", _TUNING + ": NET Ring LL"),
    ("net", "ring", "LL128"): Quantity(4.0, "us", _TUNING + ": NET Ring LL128"),
    ("net", "ring", "Simple"): Quantity(14.0, "us", _TUNING + ": NET Ring Simple"),
    ("net", "tree", "LL"): Quantity(5.0, "us", _TUNING + ": NET Tree LL"),
    ("net", "tree", "LL128"): Quantity(8.5, "us", _TUNING + ": NET Tree LL128"),
    ("net", "tree", "Simple"): Quantity(20.9, "us", _TUNING + ": NET NVLSTree Simple"),
}


@dataclasses.dataclass(frozen=True)
class Fabric:
    """A network between nodes of 8 H100s, by the tables fitted for it: `default` (all-reduce at
    NCCL's default choice, two nodes) and `ring` (NCCL_ALGO=Ring, two nodes; gives the node's
    network bandwidth), or `node_bandwidth` from a datasheet where no ring table exists."""

    name: str
    description: str
    default: tuple[str, ...]
    ring: tuple[str, ...] = ()
    node_bandwidth: Quantity | None = None


ONE_NODE = {  # 8 x H100 over NVLink/NVSwitch: the regimes every cluster's node starts from
    (AR, "ring"): ("h100-8gpu-nvlink-allreduce-ring-together.csv",),
    (AR, "nvls"): ("h100-8gpu-nvlink-allreduce-nvls-together.csv",),
    (RS, "ring"): ("h100-8gpu-nvlink-reducescatter-ring-together.csv",),
    (AG, "ring"): ("h100-8gpu-nvlink-allgather-ring-together.csv",),
}

FABRICS: dict[str, Fabric] = {
    f.name: f
    for f in (
        Fabric(
            "ib",
            "InfiniBand NDR 400 Gb/s, one NIC per GPU",
            default=(
                "h100-16gpu-2node-ib-allreduce-xe9680-nccltests309.csv",
                "h100-16gpu-2node-ib-allreduce-gjaion-nccltests309.csv",
            ),
            ring=("h100-16gpu-2node-ib-allreduce-ring-nccltests309.csv",),
        ),
        Fabric(
            "efa",
            "AWS p5.48xlarge EFA (3200 Gb/s per node)",
            default=("h100-16gpu-2node-efa-allreduce-awsp5-keitaw.csv",),
            node_bandwidth=Quantity(400e9, "B/s", "AWS p5.48xlarge: 3200 Gbps EFA networking = 400 GB/s per node"),
        ),
        Fabric(
            "tcpxo",
            "GCP A3 Mega GPUDirect-TCPXO (8 x 200 Gb/s per node)",
            default=("h100-16gpu-2node-tcpxo-allreduce-a3mega-lessizzmore.csv",),
            node_bandwidth=Quantity(
                200e9, "B/s", "GCP A3 Mega (a3-megagpu-8g): 8 NICs x 200 Gbps GPUDirect-TCPXO = 200 GB/s per node"
            ),
        ),
    )
}


@dataclasses.dataclass(frozen=True)
class Regime:
    """One NCCL algorithm/protocol line: ``latency_us + bytes x us_per_byte``."""

    algorithm: str  # "ring", "nvls" or "tree" (NCCL's default multi-node all-reduce)
    protocol: str  # "LL", "LL128" or "Simple": whose hop latencies and bandwidth caps apply
    latency_us: float
    us_per_byte: float

    def time_us(self, nbytes):
        return self.latency_us + self.us_per_byte * nbytes

    def to_json(self, collective: str, num_devices: int) -> dict:
        algbw = 1e-3 / self.us_per_byte if self.us_per_byte > 0 else math.inf
        return {
            "algorithm": self.algorithm,
            "protocol": self.protocol,
            "latency_us": round(self.latency_us, 3),
            "algbw_GBps": round(algbw, 2),
            "busbw_GBps": round(algbw * BUS_FACTOR[collective](num_devices), 2),
        }


PROTOCOLS_BY_LINES = {2: ("LL", "Simple"), 3: ("LL", "LL128", "Simple")}


@functools.cache
def fitted_regimes(files: tuple[str, ...], algorithm: str) -> tuple[Regime, ...]:
    """The lines `fit.fit_lines` finds in `files` (pooled), as regimes of NCCL's protocols by
    increasing latency (LL, [LL128,] Simple; NVLS runs Simple only). A single line is Simple,
    with an LL twin of the same latency at LL's bandwidth: slower at the fitted shape, it takes
    the latency-bound sizes where more hops make Simple's latency grow faster."""
    x, t = (np.concatenate(parts) for parts in zip(*(BY_FILE[f].rows() for f in files)))
    lines = sorted(fit.fit_lines(x, t))
    if algorithm == "nvls":
        return tuple(Regime(algorithm, "Simple", a, b) for a, b in lines)
    if len(lines) == 1:
        (a, b), ll = lines[0], LL_BANDWIDTH_FRACTION.value
        return (Regime(algorithm, "LL", a, b / ll), Regime(algorithm, "Simple", a, b))
    return tuple(Regime(algorithm, p, a, b) for p, (a, b) in zip(PROTOCOLS_BY_LINES[len(lines)], lines))


def _shape(files: tuple[str, ...]) -> tuple[int, int]:
    (shape,) = {(BY_FILE[f].gpus_per_node, BY_FILE[f].nodes) for f in files}
    return shape


def _ring_hops(collective: str, n: int, m: int) -> tuple[int, int]:
    """(NVLink hops, network hops) of NCCL's ring for `collective` on n GPUs over m nodes."""
    total, inter = (2 * (n - 1), 2 * (m - 1)) if collective == AR else (n - 1, m - 1)
    return total - inter, inter


def _hop(link: str, algorithm: str, protocol: str) -> float:
    return HOP_LATENCY_US[(link, "tree" if algorithm == "tree" else "ring", protocol)].value


def ring_regimes(collective: str, files: tuple[str, ...], gpus_per_node: int, nodes: int, node_bw: float | None):
    """A ring's fitted regimes carried to `gpus_per_node` x `nodes`: latency by the hops it adds
    (never less than fitted: a fitted floor is mostly launch cost, which fewer GPUs do not cut),
    bus bandwidth kept, capped across nodes by the node's network bandwidth (bytes/us)."""
    g0, m0 = _shape(files)
    n0, n = g0 * m0, gpus_per_node * nodes
    (intra0, inter0), (intra, inter) = _ring_hops(collective, n0, m0), _ring_hops(collective, n, nodes)
    factor0, factor = BUS_FACTOR[collective](n0), BUS_FACTOR[collective](n)
    out = []
    for r in fitted_regimes(files, "ring"):
        added = (intra - intra0) * _hop("nvlink", "ring", r.protocol)
        added += (inter - inter0) * _hop("net", "ring", r.protocol)
        latency = r.latency_us + max(0.0, added)
        per_byte = r.us_per_byte / factor0 * factor
        if nodes > 1:
            per_byte = max(per_byte, factor / (node_bw * WIRE_EFFICIENCY[r.protocol]), _ll_cap(r, nodes, factor))
        out.append(dataclasses.replace(r, latency_us=latency, us_per_byte=per_byte))
    return tuple(out)


def _ll_cap(regime: Regime, nodes: int, factor: float) -> float:
    """Least us per byte NCCL's tuner grants an LL regime on `nodes` (0 if not LL or one node);
    `factor`: bus bytes per byte of the size column (a tree's is 2)."""
    if regime.protocol != "LL" or nodes <= 1:
        return 0.0
    return factor / (LL_MAX_BUS_BW[min(nodes, 3)].value * 1e3)


def tree_regimes(files: tuple[str, ...], gpus_per_node: int, nodes: int, node_bw: float) -> tuple[Regime, ...]:
    """The default multi-node all-reduce's fitted regimes carried to `gpus_per_node` x `nodes`:
    2 log2(M) network levels (and 2(G-1) NVLink hops); network-bound, so the time per byte scales
    with what each node sends (the buffer once on two nodes, twice on more)."""
    g0, m0 = _shape(files)
    sent = 1.0 if nodes <= 2 else 2.0
    out = []
    for r in fitted_regimes(files, "tree"):
        added = 2 * (gpus_per_node - g0) * _hop("nvlink", "tree", r.protocol)
        added += 2 * (math.log2(nodes) - math.log2(m0)) * _hop("net", "tree", r.protocol)
        latency = r.latency_us + max(0.0, added)
        per_byte = max(r.us_per_byte * sent, sent / (node_bw * WIRE_EFFICIENCY[r.protocol]), _ll_cap(r, nodes, 2.0))
        out.append(dataclasses.replace(r, latency_us=latency, us_per_byte=per_byte))
    return tuple(out)


def derived_regimes(collective: str, gpus_per_node: int, nodes: int, node_bw: float | None) -> tuple[Regime, ...]:
    """All-to-all and collective-permute from the one-node all-gather's regimes (module docstring)."""
    files = ONE_NODE[(AG, "ring")]
    n0, n = _shape(files)[0], gpus_per_node * nodes
    out = []
    for r in fitted_regimes(files, "ring"):
        link_rate = BUS_FACTOR[AG](n0) / r.us_per_byte  # bytes/us each device sends
        latency = r.latency_us + (_hop("net", "ring", r.protocol) if nodes > 1 else 0.0)
        if collective == A2A:
            per_byte = BUS_FACTOR[A2A](n) / link_rate
            if nodes > 1:
                per_byte = max(per_byte, (n - gpus_per_node) / n * gpus_per_node / node_bw)
        else:
            per_byte = 1.0 / (link_rate if nodes == 1 else min(link_rate, node_bw / gpus_per_node))
        out.append(dataclasses.replace(r, latency_us=latency, us_per_byte=per_byte))
    return tuple(out)


def node_bandwidth(fabric: Fabric) -> float:
    """Bytes per microsecond a node's NICs move: the two-node ring's bus bandwidth (its fastest
    regime) where a ring table exists, else the datasheet figure."""
    if fabric.ring:
        n0 = math.prod(_shape(fabric.ring))
        return BUS_FACTOR[AR](n0) / min(r.us_per_byte for r in fitted_regimes(fabric.ring, "ring"))
    return fabric.node_bandwidth.value * 1e-6


@dataclasses.dataclass(frozen=True)
class FittedCollectives:
    """Collective costs on `gpus_per_node` x `nodes` H100s (`nodes` > 1: over `fabric`), fitted to
    nccl-tests tables: a `disco_jax.cost.AllReduceCost` with its own `collective_time_us`.
    `nbytes` follow `cost.allreduce`'s convention (nccl-tests' size column)."""

    fabric: str
    gpus_per_node: int
    nodes: int
    regimes: Mapping[str, tuple[Regime, ...]] = dataclasses.field(hash=False)
    node_bandwidth_GBps: float | None
    # NCCL on GPUs: a sharded weight update's all-reduce becomes a reduce-scatter.
    forms_reduce_scatter: ClassVar[bool] = True

    @property
    def num_devices(self) -> int:
        return self.gpus_per_node * self.nodes

    def time_us(self, nbytes: int | float) -> float:
        return self.collective_time_us(AR, nbytes)

    def collective_time_us(self, collective: str, nbytes, algorithm: str | None = None):
        """The fastest regime of `collective` for `nbytes` (an array gives an array); `algorithm`
        ("ring", "nvls", "tree"): only that algorithm's regimes (a table measured with it forced)."""
        if collective == "done":
            return 0.0
        if isinstance(nbytes, int | float) and algorithm is None and self.num_devices > 1:  # the simulator's call
            return min(r.latency_us + r.us_per_byte * nbytes for r in self.regimes[collective])
        if self.num_devices <= 1:
            return np.zeros_like(nbytes, dtype=float) if np.ndim(nbytes) else 0.0
        regimes = [r for r in self.regimes[collective] if algorithm in (None, r.algorithm)]
        if not regimes:
            raise ValueError(f"no {algorithm} regime for {collective} on {self.fabric}")
        best = np.min([r.time_us(np.asarray(nbytes, dtype=float)) for r in regimes], axis=0)
        return float(best) if np.ndim(best) == 0 else best

    def tables(self) -> tuple[Table, ...]:
        """The tables behind this model: those fitted for the regimes it uses, and every table of
        its own shape and fabric (held out or a check)."""
        used = set(_files_used(self.fabric, self.nodes))
        shape = (self.gpus_per_node, self.nodes)
        return tuple(
            t for t in TABLES if t.file in used or ((t.gpus_per_node, t.nodes) == shape and t.fabric == self.fabric)
        )

    def to_json(self) -> dict:
        return {
            "model": "fitted to nccl-tests tables (disco_jax.eval.nccl): fastest of NCCL regimes "
            "latency + bytes / bandwidth per collective, carried to this shape by NCCL's hop counts",
            "fabric": self.fabric,
            "gpus_per_node": self.gpus_per_node,
            "nodes": self.nodes,
            "node_bandwidth_GBps": self.node_bandwidth_GBps,
            "regimes": {c: [r.to_json(c, self.num_devices) for r in rs] for c, rs in self.regimes.items()},
            "tables": [{**t.to_json(), "fit": table_fit(t)} for t in self.tables()],
        }


def _files_used(fabric: str, nodes: int) -> tuple[str, ...]:
    files = [f for key, fs in ONE_NODE.items() if nodes == 1 or key[0] != AR for f in fs]
    if nodes > 1:
        files += [*FABRICS[fabric].default, *FABRICS[fabric].ring]
    return tuple(files)


@functools.cache
def collective_model(gpus_per_node: int, nodes: int = 1, fabric: str = "nvlink") -> FittedCollectives:
    """The fitted collectives of `gpus_per_node` H100s per node (NVLink/NVSwitch, `fabric`
    "nvlink") x `nodes` (more than one: over `fabric`, a `FABRICS` name)."""
    if not isinstance(gpus_per_node, int) or not 1 <= gpus_per_node <= 8:
        raise ValueError(f"an H100 NVLink node holds 1 to 8 GPUs, got {gpus_per_node!r}")
    if not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"nodes must be a positive int, got {nodes!r}")
    if (nodes == 1) != (fabric == "nvlink") or (nodes > 1 and fabric not in FABRICS):
        raise ValueError(f"fabric {fabric!r} for {nodes} node(s): one node is 'nvlink', more one of {sorted(FABRICS)}")
    node_bw = node_bandwidth(FABRICS[fabric]) if nodes > 1 else None
    g, m = gpus_per_node, nodes
    if nodes == 1:
        allreduce = ring_regimes(AR, ONE_NODE[(AR, "ring")], g, 1, None) + _nvls(g)
    else:
        allreduce = tree_regimes(FABRICS[fabric].default, g, m, node_bw)
        if FABRICS[fabric].ring:
            allreduce += ring_regimes(AR, FABRICS[fabric].ring, g, m, node_bw)
    regimes = {
        AR: allreduce,
        RS: ring_regimes(RS, ONE_NODE[(RS, "ring")], g, m, node_bw),
        AG: ring_regimes(AG, ONE_NODE[(AG, "ring")], g, m, node_bw),
        A2A: derived_regimes(A2A, g, m, node_bw),
        PERMUTE: derived_regimes(PERMUTE, g, m, node_bw),
    }
    return FittedCollectives(fabric, g, m, regimes, node_bw * 1e-3 if node_bw else None)


def _nvls(gpus_per_node: int) -> tuple[Regime, ...]:
    """NVLS regimes on one node of `gpus_per_node`: bus bandwidth kept, latency kept (NVLS has no
    ring steps: one multicast through the switch)."""
    files = ONE_NODE[(AR, "nvls")]
    n0 = _shape(files)[0]
    scale = BUS_FACTOR[AR](gpus_per_node) / BUS_FACTOR[AR](n0)
    return tuple(dataclasses.replace(r, us_per_byte=r.us_per_byte * scale) for r in fitted_regimes(files, "nvls"))


def model_for(table: Table, fabric: str | None = None) -> FittedCollectives:
    """The model a table is compared with: its shape, over `fabric` (default: its own; the IB
    model for a table whose fabric is not stated)."""
    if table.nodes == 1:
        fabric = "nvlink"
    fabric = fabric or (table.fabric if table.fabric in FABRICS else "ib")
    return collective_model(table.gpus_per_node, table.nodes, fabric)


def table_fit(table: Table, fabric: str | None = None) -> dict:
    """How the model of `table`'s shape (`model_for`) does on it: relative errors
    ``(model - measured) / measured`` over its sizes, for the algorithm it was measured with."""
    model = model_for(table, fabric)
    x, t = table.rows()
    predicted = model.collective_time_us(table.collective, x, None if table.algorithm == "default" else table.algorithm)
    relative = (predicted - t) / t
    worst = np.argsort(-np.abs(relative), kind="stable")[:3]
    return {
        "model": f"{model.fabric} {model.gpus_per_node}x{model.nodes}",
        "sizes": int(len(x)),
        "median_abs_rel_error": round(float(np.median(np.abs(relative))), 4),
        "max_abs_rel_error": round(float(np.max(np.abs(relative))), 4),
        "worst": [[int(x[i]), round(float(relative[i]), 3)] for i in worst],
    }
