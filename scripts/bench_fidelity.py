"""Simulator fidelity: does the calibrated simulator predict what it picks?

For each zoo model (``tiny`` config) and platform, the script runs the search phase's profile and
calibrate (`disco_jax._profiling`), then measures and simulates four configurations of the step:

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

Platforms: ``cpu8``: 8 CPU devices in one process; ``gloo2``: 2 processes x 1 CPU device,
collectives over gloo on loopback (`disco_jax._launch`).

    python scripts/bench_fidelity.py [--models mlp transformer rnnlm dlrm] [--platforms cpu8 gloo2]
        [--pairs 15] [--budget 5] [--json out.json]
"""

from __future__ import annotations

import argparse
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


# --------------------------------------------------------------------------- in the job


def measure_model(name: str, pairs: int, budget_s: float) -> dict | None:
    """Calibrate, search, and measure and simulate every configuration of one model (in every
    process of the job; process 0 returns the row, the others None)."""
    import jax
    import optax

    from disco_jax import _distributed, _search, _strategy, _validate, backends, cost, zoo
    from disco_jax._compile import capture, compile_strategy, compiled_stats
    from disco_jax._console import Ui
    from disco_jax._profile_store import ProfileDatabase
    from disco_jax._profiling import calibrate, profile

    started = time.perf_counter()
    spec = zoo.get_model(name, "tiny")
    step, state, batch = zoo.make_train_step(spec, optax.adam(1e-3), zoo.data_mesh(), "jit")
    args = (state, batch)
    captured = capture(step.lower(*args), backends.CPU, args, {})
    graph = captured.graph
    quiet = Ui(verbose=False)
    default_runner = captured.runner(captured.default_compiled)
    cost_model = profile(captured, default_runner, ProfileDatabase(), quiet)
    calibration = calibrate(cost_model, captured, default_runner, pairs, quiet)
    default = _strategy.xla_default(graph)

    def simulated_us(s):
        r = cost_model.simulate(graph, s)
        return None if r is None else r.iteration_us

    best = default
    if jax.process_index() == 0:
        result = _search.backtracking_search(graph, simulated_us, _search.SearchConfig(budget_s=budget_s, seed=0))
        best = result.best
    if _distributed.is_multiprocess():
        found = _distributed.broadcast_json(_distributed.new_scope("fidelity") + "/strategy", best.to_json(graph))
        best = _strategy.Strategy.from_json(graph, found)
    per_gradient = _strategy.with_buckets(default, [(g.id,) for g in graph.gradients], "per-gradient")
    no_fusion_options = backends.CPU.baseline_options["JAX_no_fusion"]
    configurations = {
        "JAX default": (default, captured.default_compiled),
        "per-gradient AR": (per_gradient, compile_strategy(captured.lowered, graph, per_gradient)[0]),
        "no fusion": (_strategy.unfused(graph), captured.lowered.compile(compiler_options=dict(no_fusion_options))),
        "search plan": (best, compile_strategy(captured.lowered, graph, best)[0]),
    }
    timings = {}
    for label, (_, compiled) in configurations.items():
        runner = default_runner if label == "JAX default" else captured.runner(compiled)
        timings[label] = _validate.time_interleaved(default_runner, runner, pairs=pairs)
    if jax.process_index() != 0:
        return None
    default_us = float(np.median([t.default_us for t in timings.values()]))
    bare = cost_model.simulate(graph, default, params=cost.SimulatorParams())
    rows = []
    for label, (strategy, compiled) in configurations.items():
        t = timings[label]
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
                "allreduces": counts["all-reduce"],
                "multi_op_fusions": counts["multi_op_loop_fusions"],
                "kernels": len(strategy.groups) + len(graph.opaque_ops),
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


def run_job(models: list[str], pairs: int, budget_s: float) -> None:
    """The job's body: every process runs every model; process 0 prints one result line each."""
    from disco_jax import initialize_from_env

    initialize_from_env()  # before anything starts a JAX backend (does nothing in one process)
    for name in models:
        row = measure_model(name, pairs, budget_s)
        if row is not None:
            print(RESULT_PREFIX + json.dumps(row), flush=True)


# --------------------------------------------------------------------------- statistics


def spearman(x: list[float], y: list[float]) -> float | None:
    """Spearman's rank correlation (average ranks for ties); None for fewer than 3 pairs."""
    if len(x) < 3:
        return None

    def ranks(v):
        v = np.asarray(v, dtype=float)
        order = np.argsort(v, kind="stable")
        r = np.empty(len(v))
        r[order] = np.arange(len(v), dtype=float)
        for value in np.unique(v):  # ties share their mean rank
            tied = v == value
            r[tied] = r[tied].mean()
        return r

    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return None
    return float(np.corrcoef(rx, ry)[0, 1])


def summarize(results: list[dict]) -> dict:
    """Median relative error and Spearman correlations over every (model, configuration)."""
    measured, simulated, errors, within = [], [], [], []
    for r in results:
        pts = [(x["measured_us"], x["simulated_us"]) for x in r["rows"] if x["simulated_us"] is not None]
        measured += [m for m, _ in pts]
        simulated += [s for _, s in pts]
        errors += [abs(s - m) / m for m, s in pts]
        rho = spearman([m for m, _ in pts], [s for _, s in pts])
        if rho is not None:
            within.append(rho)
    return {
        "points": len(errors),
        "median_error": float(np.median(errors)) if errors else None,
        "p90_error": float(np.percentile(errors, 90)) if errors else None,
        "spearman_pooled": spearman(measured, simulated),
        "spearman_within_model_mean": float(np.mean(within)) if within else None,
    }


# --------------------------------------------------------------------------- printing


def print_platform(platform: str, results: list[dict]) -> None:
    processes, devices = PLATFORMS[platform]
    print(f"\n## {platform}: {processes} process(es) x {devices} CPU device(s), times in ms per step\n")
    print("| model | configuration | measured [IQR] | simulated | error | AR | fusions |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in results:
        for x in r["rows"]:
            sim = x["simulated_us"]
            err = "-" if sim is None else f"{(sim - x['measured_us']) / x['measured_us']:+.1%}"
            low, high = x["measured_iqr_us"]
            print(
                f"| {r['model']} | {x['config']} | {x['measured_us'] / 1e3:.2f} [{low / 1e3:.2f}-{high / 1e3:.2f}] "
                f"| {'-' if sim is None else f'{sim / 1e3:.2f}'} | {err} | {x['allreduces']} "
                f"| {x['multi_op_fusions']} |"
            )
    print("\nCalibration per model (fitted on the pipeline's calibration configurations):\n")
    for r in results:
        c, fit = r["calibration"], r["allreduce"]
        print(
            f"- {r['model']}: compute x{c['compute_scale']:.2f}, {c['kernel_overhead_us']:.1f} us/kernel, "
            f"{c['step_overhead_us']:.0f} us/step, blocking {c['comm_blocking']:.0%}; misfit {c['misfit']:.1%} "
            f"over {len(c['points'])} points; traced kernels {r['traced_kernel_sum_us'] / 1e3:.2f} ms per device; "
            f"all-reduce D {fit['latency_us']:.0f} us, C {fit['per_byte_us'] * 1e6:.0f} us/MB; {r['elapsed_s']:.0f} s"
        )
    s = summarize(results)
    pooled, within = s["spearman_pooled"], s["spearman_within_model_mean"]
    print(
        f"\n{platform}: median error {s['median_error']:.1%} (90th percentile {s['p90_error']:.1%}) over "
        f"{s['points']} configurations; Spearman {'-' if pooled is None else f'{pooled:.2f}'} pooled, "
        f"{'-' if within is None else f'{within:.2f}'} within a model (mean). Targets: median error <= 10%, "
        "Spearman >= 0.8."
    )


# --------------------------------------------------------------------------- driver


def run_platform(platform: str, models: list[str], pairs: int, budget_s: float, timeout_s: float) -> list[dict]:
    from disco_jax import _launch

    processes, devices = PLATFORMS[platform]
    command = [sys.executable, os.path.abspath(__file__), "--in-job", "--models", *models]
    command += ["--pairs", str(pairs), "--budget", str(budget_s)]
    results: list[dict] = []

    def on_line(process_id: int, line: str) -> None:
        if line.startswith(RESULT_PREFIX):
            results.append(json.loads(line[len(RESULT_PREFIX) :]))
            print(f"[fidelity] {platform}: {results[-1]['model']} done", file=sys.stderr, flush=True)
        elif "[Gloo]" not in line:
            sys.stderr.write(f"[{platform} p{process_id}] {line}")

    started = time.perf_counter()
    if processes == 1:  # one process: no distributed job, just the devices
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            on_line(0, line)
        if proc.wait(timeout=timeout_s):
            print(f"[fidelity] {platform}: the job failed (exit status {proc.returncode})", file=sys.stderr)
    else:
        result = _launch.launch(command, processes, devices_per_process=devices, timeout_s=timeout_s, on_line=on_line)
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
    parser.add_argument("--in-job", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.in_job:
        run_job(args.models, args.pairs, args.budget)
        return
    everything = {}
    for platform in args.platforms:
        everything[platform] = run_platform(platform, args.models, args.pairs, args.budget, args.timeout)
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
