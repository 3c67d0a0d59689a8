"""One GPU of a simulated cluster: its peak rates, with a source for every number, and what its
kernels cost.

A `DeviceSpec` holds the peak rates the analytical kernel model needs, each a `Quantity` with its
source (``assumption=True`` marks our choices), and the device kind JAX reports on that GPU.
Where kernels were timed on the GPU (`disco_jax/profiles/<kind>/kernel_samples.jsonl`: the H100),
its per-kernel launch cost and achieved memory bandwidth are fitted to them
(`fit_device_constants`, stored in `device_constants.json` beside the samples by
`scripts/fit_device_constants.py` and read into the spec, `DeviceSpec.with_fitted`); the other
GPUs' are assumed. The H100's dot efficiency (one figure for XLA's GEMM and convolution library
calls) is measured too, on the gemm and convolution kernels of the zoo's paper-size steps traced on
an H100 (`scripts/gpu_programs_report.py --write-constants`, docs/gpu.md); elsewhere it is assumed.
`kernel_estimator(device)` is what a cluster of it charges per kernel:

* where disco-jax ships estimator weights for the device kind (`disco_jax/profiles/<kind>/`:
  kernels timed on that GPU; today the H100), the plugins' estimate (the GNN's time on the
  device) for the kernels they answer: its training times hold each kernel's fixed cost, which
  is what the fitted launch cost is, so nothing is added;
* `RooflineEstimator` (``analytical-scaled``) for the rest (opaque ops: gemms, convolutions; and
  fusions beyond the GNN's training range, such as XLA:GPU's horizontally fused optimizer updates
  (several parameters' Adam updates in one kernel of tens to hundreds of ops), which are
  memory-bound: the fitted bandwidth costs them) and for GPUs
  without weights: ``launch + max(bytes / (memory efficiency x HBM bandwidth), elementwise work
  / fp32 peak + dot and convolution flops / (dot efficiency x dot peak))``, the dot peak of the
  operands' type: 16-bit floats (bfloat16, float16) at the tensor cores' 16-bit rate, others at
  the TF32 rate.

Not charged: any gap between two kernels on a stream beyond their own time (host launch,
dispatch), which timing kernels one by one does not measure.

`scripts/estimator_report.py` compares the two on the kernels measured on the GPU (docs/gpu.md).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

from disco_jax import Graph
from disco_jax._graph import build_graph, per_graph
from disco_jax._profile_db import SHIPPED_PROFILE_DIR, sanitize_device_kind
from disco_jax.cost import (
    ELEMENTWISE,
    TRANSCENDENTAL_FLOPS,
    Estimator,
    KernelWork,
    chain,
    kernel_half_bytes,
    kernel_work,
    plugin_estimators,
    work_per_op,
)
from disco_jax.cost.host import HostLane
from disco_jax.cost.work import HALF_FLOATS


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
    dot16_flops: Quantity | None = None  # dots and convolutions of 16-bit floats; None: at dot_flops
    # Measured where a GPU's library calls were timed (`eval.gpu_fit.fit_library_calls`): per kind
    # `library_kind` ("gemm", "gemm16", "conv") -> (overhead_us, efficiency): a call's compute time
    # is the overhead plus its work at `efficiency` of the dense peak of its type, so small calls
    # achieve less of the peak than large ones. A 16-bit gemm without a fit of its own takes the
    # "gemm" fit (calibrations before 16-bit gemms were fitted apart); a kind missing: its work at
    # `dot_efficiency` for every call.
    library_fit: Mapping[str, tuple[float, float]] | None = None
    # Factor on the GNN's time of a kernel that reduces (XLA's kInput fusions), fitted where the
    # GNN's answers were set against traced kernels; None: 1.
    reduction_bias: Quantity | None = None
    # The host lane (`cost.host.HostLane`) by XLA's command-buffer setting ("on": XLA's default,
    # "off"), fitted to traced calls on such a GPU's machine; None: the host is not charged.
    host_lanes: Mapping[str, HostLane] | None = None

    def dot_time_us(self, kind: str, at_peak_us: float) -> float:
        """The compute time of a library call of `kind` whose work takes `at_peak_us` at the dense
        peak of its operands' type (`library_fit`, else `dot_efficiency`)."""
        fits = self.library_fit or {}
        fit = fits.get(kind, fits.get("gemm") if kind == "gemm16" else None)
        if fit is None:
            return at_peak_us / self.dot_efficiency.value
        overhead_us, efficiency = fit
        return overhead_us + at_peak_us / efficiency

    def host_lane(self, command_buffers: str = "on") -> HostLane | None:
        """The fitted host lane for XLA's command-buffer setting ("on" is XLA:GPU's default)."""
        return (self.host_lanes or {}).get(command_buffers)

    @property
    def constants_path(self) -> Path:
        """Where its shipped profile keeps its fitted constants (`device_constants.json`)."""
        return SHIPPED_PROFILE_DIR / sanitize_device_kind(self.device_kind or "") / CONSTANTS_FILE

    def with_fitted(self) -> DeviceSpec:
        """The spec with the constants fitted to its GPU's kernel samples and recorded programs
        where they exist (`device_constants.json` beside the shipped samples:
        `fit_device_constants`, `eval.gpu_fit.write_calibration`)."""
        path = self.constants_path
        if not self.device_kind or not path.exists():
            return self
        return self.with_constants(json.loads(path.read_text()))

    def with_constants(self, stored: Mapping) -> DeviceSpec:
        """The spec with the constants of a `device_constants.json` document: its `constants`
        (`Quantity` fields by name), and where present its `calibration` (`library_fit`,
        `reduction_bias`, `host_lanes`)."""
        quantities = {k: Quantity(v["value"], v["unit"], v["source"]) for k, v in stored.get("constants", {}).items()}
        out = dataclasses.replace(self, **quantities)
        calibration = stored.get("calibration")
        if not calibration:
            return out
        by = calibration.get("library_fit", {}).get("kinds")
        bias = calibration.get("reduction_bias")
        lanes = calibration.get("host_lanes")
        return dataclasses.replace(
            out,
            library_fit=None if by is None else {k: (float(v[0]), float(v[1])) for k, v in by.items()},
            reduction_bias=None if bias is None else Quantity(bias["value"], bias["unit"], bias["source"]),
            host_lanes=None if lanes is None else {k: HostLane.from_json(v) for k, v in lanes.items()},
        )


def library_kind(work: KernelWork) -> str:
    """The kind a library call is fitted and costed as: "conv" where convolutions are most of its
    work, "gemm16" for a product of 16-bit operands (cuBLAS's bf16/f16 kernels reach about 0.8 of
    their peak at 7B sizes where the f32 ones, on TF32, reach about 0.5: one fit for both serves
    neither), else "gemm"."""
    if 2 * work.conv >= work.dot:
        return "conv"
    return "gemm16" if work.dot_16bit >= work.dot / 2 else "gemm"


def calibration_text(device: DeviceSpec) -> str:
    """One sentence on what `device`'s costs were calibrated to (its profile's `calibration`):
    the library calls' fit and, where stored, how well the model predicted the recorded steps
    held out by model; "no calibration to recorded programs" where there is none."""
    path = device.constants_path
    calibration = json.loads(path.read_text()).get("calibration") if device.device_kind and path.exists() else None
    if not calibration:
        return "no calibration to recorded programs"
    kinds = calibration.get("library_fit", {}).get("kinds", {})
    names = {"gemm": "gemms", "gemm16": "16-bit gemms", "conv": "convolutions"}
    parts = [
        f"{names.get(k, k)} at {v[0]:.1f} us per call plus their work at {v[1]:.1%} of the dense peak"
        for k, v in kinds.items()
    ]
    text = "library calls fitted to the traced calls of the recorded programs (" + "; ".join(parts) + ")"
    held = calibration.get("fidelity", {}).get("paper/cb off", {}).get("held_out")
    if held:
        text += (
            f"; with the host lane fitted on the same machine, the model predicts the paper-size steps "
            f"recorded on one such GPU within a median {held['median']:.1%} of their step time (worst "
            f"{held['worst']:.1%}), every constant fitted without the step's own model"
        )
    return text


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
    return chain(*(DtypeTrueEstimator(p, device) for p in plugins), roofline)


@functools.cache
def _plugins(device_kind: str) -> tuple[Estimator, ...]:
    """The estimator plugins' estimators for a device kind, loaded once (rows share them; the GNN
    caches its predictions by kernel signature, which holds across graphs)."""
    return tuple(plugin_estimators(device_kind))


def opaque_op_work(graph: Graph, o: int) -> tuple[float, float, float]:
    """(elementwise, transcendental, dot/conv) work of an opaque op, looking inside the
    computation of a custom fusion (XLA:CPU wraps convolutions and dots in `__ynn_fusion`s);
    counted by `disco_jax.cost.work` and cached per graph (`cost.work.work_per_op`)."""
    work = work_per_op(graph)[o]
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
        dot16 = (d.dot16_flops or d.dot_flops).value
        at_peak_us = 1e6 * ((work.dot - work.dot_16bit) / d.dot_flops.value + work.dot_16bit / dot16)
        dot_s = d.dot_time_us(library_kind(work), at_peak_us) / 1e6 if work.dot else 0.0
        compute_s = (work.elementwise + d.transcendental_cost.value * work.transcendental) / d.fp32_flops.value + dot_s
        return 1e6 * max(memory_s, compute_s)

    def assumptions(self, graph: Graph, members: frozenset[int]) -> list[str]:
        """The device's assumed constants (`Quantity.assumption`) a kernel's time rests on."""
        work = kernel_work(graph, members)
        used = ["launch_us", "memory_efficiency"]
        fits = self.device.library_fit or {}
        fitted = library_kind(work) in fits or (library_kind(work) == "gemm16" and "gemm" in fits)
        used += ["dot_efficiency"] if work.dot and not fitted else []
        used += ["transcendental_cost"] if work.transcendental else []
        return [name for name in used if getattr(self.device, name).assumption]

    def estimate(self, graph: Graph, kernels: Sequence[frozenset[int]]) -> list[float | None]:
        return [self.kernel_time_us(graph, k) for k in kernels]

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "device": self.device.name,
            "formula": "launch + max(bytes / (eff_mem * HBM), (elementwise + 8 * transcendental) / fp32 peak "
            "+ dot flops / (eff_dot * dot peak of the operands' type))",
            "constants": {
                f.name: getattr(self.device, f.name).to_json()
                for f in dataclasses.fields(self.device)
                if isinstance(getattr(self.device, f.name), Quantity)
            },
        }


@dataclasses.dataclass
class DtypeTrueEstimator:
    """A learned estimator's answers (the GNN's) made true to the kernel's dtypes and bounded by
    the device, under the estimator's own name:

    * a kernel computing or moving 16-bit floats is answered for its 32-bit twin (the same ops with bfloat16
      and float16 widened to float32: `_widened`), where the GNN was trained (97% of its samples;
      on its own it answers a bfloat16 fusion about as its float32 twin, 74.4 against 74.8 us for
      100.7 against 201 MB, issue 47), and that answer's time above the launch is scaled by the
      kernel's bytes over the twin's (`cost.work.kernel_half_bytes`): a 16-bit kernel never costs
      more than its 32-bit twin;
    * a kernel that reduces is scaled by `DeviceSpec.reduction_bias` (fitted where the GNN's
      answers were set against traced kernels);
    * no kernel costs less than the launch plus its bytes at the datasheet bandwidth, which no
      kernel beats."""

    base: Estimator
    device: DeviceSpec

    @property
    def name(self) -> str:
        return self.base.name

    def warm_up(self) -> None:
        warm = getattr(self.base, "warm_up", None)
        if callable(warm):
            warm()

    def estimate(self, graph: Graph, kernels: Sequence[frozenset[int]]) -> list[float | None]:
        d = self.device
        launch = d.launch_us.value
        answers = list(self.base.estimate(graph, kernels))
        half = [kernel_half_bytes(graph, k) for k in kernels]
        narrow = [i for i, k in enumerate(kernels) if half[i] or _computes_16bit(graph, k)]
        if narrow:
            twin, ids = _widened(graph)
            mapped = [frozenset(ids[graph.ops[o].name] for o in kernels[i]) for i in narrow]
            for i, t in zip(narrow, self.base.estimate(twin, mapped)):
                answers[i] = t
        bias = d.reduction_bias.value if d.reduction_bias is not None else 1.0
        out: list[float | None] = []
        for members, t, h in zip(kernels, answers, half):
            if t is None:
                out.append(None)
                continue
            if bias != 1.0 and any(graph.ops[o].opcode == "reduce" for o in members):
                t *= bias
            moved = kernel_work(graph, members).bytes
            if h and moved:
                t = launch + max(0.0, t - launch) * moved / (moved + h)
            out.append(max(t, launch + 1e6 * moved / d.memory_bandwidth.value))
        return out


def _computes_16bit(graph: Graph, members: frozenset[int]) -> bool:
    """Whether any op of the kernel makes a 16-bit float value (inside it, or as its output)."""
    return any(t.dtype in HALF_FLOATS for o in members for t in graph.ops[o].inst.outputs)


@per_graph
def _widened(graph: Graph) -> tuple[Graph, dict[str, int]]:
    """The graph's 32-bit twin (every bfloat16 and float16 array float32; the ops and their names
    otherwise the same, none merged, loop bodies' too: a compiled program's graph holds them) and
    its op ids by name."""
    from disco_jax.backends import GPU

    text = graph.module.to_text().replace("bf16[", "f32[").replace("f16[", "f32[")
    twin = build_graph(text, GPU.fusible, merge_duplicates=False, control_flow=True)
    return twin, {op.name: op.id for op in twin.ops}


# --------------------------------------------------------------------------- fitted constants

CONSTANTS_FILE = "device_constants.json"
LAUNCH_FIT_MAX_BYTES = 1 << 20  # the kernels whose time is mostly their fixed cost
BANDWIDTH_FIT_MIN_BYTES = 64 << 20  # the kernels whose time is mostly streaming memory
# Ops that stream their operands (no reduction, no transposition): kernels of only these are the
# memory-bound ones XLA's elementwise fusions and horizontally fused updates are made of.
STREAMING = ELEMENTWISE | frozenset("broadcast reshape slice concatenate pad reverse iota bitcast".split())


def fit_device_constants(samples: Iterable[dict], memory_bandwidth: float, file: str = "kernel_samples.jsonl") -> dict:
    """`launch_us` and `memory_efficiency` fitted to kernels timed alone on a GPU (records of
    `kernel_samples.jsonl`: `time_us`, `read_bytes`, `written_bytes`, `kernel.nodes[].op`), as
    `Quantity` fields by name (value, unit, source, and the fit):

    * launch_us: the intercept of a least-squares line of time against bytes moved, over the
      kernels that move at most `LAUNCH_FIT_MAX_BYTES`;
    * memory_efficiency: the achieved bandwidth B, the median of bytes / (time - launch_us) over
      the kernels of only `STREAMING` ops that move at least `BANDWIDTH_FIT_MIN_BYTES` (robust:
      a least-squares slope follows the few kernels whose byte counts are off), over
      `memory_bandwidth` (the datasheet's); with the relative error of launch + bytes / B there."""
    rows = [(float(r["read_bytes"] + r["written_bytes"]), float(r["time_us"]), r) for r in samples]
    small = np.array([(b, t) for b, t, _ in rows if b <= LAUNCH_FIT_MAX_BYTES])
    (slope, launch), *_ = np.linalg.lstsq(np.stack([small[:, 0], np.ones(len(small))], 1), small[:, 1], rcond=None)
    large = np.array(
        [
            (b, t)
            for b, t, r in rows
            if b >= BANDWIDTH_FIT_MIN_BYTES and all(n["op"] in STREAMING for n in r["kernel"]["nodes"])
        ]
    )
    bandwidth = 1e6 * float(np.median(large[:, 0] / (large[:, 1] - launch)))  # bytes/s (times in us)
    errors = np.abs(launch + 1e6 * large[:, 0] / bandwidth - large[:, 1]) / large[:, 1]
    return {
        "launch_us": {
            "value": float(launch),
            "unit": "us",
            "source": f"fitted to {file}, {len(small)} kernels: intercept of time against bytes moved over the "
            f"kernels moving at most {LAUNCH_FIT_MAX_BYTES >> 20} MiB (the fixed cost of one kernel on the device)",
            "fit": {"kernels": len(small), "intercept_us": float(launch), "us_per_byte": float(slope)},
        },
        "memory_efficiency": {
            "value": bandwidth / memory_bandwidth,
            "unit": "fraction",
            "source": f"fitted to {file}, {len(large)} kernels: achieved bandwidth {bandwidth / 1e12:.3f} TB/s, the "
            f"median of bytes / (time - launch) over kernels of streaming ops moving at least "
            f"{BANDWIDTH_FIT_MIN_BYTES >> 20} MiB, over the datasheet's {memory_bandwidth / 1e12:.2f} TB/s",
            "fit": {
                "kernels": len(large),
                "bandwidth_bytes_per_s": bandwidth,
                "median_relative_error": float(np.median(errors)),
                "p90_relative_error": float(np.percentile(errors, 90)),
            },
        },
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
    # Launch and memory efficiency as assumed without samples; fitted to the H100's (`with_fitted`).
    launch_us=Quantity(5.0, "us", _ASSUMED_LAUNCH, assumption=True),
    dot_efficiency=Quantity(0.5, "fraction", _ASSUMED_DOT_EFFICIENCY, assumption=True),
    memory_efficiency=Quantity(0.8, "fraction", _ASSUMED_MEMORY_EFFICIENCY, assumption=True),
    device_kind="NVIDIA H100 80GB HBM3",  # jax.devices()[0].device_kind on one (docs/gpu.md)
    dot16_flops=Quantity(
        989.4e12, "FLOP/s", "NVIDIA H100 datasheet: BF16 / FP16 Tensor Core 1,979 TFLOPS with sparsity, 989 dense (SXM)"
    ),
).with_fitted()

H200_SXM = DeviceSpec(
    name="NVIDIA H200 SXM 141GB",
    # The H100's chip (NVIDIA H200 datasheet: the same FP32, TF32 and BF16 Tensor Core figures as
    # the H100 SXM): every compute peak carries over.
    fp32_flops=Quantity(67e12, "FLOP/s", "NVIDIA H200 datasheet: FP32 67 TFLOPS (SXM), the H100's"),
    dot_flops=Quantity(
        494.7e12, "FLOP/s", "NVIDIA H200 datasheet: TF32 Tensor Core 989 TFLOPS with sparsity, 494.7 dense"
    ),
    memory_bandwidth=Quantity(4.8e12, "B/s", "NVIDIA H200 datasheet: HBM3e 4.8 TB/s (SXM, 141 GB)"),
    launch_us=Quantity(5.0, "us", _ASSUMED_LAUNCH, assumption=True),
    dot_efficiency=Quantity(0.5, "fraction", _ASSUMED_DOT_EFFICIENCY, assumption=True),
    memory_efficiency=Quantity(0.8, "fraction", _ASSUMED_MEMORY_EFFICIENCY, assumption=True),
    device_kind="NVIDIA H200",  # jax.devices()[0].device_kind on one (data/gpu/2026-11-28/env.json)
    dot16_flops=Quantity(
        989.4e12, "FLOP/s", "NVIDIA H200 datasheet: BF16 / FP16 Tensor Core 1,979 TFLOPS with sparsity"
    ),
).with_fitted()

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
    dot16_flops=Quantity(312e12, "FLOP/s", "NVIDIA A100 datasheet: BF16 / FP16 Tensor Core 312 TFLOPS dense"),
)

DEVICES = (GTX_1080_TI, H100_SXM, H200_SXM, A100_SXM)

__all__ = [
    "A100_SXM",
    "CONSTANTS_FILE",
    "DEVICES",
    "GTX_1080_TI",
    "H100_SXM",
    "H200_SXM",
    "DtypeTrueEstimator",
    "DeviceSpec",
    "Quantity",
    "RooflineEstimator",
    "calibration_text",
    "device_for_kind",
    "fit_device_constants",
    "kernel_estimator",
    "opaque_op_work",
]
