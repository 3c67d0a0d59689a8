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
import json
import os
import sys
import tempfile
import time
import traceback
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


def record(name: str, compiled, args, *, calls: int = 30, traced: int = 5, meta: dict | None = None) -> dict:
    """Time and trace one compiled program (see the module docstring)."""
    from disco_jax._device_timing import hlo_module_name

    text = compiled.as_text()
    module = hlo_module_name(text)
    for _ in range(3):
        jax.block_until_ready(compiled(*args))
    wall = []
    for _ in range(calls):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        wall.append((time.perf_counter() - t0) * 1e6)
    with tempfile.TemporaryDirectory(prefix="gpu-programs-") as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(traced):
                jax.block_until_ready(compiled(*args))
        traces = [jax.profiler.ProfileData.from_file(str(p)) for p in sorted(Path(trace_dir).rglob("*.xplane.pb"))]
    return {
        "program": name,
        **(meta or {}),
        "module": module,
        "wall_us": wall,
        "wall_median_us": float(np.median(wall)),
        "trace": trace_summary(traces, module, traced),
        "text": text,
    }


class Output:
    """JSON lines appended and flushed one program at a time."""

    def __init__(self, path: str, common: dict):
        self.path, self.common = Path(path), common
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, row: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({**self.common, **row}) + "\n")
        brief = {k: v for k, v in row.items() if k not in ("text", "trace", "wall_us")}
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
                return [record(f"chain{length}x{elements}", compiled, args, calls=50, traced=5)]

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


def step_programs(name: str, config: str, devices, budget_s: float, sharded: bool):
    """Compile and record the default step, the plan, and (``sharded``) the sharded update."""
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
    rows.append(record("default", default, args, meta={**info, "compile_s": time.perf_counter() - t0}))
    print(f"{name}: default recorded, capture {capture_s:.1f} s", flush=True)
    if budget_s > 0:
        try:
            best, search = search_plan(lowered, program, n, budget_s)
            t0 = time.perf_counter()
            compiled, status = compile_strategy(lowered, program, best)
            extra = {"status": status, "search": search, "compile_s": time.perf_counter() - t0, **info}
            rows.append(record("plan", compiled, args, meta=extra))
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
            rows.append(
                record("sharded_update", compiled, sharded_args, meta={**info, "compile_s": time.perf_counter() - t0})
            )
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


def run_steps(out: Output, models: list[str], config: str, budget_s: float, time_budget_s: float) -> None:
    one = jax.devices()[:1]
    run_models(out, "steps", models, time_budget_s, lambda name: step_programs(name, config, one, budget_s, False))


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
    return [record(f"allreduce_{megabytes}MiB", compiled, (x,), meta={"bytes": elements * 4})]


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
    parser.add_argument("mode", choices=("launch", "steps", "mock"))
    parser.add_argument("--out", required=True, help="JSON lines appended here")
    parser.add_argument("--models", nargs="*", default=None)
    parser.add_argument("--config", default="tiny", choices=("tiny", "paper"))
    parser.add_argument("--budget", type=float, default=3.0, help="search seconds per plan (0: no plan)")
    parser.add_argument("--time-budget-s", type=float, default=float("inf"), help="no new model is started after")
    parser.add_argument("--lengths", type=int, nargs="*", default=[1, 50, 200])
    parser.add_argument("--sizes", type=int, nargs="*", default=[256, 65536, 1048576])
    parser.add_argument("--no-mock", action="store_true", help="mock mode on the real devices (a CPU check)")
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
        run_steps(out, models, args.config, args.budget, args.time_budget_s)
    else:
        run_mock(out, models, args.config, args.budget, args.time_budget_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
