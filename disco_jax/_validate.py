"""Check a plan against the unmodified step: equal outputs, and not slower beyond noise.

Both executables run on the same inputs. Outputs are compared bitwise when the plan only
regroups all-reduces (each element is still reduced in the same order), else within a tolerance:
fused and unfused elementwise code are generated differently by XLA, so values may move by a few
ulps (a fused kernel may evaluate an expression in another order or with fused multiply-adds),
and optimizers such as Adam divide by running moments, which enlarges those ulps on elements
near zero (an update's sign can flip where a gradient is ~0). The tolerance is therefore per
output array, the larger of

* atol + rtol * max |default| (rtol = 1e-4, atol = 1e-6 for 32-bit floats; 1e-2 / 1e-3 for
  16-bit; 1e-7 / 1e-9 for 64-bit), and
* 10 x the output's own sensitivity: how far the unmodified step's output moves when every
  floating-point input is nudged by one ulp (`sensitivity`). A rewrite that only reorders
  rounding stays within it; a wrong rewrite moves outputs far more.

Integer and boolean outputs must be equal.

Timing runs the two executables in interleaved pairs and reports the median of per-pair ratios
with its spread: shared machines are noisy, and on XLA:CPU the devices share the host's cores.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

TOLERANCES = {2: (1e-2, 1e-3), 4: (1e-4, 1e-6), 8: (1e-7, 1e-9)}  # itemsize -> (rtol, atol)


@dataclasses.dataclass
class Comparison:
    bitwise_equal: bool
    within_tolerance: bool
    max_abs_error: float
    max_rel_error: float
    num_outputs: int
    worst_output: int | None

    @classmethod
    def merge(cls, comparisons: list[dict]) -> Comparison:
        """One verdict from every process's comparison of its own output shards (as JSON)."""
        worst = max(comparisons, key=lambda c: c["max_abs_error"])
        return cls(
            bitwise_equal=all(c["bitwise_equal"] for c in comparisons),
            within_tolerance=all(c["within_tolerance"] for c in comparisons),
            max_abs_error=worst["max_abs_error"],
            max_rel_error=max(c["max_rel_error"] for c in comparisons),
            num_outputs=worst["num_outputs"],
            worst_output=worst["worst_output"],
        )


SENSITIVITY_FACTOR = 10.0


def nudge(args: Any) -> Any:
    """Every floating-point array moved up by one ulp, in its own sharding."""

    def up(x):
        if isinstance(x, jax.Array) and jax.numpy.issubdtype(x.dtype, jax.numpy.floating):
            return jax.device_put(jax.numpy.nextafter(x, jax.numpy.array(np.inf, x.dtype)), x.sharding)
        return x

    return jax.tree.map(up, args)


def sensitivity(reference: Any, nudged: Any) -> list[float]:
    """Per output array: max |reference - output of the step on nudged inputs|."""
    out = []
    for r, n in zip(jax.tree.leaves(reference), jax.tree.leaves(nudged)):
        r, n = np.asarray(r), np.asarray(n)
        if np.issubdtype(r.dtype, np.inexact):
            out.append(float(np.nanmax(np.abs(r.astype(np.float64) - n.astype(np.float64)), initial=0.0)))
        else:
            out.append(0.0)
    return out


def compare_outputs(reference: Any, candidate: Any, *, bitwise: bool, floor: list[float] | None = None) -> Comparison:
    """Compare step outputs; `floor` is `sensitivity(...)` per output, if measured."""
    ref_leaves, ref_tree = jax.tree.flatten(reference)
    cand_leaves, cand_tree = jax.tree.flatten(candidate)
    if ref_tree != cand_tree:
        raise ValueError(f"output structures differ: {ref_tree} vs {cand_tree}")
    equal, within, max_abs, max_rel, worst = True, True, 0.0, 0.0, None
    for i, (r, c) in enumerate(zip(ref_leaves, cand_leaves)):
        r, c = np.asarray(r), np.asarray(c)
        if r.shape != c.shape or r.dtype != c.dtype:
            return Comparison(False, False, float("inf"), float("inf"), len(ref_leaves), i)
        if np.array_equal(r, c, equal_nan=np.issubdtype(r.dtype, np.inexact)):
            continue
        equal = False
        if not np.issubdtype(r.dtype, np.inexact):
            return Comparison(False, False, float("inf"), float("inf"), len(ref_leaves), i)
        r64, c64 = r.astype(np.float64), c.astype(np.float64)
        diff = np.abs(r64 - c64)
        rtol, atol = TOLERANCES.get(r.dtype.itemsize, TOLERANCES[4])
        abs_err = float(np.nanmax(diff))
        rel_err = float(np.nanmax(diff / np.maximum(np.abs(r64), 1e-30)))
        if abs_err > max_abs:
            max_abs, worst = abs_err, i
        max_rel = max(max_rel, rel_err)
        allowed = atol + rtol * float(np.nanmax(np.abs(r64)))
        if floor is not None:
            allowed = max(allowed, SENSITIVITY_FACTOR * floor[i])
        if abs_err > allowed:
            within = False
    ok = equal if bitwise else within
    return Comparison(equal, ok, max_abs, max_rel, len(ref_leaves), worst)


@dataclasses.dataclass
class Timing:
    default_us: float  # median step time of the unmodified executable
    plan_us: float
    ratio: float  # median of per-pair plan/default ratios
    ratio_low: float  # 25th percentile of the ratios
    ratio_high: float  # 75th percentile
    pairs: int

    @property
    def noise(self) -> float:
        return max(0.03, (self.ratio_high - self.ratio_low) / 2)

    @property
    def not_slower(self) -> bool:
        return self.ratio <= 1.0 + self.noise


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return (time.perf_counter() - start) * 1e6


def time_interleaved(
    default: Callable[[], Any], plan: Callable[[], Any], *, pairs: int = 20, warmup: int = 3
) -> Timing:
    """Median step times and the median plan/default ratio over interleaved pairs."""
    for _ in range(warmup):
        _timed(default), _timed(plan)
    d, p = [], []
    for i in range(pairs):
        if i % 2:  # alternate which goes first
            p.append(_timed(plan)), d.append(_timed(default))
        else:
            d.append(_timed(default)), p.append(_timed(plan))
    ratios = np.array(p) / np.array(d)
    return Timing(
        float(np.median(d)),
        float(np.median(p)),
        float(np.median(ratios)),
        float(np.percentile(ratios, 25)),
        float(np.percentile(ratios, 75)),
        pairs,
    )
