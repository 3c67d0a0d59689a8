"""All-reduce cost: one protocol, and the measured line that implements it.

`AllReduceCost` is what the simulator asks of communication: `time_us(nbytes)`, the time of one
all-reduce of a tensor of `nbytes` bytes per device (the bytes of the all-reduce's HLO shape, not
the total over devices), and `to_json()` for the plan file and reports. Two implementations:

* `AllReduceCostModel`: DisCo's line T(bytes) = C * bytes + D, fitted (`fit_allreduce_cost`) to
  all-reduces timed on the real devices (`disco_jax._profile.measure_allreduce_cost`);
* `disco_jax.eval.clusters.ClusterAllReduce`: NCCL's ring / hierarchical model of a simulated
  GPU cluster.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class AllReduceCost(Protocol):
    """Time of one all-reduce, by the bytes of one device's tensor."""

    def time_us(self, nbytes: int | float) -> float: ...

    def to_json(self) -> dict: ...


@dataclasses.dataclass(frozen=True)
class AllReduceCostModel:
    """T(bytes) = per_byte_us * bytes + latency_us (DisCo's T = C*x + D), in microseconds.

    `bytes` is the size of the all-reduced tensor on one device (the bytes of the all-reduce's
    HLO shape), not the total over devices.
    """

    per_byte_us: float
    latency_us: float

    def time_us(self, nbytes: int | float) -> float:
        return self.per_byte_us * float(nbytes) + self.latency_us

    def to_json(self) -> dict[str, float]:
        return {"per_byte_us": float(self.per_byte_us), "latency_us": float(self.latency_us)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> AllReduceCostModel:
        return cls(per_byte_us=float(d["per_byte_us"]), latency_us=float(d["latency_us"]))


def fit_allreduce_cost(points: Sequence[tuple[int, float]]) -> AllReduceCostModel:
    """Least-squares line through (bytes, microseconds) points, both coefficients >= 0.

    Residuals are relative (each point weighted by 1/time): sizes span four orders of magnitude,
    and an unweighted fit lets the largest size decide everything and leaves the latency D, which
    is what makes tensor fusion pay off, as noise. A negative coefficient is clipped to zero and
    the other one refitted alone.
    """
    if not points:
        raise ValueError("fit_allreduce_cost needs at least one (bytes, us) point")
    x = np.array([float(b) for b, _ in points])
    t = np.array([float(us) for _, us in points])
    w = 1.0 / np.maximum(t, max(float(t.max()) * 1e-6, 1e-9))
    if len(set(x.tolist())) < 2:
        return AllReduceCostModel(per_byte_us=0.0, latency_us=max(0.0, float(np.average(t, weights=w**2))))
    design = np.stack([x, np.ones_like(x)], axis=1) * w[:, None]
    (per_byte, latency), *_ = np.linalg.lstsq(design, t * w, rcond=None)
    if per_byte < 0:
        per_byte, latency = 0.0, float(np.average(t, weights=w**2))
    if latency < 0:
        latency = 0.0
        per_byte = float(np.sum(w**2 * x * t) / np.sum(w**2 * x * x))
    return AllReduceCostModel(per_byte_us=max(0.0, float(per_byte)), latency_us=max(0.0, float(latency)))
