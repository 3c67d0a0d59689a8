"""`disco-jax demo`: a Flax Transformer and an MLP, data-parallel on 8 virtual CPU devices.

For each model the demo runs two fresh processes, as a user would: the search phase
(`optimize_distributed(search=True)`, what `ENABLE_SEARCH=1` does) and the enactment phase
(`search=False`), and prints JAX's default next to the plan: simulated and measured step time,
all-reduces and fusions in the compiled HLO, and whether the optimized step's outputs equal the
unmodified step's.

Each phase is `python -m disco_jax._demo worker --phase search|enact ...`, which writes one JSON
result file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEMO_MODELS = ("mlp", "transformer")
PHASES = ("search", "enact")
NUM_DEVICES = 8


def worker(model: str, phase: str, config: str, style: str, out: Path, budget_s: float, plan_dir: str) -> None:
    """One phase ('search' or 'enact') in this (fresh) process."""
    import jax
    import optax

    from disco_jax import _validate, optimize_distributed, zoo
    from disco_jax._output_check import OutputCheck

    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    spec = zoo.get_model(model, config)
    step, state, batch = zoo.make_train_step(spec, optax.adam(1e-3), zoo.data_mesh(NUM_DEVICES), style)
    check = OutputCheck.for_call(step, (state, batch))
    check.default()  # the unmodified step's outputs, before the decorated step runs
    optimized = optimize_distributed(
        step, search=phase == "search", budget_s=budget_s, plan_dir=plan_dir, validation_pairs=16
    )
    started = time.perf_counter()
    result = jax.block_until_ready(optimized(state, batch))
    first_call_s = time.perf_counter() - started
    report = optimized.last_report
    plan = report.plan or {}
    comparison = check.compare(result, rerun=lambda args, kwargs: optimized(*args, **kwargs))
    # Timed as training runs: each step's state fed back into it. A plan that shards the optimizer
    # state returns it sharded; fed the replicated state on every call instead, the decorated step
    # would reshard the whole state each time, which no training loop does.
    states = {"jax": state, "plan": state}

    def train(name, fn):
        def one_step():
            states[name], loss = fn(states[name], batch)
            return loss

        return one_step

    timing = _validate.time_interleaved(train("jax", step), train("plan", optimized), pairs=20)
    out.write_text(
        json.dumps(
            {
                "model": model,
                "config": config,
                "style": style,
                "phase": report.phase,
                "search_ran": report.search_ran,
                "applied": report.applied,
                "reason": (report.reason or ""),
                "first_call_s": first_call_s,
                "plan_path": report.plan_path,
                "default_counts": report.default_counts,
                "plan_counts": (report.plan_counts or report.default_counts)
                if report.applied
                else report.default_counts,
                "simulated": plan.get("simulated", {}),
                **ran(report, plan),
                "search": {k: plan.get("search", {}).get(k) for k in ("seconds", "evaluated", "candidates_per_second")},
                "measured_default_us": timing.default_us,
                "measured_plan_us": timing.plan_us,
                "measured_ratio": timing.ratio,
                "outputs_bitwise_equal": comparison.bitwise_equal,
                "outputs_within_tolerance": comparison.within_tolerance,
                "outputs_check": comparison.check,
                "max_abs_error": comparison.max_abs_error,
            }
        )
    )


def ran(report, plan: dict) -> dict:
    """What the decorated step runs, named: the weight update (replicated, or the optimizer state
    sharded over the data axis), whether a fusion/bucket plan of that program was applied, and
    the simulated step of XLA's replicated program and of the program that ran, by the same
    calibrated simulator (`sim_jax_us` from the weight-update choice's record of the replicated
    candidate where it made one, else the plan's XLA program, which is then the replicated one)."""
    update = report.weight_update or {}
    mode = update.get("mode", "replicated")
    simulated = plan.get("simulated") or {}
    candidates = update.get("candidates") or []
    replicated = candidates[0].get("simulated_us") if candidates else None
    program_default = (simulated.get("default") or {}).get("iteration_us")
    program_plan = (simulated.get("plan") or {}).get("iteration_us")
    return {
        "weight_update": mode,
        "weight_update_reason": update.get("reason"),
        "fusion_plan_applied": bool(report.applied),
        "sim_jax_us": replicated if replicated is not None else (program_default if mode == "replicated" else None),
        "sim_ran_us": program_plan if report.applied else program_default,
    }


# What the demo's CPU figures say about GPUs (README "Limits", docs/sharded-update.md).
GPU_NOTE = (
    "On a GPU: the 8 CPU devices here share 2 cores, so a sharded weight update's measured gain is "
    "partly the cores' and does not carry over; XLA:GPU all-reduces one flat buffer already. For a "
    "GPU figure, plan offline for the target (disco_jax.offline.plan_for_target) and read its "
    "compiled-program cost."
)


def run_phase(
    model: str, phase: str, *, config: str, style: str, budget_s: float, plan_dir: str, timeout_s: float = 1800
) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(
        [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
        + [f"--xla_force_host_platform_device_count={NUM_DEVICES}"]
    )
    env["JAX_PLATFORMS"] = "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            sys.executable,
            "-m",
            "disco_jax._demo",
            "worker",
            "--model",
            model,
            "--phase",
            phase,
            "--config",
            config,
            "--style",
            style,
            "--out",
            str(out),
            "--budget",
            str(budget_s),
            "--plan-dir",
            plan_dir,
        ]
        proc = subprocess.run(cmd, env=env, timeout=timeout_s)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"demo {phase} phase of {model} failed (exit code {proc.returncode})")
        return json.loads(out.read_text())


def print_table(results: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="disco-jax demo: 8 virtual CPU devices, data parallel (ms per step)", title_justify="left")
    left = ("model", "phase", "weight update", "fusion/bucket plan")
    for col in (
        "model",
        "phase",
        "searched",
        "weight update",
        "fusion/bucket plan",
        "sim JAX",
        "sim ran",
        "JAX",
        "ran",
        "ratio",
        "all-reduces",
        "fusions",
        "outputs vs JAX",
    ):
        table.add_column(col, justify="left" if col in left else "right")
    for r in results:
        sim_d = "-" if r.get("sim_jax_us") is None else f"{r['sim_jax_us'] / 1e3:.2f}"
        sim_p = "-" if r.get("sim_ran_us") is None else f"{r['sim_ran_us'] / 1e3:.2f}"
        equal = (
            "bitwise"
            if r["outputs_bitwise_equal"]
            else (f"tol ({r['max_abs_error']:.0e})" if r["outputs_within_tolerance"] else "NO")
        )
        table.add_row(
            r["model"],
            r["phase"],
            "yes" if r["search_ran"] else "no",
            r.get("weight_update", "replicated"),
            "applied" if r.get("fusion_plan_applied") else "XLA's kept",
            sim_d,
            sim_p,
            f"{r['measured_default_us'] / 1e3:.2f}",
            f"{r['measured_plan_us'] / 1e3:.2f}",
            f"{r['measured_ratio']:.3f}",
            f"{r['default_counts']['all-reduce']} -> {r['plan_counts']['all-reduce']}",
            f"{r['default_counts']['fusion']} -> {r['plan_counts']['fusion']}",
            equal,
        )
    console = Console(width=max(Console().width, 180))
    console.print(table)
    for r in results:
        if r["phase"] == "enact":
            update = r.get("weight_update", "replicated")
            plan = "fusion/bucket plan applied" if r["applied"] else "XLA's fusions and buckets kept"
            why = f" ({r['weight_update_reason']})" if update == "sharded" and r.get("weight_update_reason") else ""
            console.print(f"{r['model']}: weight update {update}{why}; {plan} — {r['reason']}")
    console.print(GPU_NOTE)


def demo(
    models=DEMO_MODELS, *, config: str = "tiny", style: str = "jit", budget_s: float = 20.0, plan_dir: str | None = None
) -> list[dict]:
    plan_dir = plan_dir or tempfile.mkdtemp(prefix="disco-jax-demo-plans-")
    results = []
    for model in models:
        for phase in PHASES:
            print(f"[demo] {model}: {phase} phase (fresh process)", flush=True)
            results.append(run_phase(model, phase, config=config, style=style, budget_s=budget_s, plan_dir=plan_dir))
    print_table(results)
    print(f"plans in {plan_dir}; look at one with: disco-jax inspect {plan_dir}/<plan>.json")
    bad = [r for r in results if r["phase"] == "enact" and (r["search_ran"] or not r["outputs_within_tolerance"])]
    if bad:
        raise SystemExit(
            f"demo check failed for {[r['model'] for r in bad]}: the enactment phase must not "
            "search and its outputs must equal the unmodified step's"
        )
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m disco_jax._demo")
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("worker")
    w.add_argument("--model", required=True)
    w.add_argument("--phase", required=True, choices=PHASES)
    w.add_argument("--config", default="tiny")
    w.add_argument("--style", default="jit")
    w.add_argument("--out", required=True, type=Path)
    w.add_argument("--budget", type=float, default=20.0)
    w.add_argument("--plan-dir", required=True)
    args = parser.parse_args(argv)
    worker(args.model, args.phase, args.config, args.style, args.out, args.budget, args.plan_dir)


if __name__ == "__main__":
    main()
