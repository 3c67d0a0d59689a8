"""On a GPU machine: run compiled programs and record what the GPU did, for the compiled-program
cost model to be checked against afterwards on any machine (`scripts/gpu_programs_report.py`).

Every program is recorded the same way (`record`): its compiled module's text (what
`disco_jax.cost.compiled_cost` reads), the wall-clock time of a call (median of 30 calls after
3 warm-ups, blocking on each), and one profiler trace of a few calls: per HLO instruction its mean
device time (as the profile phase reads it), and the device events that name no instruction of
the module (where command buffers hide kernels). The device runs nothing else: the costing,
the comparison and the tables happen offline, so a GPU lease is spent on measuring only.

Modes (one process each: XLA's flags and the mock topology are fixed when the backend starts):

* ``launch``: chains of N dependent tiny kernels (an `optimization_barrier` between steps keeps
  XLA from fusing them), at three sizes: the fixed cost of a kernel of 1-3 us inside an
  executable, and the gap between consecutive kernels on the stream.
* ``steps``: per zoo model (tiny config, or ``--config paper`` at the 8-GPU rows' per-device
  batch), XLA's default step and disco-jax's plan for it (captured through the GPU backend,
  searched for ``--budget`` seconds on the graph simulator with one H100's costs, enacted by the
  rewriter): the one-GPU fidelity programs, and with ``--config paper`` the
  library calls (gemm and convolution kernels) of the paper configs as XLA runs them.
* ``mock``: the data-parallel step compiled for 8 GPUs (default, the plan searched for
  8xH100-NVLink, the sharded weight update) run on this one GPU under
  ``jax_mock_gpu_topology=1x8x1`` (8 processes of one GPU, this process being one of them), the
  global arrays built from this process's shards (`jax.make_array_from_callback`); and one
  all-reduce of 64 MiB alone, to see what a mock collective costs.

Run with ``XLA_FLAGS=--xla_gpu_enable_command_buffer=`` for command buffers off (the default
leaves them on). Results are appended to ``--out`` (JSON lines, one per program, flushed as
they come), so a run cut short keeps what it measured:

    python scripts/gpu_programs.py launch --out out/launch.jsonl
    python scripts/gpu_programs.py steps --out out/steps_cb.jsonl [--models mlp bert] [--config tiny]
    python scripts/gpu_programs.py mock --out out/mock.jsonl
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import os
import sys
import tempfile
import time
import traceback
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

MOCK_TOPOLOGY = "1x8x1"
CB_OFF = "--xla_gpu_enable_command_buffer="  # XLA_FLAGS entry: no command buffers (CUDA graphs)


# ----------------------------------------------------------------------------------------------
# Recording one program


def host_values(avals: list, seed: int = 0) -> list[np.ndarray]:
    """Host arrays for the input leaves: small normal floats (what a trained model holds), cut
    from one random block so paper-size states take no time, and zeros for integers and booleans
    (valid token ids and labels)."""
    block = np.random.default_rng(seed).standard_normal(1 << 20, dtype=np.float32) * 0.02
    values = []
    for aval in avals:
        dtype = np.dtype(aval.dtype)
        if np.issubdtype(dtype, np.floating) or dtype.name == "bfloat16":
            values.append(np.resize(block, aval.shape).astype(dtype))
        else:
            values.append(np.zeros(aval.shape, dtype))
    return values


def global_args(compiled, host_leaves: list, treedef):
    """The call's arguments in the shardings `compiled` takes, each device's shard cut from the
    host value: in a multi-process job (a mock topology too) every process builds only its own."""
    shardings = jax.tree.leaves(compiled.input_shardings[0])
    if len(shardings) != len(host_leaves):
        raise ValueError(f"{len(shardings)} input shardings for {len(host_leaves)} leaves")
    arrays = [
        jax.make_array_from_callback(x.shape, s, lambda index, x=x: x[index]) for x, s in zip(host_leaves, shardings)
    ]
    return jax.tree.unflatten(treedef, arrays)


def pack(value) -> str:
    """A JSON value as base64 of zlib-compressed JSON: module texts and per-call timelines of the
    paper steps are megabytes each, and a row stays one line, written whole
    (`disco_jax.eval.gpu_records.unpack` reads it)."""
    return base64.b64encode(zlib.compress(json.dumps(value).encode(), 6)).decode("ascii")


def trace_summary(traces: list, module: str, calls: int) -> dict:
    """Per instruction of `module` its mean device time per call (`_device_timing.kernel_times_from_trace`,
    what the profile phase reads), and the device events that name no instruction of the module,
    by name (a command buffer's kernels are one such event, or one event of the module)."""
    from disco_jax._device_timing import kernel_times_from_trace, module_op_events

    kernel_us = kernel_times_from_trace(traces, module, steps=calls)
    named = len(module_op_events(traces, module))
    other: dict[str, float] = {}
    for trace in traces:
        for plane in trace.planes:
            if not plane.name.startswith("/device:"):
                continue
            for line in plane.lines:
                for e in line.events:
                    stats = dict(e.stats)
                    if stats.get("hlo_module") == module and "hlo_op" in stats:
                        continue
                    key = f"{line.name}: {e.name}"[:160]
                    other[key] = other.get(key, 0.0) + float(e.duration_ns) / 1e3 / calls
    return {
        "kernel_us": kernel_us,
        "events_of_module": named,
        "events_other": len(other),
        "other_us": dict(sorted(other.items(), key=lambda kv: -kv[1])[:40]),
    }


MAX_EVENTS_PER_CALL = 60000


def call_timeline(traces: list) -> dict:
    """Every event of one traced call, device and host, on the trace's own clock: a names table
    and per event [plane, line, name, start_ns, duration_ns, hlo_op or ""]. The host's events
    (Python dispatch, the runtime's launches, CUPTI's driver calls where the GPU records them)
    are what a host lane is fitted to; the device's are the kernels in the order they ran."""
    names: dict[str, int] = {}

    def index(name: str) -> int:
        return names.setdefault(name, len(names))

    events = []
    for trace in traces:
        for plane in trace.planes:
            for line in plane.lines:
                for e in line.events:
                    if len(events) >= MAX_EVENTS_PER_CALL:
                        break
                    stats = dict(e.stats)
                    op = str(stats.get("hlo_op", "")) if "hlo_module" in stats else ""
                    where = [index(plane.name), index(line.name), index(e.name[:200])]
                    events.append([*where, int(e.start_ns), int(e.duration_ns), op])
    return {"names": list(names), "events": events, "truncated": len(events) >= MAX_EVENTS_PER_CALL}


def traced_calls(call, calls: int) -> list[list]:
    """`calls` calls, each alone in its own profiler trace (parsed `ProfileData` per call), so the
    events of one call are never mixed with the next's."""
    out = []
    for _ in range(calls):
        with tempfile.TemporaryDirectory(prefix="gpu-programs-") as trace_dir:
            with jax.profiler.trace(trace_dir):
                call()
            out.append(
                [jax.profiler.ProfileData.from_file(str(p)) for p in sorted(Path(trace_dir).rglob("*.xplane.pb"))]
            )
    return out


def spread(samples: list[float]) -> dict:
    return {
        "wall_median_us": float(np.median(samples)),
        "wall_p10_us": float(np.percentile(samples, 10)),
        "wall_p90_us": float(np.percentile(samples, 90)),
    }


def memory_stats() -> dict:
    """The allocator's counters of the first local device (None where the backend keeps none)."""
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - not every backend has them
        return {}
    keep = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit", "largest_alloc_size", "num_allocs")
    return {k: int(stats[k]) for k in keep if stats and k in stats}


def memory_analysis(compiled) -> dict:
    """XLA's memory analysis of the executable (what the planners read), in bytes."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001
        return {}
    if m is None:
        return {}
    fields = ("argument", "output", "temp", "alias", "generated_code", "host_temp")
    out = {f: int(getattr(m, f"{f}_size_in_bytes", 0) or 0) for f in fields}
    peak = getattr(m, "peak_memory_in_bytes", None)
    if peak is not None:
        out["peak"] = int(peak)
    return out


class Partner:
    """A program timed beside a step, call for call (`record`'s interleaving): `call()` runs it
    once and blocks; `donated` programs feed their outputs back as the next call's inputs."""

    def __init__(self, name: str, compiled, args: tuple, donated: bool = False):
        self.name, self.compiled, self.args, self.donated = name, compiled, args, donated

    def call(self) -> None:
        result = self.compiled(*self.args)
        jax.block_until_ready(result)
        if self.donated:
            self.args = tuple(result)

    def row(self, wall: list[float], meta: dict) -> dict:
        text = self.compiled.as_text()
        return {
            "program": self.name,
            **meta,
            "module": _module_name(text),
            "arguments": len(jax.tree.leaves(self.args)),
            "wall_us": wall,
            **spread(wall),
            "text": text,
        }


def _module_name(text: str) -> str:
    from disco_jax._device_timing import hlo_module_name

    return hlo_module_name(text)


def trivial_partners(compiled, args) -> list[Partner]:
    """Two programs that take the step's argument buffers and do (almost) nothing, timed beside it:
    the per-call cost of a program with these arguments, measured directly.

    * ``args_only``: every argument (`keep_unused`), one tiny kernel, one small output;
    * ``args_outputs``: the train state's leaves in and, donated, out again (aliased, no kernel):
      the step's arguments and outputs, as buffers, without its work.
    """
    leaves = jax.tree.leaves(args)
    shardings = jax.tree.leaves(compiled.input_shardings[0])

    def touch(*xs):
        return xs[0].ravel()[:1] * 2

    args_only = jax.jit(touch, in_shardings=tuple(shardings), keep_unused=True).lower(*leaves).compile()
    state = jax.tree.leaves(args[0])
    state_shardings = shardings[: len(state)]
    copies = tuple(jax.device_put(jnp.copy(x), s) for x, s in zip(state, state_shardings))

    def identity(*xs):
        return xs

    args_outputs = (
        jax.jit(identity, in_shardings=tuple(state_shardings), donate_argnums=tuple(range(len(copies))))
        .lower(*copies)
        .compile()
    )
    return [Partner("args_only", args_only, tuple(leaves)), Partner("args_outputs", args_outputs, copies, True)]


def record(
    name: str,
    compiled,
    args,
    *,
    calls: int = 30,
    traced: int = 3,
    meta: dict | None = None,
    partners: list[Partner] = (),
    timelines: bool = True,
) -> list[dict]:
    """Time and trace one compiled program, with `partners` timed beside it (see the module
    docstring); returns its row and one row per partner.

    The allocator's counters are read around the first call, before any partner runs, so that the
    step's peak can be set against XLA's memory analysis of it."""
    text = compiled.as_text()
    module = _module_name(text)

    def step():
        jax.block_until_ready(compiled(*args))

    before = memory_stats()
    step()
    after = memory_stats()
    for _ in range(2):
        step()
    for p in partners:
        for _ in range(3):
            p.call()
    programs = [step, *(p.call for p in partners)]
    wall: list[list[float]] = [[] for _ in programs]
    for i in range(calls):  # interleaved, the order rotated each round
        for k in range(len(programs)):
            j = (i + k) % len(programs)
            t0 = time.perf_counter()
            programs[j]()
            wall[j].append((time.perf_counter() - t0) * 1e6)
    per_call = traced_calls(step, traced)
    row = {
        "program": name,
        **(meta or {}),
        "module": module,
        "wall_us": wall[0],
        **spread(wall[0]),
        "trace": trace_summary([t for call in per_call for t in call], module, traced),
        "memory": {"before_first_call": before, "after_first_call": after, "analysis": memory_analysis(compiled)},
        "text": text,
    }
    if timelines:
        row["calls_z"] = pack([call_timeline(call) for call in per_call])
    return [row, *(p.row(w, {**(meta or {}), "partner_of": name}) for p, w in zip(partners, wall[1:]))]


class Output:
    """JSON lines appended and flushed one program at a time."""

    def __init__(self, path: str, common: dict):
        self.path, self.common = Path(path), common
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, row: dict) -> None:
        stored = dict(row)
        if "text" in stored:  # compressed: the paper steps' texts are megabytes (`load_rows` reads both)
            stored["text_z"] = pack(stored.pop("text"))
        with self.path.open("a") as f:
            f.write(json.dumps({**self.common, **stored}) + "\n")
        brief = {k: v for k, v in row.items() if k not in ("text", "trace", "wall_us", "calls_z")}
        if "trace" in row:
            t = row["trace"]
            brief["kernels_traced"] = len(t["kernel_us"])
            brief["other_events"] = t["events_other"]
        print(json.dumps(brief), flush=True)


def environment() -> dict:
    device = jax.devices()[0]
    return {
        "device_kind": device.device_kind,
        "platform": device.platform,
        "jax": jax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "command_buffers": "off" if CB_OFF in os.environ.get("XLA_FLAGS", "") else "default",
    }


def guarded(out: Output, what: dict, fn) -> None:
    """Run one measurement; a failure is written as a row and does not stop the others."""
    started = time.perf_counter()
    try:
        rows = fn()
    except Exception as err:  # noqa: BLE001 - recorded, the run goes on
        traceback.print_exc()
        error = f"{type(err).__name__}: {str(err)[:2000]}"
        out.write({**what, "error": error, "seconds": time.perf_counter() - started})
        return
    for row in rows:
        out.write({**what, **row})


# ----------------------------------------------------------------------------------------------
# launch: the fixed cost of a tiny kernel


def launch_chain(length: int, elements: int):
    def chain(x):
        for i in range(length):
            x = jax.lax.optimization_barrier(jnp.sin(x) + float(i))
        return x

    x = jnp.ones((elements,), jnp.float32)
    return jax.jit(chain).lower(x).compile(), (x,)


def run_launch(out: Output, lengths: list[int], sizes: list[int]) -> None:
    for elements in sizes:
        for length in lengths:
            what = {"mode": "launch", "length": length, "elements": elements}

            def one(length=length, elements=elements):
                compiled, args = launch_chain(length, elements)
                return record(f"chain{length}x{elements}", compiled, args, calls=50, traced=5)

            guarded(out, what, one)


# ----------------------------------------------------------------------------------------------
# steps: XLA's default step and disco-jax's plan on this one GPU


def search_plan(lowered, program, devices: int, budget_s: float):
    """disco-jax's plan for the captured step: the graph simulator with the cluster's costs, the
    backtracking search from XLA's plan and the start candidates (as `offline.plan_for_target`)."""
    from disco_jax import _search, _strategy
    from disco_jax.cost import ChainEstimator, simulate
    from disco_jax.eval import clusters

    cluster = clusters.node_of("h100-sxm", devices)  # 8 devices: the report's 8xH100-NVLink costs
    estimator, allreduce = ChainEstimator([cluster.kernel_estimator()]), cluster.allreduce_model()

    def cost(s):
        result = simulate(program, s, estimator, allreduce)
        return None if result is None else result.iteration_us

    graph = program.graph
    default = _strategy.xla_default(graph)
    config = _search.SearchConfig(budget_s=budget_s)
    result = _search.backtracking_search(program, cost, config, starts=[default, *_strategy.start_candidates(graph)])
    return result.best, {"default_sim_us": cost(default), "plan_sim_us": result.best_cost, **result.stats()}


def step_programs(name: str, config: str, devices, budget_s: float, sharded: bool, trivial: bool = False):
    """Compile and record the default step (with ``trivial``, the two `trivial_partners` timed
    beside it), the plan (``budget_s`` > 0), and (``sharded``) the sharded update."""
    import optax
    from jax.sharding import Mesh

    from disco_jax import backends, zoo
    from disco_jax._compile import capture_program, compile_strategy
    from disco_jax.eval.rows import PAPER_DEVICES

    spec = zoo.get_model(name, config)
    mesh = Mesh(np.array(devices), ("data",))
    n = len(devices)
    batch = spec.default_global_batch // PAPER_DEVICES * n if config == "paper" else spec.default_global_batch
    optimizer = optax.adam(1e-3)
    args_abstract = zoo.abstract_state_and_batch(spec, optimizer, mesh, global_batch_size=batch)
    step = zoo.build_train_step(spec, optimizer, mesh, "jit")
    leaves, treedef = jax.tree.flatten(args_abstract)
    host = host_values(leaves)
    lowered = step.lower(*args_abstract)
    t0 = time.perf_counter()
    program = None
    if budget_s > 0:  # the program's graph is what the search reads
        program, _ = capture_program(lowered, backends.for_platform(jax.default_backend()))
    capture_s = time.perf_counter() - t0
    rows = []
    t0 = time.perf_counter()
    default = lowered.compile()  # XLA's own program, every pass on (the decorator's reference)
    args = global_args(default, host, treedef)
    info = {"model": name, "config": config, "global_batch": batch, "devices": n}
    compile_s = time.perf_counter() - t0
    partners = trivial_partners(default, args) if trivial else []
    rows += record("default", default, args, meta={**info, "compile_s": compile_s}, partners=partners)
    del partners
    print(f"{name}: default recorded, capture {capture_s:.1f} s", flush=True)
    if budget_s > 0:
        try:
            best, search = search_plan(lowered, program, n, budget_s)
            t0 = time.perf_counter()
            compiled, status = compile_strategy(lowered, program, best)
            extra = {"status": status, "search": search, "compile_s": time.perf_counter() - t0, **info}
            rows += record("plan", compiled, args, meta=extra)
        except Exception as err:  # noqa: BLE001
            traceback.print_exc()
            rows.append({"program": "plan", **info, "error": f"{type(err).__name__}: {str(err)[:2000]}"})
    if sharded:
        try:
            from disco_jax.sharding import update

            sharded_lowered, _, reason = update.relower_positional(step, args_abstract, default)
            if sharded_lowered is None:
                raise RuntimeError(f"no optimizer state to shard: {reason}")
            t0 = time.perf_counter()
            compiled = sharded_lowered.compile()
            sharded_args = global_args(compiled, host, treedef)
            meta = {**info, "compile_s": time.perf_counter() - t0}
            rows += record("sharded_update", compiled, sharded_args, meta=meta)
        except Exception as err:  # noqa: BLE001
            traceback.print_exc()
            rows.append({"program": "sharded_update", **info, "error": f"{type(err).__name__}: {str(err)[:2000]}"})
    return rows


def run_models(out: Output, mode: str, models: list[str], time_budget_s: float, programs) -> None:
    """`programs(name)` of each model, recorded, until the time budget is spent."""
    started = time.time()
    for name in models:
        if time.time() - started > time_budget_s:
            out.write({"mode": mode, "model": name, "skipped": "time budget spent"})
            continue
        guarded(out, {"mode": mode, "model": name}, lambda name=name: programs(name))


def run_steps(
    out: Output, models: list[str], config: str, budget_s: float, time_budget_s: float, trivial: bool = False
) -> None:
    one = jax.devices()[:1]
    run_models(
        out, "steps", models, time_budget_s, lambda name: step_programs(name, config, one, budget_s, False, trivial)
    )


# ----------------------------------------------------------------------------------------------
# gemm: library calls at the sizes of 7B-class models

# (tokens per device, in features, out features): a 7B-class decoder's projections (width 4096:
# attention 4096 x 4096 and 4096 x 12288 fused qkv, a 4x GELU MLP 4096 x 16384 and back, a SwiGLU
# MLP 4096 x 11008 and back, a 32000-token head), and the widths of 13B-70B models (8192, 16384).
GEMM_SHAPES: tuple[tuple[int, int, int], ...] = tuple(
    (m, k, n)
    for m in (16384, 4096)  # the long-context case first: a cut run keeps it
    for k, n in (
        (4096, 4096),
        (4096, 12288),
        (4096, 16384),
        (16384, 4096),
        (4096, 11008),
        (11008, 4096),
        (4096, 32000),
        (8192, 8192),
        (8192, 28672),
        (16384, 16384),
    )
)
# Layouts of the backward pass: "nn" x(M,K) @ w(K,N); "tn" the weight gradient x(M,K)^T dy(M,N),
# contracting the tokens; "nt" the input gradient dy(M,N) w(K,N)^T.
GEMM_LAYOUTS = {"nn": "mk,kn->mn", "tn": "mk,mn->kn", "nt": "mn,kn->mk"}


def gemm_programs(shapes, layouts: dict[str, tuple[str, ...]], dtypes, attention: tuple[int, int, int, int] | None):
    """(name, meta, fn, operand shapes, dtype) of every product to time: each shape in "nn" and
    the layouts `layouts` names for it, and the two batched products of attention (scores and
    their product with the values) at (batch, heads, length, head width) `attention`."""
    operands = {
        "nn": lambda m, k, n: ((m, k), (k, n)),
        "tn": lambda m, k, n: ((m, k), (m, n)),
        "nt": lambda m, k, n: ((m, n), (k, n)),
    }
    out = []
    for dtype in dtypes:
        for m, k, n in shapes:
            for layout in ("nn", *layouts.get((m, k, n), ())):
                spec = GEMM_LAYOUTS[layout]
                meta = {"m": m, "k": k, "n": n, "layout": layout, "dtype": dtype, "flops": 2 * m * k * n}
                out.append((f"gemm_{layout}_{m}x{k}x{n}_{dtype}", meta, spec, operands[layout](m, k, n), dtype))
    if attention is not None:
        b, h, s, d = attention
        for what, spec, shapes_ in (
            ("scores", "bhqd,bhkd->bhqk", ((b, h, s, d), (b, h, s, d))),
            ("values", "bhqk,bhkd->bhqd", ((b, h, s, s), (b, h, s, d))),
        ):
            meta = {"attention": what, "shape": [b, h, s, d], "dtype": "bfloat16", "flops": 2 * b * h * s * s * d}
            out.append((f"attention_{what}_{b}x{h}x{s}x{d}", meta, spec, shapes_, "bfloat16"))
    return out


def tp_shapes(width: int = 4096, hidden: int = 11008, tokens: int = 16384, ways=(2, 4, 8)):
    """The products of a Megatron-sharded layer (attention and MLP, column then row) at each
    tensor-parallel degree: what a device computes when a layer is split over the model axis."""
    shapes = []
    for t in ways:
        shapes += [(tokens, width, width // t), (tokens, width // t, width)]
        shapes += [(tokens, width, hidden // t), (tokens, hidden // t, width)]
    return tuple(shapes)


def run_gemm(out: Output, time_budget_s: float, small: bool = False, tp: bool = False) -> None:
    """Each product compiled alone (XLA:GPU autotunes it as it would in a step), timed over 10
    calls and traced once: its kernels' device time against `cost.work`'s flops. With `tp`, only
    the tensor-parallel shards' products (`tp_shapes`), forward and both backward layouts."""
    if tp:
        shapes = tp_shapes(64, 96, 32, (2,)) if small else tp_shapes()
        layouts = {shape: ("tn", "nt") for shape in shapes}
        programs = gemm_programs(shapes, layouts, ("bfloat16",), None)
    elif small:  # a CPU check of the mode itself
        shapes, layouts, attention = ((64, 32, 48),), {(64, 32, 48): ("tn", "nt")}, (1, 2, 16, 8)
    else:
        big = {(16384, k, n): ("tn", "nt") for k, n in ((4096, 4096), (4096, 16384), (16384, 4096), (8192, 8192))}
        shapes, layouts, attention = GEMM_SHAPES, big, (4, 32, 4096, 128)
    if not tp:
        programs = gemm_programs(shapes, layouts, ("bfloat16",), attention)
        f32_shapes = shapes[:1] if small else ((16384, 4096, 4096), (16384, 4096, 16384))
        programs += gemm_programs(f32_shapes, {}, ("float32",), None)
    started = time.time()
    key = jax.random.key(0)
    for name, meta, spec, shapes_, dtype in programs:
        if time.time() - started > time_budget_s:
            out.write({"mode": "gemm", "program": name, "skipped": "time budget spent"})
            continue

        def one(name=name, meta=meta, spec=spec, shapes_=shapes_, dtype=dtype):
            keys = jax.random.split(key, len(shapes_))
            args = tuple(jax.random.normal(k, s, jnp.dtype(dtype)) for k, s in zip(keys, shapes_))
            t0 = time.perf_counter()
            compiled = jax.jit(lambda a, b: jnp.einsum(spec, a, b)).lower(*args).compile()
            meta = {**meta, "compile_s": time.perf_counter() - t0}
            return record(name, compiled, args, calls=10, traced=1, meta=meta, timelines=False)

        guarded(out, {"mode": "gemm"}, one)


# ----------------------------------------------------------------------------------------------
# decoder: a 7B-shaped decoder's layers on one GPU, and one step in float32 and bfloat16


def decoder_configs(which: str):
    """(label, GPTConfig) of each decoder `which` names: ``llama7b`` a Llama2-7B-shaped stack
    (width 4096, 32 heads of 128, vocabulary 32000, 4 sequences of 4096 tokens, bfloat16 compute)
    of 1 and 2 layers, the per-layer cost being their difference, and one layer with cuDNN's
    fused attention; ``dtype`` one mid-size decoder in float32 and in bfloat16 compute;
    ``scan`` one bfloat16 decoder of 4 layers unrolled and under `nn.scan`, and of 8 layers
    scanned (a scanned step's error against its unrolled twin's, and the per-iteration cost);
    ``small`` tiny versions of these for a CPU check."""
    from disco_jax.zoo._gpt import GPTConfig

    if which == "llama7b":
        base = GPTConfig(32000, 4096, 32, 1, 4096, 4, "bfloat16")
        return [
            ("llama7b_1layer", base),
            ("llama7b_2layers", dataclasses.replace(base, num_layers=2)),
            ("llama7b_1layer_cudnn", dataclasses.replace(base, attention="cudnn")),
        ]
    if which == "dtype":
        base = GPTConfig(32000, 1024, 16, 4, 1024, 8, "float32")
        return [("gpt_f32", base), ("gpt_bf16", dataclasses.replace(base, compute_dtype="bfloat16"))]
    if which == "scan":
        base = GPTConfig(32000, 2048, 16, 4, 2048, 4, "bfloat16")
        return [
            ("scan_unrolled_4layers", base),
            ("scan_scanned_4layers", dataclasses.replace(base, scan_layers=True)),
            ("scan_scanned_8layers", dataclasses.replace(base, num_layers=8, scan_layers=True)),
        ]
    if which == "small":
        base = GPTConfig(64, 32, 2, 2, 16, 2, "float32")
        return [
            ("small_f32", base),
            ("small_bf16", dataclasses.replace(base, compute_dtype="bfloat16")),
            ("small_scanned", dataclasses.replace(base, scan_layers=True)),
        ]
    raise ValueError(f"unknown decoder set {which!r}")


def decoder_programs(label: str, cfg) -> list[dict]:
    """One decoder's Adam step on the first device, its state initialised on the device."""
    import optax
    from jax.sharding import Mesh

    from disco_jax import zoo
    from disco_jax.zoo import _gpt

    spec = _gpt.spec_of(cfg, label)
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    step, state, batch = zoo.make_train_step(spec, optax.adam(1e-4), mesh, "jit")
    t0 = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    meta = {
        "model": label,
        "config": dataclasses.asdict(cfg),
        "description": spec.description,
        "parameters": int(sum(x.size for x in jax.tree.leaves(state.params))),
        "tokens": cfg.global_batch * cfg.seq_len,
        "compile_s": time.perf_counter() - t0,
    }
    return record("default", compiled, (state, batch), calls=10, traced=2, meta=meta)


def run_decoder(out: Output, which: str, time_budget_s: float, labels: list[str] | None = None) -> None:
    started = time.time()
    for label, cfg in decoder_configs(which):
        if labels and label not in labels:
            continue
        if time.time() - started > time_budget_s:
            out.write({"mode": "decoder", "model": label, "skipped": "time budget spent"})
            continue
        guarded(out, {"mode": "decoder", "set": which}, lambda label=label, cfg=cfg: decoder_programs(label, cfg))


# ----------------------------------------------------------------------------------------------
# mock: eight-GPU programs on this one GPU


def allreduce_alone(megabytes: int) -> list[dict]:
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("data",))
    elements = megabytes * 2**20 // 4
    sharding = NamedSharding(mesh, P("data"))
    total = elements * len(jax.devices())
    host = np.ones((total,), np.float32)
    x = jax.make_array_from_callback((total,), sharding, lambda i: host[i])

    def reduce(v):
        return jax.lax.psum(v, "data")

    fn = jax.jit(jax.shard_map(reduce, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    compiled = fn.lower(x).compile()
    return record(f"allreduce_{megabytes}MiB", compiled, (x,), meta={"bytes": elements * 4})


def run_mock(out: Output, models: list[str], config: str, budget_s: float, time_budget_s: float) -> None:
    n = len(jax.devices())
    out.write(
        {
            "mode": "mock",
            "program": "topology",
            "devices": n,
            "local_devices": len(jax.local_devices()),
            "process_index": jax.process_index(),
            "process_count": jax.process_count(),
        }
    )
    guarded(out, {"mode": "mock", "model": "allreduce"}, lambda: allreduce_alone(64))
    every = jax.devices()
    run_models(out, "mock", models, time_budget_s, lambda name: step_programs(name, config, every, budget_s, True))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("launch", "steps", "mock", "gemm", "decoder"))
    parser.add_argument("--out", required=True, help="JSON lines appended here")
    parser.add_argument("--models", nargs="*", default=None)
    parser.add_argument("--config", default="tiny", choices=("tiny", "paper"))
    parser.add_argument("--budget", type=float, default=3.0, help="search seconds per plan (0: no plan)")
    parser.add_argument("--time-budget-s", type=float, default=float("inf"), help="no new model is started after")
    parser.add_argument("--lengths", type=int, nargs="*", default=[1, 50, 200])
    parser.add_argument("--sizes", type=int, nargs="*", default=[256, 65536, 1048576])
    parser.add_argument("--no-mock", action="store_true", help="mock mode on the real devices (a CPU check)")
    parser.add_argument("--trivial", action="store_true", help="steps: time the trivial programs beside each step")
    parser.add_argument(
        "--set", default="llama7b", choices=("llama7b", "dtype", "scan", "small"), help="decoder: which"
    )
    parser.add_argument("--small", action="store_true", help="gemm: tiny products (a CPU check)")
    parser.add_argument("--tp", action="store_true", help="gemm: the tensor-parallel shards' products only")
    parser.add_argument("--labels", nargs="*", default=None, help="decoder: only these of the set")
    args = parser.parse_args(argv)
    if args.mode == "mock" and not args.no_mock:
        jax.config.update("jax_mock_gpu_topology", MOCK_TOPOLOGY)
    from disco_jax import zoo

    models = args.models if args.models is not None else list(zoo.MODELS)
    out = Output(args.out, environment())
    print(json.dumps(out.common), flush=True)
    if args.mode == "launch":
        run_launch(out, args.lengths, args.sizes)
    elif args.mode == "steps":
        run_steps(out, models, args.config, args.budget, args.time_budget_s, args.trivial)
    elif args.mode == "gemm":
        run_gemm(out, args.time_budget_s, args.small, args.tp)
    elif args.mode == "decoder":
        run_decoder(out, args.set, args.time_budget_s, args.labels)
    else:
        run_mock(out, models, args.config, args.budget, args.time_budget_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
