"""Training the Fused Op Estimator (DisCo section 4.3.3) and measuring its error.

Data flow: samples (JSON records from `scripts/collect_kernel_samples.py`: a kernel description
and its measured `time_us`) -> `featurize` (each sample twice: with the ops' own times, and with
them unknown, since the core often has no time for an op inside a fusion) -> `Normalization` (mean
and standard deviation per feature, from the training set) -> minibatches (`batch_graphs`) ->
optax Adam on the paper's loss, eq. 3, read as the squared error of log times:
mean_g (log y_g - log y'_g)^2 -> `TrainedEstimator` (config, params, normalization, metadata),
which `_weights` saves and `GnnEstimator` serves.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from disco_jax.cost import AnalyticalEstimator, KernelWork, loop_work
from gnn_estimator._features import KERNEL_FEATURES, NODE_FEATURES, KernelFeatures, featurize, without_times
from gnn_estimator._model import (
    FusedOpEstimator,
    GraphBatch,
    ModelConfig,
    batch_graphs,
    init_ensemble,
    level_sizes,
    shape_level,
)


@dataclasses.dataclass(frozen=True)
class Normalization:
    """Per-feature shift and scale applied before the network (fitted on training kernels)."""

    node_mean: np.ndarray
    node_std: np.ndarray
    kernel_mean: np.ndarray
    kernel_std: np.ndarray

    @classmethod
    def fit(cls, features: Sequence[KernelFeatures]) -> Normalization:
        nodes = np.concatenate([f.nodes for f in features])
        kernels = np.stack([f.kernel for f in features])
        return cls(nodes.mean(0), np.maximum(nodes.std(0), 1e-3), kernels.mean(0), np.maximum(kernels.std(0), 1e-3))

    @classmethod
    def identity(cls) -> Normalization:
        n, k = len(NODE_FEATURES), len(KERNEL_FEATURES)
        return cls(np.zeros(n, np.float32), np.ones(n, np.float32), np.zeros(k, np.float32), np.ones(k, np.float32))

    def to_json(self) -> dict:
        return {k: [float(x) for x in getattr(self, k)] for k in ("node_mean", "node_std", "kernel_mean", "kernel_std")}

    @classmethod
    def from_json(cls, d: dict) -> Normalization:
        arrays = {k: np.asarray(d[k], np.float32) for k in ("node_mean", "node_std", "kernel_mean", "kernel_std")}
        if arrays["node_mean"].shape != (len(NODE_FEATURES),) or arrays["kernel_mean"].shape != (len(KERNEL_FEATURES),):
            raise ValueError("normalization does not match this feature list")
        return cls(**arrays)

    def batch(self, features: Sequence[KernelFeatures], sizes: tuple[int, int, int] | None = None) -> GraphBatch:
        return batch_graphs(features, self.node_mean, self.node_std, self.kernel_mean, self.kernel_std, sizes)


@functools.partial(jax.jit, static_argnums=0)
def _ensemble_log_us(config: ModelConfig, stacked_params, batch: GraphBatch) -> jax.Array:
    """The members' mean predicted log time per graph of `batch`. One jitted function for every
    estimator, the parameters an argument (not constants of the program): estimators of one config
    (each search of a process loads its own) share its compiled shapes."""
    model = FusedOpEstimator(config)
    members = jax.vmap(lambda params, b: model.apply({"params": params}, b), in_axes=(0, None))
    return jnp.mean(members(stacked_params, batch), axis=0)


@dataclasses.dataclass
class TrainedEstimator:
    """Everything needed to predict: network sizes, parameters (a list, one tree per ensemble
    member), feature normalization, and the metadata written beside the weights (training set
    summary, accuracy)."""

    config: ModelConfig
    params: list
    normalization: Normalization
    metadata: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if len(self.params) != self.config.members:
            raise ValueError(f"{len(self.params)} parameter sets for a {self.config.members}-member config")
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *self.params)
        self._apply = functools.partial(_ensemble_log_us, self.config, stacked)

    def predict_us(self, features: Sequence[KernelFeatures], chunk: int = 256) -> np.ndarray:
        """Predicted microseconds per kernel (exp of the members' mean log time); one jitted
        call per `chunk` kernels, padded to a shape level (`_model.shape_level`), so a search
        that asks for a few new kernels at a time reuses the shapes `warm_up` compiled."""
        out = []
        for i in range(0, len(features), chunk):
            part = features[i : i + chunk]
            level = shape_level(sum(f.num_nodes for f in part), sum(f.num_edges for f in part), len(part))
            log_us = self._apply(self.normalization.batch(part, level_sizes(level)))
            out.append(np.exp(np.asarray(log_us)[: len(part)]))
        return np.concatenate(out) if out else np.zeros((0,))

    def warm_up(self, levels: int = 6) -> None:
        """Compile the forward pass for the first `levels` shape levels (64 to 64 x 2^(levels-1)
        nodes), so that predicting later compiles nothing for batches that fit them."""
        for level in range(levels):
            n, e, b = level_sizes(level)
            batch = GraphBatch(
                jnp.zeros((n, len(self.normalization.node_mean)), jnp.float32),
                jnp.zeros((b, len(self.normalization.kernel_mean)), jnp.float32),
                jnp.full((e,), n - 1, jnp.int32),
                jnp.full((e,), n - 1, jnp.int32),
                jnp.full((n,), b - 1, jnp.int32),
                jnp.zeros((n,), jnp.float32),
                jnp.zeros((e,), jnp.float32),
                jnp.zeros((b,), jnp.float32),
            )
            jax.block_until_ready(self._apply(batch))


def load_samples(path: str | Path, device_kind: str | None = None) -> list[dict]:
    """Samples from a JSON-lines file (a torn last line is skipped); only those recorded on
    `device_kind` when given."""
    samples = []
    for line in Path(path).read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if device_kind is None or r.get("device_kind") == device_kind:
            samples.append(r)
    return samples


def sample_features(samples: Iterable[dict], own_times: bool = True) -> list[KernelFeatures]:
    """Features of each sample, with the ops' own times as recorded or all unknown."""
    return [featurize(s["kernel"] if own_times else without_times(s["kernel"])) for s in samples]


def log_targets(samples: Sequence[dict]) -> np.ndarray:
    return np.log(np.maximum(np.array([s["time_us"] for s in samples], np.float64), 1e-2)).astype(np.float32)


def relative_errors(predicted_us: np.ndarray, measured_us: np.ndarray) -> np.ndarray:
    """|predicted - measured| / measured, the paper's prediction error (section 6.5)."""
    measured = np.asarray(measured_us, np.float64)
    return np.abs(np.asarray(predicted_us, np.float64) - measured) / np.maximum(measured, 1e-9)


def error_summary(errors: np.ndarray) -> dict:
    """Median, 90th percentile, and fractions within 10% and 20% of a set of relative errors."""
    if len(errors) == 0:
        return {"count": 0}
    return {
        "count": int(len(errors)),
        "median": float(np.median(errors)),
        "p90": float(np.percentile(errors, 90)),
        "within_10pct": float(np.mean(errors <= 0.10)),
        "within_20pct": float(np.mean(errors <= 0.20)),
    }


def _loss(model: FusedOpEstimator, params, batch: GraphBatch, targets: jax.Array) -> jax.Array:
    predicted = model.apply({"params": params}, batch)
    return jnp.sum(batch.graph_mask * (predicted - targets) ** 2) / jnp.maximum(jnp.sum(batch.graph_mask), 1.0)


DEFAULT_CONFIG = ModelConfig()


def train(
    samples: Sequence[dict],
    *,
    config: ModelConfig = DEFAULT_CONFIG,
    epochs: int = 150,
    batch_size: int = 64,
    learning_rate: float = 2e-3,
    weight_decay: float = 0.0,
    seed: int = 0,
    drop_times: float = 0.5,
    validation: Sequence[dict] = (),
    init: TrainedEstimator | None = None,
    log: Callable[[str], None] | None = None,
) -> tuple[TrainedEstimator, list[dict]]:
    """Fit the estimator to `samples` (fresh, or fine-tuning `init`, whose normalization is kept).

    Each member of `config.members` is trained alone (seed + member). Each epoch sees every sample
    once; with probability `drop_times` a sample's own op times are hidden. Adam (AdamW with
    `weight_decay`) with warm-up and cosine decay, gradients clipped at norm 1. With `validation`
    samples, the parameters of the epoch with the lowest validation loss are returned. Returns the
    estimator and the per-epoch history (train loss, validation loss).
    """
    if not samples:
        raise ValueError("no training samples")
    with_times = sample_features(samples, True)
    no_times = sample_features(samples, False)
    if init is not None:
        config, normalization, start_params = init.config, init.normalization, list(init.params)
    else:
        normalization = Normalization.fit(with_times + no_times)
        start_params = init_ensemble(config, seed)
    members, history = [], []
    for m, params in enumerate(start_params):
        params, member_history = _train_member(
            config,
            params,
            normalization,
            samples,
            with_times,
            no_times,
            epochs=epochs,
            batch_size=batch_size,
            learning_rate=learning_rate,
            weight_decay=weight_decay,
            seed=seed + m,
            drop_times=drop_times,
            validation=validation,
            log=None if log is None else (lambda text, m=m: log(f"member {m + 1}/{len(start_params)} {text}")),
        )
        members.append(params)
        history += [{**h, "member": m} for h in member_history]
    return TrainedEstimator(config, members, normalization), history


@functools.lru_cache(maxsize=8)
def _training_functions(config: ModelConfig, learning_rate: float, weight_decay: float, warmup: int, total: int):
    """(optimizer, jitted step, jitted loss) of one network (`config.members` 1) and training
    setting, built once for every member of an ensemble and every `train` with the same setting,
    so each program compiles once per batch shape."""
    model = FusedOpEstimator(config)
    schedule = optax.warmup_cosine_decay_schedule(
        learning_rate * 0.1, learning_rate, warmup, total, learning_rate * 0.01
    )
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, weight_decay=weight_decay) if weight_decay else optax.adam(schedule),
    )

    @jax.jit
    def step(params, opt_state, batch, y):
        loss, grads = jax.value_and_grad(lambda p: _loss(model, p, batch, y))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    eval_loss = jax.jit(lambda params, batch, y: _loss(model, params, batch, y))
    return optimizer, step, eval_loss


def _train_member(
    config: ModelConfig,
    params,
    normalization: Normalization,
    samples: Sequence[dict],
    with_times: list[KernelFeatures],
    no_times: list[KernelFeatures],
    *,
    epochs: int,
    batch_size: int,
    learning_rate: float,
    weight_decay: float,
    seed: int,
    drop_times: float,
    validation: Sequence[dict],
    log,
) -> tuple[Any, list[dict]]:
    """One network of the ensemble: the optimization loop of `train`."""
    rng = np.random.default_rng(seed)
    targets = log_targets(samples)
    steps_per_epoch = math.ceil(len(samples) / batch_size)
    total = max(1, epochs * steps_per_epoch)
    total = max(2, total)
    warmup = min(200, total // 10 + 1, total - 1)
    one_network = dataclasses.replace(config, members=1)  # the step trains one member, whatever their number
    optimizer, step, eval_loss = _training_functions(one_network, learning_rate, weight_decay, warmup, total)
    opt_state = optimizer.init(params)
    val_features = sample_features(validation, True) + sample_features(validation, False)
    val_targets = np.concatenate([log_targets(validation)] * 2) if validation else np.zeros(0, np.float32)

    def validation_loss(params) -> float:
        total_loss, count = 0.0, 0
        for i in range(0, len(val_features), 256):
            part = val_features[i : i + 256]
            y = np.zeros(normalization.batch(part).graph_mask.shape[0], np.float32)
            y[: len(part)] = val_targets[i : i + len(part)]
            total_loss += float(eval_loss(params, normalization.batch(part), y)) * len(part)
            count += len(part)
        return total_loss / max(count, 1)

    history: list[dict] = []
    best = (math.inf, params)
    start = time.time()
    for epoch in range(epochs):
        order = rng.permutation(len(samples))
        losses = []
        for i in range(0, len(order), batch_size):
            idx = order[i : i + batch_size]
            hide = rng.random(len(idx)) < drop_times
            feats = [no_times[j] if h else with_times[j] for j, h in zip(idx, hide)]
            batch = normalization.batch(feats)
            y = np.zeros(batch.graph_mask.shape[0], np.float32)
            y[: len(idx)] = targets[idx]
            params, opt_state, loss = step(params, opt_state, batch, y)
            losses.append(float(loss))
        entry = {"epoch": epoch + 1, "train_loss": float(np.mean(losses)), "seconds": time.time() - start}
        if validation:
            entry["validation_loss"] = validation_loss(params)
            if entry["validation_loss"] < best[0]:
                best = (entry["validation_loss"], params)
        history.append(entry)
        if log is not None and (epoch + 1) % max(1, epochs // 20) == 0:
            log(
                f"epoch {epoch + 1}/{epochs}: train {entry['train_loss']:.4f}"
                + (f", validation {entry['validation_loss']:.4f}" if validation else "")
                + f" ({entry['seconds']:.0f} s)"
            )
    if validation:
        params = best[1]
    return params, history


# --------------------------------------------------------------------------- splits and evaluation


def _unit_hash(text: str, seed: int) -> float:
    import hashlib

    return int(hashlib.sha256(f"{seed}:{text}".encode()).hexdigest()[:12], 16) / float(1 << 48)


def split_samples(
    samples: Sequence[dict],
    *,
    holdout_families: Sequence[str] = (),
    test_fraction: float = 0.15,
    validation_fraction: float = 0.1,
    seed: int = 0,
) -> dict[str, list[dict]]:
    """{'train', 'validation', 'test', 'unseen'}: samples of the `holdout_families` models are
    'unseen' (never trained on); the others go to test / validation / train by a hash of their
    kernel key, so equal kernels measured in several models land on the same side."""
    out: dict[str, list[dict]] = {"train": [], "validation": [], "test": [], "unseen": []}
    for s in samples:
        if s.get("family") in holdout_families:
            out["unseen"].append(s)
            continue
        u = _unit_hash(s["key"], seed)
        part = "test" if u < test_fraction else "validation" if u < test_fraction + validation_fraction else "train"
        out[part].append(s)
    return out


def sample_work(sample: dict) -> KernelWork:
    """A sample's work (`disco_jax.cost.KernelWork`) rebuilt from its description: each node
    counted by `disco_jax.cost.loop_work` (a reduce's reduced elements are its stored flops)."""
    ops = [
        loop_work(node["op"], math.prod(node["shape"]) if node["shape"] else 1, node["flops"])
        for node in sample["kernel"]["nodes"]
    ]
    return KernelWork.of(sample["read_bytes"], sample["written_bytes"], ops)


def analytical_features(sample: dict) -> np.ndarray:
    """The core's analytical feature vector (`disco_jax.cost.kernel_features`: [1, bytes moved,
    elementwise work, transcendental work, dot flops]) of a sample (`sample_work`)."""
    return sample_work(sample).features()


def fit_analytical(samples: Sequence[dict]) -> AnalyticalEstimator:
    """The core's `AnalyticalEstimator` fitted to samples, as the core fits it to profiled kernels."""
    return AnalyticalEstimator.fit([(analytical_features(s), float(s["time_us"])) for s in samples])


def analytical_predict_us(estimator, samples: Sequence[dict]) -> np.ndarray:
    """The core's analytical estimate (features @ coefficients) of each sample."""
    coefficients = np.asarray(estimator.coefficients, np.float64)
    return np.array([float(analytical_features(s) @ coefficients) for s in samples])


def evaluate(trained: TrainedEstimator, samples: Sequence[dict], analytical=None) -> dict:
    """Relative-error summaries on `samples`: the GNN with the recorded own op times, the GNN with
    none known, the analytical estimator (if given), and the label noise (`repeat_error`: how far
    two independent halves of the measurement rounds disagree)."""
    if not samples:
        return {"count": 0}
    measured = np.array([s["time_us"] for s in samples])
    result = {
        "count": len(samples),
        "gnn": error_summary(relative_errors(trained.predict_us(sample_features(samples, True)), measured)),
        "gnn_without_own_times": error_summary(
            relative_errors(trained.predict_us(sample_features(samples, False)), measured)
        ),
        "measurement_noise": error_summary(np.array([s.get("repeat_error", 0.0) for s in samples])),
    }
    if analytical is not None:
        result["analytical"] = error_summary(relative_errors(analytical_predict_us(analytical, samples), measured))
    return result
