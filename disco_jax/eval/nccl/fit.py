"""A collective's time as the fastest of a few straight lines, fitted in relative error.

NCCL picks, for every message size, the algorithm and protocol its tuner predicts fastest (LL for
small messages, LL128 in between, Simple for large ones; ring, tree or NVLS), and each of those
costs about ``latency + bytes / bandwidth``. A measured nccl-tests table is then well described by
the lower envelope of K lines, ``t(x) = min_k (a_k + b_k x)`` with ``a_k, b_k >= 0``: 2K numbers,
K <= 3. Because the target is relative (a 35 us all-reduce off by 10 us matters as much as a 40 ms
one off by 11 ms), every residual is relative, ``(model - measured) / measured``.

`fit_lines` searches every split of the sizes into K contiguous runs (one line per run, each a
least-squares line in relative error with both coefficients >= 0), keeps the best few by a
truncated quadratic loss (a residual beyond `TRUNCATE` counts as
`TRUNCATE`: a first-iteration outlier or a disturbed run of sizes cannot tilt the lines), and
refines those by reassigning each size to the line that is lowest there and refitting with the
outliers weighted out. K is the smallest that comes within `K_TOLERANCE` of the best loss over K.
"""

from __future__ import annotations

import itertools

import numpy as np

MAX_LINES = 3
TRUNCATE = 0.2  # relative residual beyond which a size counts as an outlier
K_TOLERANCE = 1.15  # a K+1-line fit must lower the loss by more than this factor to be taken
REFINE_BEST = 6  # splits refined per K
REFINE_ITERATIONS = 8


def envelope_us(lines, nbytes) -> np.ndarray:
    """``min_k (a_k + b_k x)`` for `lines` of (latency_us, us_per_byte)."""
    x = np.asarray(nbytes, dtype=float)
    return np.min([a + b * x for a, b in lines], axis=0)


def relative_errors(lines, nbytes, measured_us) -> np.ndarray:
    t = np.asarray(measured_us, dtype=float)
    return (envelope_us(lines, nbytes) - t) / t


def loss(relative: np.ndarray) -> float:
    return float(np.sum(np.minimum(relative**2, TRUNCATE**2)))


def fit_lines(nbytes, measured_us, max_lines: int = MAX_LINES) -> tuple[tuple[float, float], ...]:
    """The lines (latency_us, us_per_byte), fewest first by latency, whose lower envelope fits
    the (bytes, microseconds) points best in relative error (see the module docstring). Several
    points of one size (tables pooled) are all kept."""
    x = np.asarray(nbytes, dtype=float)
    t = np.asarray(measured_us, dtype=float)
    order = np.argsort(x, kind="stable")
    x, t = x[order], t[order]
    fits = {}
    for k in range(1, max_lines + 1):
        if len(np.unique(x)) < 2 * k:
            break
        fits[k] = _best_with(k, x, t)
    best = min(loss(relative_errors(f, x, t)) for f in fits.values())
    for k in sorted(fits):
        if loss(relative_errors(fits[k], x, t)) <= K_TOLERANCE * best + 1e-12:
            return tuple(sorted(fits[k]))
    raise AssertionError("unreachable: the best K is within tolerance of itself")


def _best_with(k: int, x: np.ndarray, t: np.ndarray) -> tuple[tuple[float, float], ...]:
    # Every split at once: each run's line from prefix sums of the normal equations' terms.
    u, v = 1.0 / t, x / t
    prefix = [np.concatenate([[0.0], np.cumsum(p)]) for p in (u * u, u * v, v * v, u, v)]
    # Cuts only between distinct sizes (pooled tables repeat sizes), runs of two points or more.
    boundaries = [i for i in range(2, len(x) - 1) if x[i] != x[i - 1]]
    splits = [c for c in itertools.combinations(boundaries, k - 1) if all(b - a >= 2 for a, b in zip(c, c[1:]))]
    edges = np.array([(0, *c, len(x)) for c in splits], dtype=int).reshape(len(splits), k + 1)
    a, b = _solve(*(p[edges[:, 1:]] - p[edges[:, :-1]] for p in prefix))  # (splits, k)
    envelope = np.min(a[:, :, None] + b[:, :, None] * x[None, None, :], axis=1)
    losses = np.sum(np.minimum(((envelope - t) / t) ** 2, TRUNCATE**2), axis=1)
    best = np.argsort(losses, kind="stable")[:REFINE_BEST]
    refined = [_refine(list(zip(a[i].tolist(), b[i].tolist())), x, t) for i in best]
    return min(refined, key=lambda lines: loss(relative_errors(lines, x, t)))


def _refine(lines, x, t):
    """Reassign each size to its lowest line and refit each line on its sizes, outliers (beyond
    `TRUNCATE`) weighted out; the best envelope seen is kept."""
    best, best_loss = tuple(lines), loss(relative_errors(lines, x, t))
    for _ in range(REFINE_ITERATIONS):
        relative = relative_errors(lines, x, t)
        weight = np.where(np.abs(relative) < TRUNCATE, 1.0, 1e-3)
        owner = np.argmin([a + b * x for a, b in lines], axis=0)
        lines = [
            _line(x[owner == i], t[owner == i], weight[owner == i]) if np.count_nonzero(owner == i) >= 2 else line
            for i, line in enumerate(lines)
        ]
        current = loss(relative_errors(lines, x, t))
        if current < best_loss - 1e-12:
            best, best_loss = tuple(lines), current
        else:
            break
    return best


def _line(x: np.ndarray, t: np.ndarray, w: np.ndarray) -> tuple[float, float]:
    """min sum w ((a + b x - t) / t)^2 over a, b >= 0."""
    u, v = 1.0 / t, x / t
    a, b = _solve(*(np.sum(w * p) for p in (u * u, u * v, v * v, u, v)))
    return float(a), float(b)


def _solve(suu, suv, svv, su, sv):
    """The least-squares line (a, b >= 0) of ``a u + b v = 1`` from the sums of its normal
    equations' terms (arrays: one line per element): unconstrained where both come out >= 0,
    else the better of the two one-coefficient lines the constraint leaves."""
    with np.errstate(divide="ignore", invalid="ignore"):
        det = suu * svv - suv * suv
        a = (svv * su - suv * sv) / det
        b = (suu * sv - suv * su) / det
        flat = su / suu  # b = 0
        through_zero = sv / svv  # a = 0
    free = (det > 1e-300 * suu * svv) & (a >= 0) & (b >= 0)
    # Residual sum of squares of each constrained line: sum (1 - a u)^2 = n - 2 a su + a^2 suu.
    flat_better = su * flat >= sv * through_zero
    a = np.where(free, a, np.where(flat_better, flat, 0.0))
    b = np.where(free, b, np.where(flat_better, 0.0, through_zero))
    return a, b
