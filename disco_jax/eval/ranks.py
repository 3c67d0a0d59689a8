"""Rank correlations between two costings of the same things (a model's times against measured
ones, the graph simulator's against the compiled-program model's): Spearman's rho on average
ranks and Kendall's tau-b, both counting ties. Used by `scripts/bench_fidelity.py` (simulated
against measured) and `eval.layout_ranks` (graph simulator against compiled cost)."""

from __future__ import annotations

import numpy as np


def ranks(values) -> np.ndarray:
    """The rank of each value from 0 (smallest), ties sharing their mean rank."""
    v = np.asarray(values, dtype=float)
    order = np.argsort(v, kind="stable")
    r = np.empty(len(v))
    r[order] = np.arange(len(v), dtype=float)
    for value in np.unique(v):
        tied = v == value
        r[tied] = r[tied].mean()
    return r


def spearman(x, y) -> float | None:
    """Spearman's rank correlation (the Pearson correlation of average ranks); None for fewer
    than 3 pairs or where either side is constant."""
    if len(x) < 3:
        return None
    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return None
    return float(np.corrcoef(rx, ry)[0, 1])


def kendall_tau(x, y) -> float | None:
    """Kendall's tau-b: (concordant - discordant pairs) over the geometric mean of the pairs
    untied on each side; None for fewer than 3 pairs or where either side is constant."""
    if len(x) < 3:
        return None
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    i, j = np.triu_indices(len(x), k=1)
    dx, dy = np.sign(x[i] - x[j]), np.sign(y[i] - y[j])
    untied_x, untied_y = np.count_nonzero(dx), np.count_nonzero(dy)
    if untied_x == 0 or untied_y == 0:
        return None
    return float(np.sum(dx * dy) / np.sqrt(untied_x * untied_y))
