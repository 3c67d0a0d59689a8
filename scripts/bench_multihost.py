"""Benchmark over loopback gloo: JAX default vs disco-jax plan in a multi-process job.

Starts N processes x K CPU devices with the launcher (`disco_jax._launch`, what `disco-jax launch`
runs). In the job, for each zoo model: the search phase (every process profiles and validates
together, process 0 searches), then every process times the unmodified step and the step with
the plan in interleaved pairs. Process 0 prints per model:

* measured step time of JAX default and of the plan, their ratio (median of per-pair ratios,
  interquartile range); when the plan was rejected, the ratio validation measured for it;
* simulated step time of both, and the simulator's error against the measurement;
* the all-reduce fit measured over gloo (T = C * bytes + D), in this run: the job gets a profile
  directory of its own, the first model's search measures the fit and the next models take it
  (as a job's later searches do).

Usage:

    python scripts/bench_multihost.py [--models mlp transformer] [--processes 2]
        [--devices-per-process 1] [--budget 20] [--pairs 40] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile

import jax
import optax
from rich.console import Console
from rich.table import Table

from disco_jax import _launch, _validate, initialize_from_env, optimize_distributed, zoo
from disco_jax._profile_db import PROFILE_DIR_ENV

RESULT_PREFIX = "BENCH "


def bench_in_job(models: list[str], config: str, style: str, budget_s: float, pairs: int, plan_dir: str) -> None:
    """Run inside every process of the job; process 0 prints one RESULT_PREFIX line per model."""
    initialize_from_env()  # before anything starts a JAX backend
    for name in models:
        spec = zoo.get_model(name, config)
        step, state, batch = zoo.make_train_step(spec, optax.adam(1e-3), zoo.data_mesh(), style)
        optimized = optimize_distributed(step, search=True, budget_s=budget_s, plan_dir=plan_dir, verbose=False)
        jax.block_until_ready(optimized(state, batch))
        # Every process runs both executables in the same order (they are collectives).
        timing = _validate.time_interleaved(
            functools.partial(step, state, batch), functools.partial(optimized, state, batch), pairs=pairs
        )
        if jax.process_index() != 0:
            continue
        report = optimized.last_report
        sim, search, measured = report.simulated, report.search, report.measured or {}
        counts = report.default_counts["all-reduce"]
        row = {
            "model": name,
            "config": config,
            "style": style,
            "processes": jax.process_count(),
            "devices": jax.device_count(),
            "applied": report.applied,
            "reason": report.reason,
            "measured_default_us": timing.default_us,
            "measured_plan_us": timing.plan_us,
            "ratio": timing.ratio,
            "ratio_iqr": [timing.ratio_low, timing.ratio_high],
            "validation_ratio": measured.get("ratio"),
            "simulated_default_us": sim["default"]["iteration_us"],
            "simulated_plan_us": sim["plan"]["iteration_us"] if report.applied else sim["default"]["iteration_us"],
            "simulated_candidate_us": sim["plan"]["iteration_us"],
            "allreduce_fit": search["cost_model"]["allreduce"],
            "calibration": search["cost_model"].get("calibration", {}),
            "search_s": search["seconds"],
            "evaluated": search["evaluated"],
            "allreduces": [counts, report.plan_counts["all-reduce"] if report.applied else counts],
        }
        print(RESULT_PREFIX + json.dumps(row), flush=True)


def print_rows(rows: list[dict]) -> None:
    first = rows[0]
    table = Table(
        title=f"disco-jax bench: {first['processes']} processes, {first['devices']} CPU devices, "
        "gloo over loopback (times in ms per step)",
        title_justify="left",
    )
    for col in (
        "model",
        "plan used",
        "JAX",
        "plan",
        "ratio [IQR]",
        "validation ratio",
        "sim JAX",
        "sim plan",
        "sim err JAX",
        "sim err plan",
        "all-reduces",
        "gloo fit D us / C us/MB",
    ):
        table.add_column(col, justify="left" if col in ("model", "plan used") else "right")
    for r in rows:
        err_d = (r["simulated_default_us"] - r["measured_default_us"]) / r["measured_default_us"]
        err_p = (r["simulated_plan_us"] - r["measured_plan_us"]) / r["measured_plan_us"]
        fit = r["allreduce_fit"]
        table.add_row(
            r["model"],
            "yes" if r["applied"] else "no (default)",
            f"{r['measured_default_us'] / 1e3:.2f}",
            f"{r['measured_plan_us'] / 1e3:.2f}",
            f"{r['ratio']:.3f} [{r['ratio_iqr'][0]:.3f}-{r['ratio_iqr'][1]:.3f}]",
            "-" if r["validation_ratio"] is None else f"{r['validation_ratio']:.3f}",
            f"{r['simulated_default_us'] / 1e3:.2f}",
            f"{r['simulated_plan_us'] / 1e3:.2f}",
            f"{err_d:+.1%}",
            f"{err_p:+.1%}",
            f"{r['allreduces'][0]} -> {r['allreduces'][1]}",
            f"{fit['latency_us']:.0f} / {fit['per_byte_us'] * 1e6:.0f}",
        )
    Console(width=170).print(table)
    for r in rows:
        print(f"{r['model']}: {r['reason']} (simulated candidate {r['simulated_candidate_us'] / 1e3:.2f} ms)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "transformer"])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--style", default="jit", choices=("jit", "shard_map"))
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices-per-process", type=int, default=1)
    parser.add_argument("--budget", type=float, default=20.0)
    parser.add_argument("--pairs", type=int, default=40)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before the job is terminated")
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    parser.add_argument("--in-job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--plan-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.in_job:
        bench_in_job(args.models, args.config, args.style, args.budget, args.pairs, args.plan_dir)
        return
    plan_dir = tempfile.mkdtemp(prefix="disco-jax-bench-multihost-")
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--in-job",
        "--plan-dir",
        plan_dir,
        "--models",
        *args.models,
        "--config",
        args.config,
        "--style",
        args.style,
        "--budget",
        str(args.budget),
        "--pairs",
        str(args.pairs),
    ]
    rows = []

    def on_line(process_id: int, line: str) -> None:
        if line.startswith(RESULT_PREFIX):
            rows.append(json.loads(line[len(RESULT_PREFIX) :]))
            print(f"[bench] {rows[-1]['model']} done", file=sys.stderr, flush=True)
        elif "[Gloo]" not in line:
            sys.stderr.write(f"[p{process_id}] {line}")

    print(
        f"[bench] {args.processes} processes x {args.devices_per_process} devices: {' '.join(args.models)}",
        file=sys.stderr,
        flush=True,
    )
    result = _launch.launch(
        command,
        args.processes,
        devices_per_process=args.devices_per_process,
        timeout_s=args.timeout,
        on_line=on_line,
        env={**os.environ, PROFILE_DIR_ENV: os.path.join(plan_dir, "profiles")},
    )
    if rows:
        print_rows(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if result.exit_code:
        raise SystemExit(
            f"bench_multihost: the job failed (exit statuses {result.returncodes}, timed out: {result.timed_out})"
        )


if __name__ == "__main__":
    main()
