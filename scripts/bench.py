"""Benchmark: JAX default vs disco-jax plan on the demo models, measured in one run.

For each model: run the search phase in this process (profiling, calibration, search,
validation), then time the unmodified step and the step with the plan in interleaved pairs and
print, per model:

* measured step time of JAX default and of the plan, and their ratio (median of per-pair ratios
  with its interquartile range: these machines are shared and noisy);
* simulated step time of both, and the simulator's error against the measurement;
* search time and candidates per second.

Usage (8 virtual CPU devices are set up here):

    python scripts/bench.py [--models mlp transformer] [--budget 30] [--pairs 40] [--json out.json]

The full evaluation (every baseline of DisCo section 6, measured on 8 CPU devices and simulated
on GPU clusters, written as a report folder) is `disco-jax bench`; the same from here:

    python scripts/bench.py --report [--out report] [any other `disco-jax bench` option]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import jax
import optax
from rich.console import Console
from rich.table import Table

from disco_jax import _validate, optimize_distributed, zoo
from disco_jax.eval import bench

NUM_DEVICES = 8


def use_cpu_devices(n: int) -> None:
    """`n` virtual CPU devices (JAX_PLATFORMS=cpu unless it is set); before JAX starts a backend."""
    if not os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n)


def bench_model(name: str, config: str, style: str, budget_s: float, pairs: int, plan_dir: str) -> dict:
    spec = zoo.get_model(name, config)
    step, state, batch = zoo.make_train_step(spec, optax.adam(1e-3), zoo.data_mesh(NUM_DEVICES), style)
    optimized = optimize_distributed(step, search=True, budget_s=budget_s, plan_dir=plan_dir, verbose=False)
    jax.block_until_ready(optimized(state, batch))
    report = optimized.last_report
    timing = _validate.time_interleaved(lambda: step(state, batch), lambda: optimized(state, batch), pairs=pairs)
    sim = report.simulated
    search = report.search
    return {
        "model": name,
        "config": config,
        "style": style,
        "applied": report.applied,
        "reason": report.reason,
        "measured_default_us": timing.default_us,
        "measured_plan_us": timing.plan_us,
        "ratio": timing.ratio,
        "ratio_iqr": [timing.ratio_low, timing.ratio_high],
        "simulated_default_us": sim["default"]["iteration_us"],
        "simulated_plan_us": sim["plan"]["iteration_us"] if report.applied else sim["default"]["iteration_us"],
        "search_s": search["seconds"],
        "candidates_per_second": search["candidates_per_second"],
        "evaluated": search["evaluated"],
        "calibration": search["cost_model"].get("calibration", {}),
        "allreduces": [
            report.default_counts["all-reduce"],
            (report.plan_counts or report.default_counts)["all-reduce"]
            if report.applied
            else report.default_counts["all-reduce"],
        ],
    }


def print_rows(rows: list[dict]) -> None:
    table = Table(title="disco-jax bench: 8 virtual CPU devices (times in ms per step)", title_justify="left")
    for col in (
        "model",
        "plan used",
        "JAX",
        "plan",
        "ratio [IQR]",
        "sim JAX",
        "sim plan",
        "sim err JAX",
        "sim err plan",
        "all-reduces",
        "search s",
        "cand/s",
    ):
        table.add_column(col, justify="left" if col in ("model", "plan used") else "right")
    for r in rows:
        err_d = (r["simulated_default_us"] - r["measured_default_us"]) / r["measured_default_us"]
        err_p = (r["simulated_plan_us"] - r["measured_plan_us"]) / r["measured_plan_us"]
        table.add_row(
            r["model"],
            "yes" if r["applied"] else "no (default)",
            f"{r['measured_default_us'] / 1e3:.2f}",
            f"{r['measured_plan_us'] / 1e3:.2f}",
            f"{r['ratio']:.3f} [{r['ratio_iqr'][0]:.3f}-{r['ratio_iqr'][1]:.3f}]",
            f"{r['simulated_default_us'] / 1e3:.2f}",
            f"{r['simulated_plan_us'] / 1e3:.2f}",
            f"{err_d:+.1%}",
            f"{err_p:+.1%}",
            f"{r['allreduces'][0]} -> {r['allreduces'][1]}",
            f"{r['search_s']:.1f}",
            f"{r['candidates_per_second']:.0f}",
        )
    Console(width=150).print(table)
    for r in rows:
        print(f"{r['model']}: {r['reason']}")


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--report" in argv:  # the full evaluation: disco_jax.eval.bench (disco-jax bench)
        report_parser = argparse.ArgumentParser(prog="scripts/bench.py --report")
        bench.add_arguments(report_parser)
        bench.main(report_parser.parse_args([a for a in argv if a != "--report"]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "transformer"])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--style", default="jit", choices=("jit", "shard_map"))
    parser.add_argument("--budget", type=float, default=30.0)
    parser.add_argument("--pairs", type=int, default=40)
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    use_cpu_devices(NUM_DEVICES)
    plan_dir = tempfile.mkdtemp(prefix="disco-jax-bench-")
    rows = []
    for name in args.models:
        print(f"[bench] {name}: search + validation + {args.pairs} timed pairs", file=sys.stderr, flush=True)
        rows.append(bench_model(name, args.config, args.style, args.budget, args.pairs, plan_dir))
    print_rows(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
