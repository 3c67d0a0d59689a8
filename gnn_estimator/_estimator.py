"""The GNN as a `disco_jax.cost.Estimator`, and how the core finds it for a device kind.

The core finds it as an estimator plugin: `load_estimator` is registered under the entry-point
group ``disco_jax.estimators`` (pyproject.toml), so `disco_jax.cost.plugin_estimators(device_kind)`
calls it when a profile is built, and the core never imports this package itself.

Data flow in `GnnEstimator.estimate(graph, kernels)`: each kernel -> its cache key (the kernel's
`Graph.kernel_signature` and which of its ops it exports) -> cached prediction, or its features
(`KernelFeaturizer`, equal to `kernel_features`; own op times looked up in an optional table of
single-op kernel times, else unknown) -> all
misses of the call packed into padded batches of up to `chunk` kernels -> one jitted forward pass
each -> exp(log time) -> cache. Kernels holding a non-fusible op (dots, custom calls) get None, so
a `ChainEstimator` falls through to the next estimator for them. So do kernels outside what the
network was trained on (`GnnEstimator.trusted`): more ops than the largest training kernel, or a
prediction beyond twice the longest training time. A sum readout over hundreds of ops extrapolates
without bound (an XLA:GPU concatenate fusion of 655 ops of the RNNLM was predicted at 517 s).
And kernels holding an op that touches only a region of a buffer (`REGION_OPS`: a loop body's
dynamic slice of its layer's stacked parameters, its in-place update of stacked activations)
where no training kernel held one (the weights' `training.opcodes`): such a node's features
describe the whole buffer, which the kernel neither reads nor writes.
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path

from disco_jax._graph import Graph
from disco_jax._profile_db import SHIPPED_PROFILE_DIR, sanitize_device_kind
from gnn_estimator import _kernels
from gnn_estimator._features import KernelFeaturizer
from gnn_estimator._train import TrainedEstimator
from gnn_estimator._weights import METADATA_FILE, WEIGHTS_FILE, WeightsError, read_weights

_NOT_FUSIBLE = ("not fusible",)  # in place of a key: a kernel holding a non-fusible op, answered None
REGION_OPS = frozenset({"dynamic-slice", "dynamic-update-slice"})


class GnnWeightsWarning(UserWarning):
    """Stored GNN weights exist for a device kind but cannot be used (version, corruption)."""


class GnnEstimator:
    """DisCo's Fused Op Estimator: kernel (fusible op ids of a graph) -> predicted microseconds.

    `op_times_us` optionally maps `Graph.kernel_signature` of single-op kernels to measured times (the
    profile database's kernel table); ops found there get their own time as a feature. Predictions
    are cached by kernel signature and exports, so a search that revisits kernels pays once.
    """

    name = "gnn"

    def __init__(self, trained: TrainedEstimator, op_times_us: Mapping[str, float] | None = None, chunk: int = 256):
        self.trained = trained
        self.op_times_us = dict(op_times_us or {})
        self.chunk = chunk
        self._cache: dict[tuple[str, tuple[int, ...]], float | None] = {}
        # Of the graph last asked about (not kept alive by the estimator, which the simulated
        # clusters keep for the process): its featurizer, and each kernel's cache key.
        self._graph: weakref.ref | None = None
        self._featurizer = KernelFeaturizer()
        self._keys: dict[frozenset[int], tuple[str, tuple[int, ...]]] = {}
        training = trained.metadata.get("training", {})
        # Weights trained before these were recorded have no limit on that side.
        self.max_ops = (training.get("kernel_ops_range") or [None, None])[1]
        self.max_us = 2.0 * training["time_us_range"][1] if training.get("time_us_range") else None
        # Region ops no training kernel held (weights that do not record their opcodes: all of them).
        self.untrained_region_ops = REGION_OPS - set(training.get("opcodes") or ())

    def trusted(self, ops: int, predicted_us: float) -> bool:
        """Whether a prediction lies where the network was trained (see the module docstring)."""
        return (self.max_ops is None or ops <= self.max_ops) and (self.max_us is None or predicted_us <= self.max_us)

    @property
    def metadata(self) -> dict:
        return self.trained.metadata

    def with_op_times(self, op_times_us: Mapping[str, float]) -> GnnEstimator:
        """The same network with a table of single-op kernel times (a new, empty cache)."""
        return GnnEstimator(self.trained, op_times_us, self.chunk)

    def warm_up(self) -> None:
        """Compile the network for the batch shapes a search asks for (`TrainedEstimator.warm_up`)."""
        self.trained.warm_up()

    def _key(self, graph: Graph, kernel: frozenset[int]) -> tuple[str, tuple[int, ...]]:
        order = sorted(kernel)
        position = {o: i for i, o in enumerate(order)}
        return graph.kernel_signature(kernel), tuple(position[o] for o in _kernels.default_exports(graph, kernel))

    def _own_times(self, graph: Graph, kernel: frozenset[int]) -> dict[int, float]:
        if not self.op_times_us:
            return {}
        times = {}
        for o in kernel:
            t = self.op_times_us.get(graph.kernel_signature(frozenset([o])))
            if t is not None:
                times[o] = float(t)
        return times

    def estimate(self, graph: Graph, kernels: Sequence[frozenset[int]]) -> list[float | None]:
        if self._graph is None or self._graph() is not graph:
            self._graph, self._featurizer, self._keys = weakref.ref(graph), KernelFeaturizer(), {}
        known = self._keys
        keys: list[tuple | None] = []
        misses: dict[tuple, frozenset[int]] = {}
        for k in kernels:
            k = k if isinstance(k, frozenset) else frozenset(k)
            key = known.get(k)
            if key is None:
                fusible = k and all(graph.ops[o].kind == "fusible" for o in k)
                untrained = any(graph.ops[o].opcode in self.untrained_region_ops for o in k)
                key = known[k] = self._key(graph, k) if fusible and not untrained else _NOT_FUSIBLE
            if key is _NOT_FUSIBLE:
                keys.append(None)
                continue
            keys.append(key)
            if key in self._cache or key in misses:
                continue
            if self.max_ops is not None and len(k) > self.max_ops:
                self._cache[key] = None  # larger than any training kernel: not even predicted
            else:
                misses[key] = k
        if misses:
            featurize = self._featurizer.features
            # The key's second half is the kernel's exports by position: not computed again.
            features = [featurize(graph, k, self._own_times(graph, k), key[1]) for key, k in misses.items()]
            predicted = self.trained.predict_us(features, chunk=self.chunk)
            for (key, k), us in zip(misses.items(), predicted):
                self._cache[key] = float(us) if self.trusted(len(k), float(us)) else None
        return [None if key is None else self._cache[key] for key in keys]


def weights_dir(device_kind: str, profiles_dir: str | os.PathLike | None = None) -> Path:
    """`<profiles_dir or the shipped profiles/>/<sanitized device kind>/`."""
    root = Path(profiles_dir) if profiles_dir is not None else SHIPPED_PROFILE_DIR
    return root / sanitize_device_kind(device_kind)


def load_estimator(device_kind: str, profiles_dir: str | os.PathLike | None = None) -> GnnEstimator | None:
    """The GNN trained for `device_kind`, or None: silently when no weights exist for it, with a
    `GnnWeightsWarning` when they exist but are for another feature version or corrupt. This is
    the ``gnn`` factory of the ``disco_jax.estimators`` entry-point group."""
    directory = weights_dir(device_kind, profiles_dir)
    if not (directory / METADATA_FILE).exists() and not (directory / WEIGHTS_FILE).exists():
        return None
    try:
        return GnnEstimator(read_weights(directory))
    except FileNotFoundError as err:
        warnings.warn(f"incomplete GNN estimator files in {directory}: {err}", GnnWeightsWarning, stacklevel=2)
    except (WeightsError, OSError) as err:
        warnings.warn(f"not using the GNN estimator weights in {directory}: {err}", GnnWeightsWarning, stacklevel=2)
    return None


def estimator_for_device(device_kind: str, fallback, profiles_dir: str | os.PathLike | None = None):
    """The GNN for `device_kind` when usable weights exist, else `fallback` (e.g. the core's
    `AnalyticalEstimator`)."""
    gnn = load_estimator(device_kind, profiles_dir)
    return gnn if gnn is not None else fallback
