"""All-reduce cost: one protocol, and the measured line that implements it.

`AllReduceCost` is what the simulator asks of communication: `time_us(nbytes)`, the time of one
all-reduce of a tensor of `nbytes` bytes per device (the bytes of the all-reduce's HLO shape, not
the total over devices), and `to_json()` for the plan file and reports. Two implementations:

* `AllReduceCostModel`: DisCo's line T(bytes) = C * bytes + D, fitted robustly
  (`fit_allreduce_cost`: medians per size, Huber-weighted relative residuals) to all-reduces
  timed on the real devices (`disco_jax._device_timing.measure_allreduce_cost`), with the spread of the
  fit over its repetitions (`fit_allreduce_samples`);
* `disco_jax.eval.nccl.FittedCollectives`: a simulated H100 cluster's collectives, fitted to
  published nccl-tests tables (every collective its own); `disco_jax.eval.clusters.ClusterAllReduce`:
  the datasheet ring / hierarchical model of a cluster with no measured table.

The other collectives a program holds (`collective_ops`: the all-gathers and reduce-scatters of a
sharded weight update) cost `collective_time_us`: the cost's own (a measured scatter/gather line)
or, from the all-reduce line, what a ring sends (`ring_collective_us`). `transfer_bytes` counts a
gradient the program's compiler will reduce-scatter as one; `communication_bytes` is what each
device sends. Both read the compiler, so they take the `_program.Program`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from disco_jax._graph import Graph, per_graph
from disco_jax._program import Program, per_program
from disco_jax.cost.sharded import scattered_gradients


@runtime_checkable
class AllReduceCost(Protocol):
    """Time of one all-reduce, by the bytes of one device's tensor. Optional members the simulator
    reads when present: `bucket_time_us(tensor_bytes)`, `collective_time_us(collective, nbytes)`,
    and `forms_reduce_scatter` (whether the platform modelled turns a sharded update's all-reduce
    into a reduce-scatter; absent or None: the program's backend decides)."""

    def time_us(self, nbytes: int | float) -> float: ...

    def to_json(self) -> dict: ...


# Collectives the simulator puts on the communication channel besides the gradient buckets.
COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")


@per_graph
def collective_ops(graph: Graph) -> dict[int, tuple[str, int]]:
    """`graph`'s opaque collectives (not the gradients' all-reduces): op id -> (collective, bytes
    of the larger of its input and output per device); an async collective's '-done' half is
    ("done", 0): it waits on the channel, and its '-start' carries the cost. Computed once per graph."""
    out = {}
    for o in graph.opaque_ops:
        op = graph.ops[o]
        name = op.opcode.removesuffix("-start").removesuffix("-done")
        if name in COLLECTIVES:
            moved = max(op.output_bytes, sum(graph.ops[i].output_bytes for i in op.operands))
            out[o] = ("done", 0) if op.opcode.endswith("-done") else (name, moved)
    return out


@per_program
def transfer_bytes(program: Program) -> list[float]:
    """Per gradient of `program`, the bytes its all-reduce's transfer counts: its own, or half where
    it runs as a reduce-scatter (`cost.sharded.scattered_gradients`: the sharded weight update's
    gradients, on XLA:GPU and, through the hook's rule, on XLA:CPU). A ring reduce-scatter sends
    half of what an all-reduce sends, at the same latency. Computed once per program."""
    scattered = scattered_gradients(program)
    return [g.nbytes / 2 if g.id in scattered else float(g.nbytes) for g in program.graph.gradients]


# Bytes each device sends per byte of a collective's tensor on N devices (ring algorithms;
# a collective-permute sends its whole operand once).
RING_BYTES = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n,
    "collective-permute": lambda n: 1.0,
}


def communication_bytes(program: Program, num_devices: int) -> dict[str, float]:
    """Bytes each device sends in one step of `program`, by collective (ring algorithms): the
    gradients' all-reduces (reduce-scatters where the compiler will make them, as
    `transfer_bytes` says) and every other collective (`collective_ops`)."""
    graph = program.graph
    out = {name: 0.0 for name in RING_BYTES}
    for g, moved in zip(graph.gradients, transfer_bytes(program)):  # half: it becomes a reduce-scatter
        name = "all-reduce" if moved == g.nbytes else "reduce-scatter"
        out[name] += RING_BYTES[name](num_devices) * g.nbytes
    for name, nbytes in collective_ops(graph).values():
        if name != "done":  # an async collective's second half: its start sent the bytes
            out[name] += RING_BYTES[name](num_devices) * nbytes
    out["total"] = sum(out.values())
    return out


def collective_time_us(cost: AllReduceCost, collective: str, nbytes: int | float) -> float:
    """One collective moving a tensor of `nbytes` per device (the larger of its input and output:
    a reduce-scatter's input, an all-gather's output): the cost's own `collective_time_us` where
    it has one, else from its all-reduce line as a ring runs it. A ring all-reduce is a
    reduce-scatter then an all-gather of the same bytes, so each of those (and an all-to-all or a
    collective-permute, which send each byte once) costs the line's latency plus half its
    per-byte time. That is also the datasheet clusters' formula (`eval.clusters.ClusterAllReduce`):
    half the ring or hierarchical transfer, with the all-reduce's latency (an overestimate by the
    ring's steps, which only small tensors notice)."""
    if collective == "done":
        return 0.0
    own = getattr(cost, "collective_time_us", None)
    return float(own(collective, nbytes)) if own is not None else ring_collective_us(cost, collective, nbytes)


def ring_collective_us(cost: AllReduceCost, collective: str, nbytes: int | float) -> float:
    """A collective's time from the all-reduce line alone (`collective_time_us`)."""
    if collective == "all-reduce":
        return float(cost.time_us(nbytes))
    latency = float(cost.time_us(0))
    return latency + (float(cost.time_us(nbytes)) - latency) / 2


def bucket_time_us(cost: AllReduceCost, tensor_bytes: Sequence[int | float]) -> float:
    """One all-reduce of several tensors: the cost's own `bucket_time_us` where it has one (a cost
    that depends on how many tensors are combined), else `time_us` of their total bytes."""
    own = getattr(cost, "bucket_time_us", None)
    return float(own(tensor_bytes)) if own is not None else float(cost.time_us(sum(tensor_bytes)))


@dataclasses.dataclass(frozen=True)
class AllReduceCostModel:
    """T(bytes) = per_byte_us * bytes + latency_us (DisCo's T = C*x + D), in microseconds.

    `bytes` is the size of the all-reduced tensor on one device (the bytes of the all-reduce's
    HLO shape), not the total over devices. `per_tensor_us`: what each tensor after the first adds
    to a variadic all-reduce of several (`bucket_time_us`; 0 where combining tensors saves the
    whole latency, as NCCL's does on a flat buffer; about D on XLA:CPU, which all-reduces the
    operands one at a time). `spread`, when the fit had repeated measurements: how far the fit
    moves over them (`fit_allreduce_samples`); not part of the model's identity.
    `scatter_gather`: the line (per_byte_us, latency_us) of one reduce-scatter or all-gather
    (bytes: the whole tensor), fitted to measured pairs of them
    (`disco_jax._device_timing.measure_scatter_gather_cost`); None: half the all-reduce's per-byte time.
    """

    per_byte_us: float
    latency_us: float
    spread: Mapping[str, Any] | None = dataclasses.field(default=None, compare=False, hash=False)
    per_tensor_us: float = 0.0
    scatter_gather: tuple[float, float] | None = None

    def time_us(self, nbytes: int | float) -> float:
        return self.per_byte_us * float(nbytes) + self.latency_us

    def collective_time_us(self, collective: str, nbytes: int | float) -> float:
        """One collective of a tensor of `nbytes` per device: the measured scatter/gather line
        where there is one, else the ring formula (`ring_collective_us`)."""
        if self.scatter_gather is not None and collective != "all-reduce":
            per_byte, latency = self.scatter_gather
            return per_byte * float(nbytes) + latency
        return ring_collective_us(self, collective, nbytes)

    def bucket_time_us(self, tensor_bytes: Sequence[int | float]) -> float:
        """One all-reduce of several tensors (bytes of each, per device)."""
        return self.time_us(sum(tensor_bytes)) + self.per_tensor_us * max(0, len(tensor_bytes) - 1)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"per_byte_us": float(self.per_byte_us), "latency_us": float(self.latency_us)}
        if self.per_tensor_us:
            out["per_tensor_us"] = float(self.per_tensor_us)
        if self.spread is not None:
            out["spread"] = dict(self.spread)
        if self.scatter_gather is not None:
            out["scatter_gather"] = {"per_byte_us": self.scatter_gather[0], "latency_us": self.scatter_gather[1]}
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> AllReduceCostModel:
        return cls(
            per_byte_us=float(d["per_byte_us"]),
            latency_us=float(d["latency_us"]),
            spread=d.get("spread"),
            per_tensor_us=float(d.get("per_tensor_us", 0.0)),
            scatter_gather=(
                (float(d["scatter_gather"]["per_byte_us"]), float(d["scatter_gather"]["latency_us"]))
                if d.get("scatter_gather")
                else None
            ),
        )


def fit_allreduce_cost(points: Sequence[tuple[int, float]]) -> AllReduceCostModel:
    """A line through (bytes, microseconds) points, both coefficients >= 0, robust to outliers.

    Residuals are relative (each point weighted by 1/time): sizes span four orders of magnitude,
    and an unweighted fit lets the largest size decide everything and leaves the latency D, which
    is what makes tensor fusion pay off, as noise. Several points of one size are first reduced
    to their median (clipped at 0: a size too small to measure). With four sizes or more, the
    line is then refitted by iteratively reweighted least squares on the relative residuals,
    first with Huber's weights, then with Tukey's bisquare weights (a size whose median is off
    the line by more than ~4.7 robust standard deviations counts not at all), so one disturbed
    size cannot tilt the line. A
    negative coefficient is clipped to zero and the other one refitted alone.
    """
    if not points:
        raise ValueError("fit_allreduce_cost needs at least one (bytes, us) point")
    by_size: dict[float, list[float]] = {}
    for b, us in points:
        by_size.setdefault(float(b), []).append(float(us))
    x = np.array(sorted(by_size))
    t = np.array([max(0.0, float(np.median(by_size[b]))) for b in x])
    base = 1.0 / np.maximum(t, max(float(t.max()) * 1e-6, 1e-9))
    if len(x) < 2:
        return AllReduceCostModel(per_byte_us=0.0, latency_us=max(0.0, float(t[0])))
    per_byte, latency = _weighted_line(x, t, base)
    if len(x) > 3:
        per_byte, latency = _reweighted(x, t, base, per_byte, latency, _huber)
        per_byte, latency = _reweighted(x, t, base, per_byte, latency, _bisquare)
    return AllReduceCostModel(per_byte_us=per_byte, latency_us=latency)


def _huber(relative: np.ndarray, sigma: float) -> np.ndarray:
    return np.minimum(1.0, HUBER_K * sigma / np.maximum(np.abs(relative), 1e-300))


def _bisquare(relative: np.ndarray, sigma: float) -> np.ndarray:
    u = relative / (BISQUARE_C * sigma)
    return np.where(np.abs(u) < 1.0, (1.0 - u**2) ** 2, 0.0)


def _reweighted(x, t, base, per_byte, latency, weight, iterations: int = 30) -> tuple[float, float]:
    """Iteratively reweighted least squares from a line, with the robust scale of its relative
    residuals (MAD) fixed at the start; the line it started from when the weights collapse."""
    relative = (per_byte * x + latency - t) * base
    sigma = 1.4826 * float(np.median(np.abs(relative - np.median(relative))))
    if sigma <= 1e-12:
        return per_byte, latency
    w = np.ones_like(t)
    for _ in range(iterations):
        new = weight((per_byte * x + latency - t) * base, sigma)
        if np.count_nonzero(new) < 2:
            break
        if np.allclose(new, w):
            break
        w = new
        per_byte, latency = _weighted_line(x, t, base * np.sqrt(w))
    return per_byte, latency


HUBER_K = 1.345  # Huber's constant: 95% efficiency on Gaussian noise
BISQUARE_C = 4.685  # Tukey's bisquare constant: 95% efficiency, weight 0 beyond c robust sigmas


def _weighted_line(x: np.ndarray, t: np.ndarray, w: np.ndarray) -> tuple[float, float]:
    """min sum (w (C x + D - t))^2 over C, D >= 0."""
    design = np.stack([x, np.ones_like(x)], axis=1) * w[:, None]
    (per_byte, latency), *_ = np.linalg.lstsq(design, t * w, rcond=None)
    if per_byte < 0:
        per_byte, latency = 0.0, float(np.average(t, weights=w**2))
    if latency < 0:
        latency = 0.0
        per_byte = float(np.sum(w**2 * x * t) / np.sum(w**2 * x * x))
    return max(0.0, float(per_byte)), max(0.0, float(latency))


def fit_allreduce_samples(
    samples: Mapping[int, Sequence[float]], *, resamples: int = 200, seed: int = 0
) -> AllReduceCostModel:
    """`fit_allreduce_cost` over repeated measurements per size ({bytes: [us, ...]}), with its spread.

    The fit is to each size's median. `spread` (in the model's JSON) says how much it is worth:
    `latency_us` and `per_byte_us` as [10th, 90th] percentiles of the fit over bootstrap
    resamples of the repetitions (each size's repetitions drawn with replacement), and per size
    its median and the interquartile range of its repetitions relative to the median."""
    sizes = sorted(samples)
    if not sizes or any(len(samples[b]) == 0 for b in sizes):
        raise ValueError("fit_allreduce_samples needs at least one measurement per size")
    model = fit_allreduce_cost([(b, us) for b in sizes for us in samples[b]])
    rng = np.random.default_rng(seed)
    latencies, per_bytes = [], []
    for _ in range(resamples):
        drawn = [(b, float(np.median(rng.choice(samples[b], len(samples[b]))))) for b in sizes]
        fit = fit_allreduce_cost(drawn)
        latencies.append(fit.latency_us)
        per_bytes.append(fit.per_byte_us)
    per_size = []
    for b in sizes:
        values = np.asarray(samples[b], dtype=float)
        median = float(np.median(values))
        q1, q3 = np.percentile(values, [25, 75])
        per_size.append(
            {
                "bytes": int(b),
                "median_us": median,
                "iqr_rel": float((q3 - q1) / median) if median > 0 else None,
                "n": len(values),
            }
        )
    spread = {
        "latency_us": [float(np.percentile(latencies, 10)), float(np.percentile(latencies, 90))],
        "per_byte_us": [float(np.percentile(per_bytes, 10)), float(np.percentile(per_bytes, 90))],
        "resamples": resamples,
        "per_size": per_size,
    }
    return dataclasses.replace(model, spread=spread)
