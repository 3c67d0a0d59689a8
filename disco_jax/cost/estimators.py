"""Kernel cost estimators (DisCo section 4.4) and the registry of estimator plugins.

An `Estimator` maps kernels (sets of op ids of one graph) to times in microseconds, or None where
it does not know. Estimators are small objects with that one method, and compose the way optax
transformations do: `chain(a, b, c)` asks each in turn and the first answer wins, and
`CalibratedEstimator(base, graph, measured)` wraps a base model so measured kernels keep their
measured times. The profile phase builds: measured table, then each plugin estimator (the GNN,
when trained weights exist for the device kind) calibrated, then the analytical roofline
calibrated, for the kernels the search invents.

Plugins: an estimator package registers a factory ``device_kind -> Estimator | None`` under the
entry-point group ``disco_jax.estimators`` (``gnn = "gnn_estimator:load_estimator"`` in this
project's pyproject.toml), or in code with `register_estimator`. The core never imports a plugin
package itself: `plugin_estimators` loads them when a profile is built.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from disco_jax import _warnings
from disco_jax.cost.work import ANALYTICAL_FEATURES, kernel_work

if TYPE_CHECKING:
    from disco_jax._graph import Graph

ENTRY_POINT_GROUP = "disco_jax.estimators"


class Estimator(Protocol):
    """Kernel -> time. `kernels` are frozensets of op ids of `graph` (a fusion group, or one
    opaque op). Returns microseconds, None for a kernel the estimator cannot cost."""

    name: str

    def estimate(self, graph: Graph, kernels: Sequence[frozenset[int]]) -> list[float | None]: ...


EstimatorFactory = Callable[[str], "Estimator | None"]
"""What a plugin registers: device kind (as `jax.Device.device_kind`) -> an estimator, or None
when it has nothing for that device kind."""


class TableEstimator:
    """Measured kernel times by `Graph.kernel_signature` (the profile database's table)."""

    name = "profile"

    def __init__(self, times_us: dict[str, float]):
        self.times_us = times_us

    def estimate(self, graph, kernels):
        return [self.times_us.get(graph.kernel_signature(k)) for k in kernels]


def kernel_features(graph: Graph, members: frozenset[int]) -> np.ndarray:
    """[1, bytes moved, elementwise work, transcendental work, dot/conv flops] of one kernel
    (`disco_jax.cost.work.KernelWork.features`)."""
    return kernel_work(graph, members).features()


@dataclasses.dataclass
class AnalyticalEstimator:
    """Additive roofline: launch + bytes moved + elementwise, transcendental and dot work, each
    with a per-unit cost fitted (non-negative least squares, relative error) to the device's
    profiled kernels. The defaults are rough CPU figures for when nothing was profiled."""

    coefficients: tuple[float, ...] = (3.0, 1.0 / 5e3, 1.0 / 2e3, 1.0 / 2e2, 1.0 / 1e4)
    name: str = "analytical"

    def estimate(self, graph, kernels):
        coef = np.array(self.coefficients)
        return [float(kernel_features(graph, k) @ coef) for k in kernels]

    @classmethod
    def fit(cls, samples: Sequence[tuple[np.ndarray, float]]) -> AnalyticalEstimator:
        """samples: (kernel_features, measured us). Defaults with fewer than 8 samples."""
        if len(samples) < 8:
            return cls()
        x = np.stack([f for f, _ in samples])
        y = np.array([t for _, t in samples])
        w = 1.0 / np.maximum(y, 1e-3)  # kernels span orders of magnitude: fit relative error
        n = x.shape[1]
        best, best_err = None, np.inf
        for mask in range(1, 2**n):  # exhaustive NNLS over the few coefficients
            cols = [i for i in range(n) if mask >> i & 1]
            coef, *_ = np.linalg.lstsq(x[:, cols] * w[:, None], y * w, rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(n)
            full[cols] = coef
            err = float(np.sum(((x @ full - y) * w) ** 2))
            if err < best_err:
                best, best_err = full, err
        return cls() if best is None else cls(tuple(float(c) for c in best))

    def to_json(self) -> dict:
        return {"coefficients": list(self.coefficients), "features": list(ANALYTICAL_FEATURES)}


class CalibratedEstimator:
    """Measured time, redistributed: a base estimator supplies only the relative gain of fusion.

    Each op of a profiled kernel K carries a share of K's measured time, split by the base
    model's cost of the op alone, and the fusion gain of K (base(K) / sum of base(op) over K).
    A kernel is estimated as the sum of its ops' shares times its own fusion gain over theirs:

        estimate(K') = sum_{o in K'} share(o) * gain(K') / gain(K_o)

    so a kernel XLA formed costs exactly its measured time, and kernels the search forms from
    its pieces are costed consistently with them: the search cannot win by trading measured
    kernels for ones the base model underestimates. Ops never measured use the base model
    scaled by the median measured/estimated ratio."""

    def __init__(self, base: Estimator, graph: Graph, measured: Mapping[frozenset[int], float]):
        self.base = base
        self.name = f"calibrated-{base.name}"
        self.graph = graph
        self.share: dict[int, float] = {}
        self.gain: dict[int, float] = {}
        self._op_cost: dict[int, float] = {}
        ratios = []
        for k, t in measured.items():
            alone = self._alone(k)
            total = sum(alone.values()) or 1.0
            kernel = self.base.estimate(graph, [k])[0] or total
            ratios.append(t / kernel if kernel > 0 else 1.0)
            for o, b in alone.items():
                if o not in self.share:  # an op XLA duplicated: its first kernel speaks for it
                    self.share[o] = t * b / total
                    self.gain[o] = kernel / total
        self.default_ratio = float(np.median(ratios)) if ratios else 1.0

    def warm_up(self) -> None:
        _warm_up(self.base)

    def _alone(self, kernel: frozenset[int]) -> dict[int, float]:
        """The base model's cost of each op of a kernel alone (asked once per op)."""
        ops = sorted(kernel)
        missing = [o for o in ops if o not in self._op_cost]
        if missing:
            for o, b in zip(missing, self.base.estimate(self.graph, [frozenset([o]) for o in missing])):
                self._op_cost[o] = float(b or 0.0)
        return {o: self._op_cost[o] for o in ops}

    def estimate(self, graph, kernels):
        if graph is not self.graph:
            return [None] * len(kernels)
        out = []
        for k, est in zip(kernels, self.base.estimate(graph, kernels)):
            if est is None:
                out.append(None)
                continue
            alone = self._alone(k)
            gain = est / (sum(alone.values()) or 1.0)
            total = 0.0
            for o, b in alone.items():
                if o in self.share:
                    total += self.share[o] * gain / max(self.gain[o], 1e-9)
                else:
                    total += b * gain * self.default_ratio
            out.append(total)
        return out


class ChainEstimator:
    """Ask each estimator in turn; the first answer wins. Caches per graph and kernel."""

    def __init__(self, estimators: Sequence[Estimator]):
        self.estimators = list(estimators)
        self.name = "+".join(e.name for e in self.estimators)
        self._cache: dict[int, dict[frozenset[int], tuple[float, str]]] = {}  # per graph, per kernel

    def warm_up(self) -> None:
        """Let each estimator prepare what it would otherwise do during a search (the GNN
        compiles its batch shapes)."""
        for e in self.estimators:
            _warm_up(e)

    def to_json(self) -> dict:
        return {"name": self.name, "chain": [_json(e) for e in self.estimators]}

    def estimate(self, graph, kernels):
        return [t for t, _ in self.estimate_with_source(graph, kernels)]

    def estimate_with_source(self, graph, kernels) -> list[tuple[float, str]]:
        cache = self._cache.setdefault(id(graph), {})
        missing = [k for k in dict.fromkeys(kernels) if k not in cache]
        for est in self.estimators:
            if not missing:
                break
            answers = est.estimate(graph, missing)
            still = []
            for k, t in zip(missing, answers):
                if t is None:
                    still.append(k)
                else:
                    cache[k] = (max(float(t), 0.0), est.name)
            missing = still
        for k in missing:
            cache[k] = (0.0, "none")
        return [cache[k] for k in kernels]


def _json(estimator: Estimator) -> dict:
    method = getattr(estimator, "to_json", None)
    return method() if callable(method) else {"name": estimator.name}


class OverheadEstimator:
    """A base estimator's times plus a fixed cost per kernel. The GNN predicts a kernel's time on
    the device (it was trained on kernels timed alone); a simulated cluster charges every kernel
    its launch overhead on top (`disco_jax.eval.gpus`), as its roofline does."""

    def __init__(self, base: Estimator, overhead_us: float):
        self.base, self.overhead_us = base, float(overhead_us)
        self.name = f"{base.name}+launch"

    def warm_up(self) -> None:
        _warm_up(self.base)

    def estimate(self, graph, kernels):
        return [None if t is None else t + self.overhead_us for t in self.base.estimate(graph, kernels)]

    def to_json(self) -> dict:
        return {"name": self.name, "overhead_us": self.overhead_us, "base": _json(self.base)}


def _warm_up(estimator: Estimator) -> None:
    method = getattr(estimator, "warm_up", None)
    if callable(method):
        method()


def chain(*estimators: Estimator) -> ChainEstimator:
    """`ChainEstimator` of the arguments, in order (as `optax.chain` composes transformations)."""
    return ChainEstimator(estimators)


def with_op_times(estimator: Estimator, op_times_us: Mapping[str, float]) -> Estimator:
    """The estimator given the profile's table of measured kernel times (by kernel signature),
    for an estimator that reads its ops' own times (one with a `with_op_times` method, like the
    GNN); any other estimator unchanged."""
    method = getattr(estimator, "with_op_times", None)
    return method(op_times_us) if callable(method) else estimator


# --------------------------------------------------------------------------- plugins


class EstimatorPluginWarning(UserWarning):
    """An estimator plugin could not be loaded or raised while building its estimator."""


_REGISTERED: dict[str, EstimatorFactory] = {}


def register_estimator(name: str, factory: EstimatorFactory) -> EstimatorFactory:
    """Add an estimator plugin without packaging it: `factory(device_kind)` returns an estimator
    or None. A name registered here takes precedence over an entry point of the same name.
    Returns `factory`."""
    _REGISTERED[name] = factory
    return factory


def unregister_estimator(name: str) -> None:
    """Forget a plugin added with `register_estimator` (entry points stay)."""
    _REGISTERED.pop(name, None)


def _entry_point_factory(entry_point: importlib.metadata.EntryPoint) -> EstimatorFactory:
    def factory(device_kind: str):
        return entry_point.load()(device_kind)  # imports the plugin package only now

    return factory


def estimator_factories() -> dict[str, EstimatorFactory]:
    """The estimator plugins, by name: those added with `register_estimator` (in the order they
    were added), then the ``disco_jax.estimators`` entry points of the installed distributions
    (by name). Nothing is imported until a factory is called."""
    found = dict(_REGISTERED)
    for entry_point in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        found.setdefault(entry_point.name, _entry_point_factory(entry_point))
    return found


def plugin_estimators(device_kind: str) -> list[Estimator]:
    """The estimators the plugins have for `device_kind`, in `estimator_factories` order. A
    plugin that has none returns None and is skipped; one that fails is skipped with an
    `EstimatorPluginWarning`."""
    out = []
    for name, factory in estimator_factories().items():
        try:
            estimator = factory(device_kind)
        except Exception as err:  # a broken plugin must not stop the search: the core has its own
            _warnings.warn(
                f"estimator plugin {name!r} failed for device kind {device_kind!r}: {type(err).__name__}: {err}",
                EstimatorPluginWarning,
            )
            continue
        if estimator is not None:
            out.append(estimator)
    return out
