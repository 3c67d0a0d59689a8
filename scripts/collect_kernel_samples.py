"""Collect fused-kernel samples for the GNN estimator: random kernels of real training steps,
each compiled alone and timed on the current backend (DisCo section 5.2).

For each model below (small training steps written here, plus the `disco_jax.zoo` models when the
zoo can be imported): capture the step's HLO at XLA's hook stage, build the graph IR, then

1. time every distinct single fusible op (kind ``single``): these are also the "own time" of the
   ops in the fused kernels' features;
2. time XLA's own fusions (kind ``xla``);
3. time random kernels made the paper's way (kind ``random``): start from a random op, fuse a
   random producer into the kernel, repeat; lengths log-uniform in [2, --max-len]; kept when convex
   and new for this model.

Kernels are compiled alone through the XLA pass hook and timed under the profiler
(`gnn_estimator.compile_kernel`, `gnn_estimator.time_kernels`). Every sample is one JSON line
appended to --out (resumable: a rerun skips what the file already holds), with the device kind
recorded. Usage:

    python scripts/collect_kernel_samples.py --out disco_jax/profiles/cpu/kernel_samples.jsonl --per-model 350
    python scripts/collect_kernel_samples.py --list

On a GPU, the ``-gpu`` models give kernels of 10 us to milliseconds; their kernels move up to
gigabytes, so raise the size limits, and bound the run by time (docs/gpu.md has the H100 runs):

    python scripts/collect_kernel_samples.py --no-zoo --models mlp-gpu norms-gpu attention-gpu conv-gpu \
        lstm-gpu --max-kernel-mb 2048 --max-batch-mb 16384 --batch 24 --time-budget-s 400
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from disco_jax import Graph, Program, _compile, backends
from disco_jax._profile_db import SHIPPED_PROFILE_DIR, device_kind_key
from disco_jax.cost import flops_per_op, kernel_io_bytes
from gnn_estimator import (
    compile_kernel,
    default_exports,
    describe_kernel,
    is_convex,
    measurable,
    random_kernel,
    time_kernels,
)

console = Console()


# --------------------------------------------------------------------------- models


@dataclasses.dataclass(frozen=True)
class ModelDef:
    """A training step to sample kernels from: `build() -> jax.stages.Lowered` of the step."""

    name: str
    family: str
    build: Callable[[], jax.stages.Lowered]


def _dense_init(key, sizes, dtype=jnp.float32):
    keys = jax.random.split(key, len(sizes))
    return [
        {"w": jax.random.normal(k, (a, b), dtype) / math.sqrt(a), "b": jnp.zeros((b,), dtype)}
        for k, a, b in zip(keys, sizes[:-1], sizes[1:])
    ]


def _step_with(loss, optimizer):
    def step(params, opt_state, batch):
        grads = jax.grad(loss)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def _mlp(batch, sizes, activation, optimizer, compute_dtype=jnp.float32):
    def build():
        params = _dense_init(jax.random.key(0), sizes)
        x = jax.random.normal(jax.random.key(1), (batch, sizes[0]))
        y = jax.random.randint(jax.random.key(2), (batch,), 0, sizes[-1])

        def loss(params, batch):
            h, labels = batch
            h = h.astype(compute_dtype)
            for i, layer in enumerate(params):
                h = h @ layer["w"].astype(compute_dtype) + layer["b"].astype(compute_dtype)
                if i < len(params) - 1:
                    h = activation(h)
            return optax.softmax_cross_entropy_with_integer_labels(h.astype(jnp.float32), labels).mean()

        return jax.jit(_step_with(loss, optimizer)).lower(params, optimizer.init(params), (x, y))

    return build


def _convnet(batch, hw, channels, optimizer):
    def build():
        k = jax.random.split(jax.random.key(0), 4)
        c_in, c_mid = channels
        params = {
            "c1": jax.random.normal(k[0], (3, 3, c_in, c_mid)) * 0.1,
            "c2": jax.random.normal(k[1], (3, 3, c_mid, c_mid)) * 0.1,
            "scale": jnp.ones((c_mid,)),
            "shift": jnp.zeros((c_mid,)),
            "head": jax.random.normal(k[2], (c_mid, 10)) * 0.1,
        }
        x = jax.random.normal(k[3], (batch, hw, hw, c_in))
        y = jnp.arange(batch) % 10

        def conv(h, w):
            return jax.lax.conv_general_dilated(h, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

        def loss(params, batch):
            h, labels = batch
            h = jax.nn.relu(conv(h, params["c1"]))
            h = conv(h, params["c2"])
            mean = h.mean(axis=(0, 1, 2))
            var = ((h - mean) ** 2).mean(axis=(0, 1, 2))
            h = (h - mean) * jax.lax.rsqrt(var + 1e-5) * params["scale"] + params["shift"]
            h = jax.nn.relu(h)
            h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
            logits = h.mean(axis=(1, 2)) @ params["head"]
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        return jax.jit(_step_with(loss, optimizer)).lower(params, optimizer.init(params), (x, y))

    return build


def _lstm(batch, hidden, steps, optimizer):
    def build():
        k = jax.random.split(jax.random.key(0), 4)
        params = {
            "wx": jax.random.normal(k[0], (hidden, 4 * hidden)) * 0.1,
            "wh": jax.random.normal(k[1], (hidden, 4 * hidden)) * 0.1,
            "b": jnp.zeros((4 * hidden,)),
            "out": jax.random.normal(k[2], (hidden, hidden)) * 0.1,
        }
        xs = jax.random.normal(k[3], (steps, batch, hidden))

        def loss(params, xs):
            h = c = jnp.zeros((batch, hidden))
            total = 0.0
            for t in range(steps):
                gates = xs[t] @ params["wx"] + h @ params["wh"] + params["b"]
                i, f, g, o = jnp.split(gates, 4, axis=-1)
                c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
                h = jax.nn.sigmoid(o) * jnp.tanh(c)
                total = total + jnp.mean((h @ params["out"] - xs[t]) ** 2)
            return total / steps

        return jax.jit(_step_with(loss, optimizer)).lower(params, optimizer.init(params), xs)

    return build


def _norms(batch, width, optimizer):
    def build():
        k = jax.random.split(jax.random.key(0), 3)
        params = {
            "w1": jax.random.normal(k[0], (width, width)) / math.sqrt(width),
            "w2": jax.random.normal(k[1], (width, width)) / math.sqrt(width),
            "g1": jnp.ones((width,)),
            "b1": jnp.zeros((width,)),
            "g2": jnp.ones((width,)),
        }
        x = jax.random.normal(k[2], (batch, width))
        y = jnp.arange(batch) % width

        def layernorm(h, g, b):
            mean = h.mean(-1, keepdims=True)
            var = ((h - mean) ** 2).mean(-1, keepdims=True)
            return (h - mean) / jnp.sqrt(var + 1e-6) * g + b

        def rmsnorm(h, g):
            return h * jax.lax.rsqrt((h * h).mean(-1, keepdims=True) + 1e-6) * g

        def loss(params, batch):
            h, labels = batch
            h = layernorm(h @ params["w1"], params["g1"], params["b1"])
            h = jax.nn.softmax(h, axis=-1) * width + jax.nn.silu(h)
            h = rmsnorm(h @ params["w2"], params["g2"])
            logz = jax.nn.logsumexp(h, axis=-1)
            return (logz - jnp.take_along_axis(h, labels[:, None], axis=-1)[:, 0]).mean() + 1e-3 * jnp.abs(h).max()

        return jax.jit(_step_with(loss, optimizer)).lower(params, optimizer.init(params), (x, y))

    return build


def _attention(batch, seq, width, heads, optimizer):
    def build():
        k = jax.random.split(jax.random.key(0), 6)
        params = {
            "qkv": jax.random.normal(k[0], (width, 3 * width)) / math.sqrt(width),
            "o": jax.random.normal(k[1], (width, width)) / math.sqrt(width),
            "ff1": jax.random.normal(k[2], (width, 4 * width)) / math.sqrt(width),
            "ff2": jax.random.normal(k[3], (4 * width, width)) / math.sqrt(4 * width),
            "ln1": jnp.ones((width,)),
            "ln2": jnp.ones((width,)),
        }
        x = jax.random.normal(k[4], (batch, seq, width))

        def layernorm(h, g):
            mean = h.mean(-1, keepdims=True)
            return (h - mean) * jax.lax.rsqrt(((h - mean) ** 2).mean(-1, keepdims=True) + 1e-6) * g

        def loss(params, x):
            h = layernorm(x, params["ln1"])
            q, kk, v = jnp.split(h @ params["qkv"], 3, axis=-1)

            def split(t):
                return t.reshape(batch, seq, heads, width // heads).transpose(0, 2, 1, 3)

            q, kk, v = split(q), split(kk), split(v)
            scores = q @ kk.transpose(0, 1, 3, 2) / math.sqrt(width // heads)
            mask = jnp.tril(jnp.ones((seq, seq), bool))
            scores = jnp.where(mask, scores, -1e9)
            attn = jax.nn.softmax(scores, axis=-1) @ v
            h = x + attn.transpose(0, 2, 1, 3).reshape(batch, seq, width) @ params["o"]
            h = h + jax.nn.gelu(layernorm(h, params["ln2"]) @ params["ff1"]) @ params["ff2"]
            return jnp.mean((h - x) ** 2)

        return jax.jit(_step_with(loss, optimizer)).lower(params, optimizer.init(params), x)

    return build


MODELS: list[ModelDef] = [
    ModelDef("mlp-s", "mlp", _mlp(16, [64, 64, 64, 10], jax.nn.gelu, optax.adam(1e-3))),
    ModelDef("mlp-l", "mlp", _mlp(128, [512, 512, 512, 100], jnp.tanh, optax.adam(1e-3))),
    ModelDef("mlp-xl", "mlp", _mlp(64, [1024, 1024, 1024], jax.nn.relu, optax.sgd(1e-2, momentum=0.9))),
    ModelDef("mlp-bf16", "mlp", _mlp(64, [256, 256, 256, 32], jax.nn.gelu, optax.adamw(1e-3), jnp.bfloat16)),
    ModelDef("conv-s", "conv", _convnet(8, 16, (4, 16), optax.adam(1e-3))),
    ModelDef("conv-l", "conv", _convnet(16, 32, (8, 32), optax.sgd(1e-2, momentum=0.9))),
    ModelDef("conv-xl", "conv", _convnet(32, 64, (16, 64), optax.adam(1e-3))),
    ModelDef("lstm-s", "lstm", _lstm(8, 32, 4, optax.sgd(1e-2))),
    ModelDef("lstm-l", "lstm", _lstm(32, 256, 4, optax.adam(1e-3))),
    ModelDef("lstm-xl", "lstm", _lstm(128, 512, 3, optax.adamw(1e-3))),
    ModelDef("norms-s", "norms", _norms(32, 128, optax.adam(1e-3))),
    ModelDef("norms-l", "norms", _norms(256, 512, optax.rmsprop(1e-3))),
    ModelDef("norms-xl", "norms", _norms(2048, 1024, optax.adam(1e-3))),
    ModelDef("attention-s", "attention", _attention(4, 16, 32, 2, optax.adam(1e-3))),
    ModelDef("attention-l", "attention", _attention(8, 64, 128, 4, optax.adamw(1e-3))),
    ModelDef("attention-xl", "attention", _attention(8, 256, 256, 8, optax.adam(1e-3))),
    # Sized for a GPU (pass --max-kernel-mb 2048): tensors of 32-512 MB, so kernels run from
    # microseconds to milliseconds on an H100, where the models above stay under 50 us.
    ModelDef("mlp-gpu", "mlp", _mlp(8192, [4096, 4096, 4096, 1024], jax.nn.gelu, optax.adam(1e-3))),
    ModelDef("norms-gpu", "norms", _norms(16384, 4096, optax.adam(1e-3))),
    ModelDef("attention-gpu", "attention", _attention(8, 1024, 1024, 16, optax.adamw(1e-3))),
    ModelDef("conv-gpu", "conv", _convnet(64, 128, (32, 128), optax.sgd(1e-2, momentum=0.9))),
    ModelDef("lstm-gpu", "lstm", _lstm(4096, 2048, 3, optax.adam(1e-3))),
]


def _zoo_models() -> list[ModelDef]:
    """The zoo's tiny configs, when `disco_jax.zoo` can be imported (it is optional here)."""
    try:
        from disco_jax import zoo

        names = list(zoo.MODELS) if hasattr(zoo, "MODELS") else list(zoo.list_models())
    except Exception as err:  # the zoo is written elsewhere; never block collection on it
        console.print(f"[yellow]zoo not used: {type(err).__name__}: {err}")
        return []
    out = []
    for config in ("tiny", "paper"):
        for name in names:

            def build(name=name, config=config):
                spec = zoo.get_model(name, config)
                # The paper configs at a global batch of 4 on one device: realistic layer sizes, and
                # kernels from microseconds to milliseconds; the step is only compiled, never run.
                return zoo.lower_abstract(
                    spec, optax.adam(1e-3), zoo.data_mesh(1), global_batch_size=4 if config == "paper" else None
                )

            out.append(ModelDef(f"zoo-{name}-{config}", f"zoo-{name}", build))
    return out


def capture_program(model: ModelDef) -> Program:
    """The step's program on this machine's backend, with XLA's own fusions (the ``xla`` kernels)."""
    program, _ = _compile.capture_program(model.build(), backends.for_platform(jax.default_backend()))
    return program


# --------------------------------------------------------------------------- sampling


def kernel_key(graph: Graph, kernel: frozenset[int]) -> str:
    """Identity of a measured kernel: its computation (`Graph.kernel_signature`) and which of its
    ops it exports (positions in op order)."""
    order = sorted(kernel)
    exports = [order.index(o) for o in default_exports(graph, kernel)]
    return graph.kernel_signature(kernel) + ":" + ",".join(map(str, exports))


def _log_uniform_length(rng: random.Random, max_len: int) -> int:
    return int(math.exp(rng.uniform(math.log(2), math.log(max_len + 1))))


def _candidates(program: Program, kind: str, rng: random.Random, max_len: int):
    """Random kernels, lazily and endlessly: DisCo's sampling from size-weighted start ops."""
    graph = program.graph
    if kind == "random":
        # Most fusible ops of a step are tiny (biases, scalars): start from an op with at least
        # 4096 output elements three times in four, so kernel times span microseconds to ms.
        big = [o for o in graph.fusible_ops if graph.ops[o].inst.outputs[0].elements >= 4096]
        while True:
            start = rng.choice(big) if big and rng.random() < 0.75 else None
            yield random_kernel(program, rng, _log_uniform_length(rng, max_len), start=start)


# --------------------------------------------------------------------------- collection


class Collector:
    """Appends timed samples of one model to the output file, in batches."""

    def __init__(
        self,
        out: Path,
        device_kind: str,
        batch: int,
        rounds: int,
        seed: int,
        max_kernel_bytes: int = 256 << 20,
        max_batch_bytes: int = 1 << 30,
    ):
        self.out, self.device_kind, self.batch, self.rounds = out, device_kind, batch, rounds
        # A kernel reading and writing more than max_kernel_bytes is skipped; a batch of compiled
        # kernels holds all its inputs in memory at once, so it is flushed at max_batch_bytes.
        self.max_kernel_bytes, self.max_batch_bytes = max_kernel_bytes, max_batch_bytes
        self.np_rng = np.random.default_rng(seed)
        self.failures = 0

    def measure(
        self, model: ModelDef, program: Program, kernels: list[frozenset[int]], kind: str, op_times: dict[int, float]
    ) -> list[dict]:
        graph, compiled, kept = program.graph, [], []
        for k in kernels:
            try:
                compiled.append(compile_kernel(program, k, self.np_rng))
                kept.append(k)
            except Exception as err:  # a kernel XLA rejects is skipped, and counted
                self.failures += 1
                if self.failures <= 5:
                    console.print(f"[yellow]skipped a kernel of {model.name}: {str(err).splitlines()[-1][:200]}")
        timings = time_kernels(compiled, rounds=self.rounds)
        records = []
        for k, timing in zip(kept, timings):
            if timing is None:
                self.failures += 1
                continue
            read, written = kernel_io_bytes(graph, k, default_exports(graph, k))
            times = dict(op_times)
            if kind == "single":
                (o,) = k
                times[o] = timing.time_us
            records.append(
                {
                    "model": model.name,
                    "family": model.family,
                    "kind": kind,
                    "key": kernel_key(graph, k),
                    "ops": [graph.ops[o].name for o in sorted(k)],
                    "kernel": describe_kernel(graph, k, times),
                    "time_us": timing.time_us,
                    "round_us": list(timing.round_us),
                    "runs": timing.runs,
                    "repeat_error": timing.repeat_error,
                    "read_bytes": read,
                    "written_bytes": written,
                    "flops": float(sum(flops_per_op(graph)[o] for o in k)),
                    "device_kind": self.device_kind,
                    "backend": jax.default_backend(),
                    "jax_version": jax.__version__,
                }
            )
        with self.out.open("a") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        return records


def _existing(out: Path) -> dict[str, dict[str, dict]]:
    """model -> key -> record, from an existing output file (skipping a torn last line)."""
    found: dict[str, dict[str, dict]] = {}
    if out.exists():
        for line in out.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            found.setdefault(r["model"], {})[r["key"]] = r
    return found


def _boundary_bytes(graph, kernel: frozenset[int]) -> int:
    read, written = kernel_io_bytes(graph, kernel, default_exports(graph, kernel))
    return read + written


def collect_model(
    model: ModelDef,
    collector: Collector,
    done: dict[str, dict],
    per_model: int,
    max_singles: int,
    max_len: int,
    seed: int,
    progress: Progress,
    task,
    deadline: float = math.inf,
) -> int:
    """Sample, time and append one model's kernels; returns how many were added. Past `deadline`
    (a `time.time()`) no new batch is started: what was measured is kept, and a rerun resumes."""
    program = capture_program(model)
    graph = program.graph
    rng = random.Random(f"{seed}-{model.name}")
    added = 0

    def flush(kernels: list[frozenset[int]], kind: str, op_times: dict[int, float]) -> None:
        nonlocal added
        for r in collector.measure(model, program, kernels, kind, op_times):
            done[r["key"]] = r
            added += 1
        progress.update(task, completed=min(sum(1 for r in done.values() if r["kind"] != "single"), per_model))

    def run(kind: str, candidates, quota: int, op_times: dict[int, float], max_attempts: int) -> None:
        """Measure new kernels from `candidates` until `quota` of this kind are in `done`."""
        pending: list[frozenset[int]] = []
        pending_keys: set[str] = set()
        pending_bytes = 0
        have = sum(1 for r in done.values() if r["kind"] == kind)
        for attempt, k in enumerate(candidates):
            if have + len(pending) >= quota or attempt >= max_attempts or time.time() > deadline:
                break
            if (len(k) < 2 and kind != "single") or not measurable(graph, k) or not is_convex(graph, k):
                continue
            key = kernel_key(graph, k)
            nbytes = _boundary_bytes(graph, k)
            if key in done or key in pending_keys or nbytes > collector.max_kernel_bytes:
                continue
            pending.append(k)
            pending_keys.add(key)
            pending_bytes += nbytes
            if len(pending) >= collector.batch or pending_bytes > collector.max_batch_bytes:
                flush(pending, kind, op_times)
                have = sum(1 for r in done.values() if r["kind"] == kind)
                pending, pending_keys, pending_bytes = [], set(), 0
        if pending:
            flush(pending, kind, op_times)

    # 1. Single ops (a random subset of the distinct ones): their times are the own-time feature
    #    of the ops of every later kernel of this model (unknown for the others).
    by_key: dict[str, list[int]] = {}
    for o in graph.fusible_ops:
        by_key.setdefault(kernel_key(graph, frozenset([o])), []).append(o)
    keys = sorted(by_key)
    rng.shuffle(keys)
    progress.update(task, description=f"{model.name} (single)")
    run("single", (frozenset([by_key[key][0]]) for key in keys), max_singles, {}, len(keys))
    op_times = {o: done[key]["time_us"] for key, ops in by_key.items() if key in done for o in ops}
    # 2. XLA's own fusions (at most a third of the quota), 3. random kernels for the rest.
    progress.update(task, description=f"{model.name} (xla)")
    run("xla", (g for g in graph.xla_groups if len(g) > 1), per_model // 3, op_times, len(graph.xla_groups))
    have_xla = sum(1 for r in done.values() if r["kind"] == "xla")
    progress.update(task, description=f"{model.name} (random)")
    run("random", _candidates(program, "random", rng, max_len), per_model - have_xla, op_times, 30 * per_model)
    return added


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    device_kind = device_kind_key(jax.devices()[0])
    parser.add_argument("--out", type=Path, default=SHIPPED_PROFILE_DIR / device_kind / "kernel_samples.jsonl")
    parser.add_argument("--models", nargs="*", help="model names (default: all; see --list)")
    parser.add_argument("--per-model", type=int, default=350, help="multi-op kernels per model")
    parser.add_argument("--max-singles", type=int, default=120, help="distinct single ops timed per model")
    parser.add_argument("--max-len", type=int, default=30)
    parser.add_argument("--batch", type=int, default=48, help="kernels compiled and timed together")
    parser.add_argument("--rounds", type=int, default=4, help="timing rounds per kernel (minimum of medians)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-kernel-mb", type=float, default=256, help="skip kernels moving more bytes")
    parser.add_argument("--max-batch-mb", type=float, default=1024, help="inputs a batch may hold at once")
    parser.add_argument(
        "--time-budget-s", type=float, default=math.inf, help="shared evenly by the models still to collect"
    )
    parser.add_argument("--no-zoo", action="store_true")
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args(argv)
    models = MODELS + ([] if args.no_zoo else _zoo_models())
    if args.list:
        for m in models:
            console.print(f"{m.name:16s} family={m.family}")
        return 0
    if args.models:
        unknown = set(args.models) - {m.name for m in models}
        if unknown:
            parser.error(f"unknown models {sorted(unknown)}")
        models = [m for m in models if m.name in args.models]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    existing = _existing(args.out)
    collector = Collector(
        args.out,
        device_kind,
        args.batch,
        args.rounds,
        args.seed,
        max_kernel_bytes=int(args.max_kernel_mb * 2**20),
        max_batch_bytes=int(args.max_batch_mb * 2**20),
    )
    start = time.time()
    with Progress(
        TextColumn("{task.description:28s}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as progress:
        for i, model in enumerate(models):
            task = progress.add_task(model.name, total=args.per_model)
            done = existing.setdefault(model.name, {})
            # An even share of what is left, so a budget cut short still samples every model.
            deadline = time.time() + (start + args.time_budget_s - time.time()) / (len(models) - i)
            try:
                new = collect_model(
                    model,
                    collector,
                    done,
                    args.per_model,
                    args.max_singles,
                    args.max_len,
                    args.seed,
                    progress,
                    task,
                    deadline,
                )
            except Exception as err:
                console.print(f"[red]{model.name} failed: {type(err).__name__}: {err}")
                continue
            progress.update(task, description=f"{model.name} (+{new})")
    total = sum(len(v) for v in existing.values())
    console.print(
        f"{total} samples in {args.out} ({args.out.stat().st_size / 1e6:.1f} MB), "
        f"{collector.failures} kernels skipped, {time.time() - start:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
