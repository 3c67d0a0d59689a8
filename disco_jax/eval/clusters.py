"""Simulated GPU clusters, as data with a source for every number.

A `Cluster` is a GPU (`disco_jax.eval.gpus.DeviceSpec`: its peak rates and kernel costs) times a
topology (`gpus_per_node` x `nodes`, the intra-node and inter-node `Link`s). It gives the two cost
models the simulator needs for a platform we cannot run on:

* `cluster.allreduce_model()`: the cost of its collectives. H100 clusters (`collectives` names
  the fabric) take the models fitted to published nccl-tests tables
  (`disco_jax.eval.nccl.collective_model`: per collective, the fastest of NCCL's regimes
  ``latency + bytes / bandwidth``, carried from the measured shapes by NCCL's hop counts;
  docs/collectives.md). Clusters with no measured table (cluster A, A100 nodes) keep the
  datasheet model `ClusterAllReduce`: ring all-reduce, ``2(N-1)/N * bytes / bandwidth +
  latency`` within a node, hierarchical across nodes (reduce-scatter in the node, all-reduce of
  the 1/G shard between nodes, all-gather in the node), latencies from NCCL's tuning model (a
  base latency plus a per-step hardware latency, for its LL and Simple protocols), the faster
  protocol for each size.
* `cluster.kernel_estimator()`: the GPU's kernel costs (`gpus.kernel_estimator`): the GNN trained
  on that GPU plus the launch overhead where disco-jax ships weights for its device kind (the
  H100), the analytical roofline scaled to the GPU for the rest.

Every number is a `Quantity` with its source; those marked `assumption=True` are our choices
(efficiencies, launch overhead), not published figures. `CLUSTERS` holds the named clusters of
the benchmark (`disco_jax.eval.bench`).

A simulated cluster step is one device's step of the captured program (the zoo's paper config at
its per-device batch: global batch / 8), with the all-reduces costed for the cluster's device
count: the per-device batch stays the same on every cluster (weak scaling), only communication
changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import ClassVar

from disco_jax.cost import AllReduceCost, Estimator, SimulatorParams
from disco_jax.cost.allreduce import bucket_time_us, collective_time_us
from disco_jax.eval import gpus, nccl
from disco_jax.eval.gpus import A100_SXM, GTX_1080_TI, H100_SXM, H200_SXM, DeviceSpec, Quantity, RooflineEstimator

NCCL_TUNING = "NCCL src/graph/tuning.cc (v2.7), baseLat/hwLat tables, ring algorithm"
GB = 1e9


@dataclasses.dataclass(frozen=True)
class Link:
    """One GPU's view of an interconnect: bandwidth per direction available to it, NCCL's
    per-step latencies of the ring algorithm for its two protocols, and the achieved fraction
    of the bandwidth."""

    name: str
    bandwidth: Quantity  # bytes/s per GPU per direction
    step_latency_ll_us: Quantity
    step_latency_simple_us: Quantity
    efficiency: Quantity

    @property
    def effective_bandwidth(self) -> float:
        return self.bandwidth.value * self.efficiency.value


# NCCL's ring base latencies (us) and the LL protocol's bandwidth penalty for all-reduce.
RING_BASE_LATENCY_LL = Quantity(3.6, "us", NCCL_TUNING + ": baseLat[Ring][LL]")
RING_BASE_LATENCY_SIMPLE = Quantity(8.4, "us", NCCL_TUNING + ": baseLat[Ring][Simple]")
LL_BANDWIDTH_FRACTION = Quantity(0.25, "fraction", NCCL_TUNING + ": ring LL busBw *= 1/4 for all-reduce")


def ring_allreduce_us(nbytes: float, num_devices: int, bandwidth: float, latency_us: float = 0.0) -> float:
    """Textbook ring all-reduce: ``2(N-1)/N * bytes / bandwidth + latency`` (bandwidth in bytes/s
    per direction per device; result in microseconds)."""
    if num_devices <= 1:
        return 0.0
    return 2.0 * (num_devices - 1) / num_devices * float(nbytes) / bandwidth * 1e6 + latency_us


def hierarchical_allreduce_us(
    nbytes: float,
    gpus_per_node: int,
    nodes: int,
    intra_bandwidth: float,
    inter_bandwidth: float,
    latency_us: float = 0.0,
) -> float:
    """Two-level all-reduce of ``nbytes`` per device: reduce-scatter within each node
    ((G-1)/G * S / B_intra), ring all-reduce of each 1/G shard across the nodes, G rings in
    parallel (2(M-1)/M * (S/G) / B_inter, B_inter the inter-node bandwidth per GPU), all-gather
    within the node ((G-1)/G * S / B_intra); plus ``latency_us``."""
    intra = 2.0 * (gpus_per_node - 1) / gpus_per_node * float(nbytes) / intra_bandwidth if gpus_per_node > 1 else 0.0
    inter = (2.0 * (nodes - 1) / nodes * float(nbytes) / gpus_per_node / inter_bandwidth) if nodes > 1 else 0.0
    return (intra + inter) * 1e6 + latency_us


@dataclasses.dataclass(frozen=True)
class ClusterAllReduce(AllReduceCost):
    """All-reduce cost on a cluster (a `disco_jax.cost.AllReduceCost`): `time_us(nbytes)` with
    ``nbytes`` the bytes of one device's tensor (the all-reduce's HLO shape).

    For each NCCL protocol p in (LL, Simple): base_p + 2(G-1) x intra step latency_p + 2(M-1) x
    inter step latency_p (NCCL's ring latency model), plus the ring (one node) or hierarchical
    (several nodes) transfer time at the protocol's bandwidth (LL: a quarter). The faster
    protocol wins, as NCCL's tuner picks it."""

    gpus_per_node: int
    nodes: int
    intra_bandwidth: float  # bytes/s per GPU per direction, achieved
    inter_bandwidth: float  # bytes/s per GPU per direction, achieved (0 for one node)
    latency_ll_us: float
    latency_simple_us: float
    ll_bandwidth_fraction: float = 0.25
    # NCCL on GPUs: a sharded weight update's all-reduce becomes a reduce-scatter, whichever
    # backend captured the graph the cluster's row costs (`cost.sharded.reduce_scatters`).
    forms_reduce_scatter: ClassVar[bool] = True

    @property
    def num_devices(self) -> int:
        return self.gpus_per_node * self.nodes

    def _transfer_us(self, nbytes: float, fraction: float) -> float:
        if self.nodes == 1:
            return ring_allreduce_us(nbytes, self.gpus_per_node, self.intra_bandwidth * fraction)
        return hierarchical_allreduce_us(
            nbytes, self.gpus_per_node, self.nodes, self.intra_bandwidth * fraction, self.inter_bandwidth * fraction
        )

    def protocol_times_us(self, nbytes: float) -> dict[str, float]:
        return {
            "LL": self.latency_ll_us + self._transfer_us(nbytes, self.ll_bandwidth_fraction),
            "Simple": self.latency_simple_us + self._transfer_us(nbytes, 1.0),
        }

    def time_us(self, nbytes: int | float) -> float:
        if self.num_devices <= 1:
            return 0.0
        return min(self.protocol_times_us(nbytes).values())

    def to_json(self) -> dict:
        return {
            "model": "datasheet: ring (one node) / hierarchical (several nodes), min over NCCL LL and Simple",
            "source": "datasheet",
            **dataclasses.asdict(self),
        }


@dataclasses.dataclass(frozen=True)
class Cluster:
    name: str
    description: str
    device: DeviceSpec
    gpus_per_node: int
    nodes: int
    intra: Link
    inter: Link | None
    source: str  # where the cluster itself comes from
    # The `disco_jax.targets` GPU target its steps are captured and compiled for with XLA:GPU
    # (deviceless); None: no target XLA:GPU compiles for here, the step is XLA:CPU's module.
    target: str | None = None
    # The fabric whose fitted collectives it takes (`nccl.collective_model`: "nvlink" for one
    # H100 node, "ib" / "efa" / "tcpxo" between H100 nodes); None: the datasheet model.
    collectives: str | None = None

    @property
    def num_devices(self) -> int:
        return self.gpus_per_node * self.nodes

    def allreduce_model(self) -> AllReduceCost:
        """Its collectives' cost: fitted to nccl-tests tables where `collectives` names a fabric,
        else the datasheet model (`datasheet_allreduce`)."""
        if self.collectives is not None:
            return nccl.collective_model(self.gpus_per_node, self.nodes, self.collectives)
        return self.datasheet_allreduce()

    def grouped_collectives(self) -> AllReduceCost:
        """Its collectives' cost per replica group (`GroupedCollectives`): a collective over part of
        the devices (a mesh axis) costed for its group's GPUs per node and nodes; the whole
        cluster's model for one over every device."""
        return GroupedCollectives(self)

    def datasheet_allreduce(self) -> ClusterAllReduce:
        """Ring / hierarchical all-reduce from the links' datasheet figures and NCCL's latency model."""
        steps_intra = 2 * (self.gpus_per_node - 1)
        steps_inter = 2 * (self.nodes - 1)
        inter = self.inter
        lat_ll = RING_BASE_LATENCY_LL.value + steps_intra * self.intra.step_latency_ll_us.value
        lat_simple = RING_BASE_LATENCY_SIMPLE.value + steps_intra * self.intra.step_latency_simple_us.value
        if self.nodes > 1:
            if inter is None:
                raise ValueError(f"cluster {self.name} has {self.nodes} nodes but no inter-node link")
            lat_ll += steps_inter * inter.step_latency_ll_us.value
            lat_simple += steps_inter * inter.step_latency_simple_us.value
        return ClusterAllReduce(
            self.gpus_per_node,
            self.nodes,
            self.intra.effective_bandwidth,
            inter.effective_bandwidth if (inter is not None and self.nodes > 1) else 0.0,
            lat_ll,
            lat_simple,
            LL_BANDWIDTH_FRACTION.value,
        )

    def kernel_estimator(self) -> Estimator:
        """What a kernel costs on this cluster's GPU (`gpus.kernel_estimator`)."""
        return gpus.kernel_estimator(self.device)

    def simulator_params(self) -> SimulatorParams:
        """How its GPUs execute beyond kernel and collective costs, for the compiled-program model:
        the host lane fitted on such a GPU's machine with XLA's default command buffers
        (`DeviceSpec.host_lane`; none where no GPU of the kind was recorded)."""
        return SimulatorParams(host=self.device.host_lane("on"))

    def sources(self) -> dict:
        """Every number behind this cluster, with its source (for the report). A fitted cluster's
        collectives: per nccl-tests table behind them, how the model does on it (`nccl.table_fit`);
        a datasheet cluster's: its links' figures and NCCL's ring latencies."""
        out = {"cluster": self.source, **_quantities("device", self.device)}
        if self.collectives is not None:
            for t in self.allreduce_model().tables():
                fit = nccl.table_fit(t)
                out[f"fit.{t.file}"] = Quantity(
                    round(100 * fit["median_abs_rel_error"], 1),
                    f"% median |error| over {fit['sizes']} sizes ({t.role}; model {fit['model']})",
                    f"nccl-tests table: {t.source()}",
                ).to_json()
            return out
        out.update(_quantities("intra", self.intra))
        if self.inter is not None:
            out.update(_quantities("inter", self.inter))
        out["ring.base_latency_ll"] = RING_BASE_LATENCY_LL.to_json()
        out["ring.base_latency_simple"] = RING_BASE_LATENCY_SIMPLE.to_json()
        out["ring.ll_bandwidth_fraction"] = LL_BANDWIDTH_FRACTION.to_json()
        return out

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "description": self.description,
            "gpus_per_node": self.gpus_per_node,
            "nodes": self.nodes,
            "num_devices": self.num_devices,
            "target": self.target,
            "collectives": f"fitted to nccl-tests tables ({self.collectives})" if self.collectives else "datasheet",
            "allreduce": self.allreduce_model().to_json(),
            "sources": self.sources(),
        }


class GroupedCollectives:
    """A cluster's collectives per replica group (an `AllReduceCost` with `for_group`, which
    `cost.compiled` asks for each collective of a compiled program). A group of g GPUs on each of
    m nodes (device ids numbered node by node) costs what m x g GPUs cost over the cluster's
    links: for a fitted cluster `nccl.collective_model(g, m, fabric)`, the nccl-tests fits scaled
    to g GPUs per node by the ring's bus factor (the one-node tables are 8-GPU NVLink ones: a
    tensor-parallel group of 2 or 4 is their fit scaled, not measured; one across nodes takes the
    2-node fabric fits, scaled to m nodes); for a datasheet cluster the ring/hierarchical formula
    for g x m. Without a group: the whole cluster's model."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.whole = cluster.allreduce_model()
        self._by_shape: dict[tuple[int, int], AllReduceCost] = {}

    def for_group(self, group) -> AllReduceCost:
        g_per_node = self.cluster.gpus_per_node
        nodes = len({d // g_per_node for d in group})
        per_node = max(1, len(group) // nodes)
        if (per_node, nodes) == (g_per_node, self.cluster.nodes):
            return self.whole
        key = (per_node, nodes)
        if key not in self._by_shape:
            fabric = self.cluster.collectives
            if fabric is not None:
                self._by_shape[key] = nccl.collective_model(per_node, nodes, "nvlink" if nodes == 1 else fabric)
            else:
                part = dataclasses.replace(self.cluster, gpus_per_node=per_node, nodes=nodes)
                self._by_shape[key] = part.datasheet_allreduce()
        return self._by_shape[key]

    def time_us(self, nbytes: int | float) -> float:
        return self.whole.time_us(nbytes)

    def collective_time_us(self, collective: str, nbytes: int | float) -> float:
        return collective_time_us(self.whole, collective, nbytes)

    def bucket_time_us(self, tensor_bytes) -> float:
        return bucket_time_us(self.whole, tensor_bytes)

    def to_json(self) -> dict:
        return {"model": "per replica group", "whole": self.whole.to_json()}


def _quantities(prefix: str, obj) -> dict:
    """`obj`'s `Quantity` fields as JSON, keyed ``prefix.field``."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, Quantity):
            out[f"{prefix}.{f.name}"] = value.to_json()
    return out


# --------------------------------------------------------------------------- the data

_ASSUMED_LINK_EFFICIENCY = "achieved fraction of the link bandwidth by NCCL (bus bandwidth / link rate), assumed"

PCIE3_X16 = Link(
    name="PCIe 3.0 x16 (two GPUs in one machine, no NVLink)",
    bandwidth=Quantity(
        15.75e9, "B/s", "PCI-SIG PCIe 3.0: 8 GT/s x 16 lanes, 128b/130b encoding = 15.75 GB/s per direction"
    ),
    step_latency_ll_us=Quantity(1.0, "us", NCCL_TUNING + ": hwLat[PCI][Ring][LL]"),
    step_latency_simple_us=Quantity(5.7, "us", NCCL_TUNING + ": hwLat[PCI][Ring][Simple]"),
    efficiency=Quantity(0.8, "fraction", _ASSUMED_LINK_EFFICIENCY, assumption=True),
)

ETHERNET_100G_SHARED_BY_2 = Link(
    name="100 GbE RDMA, one NIC per machine shared by its 2 GPUs",
    bandwidth=Quantity(
        12.5e9 / 2,
        "B/s",
        "DisCo paper section 6.1 (cluster A: one 100GbE Mellanox RDMA card per machine of 2 GPUs): "
        "100 Gb/s = 12.5 GB/s per direction, halved per GPU",
    ),
    step_latency_ll_us=Quantity(2.7, "us", NCCL_TUNING + ": hwLat[NET][Ring][LL]"),
    step_latency_simple_us=Quantity(9.6, "us", NCCL_TUNING + ": hwLat[NET][Ring][Simple]"),
    efficiency=Quantity(0.8, "fraction", _ASSUMED_LINK_EFFICIENCY, assumption=True),
)

NVLINK4 = Link(
    name="NVLink 4 (NVSwitch, DGX/HGX H100)",
    bandwidth=Quantity(
        450e9, "B/s", "NVIDIA H100 datasheet: NVLink 900 GB/s per GPU, bidirectional = 450 GB/s per direction"
    ),
    step_latency_ll_us=Quantity(0.47, "us", NCCL_TUNING + ": hwLat[NVLink][Ring][LL]"),
    step_latency_simple_us=Quantity(3.4, "us", NCCL_TUNING + ": hwLat[NVLink][Ring][Simple]"),
    efficiency=Quantity(0.8, "fraction", _ASSUMED_LINK_EFFICIENCY, assumption=True),
)

NVLINK3 = Link(
    name="NVLink 3 (NVSwitch, DGX/HGX A100)",
    bandwidth=Quantity(
        300e9, "B/s", "NVIDIA A100 datasheet: NVLink 600 GB/s per GPU, bidirectional = 300 GB/s per direction"
    ),
    step_latency_ll_us=Quantity(0.47, "us", NCCL_TUNING + ": hwLat[NVLink][Ring][LL]"),
    step_latency_simple_us=Quantity(3.4, "us", NCCL_TUNING + ": hwLat[NVLink][Ring][Simple]"),
    efficiency=Quantity(0.8, "fraction", _ASSUMED_LINK_EFFICIENCY, assumption=True),
)

INFINIBAND_NDR_PER_GPU = Link(
    name="InfiniBand NDR 400 Gb/s, one NIC per GPU (DGX H100: 8 ConnectX-7)",
    bandwidth=Quantity(
        50e9,
        "B/s",
        "NVIDIA DGX H100 user guide: 8 single-port ConnectX-7 400 Gb/s InfiniBand NDR for compute; "
        "400 Gb/s = 50 GB/s per direction per GPU",
    ),
    step_latency_ll_us=Quantity(2.7, "us", NCCL_TUNING + ": hwLat[NET][Ring][LL]"),
    step_latency_simple_us=Quantity(9.6, "us", NCCL_TUNING + ": hwLat[NET][Ring][Simple]"),
    efficiency=Quantity(0.8, "fraction", _ASSUMED_LINK_EFFICIENCY, assumption=True),
)

CLUSTER_A = Cluster(
    name="clusterA-12x1080Ti",
    description="DisCo's cluster A: 6 machines x 2 GTX 1080 Ti (PCIe), 100 GbE RDMA between machines",
    device=GTX_1080_TI,
    gpus_per_node=2,
    nodes=6,
    intra=PCIE3_X16,
    inter=ETHERNET_100G_SHARED_BY_2,
    source="DisCo paper, section 6.1 (Testbed, cluster A)",
    # No target: XLA:GPU here cannot compile for compute capability 6.1 (its ptxas refuses sm_61,
    # "ptxas too old"), so cluster A costs XLA:CPU's module.
)

H100_NVLINK_8 = Cluster(
    name="8xH100-NVLink",
    description="one HGX/DGX H100 node: 8 H100 SXM over NVLink 4 / NVSwitch",
    device=H100_SXM,
    gpus_per_node=8,
    nodes=1,
    intra=NVLINK4,
    inter=None,
    source="NVIDIA DGX H100 system (8 H100 SXM5, 4th-gen NVSwitch); collectives fitted to one-node nccl-tests "
    "tables (docs/collectives.md)",
    target="h100-sxm",
    collectives="nvlink",
)

H100_IB_4X8 = Cluster(
    name="4x8xH100-IB400",
    description="4 nodes x 8 H100 SXM: NVLink 4 in the node, 400 Gb/s NDR InfiniBand (one NIC per GPU) between nodes",
    device=H100_SXM,
    gpus_per_node=8,
    nodes=4,
    intra=NVLINK4,
    inter=INFINIBAND_NDR_PER_GPU,
    source="NVIDIA DGX H100 SuperPOD building block (8 GPUs and 8 ConnectX-7 NDR NICs per node); collectives "
    "fitted to one-node and two-node InfiniBand nccl-tests tables, carried to 4 nodes (docs/collectives.md)",
    target="h100-sxm",
    collectives="ib",
)

CLUSTERS: dict[str, Cluster] = {c.name: c for c in (CLUSTER_A, H100_NVLINK_8, H100_IB_4X8)}


# GPU target (`disco_jax.targets`) -> the GPU, its node's interconnect and the fitted collectives
# of such a node (None: datasheet), for `node_of`.
TARGET_NODES: dict[str, tuple[DeviceSpec, Link, str | None]] = {
    "h100-sxm": (H100_SXM, NVLINK4, "nvlink"),
    # The H200 SXM has the H100's NVLink 4 and NVSwitch: the H100 node's fitted collectives carry over.
    "h200-sxm": (H200_SXM, NVLINK4, "nvlink"),
    "a100-sxm": (A100_SXM, NVLINK3, None),
}


def node_of(target: str, devices: int) -> Cluster:
    """One node of `devices` GPUs of a shipped target over its NVLink/NVSwitch (a plan for a
    cluster one does not have, `disco_jax.offline`)."""
    if target not in TARGET_NODES:
        raise ValueError(f"no cluster model for GPU target {target!r}; known: {', '.join(sorted(TARGET_NODES))}")
    if not isinstance(devices, int) or not 1 <= devices <= 8:
        raise ValueError(f"one node holds 1 to 8 GPUs, got {devices!r}; pass a multi-node Cluster instead")
    device, link, collectives = TARGET_NODES[target]
    return Cluster(
        name=f"{devices}x{target}",
        description=f"one node: {devices} x {device.name} over {link.name}",
        device=device,
        gpus_per_node=devices,
        nodes=1,
        intra=link,
        inter=None,
        source=f"{device.name} and {link.name} datasheet figures (see each number)"
        + ("; collectives fitted to one-node nccl-tests tables" if collectives else ""),
        target=target,
        collectives=collectives,
    )


def get_cluster(name: str) -> Cluster:
    if name not in CLUSTERS:
        raise KeyError(f"unknown cluster {name!r}; known: {sorted(CLUSTERS)}")
    return CLUSTERS[name]


def describe_allreduce(cluster: Cluster, sizes: Sequence[int] = (4, 1 << 20, 25 << 20, 100 << 20)) -> str:
    """One line per size: the all-reduce time on this cluster (for the report)."""
    model = cluster.allreduce_model()
    return "; ".join(f"{_fmt_bytes(s)}: {model.time_us(s):.1f} us" for s in sizes)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n} B"


__all__ = [
    "CLUSTERS",
    "Cluster",
    "ClusterAllReduce",
    "DeviceSpec",
    "Link",
    "Quantity",
    "RooflineEstimator",
    "get_cluster",
    "node_of",
    "hierarchical_allreduce_us",
    "ring_allreduce_us",
]
