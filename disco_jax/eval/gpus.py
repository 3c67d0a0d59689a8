"""One GPU of a simulated cluster: its peak rates, with a source for every number, and what its
kernels cost.

A `DeviceSpec` holds the peak rates the analytical kernel model needs, each a `Quantity` with its
source (``assumption=True`` marks our choices: efficiencies, launch overhead), and the device kind
JAX reports on that GPU. `kernel_estimator(device)` is what a cluster of it charges per kernel:

* where disco-jax ships estimator weights for the device kind (`disco_jax/profiles/<kind>/`:
  kernels timed on that GPU; today the H100), the plugins' estimate (the GNN's time on the device)
  plus the launch overhead, for the kernels they answer (``gnn+launch``);
* `RooflineEstimator` (``analytical-scaled``) for the rest (opaque ops: gemms, convolutions) and
  for GPUs without weights: ``launch + max(bytes / (memory efficiency x HBM bandwidth),
  elementwise work / fp32 peak + dot and convolution flops / (dot efficiency x dot peak))``.

`scripts/estimator_report.py` compares the two on the kernels measured on the GPU (docs/gpu.md).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

from disco_jax import Graph
from disco_jax._profile_store import sanitize_device_kind
from disco_jax.cost import (
    TRANSCENDENTAL_FLOPS,
    Estimator,
    KernelWork,
    OverheadEstimator,
    chain,
    kernel_work,
    plugin_estimators,
)


@dataclasses.dataclass(frozen=True)
class Quantity:
    """A number with its unit and where it comes from."""

    value: float
    unit: str
    source: str
    assumption: bool = False  # our choice, not a published figure

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """Peak rates of one GPU for the analytical kernel model."""

    name: str
    fp32_flops: Quantity  # elementwise work (FLOP/s)
    dot_flops: Quantity  # dots and convolutions at JAX's default float32 precision (FLOP/s)
    memory_bandwidth: Quantity  # bytes/s
    launch_us: Quantity  # per-kernel launch and dispatch overhead
    dot_efficiency: Quantity  # achieved fraction of dot_flops
    memory_efficiency: Quantity  # achieved fraction of memory_bandwidth
    transcendental_cost: Quantity = Quantity(
        TRANSCENDENTAL_FLOPS,
        "flop-equivalents per element",
        "disco_jax.cost.work.TRANSCENDENTAL_FLOPS weighting (exp, log, tanh... cost several FMAs)",
        assumption=True,
    )
    device_kind: str | None = None  # what JAX reports on this GPU: the key of its estimator weights


def device_for_kind(device_kind: str) -> DeviceSpec | None:
    """The simulated clusters' spec of the GPU JAX reports as `device_kind` (raw or sanitized)."""
    key = sanitize_device_kind(device_kind)
    return next((d for d in DEVICES if d.device_kind and sanitize_device_kind(d.device_kind) == key), None)


def kernel_estimator(device: DeviceSpec) -> Estimator:
    """What a cluster of `device` charges per kernel (see the module docstring)."""
    roofline = RooflineEstimator(device)
    plugins = _plugins(device.device_kind) if device.device_kind else ()
    if not plugins:
        return roofline
    return chain(*(OverheadEstimator(p, device.launch_us.value) for p in plugins), roofline)


@functools.cache
def _plugins(device_kind: str) -> tuple[Estimator, ...]:
    """The estimator plugins' estimators for a device kind, loaded once (rows share them; the GNN
    caches its predictions by kernel signature, which holds across graphs)."""
    return tuple(plugin_estimators(device_kind))


def opaque_op_work(graph: Graph, o: int) -> tuple[float, float, float]:
    """(elementwise, transcendental, dot/conv) work of an opaque op, looking inside the
    computation of a custom fusion (XLA:CPU wraps convolutions and dots in `__ynn_fusion`s);
    counted by `disco_jax.cost.work` and cached on the graph (`graph.op_work`)."""
    work = graph.op_work[o]
    return work.elementwise, work.transcendental, work.dot


@dataclasses.dataclass
class RooflineEstimator:
    """The analytical model scaled to a GPU: per kernel
    ``launch + max(memory time, elementwise time + dot time)`` (see the module docstring), with
    each kernel's work counted by `disco_jax.cost.work`. Implements `disco_jax.cost.Estimator`."""

    device: DeviceSpec
    name: str = "analytical-scaled"

    def kernel_time_us(self, graph: Graph, members: frozenset[int]) -> float:
        return self.device.launch_us.value + self.device_time_us(kernel_work(graph, members))

    def device_time_us(self, work: KernelWork) -> float:
        """The kernel's time on the device, without the launch overhead (what a kernel timed
        alone on the GPU measures: `scripts/estimator_report.py` compares the two)."""
        d = self.device
        memory_s = work.bytes / (d.memory_bandwidth.value * d.memory_efficiency.value)
        compute_s = (
            work.elementwise + d.transcendental_cost.value * work.transcendental
        ) / d.fp32_flops.value + work.dot / (d.dot_flops.value * d.dot_efficiency.value)
        return 1e6 * max(memory_s, compute_s)

    def estimate(self, graph: Graph, kernels: Sequence[frozenset[int]]) -> list[float | None]:
        return [self.kernel_time_us(graph, k) for k in kernels]

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "device": self.device.name,
            "formula": "launch + max(bytes / (eff_mem * HBM), (elementwise + 8 * transcendental) / fp32 peak "
            "+ dot flops / (eff_dot * dot peak))",
        }


# --------------------------------------------------------------------------- the data

_ASSUMED_LAUNCH = (
    "kernel launch plus XLA thunk dispatch on a GPU, typically 3-10 us; 5 us taken "
    "(NVIDIA CUDA C++ Best Practices Guide notes launches cost microseconds)"
)
_ASSUMED_MEMORY_EFFICIENCY = "achievable fraction of peak DRAM bandwidth for streaming kernels (STREAM-like), assumed"
_ASSUMED_DOT_EFFICIENCY = "achievable fraction of peak matrix throughput for XLA's GEMM/conv libraries, assumed"

GTX_1080_TI = DeviceSpec(
    name="NVIDIA GeForce GTX 1080 Ti",
    fp32_flops=Quantity(
        11.34e12, "FLOP/s", "NVIDIA GTX 1080 Ti specifications: 3584 CUDA cores x 1582 MHz boost x 2 = 11.3 TFLOPS fp32"
    ),
    dot_flops=Quantity(11.34e12, "FLOP/s", "Pascal has no tensor cores: dots run at the fp32 peak (11.3 TFLOPS)"),
    memory_bandwidth=Quantity(484e9, "B/s", "NVIDIA GTX 1080 Ti specifications: 11 Gbps GDDR5X, 352-bit, 484 GB/s"),
    launch_us=Quantity(5.0, "us", _ASSUMED_LAUNCH, assumption=True),
    dot_efficiency=Quantity(0.7, "fraction", _ASSUMED_DOT_EFFICIENCY, assumption=True),
    memory_efficiency=Quantity(0.8, "fraction", _ASSUMED_MEMORY_EFFICIENCY, assumption=True),
)

H100_SXM = DeviceSpec(
    name="NVIDIA H100 SXM5 80GB",
    fp32_flops=Quantity(67e12, "FLOP/s", "NVIDIA H100 Tensor Core GPU datasheet: FP32 67 TFLOPS (SXM)"),
    dot_flops=Quantity(
        494.7e12,
        "FLOP/s",
        "NVIDIA H100 datasheet: TF32 Tensor Core 989 TFLOPS with sparsity, 494.7 dense (SXM); "
        "JAX docs, Matmul precision (docs.jax.dev/en/latest/201/precision.html): by default float32 "
        "dots may use TF32 on recent GPUs",
    ),
    memory_bandwidth=Quantity(3.35e12, "B/s", "NVIDIA H100 datasheet: HBM3 3.35 TB/s (SXM)"),
    launch_us=Quantity(5.0, "us", _ASSUMED_LAUNCH, assumption=True),
    dot_efficiency=Quantity(0.5, "fraction", _ASSUMED_DOT_EFFICIENCY, assumption=True),
    memory_efficiency=Quantity(0.8, "fraction", _ASSUMED_MEMORY_EFFICIENCY, assumption=True),
    device_kind="NVIDIA H100 80GB HBM3",  # jax.devices()[0].device_kind on one (docs/gpu.md)
)

A100_SXM = DeviceSpec(
    name="NVIDIA A100 SXM4 80GB",
    fp32_flops=Quantity(19.5e12, "FLOP/s", "NVIDIA A100 Tensor Core GPU datasheet: FP32 19.5 TFLOPS"),
    dot_flops=Quantity(
        156e12,
        "FLOP/s",
        "NVIDIA A100 datasheet: TF32 Tensor Core 156 TFLOPS dense (312 with sparsity); JAX's default "
        "float32 dot precision may use TF32 (docs.jax.dev/en/latest/201/precision.html)",
    ),
    memory_bandwidth=Quantity(2.039e12, "B/s", "NVIDIA A100 datasheet: HBM2e 2,039 GB/s (80GB SXM)"),
    launch_us=Quantity(5.0, "us", _ASSUMED_LAUNCH, assumption=True),
    dot_efficiency=Quantity(0.5, "fraction", _ASSUMED_DOT_EFFICIENCY, assumption=True),
    memory_efficiency=Quantity(0.8, "fraction", _ASSUMED_MEMORY_EFFICIENCY, assumption=True),
)

DEVICES = (GTX_1080_TI, H100_SXM, A100_SXM)

__all__ = [
    "A100_SXM",
    "DEVICES",
    "GTX_1080_TI",
    "H100_SXM",
    "DeviceSpec",
    "Quantity",
    "RooflineEstimator",
    "device_for_kind",
    "kernel_estimator",
    "opaque_op_work",
]
