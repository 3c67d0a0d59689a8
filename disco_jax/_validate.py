"""Check a plan against the unmodified step: equal outputs, and not slower beyond noise.

Both executables run on the same inputs (`_output_check.OutputCheck` runs them and picks the
check). Outputs are compared bitwise when the plan only regroups all-reduces (each element is
still reduced in the same order). Otherwise fused and unfused elementwise code are generated
differently by XLA, and collectives may sum in another order, so values move by a few ulps; and
optimizers such as Adam divide by running moments, which turns those ulps on elements near zero
into learning-rate-sized differences (an update's sign can flip where a gradient is ~0). So:

* where the step can be re-run in float64, `compare_to_float64`: per floating output array the
  plan's max deviation from the float64 result must be at most FACTOR x XLA's own program's plus
  FLOOR_ULPS ulps of the array's magnitude (the reasons for those values: docs/output-check.md);
* else `compare_outputs`, the ulp tolerance, per output array the larger of
  atol + rtol * max |default| (rtol = 1e-4, atol = 1e-6 for 32-bit floats; 1e-2 / 1e-3 for
  16-bit; 1e-7 / 1e-9 for 64-bit), and 10 x the output's own sensitivity: how far the unmodified
  step's output moves when every floating-point input is nudged by one ulp (`sensitivity`).

Integer and boolean outputs must be equal.

Timing runs the two executables in interleaved pairs and reports the median of per-pair ratios
with its spread and its confidence interval. A plan is used only when it is faster with confidence
(`ACCEPTANCE_RULE`, `time_until_decided`): shared machines are noisy, and on XLA:CPU the devices
share the host's cores, so a median alone lets slower plans through.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

TOLERANCES = {2: (1e-2, 1e-3), 4: (1e-4, 1e-6), 8: (1e-7, 1e-9)}  # itemsize -> (rtol, atol)

# Which check decided a `Comparison`.
BITWISE_CHECK, FLOAT64_CHECK, ULP_CHECK = "bitwise", "float64-reference", "ulp-tolerance"
# The float64 check (`compare_to_float64`): a candidate may deviate from the float64 result by
# FACTOR x XLA's own deviation plus FLOOR_ULPS ulps of the array's magnitude (docs/output-check.md).
FACTOR = 8.0
FLOOR_ULPS = 4.0


@dataclasses.dataclass
class Comparison:
    """A candidate's outputs against its program's reference (`_output_check.OutputCheck`).

    bitwise_equal: equal to XLA's outputs bit for bit. within_tolerance: the verdict of `check`,
    which is 'bitwise' (only all-reduces regrouped: equality required), 'float64-reference'
    (`compare_to_float64`) or 'ulp-tolerance' (`compare_outputs`; `fallback_reason` says why the
    float64 reference was not used). max_abs_error / max_rel_error / worst_output: the largest
    |candidate - XLA's outputs| over the compared arrays, and where. For the float64 check, per
    compared array (an output leaf; in a multi-process job one local shard of it), in leaf order:
    `default_deviation` and `plan_deviation`, max |XLA's - float64| and max |candidate - float64|,
    and `allowed`, `factor` x the first plus the floor (`floor_ulps` ulps of the array's magnitude);
    0.0 for integer and boolean arrays, which must equal XLA's. `state_steps`: the verdict is the
    one from the state after that many unmodified steps (the candidate passed from the call's
    own inputs first; `_output_check.OutputCheck.moved`); 0 with `state_reason` saying why it was
    judged from the call's inputs only."""

    bitwise_equal: bool
    within_tolerance: bool
    max_abs_error: float
    max_rel_error: float
    num_outputs: int
    worst_output: int | None
    check: str = ULP_CHECK
    fallback_reason: str | None = None
    factor: float | None = None
    floor_ulps: float | None = None
    default_deviation: list[float] | None = None
    plan_deviation: list[float] | None = None
    allowed: list[float] | None = None
    state_steps: int = 0
    state_reason: str | None = None

    @classmethod
    def merge(cls, comparisons: list[dict]) -> Comparison:
        """One verdict from every process's comparison of its own output shards (as JSON): within
        when every process's is; per-array deviations at their largest over the processes."""
        worst = max(comparisons, key=lambda c: c["max_abs_error"])
        first = comparisons[0]

        def largest(field: str) -> list[float] | None:
            lists = [c.get(field) for c in comparisons]
            if any(values is None for values in lists) or len({len(v) for v in lists}) != 1:
                return first.get(field)
            return [max(values) for values in zip(*lists)]

        return cls(
            bitwise_equal=all(c["bitwise_equal"] for c in comparisons),
            within_tolerance=all(c["within_tolerance"] for c in comparisons),
            max_abs_error=worst["max_abs_error"],
            max_rel_error=max(c["max_rel_error"] for c in comparisons),
            num_outputs=worst["num_outputs"],
            worst_output=worst["worst_output"],
            check=first.get("check", ULP_CHECK),
            fallback_reason=next((c["fallback_reason"] for c in comparisons if c.get("fallback_reason")), None),
            factor=first.get("factor"),
            floor_ulps=first.get("floor_ulps"),
            default_deviation=largest("default_deviation"),
            plan_deviation=largest("plan_deviation"),
            allowed=largest("allowed"),
            state_steps=first.get("state_steps", 0),
            state_reason=first.get("state_reason"),
        )

    def summary(self) -> str:
        """One line for a rejection reason: which check, by how much, and from which state."""
        where = f" from the state after {self.state_steps} unmodified steps" if self.state_steps else ""
        if self.check == FLOAT64_CHECK and self.plan_deviation:
            i = max(range(len(self.plan_deviation)), key=lambda k: self.plan_deviation[k] - self.allowed[k])
            return (
                f"output {i} deviates {self.plan_deviation[i]:.3g} from the float64 result{where}, allowed "
                f"{self.allowed[i]:.3g} ({self.factor:g} x XLA's {self.default_deviation[i]:.3g} + floor)"
            )
        if self.check == BITWISE_CHECK:
            return f"max abs error {self.max_abs_error:.3g}{where}, bitwise equality required"
        why = f" ({self.fallback_reason})" if self.fallback_reason else ""
        return f"max abs error {self.max_abs_error:.3g}{where}, beyond the ulp tolerance{why}"


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
        if jax.numpy.issubdtype(r.dtype, jax.numpy.inexact):
            out.append(float(np.nanmax(np.abs(r.astype(np.float64) - n.astype(np.float64)), initial=0.0)))
        else:
            out.append(0.0)
    return out


def _flattened(reference: Any, candidate: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    ref_leaves, ref_tree = jax.tree.flatten(reference)
    cand_leaves, cand_tree = jax.tree.flatten(candidate)
    if ref_tree != cand_tree:
        raise ValueError(f"output structures differ: {ref_tree} vs {cand_tree}")
    return [(np.asarray(r), np.asarray(c)) for r, c in zip(ref_leaves, cand_leaves)]


def _differs(r: np.ndarray, c: np.ndarray) -> bool | None:
    """None when equal, False when they differ only in floating values, True when they cannot be
    compared as values (shape, dtype, integer or boolean contents)."""
    if r.shape != c.shape or r.dtype != c.dtype:
        return True
    floating = bool(jnp.issubdtype(r.dtype, jnp.inexact))
    if np.array_equal(r, c, equal_nan=floating):
        return None
    return not floating


def _errors(r: np.ndarray, c: np.ndarray) -> tuple[float, float]:
    """(max abs, max rel) |c - r|."""
    r64, c64 = r.astype(np.float64), c.astype(np.float64)
    diff = np.abs(r64 - c64)
    return float(np.nanmax(diff)), float(np.nanmax(diff / np.maximum(np.abs(r64), 1e-30)))


def ulp_bound(default: np.ndarray, sensitivity: float | None = None) -> float:
    """The ulp tolerance's bound on max |plan - default| for one floating array: atol + rtol x
    max |default| (`TOLERANCES` by itemsize), and at least SENSITIVITY_FACTOR x its `sensitivity`."""
    rtol, atol = TOLERANCES.get(default.dtype.itemsize, TOLERANCES[4])
    bound = atol + rtol * float(np.nanmax(np.abs(default.astype(np.float64))))
    return bound if sensitivity is None else max(bound, SENSITIVITY_FACTOR * sensitivity)


def compare_outputs(reference: Any, candidate: Any, *, bitwise: bool, floor: list[float] | None = None) -> Comparison:
    """Compare step outputs with the ulp tolerance (or bitwise); `floor` is `sensitivity(...)`
    per output, if measured."""
    check = BITWISE_CHECK if bitwise else ULP_CHECK
    pairs = _flattened(reference, candidate)
    equal, within, max_abs, max_rel, worst = True, True, 0.0, 0.0, None
    for i, (r, c) in enumerate(pairs):
        differs = _differs(r, c)
        if differs is None:
            continue
        equal = False
        if differs:
            return Comparison(False, False, float("inf"), float("inf"), len(pairs), i, check)
        abs_err, rel_err = _errors(r, c)
        if abs_err > max_abs:
            max_abs, worst = abs_err, i
        max_rel = max(max_rel, rel_err)
        if abs_err > ulp_bound(r, None if floor is None else floor[i]):
            within = False
    ok = equal if bitwise else within
    return Comparison(equal, ok, max_abs, max_rel, len(pairs), worst, check)


def deviation(values: np.ndarray, exact: np.ndarray) -> float:
    """max |values - exact| (exact: float64); equal infinities and NaN against NaN count 0, a NaN
    against a number counts infinite."""
    v = values.astype(np.complex128 if np.iscomplexobj(values) else np.float64)
    same = (v == exact) | (np.isnan(v) & np.isnan(exact))
    with np.errstate(invalid="ignore"):  # inf - inf, where `same` already decided
        diff = np.where(same, 0.0, np.abs(v - exact))
    return float(np.where(np.isnan(diff), np.inf, diff).max(initial=0.0))


def deviation_floor(exact: np.ndarray, dtype: np.dtype) -> float:
    """FLOOR_ULPS ulps (of `dtype`) of the largest finite |exact|, and at least the dtype's
    smallest normal number (XLA may flush denormals in one program and not the other)."""
    info = jnp.finfo(dtype)
    finite = np.abs(exact[np.isfinite(exact)])
    return max(FLOOR_ULPS * float(info.eps) * float(finite.max(initial=0.0)), float(info.tiny))


def compare_to_float64(exact: Any, default: Any, candidate: Any) -> Comparison:
    """A candidate's outputs against the float64 result `exact` of the same call, with XLA's own
    program's (`default`) as the yardstick: per floating array, max |candidate - exact| must be at
    most FACTOR x max |default - exact| + `deviation_floor`. Integer and boolean arrays must equal
    XLA's. `exact`: host float64 arrays in the structure of `default` and `candidate`."""
    pairs = _flattened(default, candidate)
    exact_leaves = [np.asarray(x) for x in jax.tree.leaves(exact)]
    equal, within, max_abs, max_rel, worst = True, True, 0.0, 0.0, None
    by_default, by_plan, allowed = [], [], []
    for i, ((d, c), x) in enumerate(zip(pairs, exact_leaves)):
        differs = _differs(d, c)
        if differs:
            return Comparison(False, False, float("inf"), float("inf"), len(pairs), i, FLOAT64_CHECK)
        if not jnp.issubdtype(d.dtype, jnp.inexact):
            by_default.append(0.0), by_plan.append(0.0), allowed.append(0.0)
            continue
        if differs is not None:
            equal = False
            abs_err, rel_err = _errors(d, c)
            if abs_err > max_abs:
                max_abs, worst = abs_err, i
            max_rel = max(max_rel, rel_err)
        from_default, from_plan = deviation(d, x), deviation(c, x)
        bound = FACTOR * from_default + deviation_floor(x, d.dtype)
        within = within and from_plan <= bound
        by_default.append(from_default), by_plan.append(from_plan), allowed.append(bound)
    return Comparison(
        equal,
        within,
        max_abs,
        max_rel,
        len(pairs),
        worst,
        FLOAT64_CHECK,
        factor=FACTOR,
        floor_ulps=FLOOR_ULPS,
        default_deviation=by_default,
        plan_deviation=by_plan,
        allowed=allowed,
    )


CONFIDENCE = 0.95
ACCEPTANCE_RULE = (
    "interleaved pairs; the confidence interval of the median per-pair plan/default ratio (the wider of the "
    "binomial order statistics and the same allowing for neighbouring pairs that move together, "
    "Bonferroni-adjusted over the looks of the sequential test) must lie below 1.0; an interval above 1.0 or "
    "still holding 1.0 at the last look keeps XLA's executable"
)


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Distribution-free confidence interval of the median of independent values: the order
    statistics (k, n - k + 1) with k the largest for which P(Binomial(n, 1/2) < k) <= (1 - confidence)/2.
    (-inf, inf) when there are too few values for any interval at this confidence."""
    s = sorted(values)
    n = len(s)
    tail = (1.0 - confidence) / 2
    k, below = 0, 0.0  # below = P(B <= k - 1)
    while k < n // 2:
        nxt = below + math.comb(n, k) / 2**n  # P(B <= k)
        if nxt > tail:
            break
        below, k = nxt, k + 1
    if k == 0:
        return -math.inf, math.inf
    return s[k - 1], s[n - k]


def sign_autocorrelation(values: Sequence[float]) -> float:
    """Lag-1 autocorrelation of the values' signs about their median (+1 above, -1 below, ties
    dropped), corrected for its small-sample bias (about -(1 + 3 rho) / n), at most 0.9. Positive
    when neighbouring pairs move together: a machine busier for a while slows several pairs in a
    row, which the binomial interval would count as independent evidence."""
    x = np.asarray(values, dtype=float)
    signs = np.sign(x - np.median(x))
    signs = signs[signs != 0]
    n = len(signs)
    if n < 4:
        return 0.0
    rho = float(np.mean(signs[1:] * signs[:-1]))
    return min(0.9, rho + (1.0 + 3.0 * max(rho, 0.0)) / n)


def dependent_median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Confidence interval of the median of serially dependent values: the order statistics at
    n/2 -+ z * sqrt(n * (1 + rho) / (1 - rho)) / 2, with rho the values' `sign_autocorrelation`
    (the normal approximation to the binomial interval with the variance of the count above the
    median inflated as for an AR(1) sequence of signs; rho <= 0 counts as 0), at most the
    sample's range (a plan whose every ratio is below 1 is judged by its largest). (-inf, inf)
    below 4 values."""
    s = sorted(values)
    n = len(s)
    if n < 4:
        return -math.inf, math.inf
    rho = max(0.0, sign_autocorrelation(values))
    half = statistics.NormalDist().inv_cdf(1.0 - (1.0 - confidence) / 2) * 0.5 * math.sqrt(n * (1 + rho) / (1 - rho))
    low, high = max(1, math.floor(n / 2 - half)), min(n, math.ceil(n / 2 + half))
    return s[low - 1], s[high - 1]


def ratio_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The interval the project judges a median per-pair ratio by: the binomial order statistics
    (`median_interval`, exact for independent pairs) and the interval allowing for neighbouring
    pairs that move together (`dependent_median_interval`), whichever reaches further on each
    side. On AR(1) log-ratios (t3 noise, 30 values, 400 draws) the binomial interval covered the
    median 80% (rho 0.5) and 67% (rho 0.7) of the time, this one 95% and 90%; its coverage on
    this machine is what `scripts/aa_calibration.py` measures."""
    low, high = median_interval(values, confidence)
    dependent_low, dependent_high = dependent_median_interval(values, confidence)
    return min(low, dependent_low), max(high, dependent_high)


@dataclasses.dataclass
class Timing:
    """Interleaved timing of a plan against the unmodified step.

    default_us / plan_us: median step times; ratio: median of the per-pair plan/default ratios;
    ratio_low / ratio_high: their 25th and 75th percentiles (the spread); ratio_ci95: the confidence
    interval of the median ratio at `confidence` (per look of a sequential test, Bonferroni-adjusted
    so that the whole test holds at least 95%); ratios: every pair's ratio."""

    default_us: float
    plan_us: float
    ratio: float
    ratio_low: float
    ratio_high: float
    pairs: int
    ratio_ci95: tuple[float, float] = (-math.inf, math.inf)
    ratios: list[float] = dataclasses.field(default_factory=list, repr=False)
    confidence: float = CONFIDENCE

    @property
    def faster(self) -> bool:
        """The plan is faster with confidence: the whole interval is below 1."""
        return self.ratio_ci95[1] < 1.0

    @property
    def slower(self) -> bool:
        """The plan is slower with confidence: the whole interval is above 1."""
        return self.ratio_ci95[0] > 1.0

    @property
    def verdict(self) -> str:
        return "faster" if self.faster else "slower" if self.slower else "undecided"

    def to_json(self) -> dict:
        return {
            "default_us": self.default_us,
            "plan_us": self.plan_us,
            "ratio": self.ratio,
            "ratio_iqr": [self.ratio_low, self.ratio_high],
            "ratio_ci95": list(self.ratio_ci95),
            "confidence": self.confidence,
            "pairs": self.pairs,
            "verdict": self.verdict,
            "rule": ACCEPTANCE_RULE,
        }


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return (time.perf_counter() - start) * 1e6


def _pairs(default: Callable[[], Any], plan: Callable[[], Any], pairs: int, start: int = 0) -> tuple[list, list]:
    d, p = [], []
    for i in range(start, start + pairs):
        if i % 2:  # alternate which goes first
            p.append(_timed(plan)), d.append(_timed(default))
        else:
            d.append(_timed(default)), p.append(_timed(plan))
    return d, p


def summarize(
    d: Sequence[float], p: Sequence[float], ratios: Sequence[float] | None = None, confidence: float = CONFIDENCE
) -> Timing:
    """A `Timing` from per-pair default and plan times (`ratios`: the per-pair ratios to judge by,
    default p/d)."""
    ratios = list(np.array(p) / np.array(d)) if ratios is None else list(ratios)
    return Timing(
        float(np.median(d)),
        float(np.median(p)),
        float(np.median(ratios)),
        float(np.percentile(ratios, 25)),
        float(np.percentile(ratios, 75)),
        len(ratios),
        tuple(float(x) for x in ratio_interval(ratios, confidence)),
        [float(r) for r in ratios],
        confidence,
    )


def time_interleaved(
    default: Callable[[], Any],
    plan: Callable[[], Any],
    *,
    pairs: int = 20,
    warmup: int = 3,
    merge: Callable[[list[float], list[float]], list[float]] | None = None,
) -> Timing:
    """Median step times, the median plan/default ratio and its 95% interval over interleaved pairs
    (`merge`: the multi-process pair merge of `time_until_decided`, or None)."""
    for _ in range(warmup):
        _timed(default), _timed(plan)
    d, p = _pairs(default, plan, pairs)
    return summarize(d, p, merge(d, p) if merge is not None else None)


def time_until_decided(
    default: Callable[[], Any],
    plan: Callable[[], Any],
    *,
    looks: Sequence[int] = (20, 40, 80),
    warmup: int = 3,
    merge: Callable[[list[float], list[float]], list[float]] | None = None,
) -> Timing:
    """A sequential test: time interleaved pairs until the plan is faster or slower with confidence,
    looking after `looks[i]` pairs in all; undecided after the last look. Each look uses
    confidence 1 - 0.05 / len(looks) (Bonferroni), so the decision holds at 95% overall.

    `merge(default_us, plan_us) -> ratios` combines this process's per-pair times with the other
    processes' into the ratios judged (`_distributed.slowest_pairs`: multi-process jobs run the
    same pairs everywhere and must take the same decision)."""
    confidence = 1.0 - (1.0 - CONFIDENCE) / len(looks)
    for _ in range(warmup):
        _timed(default), _timed(plan)
    d: list[float] = []
    p: list[float] = []
    timing = None
    for look in looks:
        more_d, more_p = _pairs(default, plan, look - len(d), start=len(d))
        d += more_d
        p += more_p
        timing = summarize(d, p, merge(d, p) if merge is not None else None, confidence)
        if timing.faster or timing.slower:
            break
    return timing
