"""Simulator fidelity: does the calibrated simulator predict what it picks?

For each zoo model (``tiny`` config) and platform, the script runs the search phase's profile and
calibrate (`disco_jax._profile_phase`), then measures and simulates four configurations of the step:

* ``JAX default``: XLA's executable;
* ``per-gradient AR``: XLA's fusions, one all-reduce per gradient (our rewrite);
* ``no fusion``: XLA's ``fusion`` and all-reduce combiner passes disabled (the JAX_no_fusion
  baseline, `backends.CPU.baseline_options`); simulated as the unfused strategy;
* ``search plan``: the strategy the backtracking search picks on the calibrated simulator (our
  rewrite), whether or not validation would keep it.

Measured times: interleaved pairs against JAX default (`_validate.time_interleaved`); a
configuration's time is its median per-pair ratio times the median JAX default time over all its
pairings, with the interquartile range of the ratios as its spread (JAX default: paired with
itself, so its spread is the machine's noise). Then per platform: the median relative error
|simulated - measured| / measured over every (model, configuration), the Spearman rank
correlation over them (pooled), and the mean of the per-model Spearman correlations (how well the
simulator ranks one model's configurations, which is what the search relies on).

The error of each configuration's ratio to JAX default is printed too: it is free of the drift
of a shared machine's speed between calibration and measurement, which absolute errors are not.

Platforms: ``cpu8``: 8 CPU devices in one process; ``gloo2``: 2 processes x 1 CPU device,
collectives over gloo on loopback (`disco_jax._launch`).

    python scripts/bench_fidelity.py [--models mlp transformer rnnlm dlrm] [--platforms cpu8 gloo2]
        [--pairs 15] [--budget 5] [--json out.json]

A model may carry changes to its tiny config, ``NAME:FIELD=VALUE,...`` (`zoo.resized`): the GPT
scanned and unrolled side by side (issue 43: a scanned step's error against its twin's) is
``--models gpt gpt:scan_layers=True``.

With ``--gap`` it prints instead where the step time of JAX default goes on each platform (the
measurements behind docs/simulator-fidelity.md): wall time, the null program's time, and from a
profiler trace the time per device inside the module's thunks, the all-reduces' share, the thunk
count and the span of the step; and one variadic all-reduce of 16 tensors against 16 separate ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

import numpy as np

PLATFORMS = {"cpu8": (1, 8), "gloo2": (2, 1)}  # name -> (processes, devices per process)
CONFIGS = ("JAX default", "per-gradient AR", "no fusion", "search plan")
DEFAULT_MODELS = ("mlp", "transformer", "rnnlm", "dlrm")
RESULT_PREFIX = "FIDELITY "
GAP_ENV = "DISCO_JAX_FIDELITY_GAP"  # set by --gap for the job


# --------------------------------------------------------------------------- in the job


def model_spec(name: str):
    """The tiny spec `name` names: a zoo model, or ``model:field=value,...`` resized."""
    import ast

    from disco_jax import zoo

    base, _, changes = name.partition(":")
    if not changes:
        return zoo.get_model(base, "tiny")
    fields = dict(item.split("=", 1) for item in changes.split(","))
    return zoo.resized(base, "tiny", **{k: ast.literal_eval(v) for k, v in fields.items()})


def measure_model(name: str, pairs: int, budget_s: float) -> dict | None:
    """Calibrate, search, and measure and simulate every configuration of one model (in every
    process of the job; process 0 returns the row, the others None)."""
    import jax
    import optax

    from disco_jax import _distributed, _search, _strategy, _validate, backends, cost, zoo
    from disco_jax._compile import capture, compile_strategy, compiled_stats
    from disco_jax._console import Ui
    from disco_jax._profile_db import ProfileDatabase
    from disco_jax._profile_phase import calibrate, calibration_strategies, profile

    started = time.perf_counter()
    spec = model_spec(name)
    step, state, batch = zoo.make_train_step(spec, optax.adam(1e-3), zoo.data_mesh(), "jit")
    args = (state, batch)
    captured = capture(step.lower(*args), backends.CPU, args, {})
    program, graph = captured.program, captured.graph
    quiet = Ui(verbose=False)
    default_runner = captured.runner(captured.default_compiled)
    cost_model = profile(captured, default_runner, ProfileDatabase(), quiet)
    calibration = calibrate(cost_model, captured, default_runner, pairs, quiet)
    default = _strategy.xla_default(graph)

    def simulated_us(s):
        r = cost_model.simulate(program, s)
        return None if r is None else r.iteration_us

    best = default
    if jax.process_index() == 0:
        result = _search.backtracking_search(program, simulated_us, _search.SearchConfig(budget_s=budget_s, seed=0))
        best = result.best
    if _distributed.is_multiprocess():
        found = _distributed.broadcast_json(_distributed.new_scope("fidelity") + "/strategy", best.to_json(graph))
        best = _strategy.Strategy.from_json(graph, found)
    per_gradient = _strategy.with_buckets(default, [(g.id,) for g in graph.gradients], "per-gradient")
    no_fusion_options = backends.CPU.baseline_options["JAX_no_fusion"]
    configurations = {
        "JAX default": (default, captured.default_compiled),
        "per-gradient AR": (per_gradient, compile_strategy(captured.lowered, program, per_gradient)[0]),
        "no fusion": (_strategy.unfused(graph), captured.lowered.compile(compiler_options=dict(no_fusion_options))),
        "search plan": (best, compile_strategy(captured.lowered, program, best)[0]),
    }
    timings = {}
    for label, (_, compiled) in configurations.items():
        runner = default_runner if label == "JAX default" else captured.runner(compiled)
        timings[label] = _validate.time_interleaved(default_runner, runner, pairs=pairs)
    if jax.process_index() != 0:
        return None
    default_us = float(np.median([t.default_us for t in timings.values()]))
    bare = cost_model.simulate(program, default, params=cost.SimulatorParams())
    calibrated_on = {s.key() for s in calibration_strategies(program).values()}
    old = old_model(program, cost_model, calibration, {"default": default, "per-gradient": per_gradient})
    rows = []
    for label, (strategy, compiled) in configurations.items():
        t = timings[label]
        if label == "JAX default":  # paired with itself: its ratios are the machine's noise
            t = dataclasses.replace(t, ratio=1.0)
        counts = compiled_stats(compiled.as_text())
        rows.append(
            {
                "config": label,
                "measured_us": t.ratio * default_us,
                "measured_iqr_us": [t.ratio_low * default_us, t.ratio_high * default_us],
                "ratio": t.ratio,
                "ratio_iqr": [t.ratio_low, t.ratio_high],
                "pairs": t.pairs,
                "simulated_us": simulated_us(strategy),
                "old_model_us": old(strategy),
                "allreduces": counts["all-reduce"],
                "multi_op_fusions": counts["multi_op_loop_fusions"],
                "kernels": len(strategy.groups) + len(graph.opaque_ops),
                "in_calibration": strategy.key() in calibrated_on,
            }
        )
    return {
        "model": name,
        "processes": jax.process_count(),
        "devices": jax.device_count(),
        "rows": rows,
        "calibration": calibration.to_json(),
        "allreduce": cost_model.allreduce.to_json(),
        "traced_kernel_sum_us": bare.compute_us,
        "elapsed_s": time.perf_counter() - started,
    }


def old_model(program, cost_model, calibration, strategies: dict):
    """The simulator as it was before (for comparison, on the same measurements): a bucket costs
    one latency whatever its tensors, no step overhead, compute scale and blocking fitted to the
    two calibration points XLA's plan and one all-reduce per gradient."""
    from disco_jax import cost

    fit = cost_model.allreduce
    bucket = cost.AllReduceCostModel(fit.per_byte_us, fit.latency_us)
    measured = {p.label: p.measured_us for p in calibration.points}
    if "per-gradient" not in measured:
        return lambda s: None

    def at(p, s):
        r = cost.simulate(program, s, cost_model.estimator, bucket, p)
        return None if r is None else r.iteration_us

    fitted = cost.calibrate(
        lambda p: [at(p, strategies[k]) for k in ("default", "per-gradient")],
        [measured["default"], measured["per-gradient"]],
    )
    return lambda s: at(fitted.params, s)


def gap_model(name: str, steps: int = 5) -> dict | None:
    """Where one model's step time goes: wall time; the null program's (the step's arguments and
    results, no computation: `_profile_phase.null_program`); and from a profiler trace, per device
    and step, the time inside the module's thunks, the all-reduces' share of it and the thunk
    count, and the span from the first thunk's start to the last one's end over all devices."""
    import tempfile
    from pathlib import Path

    import jax
    import optax

    from disco_jax import _device_timing, _profile_phase, _validate, backends, zoo
    from disco_jax._compile import capture

    spec = model_spec(name)
    step, state, batch = zoo.make_train_step(spec, optax.adam(1e-3), zoo.data_mesh(), "jit")
    captured = capture(step.lower(state, batch), backends.CPU, (state, batch), {})
    runner = captured.runner(captured.default_compiled)
    null = _validate.time_interleaved(runner, _profile_phase.null_program(captured), pairs=20)
    with tempfile.TemporaryDirectory(prefix="disco-jax-gap-") as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(steps):
                jax.block_until_ready(runner())
        traces = [jax.profiler.ProfileData.from_file(str(p)) for p in Path(trace_dir).rglob("*.xplane.pb")]
    events = _device_timing.module_op_events(traces, captured.module_name)
    if jax.process_index() != 0:
        return None
    executions: dict = {}
    for e in events:
        executions.setdefault((e.device, e.run), []).append(e)
    busy, allreduce, thunks, spans = [], [], [], {}
    for (_, run), es in executions.items():
        busy.append(_device_timing._union_length([(e.start_ns, e.end_ns) for e in es]))
        allreduce.append(_device_timing._union_length([(e.start_ns, e.end_ns) for e in es if "all-reduce" in e.op]))
        thunks.append(len({e.op for e in es}))
        first, last = min(e.start_ns for e in es), max(e.end_ns for e in es)
        spans[run] = (min(first, spans.get(run, (first, last))[0]), max(last, spans.get(run, (first, last))[1]))
    return {
        "model": name,
        "devices": jax.device_count(),
        "wall_us": null.default_us,
        "null_us": null.ratio * null.default_us,
        "thunk_time_us": float(np.mean(busy)) / 1e3,
        "allreduce_us": float(np.mean(allreduce)) / 1e3,
        "thunks": float(np.mean(thunks)),
        "span_us": float(np.mean([b - a for a, b in spans.values()])) / 1e3,
        "gradients": len(captured.graph.gradients),
    }


def variadic_allreduce(tensors: int = 16, elements: int = 256, pairs: int = 15) -> dict:
    """One all-reduce of `tensors` small tensors (XLA's combiner on, its default) against as many
    separate all-reduces (combiner off), timed in interleaved pairs."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from disco_jax import _validate

    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    spec = PartitionSpec("d")
    xs = [
        jax.device_put(jnp.full((mesh.size * elements,), i, jnp.float32), NamedSharding(mesh, spec))
        for i in range(tensors)
    ]

    def body(xs):
        return [y.at[0].set(0.0) for y in jax.lax.psum(tuple(x * 1.5 for x in xs), "d")]

    program = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)).lower(xs)
    combined = program.compile()
    separate = program.compile(compiler_options={"xla_disable_hlo_passes": "cpu-all-reduce-combiner"})
    t = _validate.time_interleaved(lambda: combined(xs), lambda: separate(xs), pairs=pairs)
    return {"tensors": tensors, "bytes_each": 4 * elements, "combined_us": t.default_us, "separate_us": t.plan_us}


def run_job(models: list[str], pairs: int, budget_s: float) -> None:
    """The job's body: every process runs every model; process 0 prints one result line each."""
    from disco_jax import initialize_from_env

    initialize_from_env()  # before anything starts a JAX backend (does nothing in one process)
    if os.environ.get(GAP_ENV):
        import jax

        rows = [gap_model(name) for name in models]
        variadic = variadic_allreduce()
        if jax.process_index() == 0:
            print(RESULT_PREFIX + json.dumps({"gap": rows, "variadic": variadic}), flush=True)
        return
    for name in models:
        row = measure_model(name, pairs, budget_s)
        if row is not None:
            print(RESULT_PREFIX + json.dumps(row), flush=True)


# --------------------------------------------------------------------------- statistics


def summarize(results: list[dict]) -> dict:
    """Median relative error and Spearman correlations over every (model, configuration); the
    same for the ratio to JAX default (simulated ratio against measured ratio: free of the drift
    of the machine's speed between calibration and measurement), and over the configurations
    the simulator was not calibrated on."""
    from disco_jax.eval.ranks import spearman  # here: the workers set up JAX before any import of it

    measured, simulated, errors, ratio_errors, held_out, within, old_errors = [], [], [], [], [], [], []
    for r in results:
        rows = [x for x in r["rows"] if x["simulated_us"] is not None]
        sim_default = next((x["simulated_us"] for x in rows if x["config"] == "JAX default"), None)
        for x in rows:
            m, sim = x["measured_us"], x["simulated_us"]
            measured.append(m)
            simulated.append(sim)
            errors.append(abs(sim - m) / m)
            if x.get("old_model_us") is not None:
                old_errors.append(abs(x["old_model_us"] - m) / m)
            if not x["in_calibration"]:
                held_out.append(abs(sim - m) / m)
            if sim_default and x["config"] != "JAX default":
                ratio_errors.append(abs(sim / sim_default - x["ratio"]) / x["ratio"])
        rho = spearman([x["measured_us"] for x in rows], [x["simulated_us"] for x in rows])
        if rho is not None:
            within.append(rho)

    def median(v):
        return float(np.median(v)) if v else None

    return {
        "points": len(errors),
        "median_error": median(errors),
        "p90_error": float(np.percentile(errors, 90)) if errors else None,
        "median_error_held_out": median(held_out),
        "held_out": len(held_out),
        "median_ratio_error": median(ratio_errors),
        "median_error_old_model": median(old_errors),
        "spearman_pooled": spearman(measured, simulated),
        "spearman_within_model_mean": float(np.mean(within)) if within else None,
    }


# --------------------------------------------------------------------------- printing


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def _old(x: dict) -> str:
    old = x.get("old_model_us")
    return "-" if old is None else f"{old / 1e3:.2f}, {(old - x['measured_us']) / x['measured_us']:+.1%}"


def print_platform(platform: str, results: list[dict]) -> None:
    processes, devices = PLATFORMS[platform]
    print(f"\n## {platform}: {processes} process(es) x {devices} CPU device(s), times in ms per step\n")
    print(
        "| model | configuration | measured [IQR] | simulated | error | ratio to default: measured / simulated "
        "| old model: simulated, error | AR | fusions |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        sim_default = next((x["simulated_us"] for x in r["rows"] if x["config"] == "JAX default"), None)
        for x in r["rows"]:
            sim = x["simulated_us"]
            err = "-" if sim is None else f"{(sim - x['measured_us']) / x['measured_us']:+.1%}"
            low, high = x["measured_iqr_us"]
            sim_ratio = "-" if sim is None or not sim_default else f"{sim / sim_default:.3f}"
            mark = "" if x["in_calibration"] else " *"
            print(
                f"| {r['model']} | {x['config']}{mark} | {x['measured_us'] / 1e3:.2f} "
                f"[{low / 1e3:.2f}-{high / 1e3:.2f}] "
                f"| {'-' if sim is None else f'{sim / 1e3:.2f}'} | {err} | {x['ratio']:.3f} / {sim_ratio} "
                f"| {_old(x)} "
                f"| {x['allreduces']} | {x['multi_op_fusions']} |"
            )
    print(
        "\n`*`: not one of the configurations the simulator was calibrated on "
        "(`_profile_phase.calibration_strategies`)."
    )
    print(
        "\nCalibration per model (4 configurations; the step's fixed cost measured with a null program; "
        "all-reduce D, C and the per-tensor cost measured apart):\n"
    )
    for r in results:
        c, fit = r["calibration"], r["allreduce"]
        print(
            f"- {r['model']}: {c['step_overhead_us'] / 1e3:.2f} ms/step, compute x{c['compute_scale']:.2f}, "
            f"{c['kernel_overhead_us']:.1f} us/kernel, {c.get('allreduce_tensor_us') or 0.0:.0f} us per combined "
            f"tensor, blocking {c['comm_blocking']:.0%}; misfit {c['misfit']:.1%} "
            f"over {len(c['points'])} points; JAX default {c['measured_default_us'] / 1e3:.2f} ms at calibration; "
            f"traced kernels {r['traced_kernel_sum_us'] / 1e3:.2f} ms per device; all-reduce D "
            f"{fit['latency_us']:.0f} us, C {fit['per_byte_us'] * 1e6:.0f} us/MB, "
            f"{fit.get('per_tensor_us', 0.0):.0f} us per extra tensor; {r['elapsed_s']:.0f} s"
        )
    s = summarize(results)
    pooled, within = s["spearman_pooled"], s["spearman_within_model_mean"]
    print(
        f"\n{platform}: median error {_pct(s['median_error'])} (90th percentile {_pct(s['p90_error'])}) over "
        f"{s['points']} configurations, {_pct(s['median_error_held_out'])} over the {s['held_out']} not calibrated "
        f"on; median error of the ratio to JAX default {_pct(s['median_ratio_error'])}; the old model's "
        f"median error {_pct(s['median_error_old_model'])}; Spearman "
        f"{'-' if pooled is None else f'{pooled:.2f}'} pooled, {'-' if within is None else f'{within:.2f}'} within "
        "a model (mean). Targets: median error <= 10%, Spearman >= 0.8."
    )


def print_gap(platform: str, result: dict) -> None:
    processes, devices = PLATFORMS[platform]
    print(f"\n## {platform}: where the step time goes ({processes} process(es) x {devices} device(s), ms)\n")
    print(
        "| model | step (wall) | null program | thunks per device | time in thunks | of it all-reduce "
        "| other thunks | span |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for g in result["gap"]:
        if g is None:
            continue
        print(
            f"| {g['model']} | {g['wall_us'] / 1e3:.2f} | {g['null_us'] / 1e3:.2f} | {g['thunks']:.0f} "
            f"| {g['thunk_time_us'] / 1e3:.2f} | {g['allreduce_us'] / 1e3:.2f} "
            f"| {(g['thunk_time_us'] - g['allreduce_us']) / 1e3:.2f} | {g['span_us'] / 1e3:.2f} |"
        )
    v = result["variadic"]
    print(
        f"\nOne all-reduce of {v['tensors']} tensors of {v['bytes_each']} bytes: {v['combined_us'] / 1e3:.2f} ms; "
        f"{v['tensors']} separate all-reduces: {v['separate_us'] / 1e3:.2f} ms."
    )


# --------------------------------------------------------------------------- driver


def run_platform(
    platform: str, models: list[str], pairs: int, budget_s: float, timeout_s: float, gap: bool = False
) -> list[dict]:
    from disco_jax import _launch

    processes, devices = PLATFORMS[platform]
    command = [sys.executable, os.path.abspath(__file__), "--in-job", "--models", *models]
    command += ["--pairs", str(pairs), "--budget", str(budget_s)]
    results: list[dict] = []

    def on_line(process_id: int, line: str) -> None:
        if line.startswith(RESULT_PREFIX):
            results.append(json.loads(line[len(RESULT_PREFIX) :]))
            print(f"[fidelity] {platform}: {results[-1].get('model', 'gap')} done", file=sys.stderr, flush=True)
        elif "[Gloo]" not in line:
            sys.stderr.write(f"[{platform} p{process_id}] {line}")

    started = time.perf_counter()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", **({GAP_ENV: "1"} if gap else {})}
    if processes == 1:  # one process: no distributed job, just the devices
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            on_line(0, line)
        if proc.wait(timeout=timeout_s):
            print(f"[fidelity] {platform}: the job failed (exit status {proc.returncode})", file=sys.stderr)
    else:
        result = _launch.launch(
            command, processes, devices_per_process=devices, timeout_s=timeout_s, on_line=on_line, env=env
        )
        if result.exit_code:
            print(f"[fidelity] {platform}: the job failed ({result.returncodes})", file=sys.stderr)
    print(f"[fidelity] {platform}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    parser.add_argument("--platforms", nargs="+", default=list(PLATFORMS), choices=list(PLATFORMS))
    parser.add_argument("--pairs", type=int, default=15, help="interleaved pairs per configuration")
    parser.add_argument("--budget", type=float, default=5.0, help="search budget per model, seconds")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per platform before it is stopped")
    parser.add_argument("--json", default=None, help="also write every result here")
    parser.add_argument("--gap", action="store_true", help="instead: where the step time goes (trace, null program)")
    parser.add_argument("--in-job", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.in_job:
        run_job(args.models, args.pairs, args.budget)
        return
    everything = {}
    for platform in args.platforms:
        everything[platform] = run_platform(platform, args.models, args.pairs, args.budget, args.timeout, args.gap)
    if args.gap:
        print("# Where the step time goes (zoo `tiny` configs, JAX default)")
        for platform, results in everything.items():
            if results:
                print_gap(platform, results[0])
        return
    print("# Simulator fidelity: simulated against measured step times (zoo `tiny` configs)")
    for platform, results in everything.items():
        if results:
            print_platform(platform, results)
    if args.json:
        summary = {p: {"results": r, "summary": summarize(r)} for p, r in everything.items() if r}
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
