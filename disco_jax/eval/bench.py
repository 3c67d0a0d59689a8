"""`disco-jax bench`: DisCo's evaluation (section 6) rebuilt as one reproducible run.

For every zoo model and platform the benchmark produces one *row* (`disco_jax.eval.rows`): the
iteration time of each baseline (`disco_jax.eval.baselines`) and of disco-jax, the speed-up of
disco-jax over the best baseline, the full-overlap bound FO, the fraction of FO's headroom
disco-jax captured, and the search time. Platforms:

* ``cpu-8dev`` (measured): the model's ``tiny`` config on 8 virtual CPU devices of this machine
  (`rows.measured_row`);
* each cluster of `disco_jax.eval.clusters.CLUSTERS` (simulated): the model's ``paper`` config,
  captured from shapes alone and costed by the cluster's models (`rows.simulated_row`).

FO = the smallest max(compute, comm) among the strategies of the row (all baselines and
disco-jax), so no strategy of the row is simulated faster than FO; on the measured platform it is
put on the measured time scale (times measured / simulated JAX_default).

Every row is a JSON file under ``<out>/rows/``; a run skips rows already there unless ``force``,
so a long run is resumable. Each model runs in its own process (``python -m
disco_jax.eval.bench worker ...``, its log under ``<out>/logs/``, git-ignored); the report
(`disco_jax.eval.report`: ``README.md`` and PNG figures) is written from the rows at the end
(``--report-only`` rewrites it from the rows alone).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from disco_jax.eval.report import write_report
from disco_jax.eval.rows import ALL_MODELS, CPU_PLATFORM, NUM_CPU_DEVICES, default_platforms, row_path, run_model

DEFAULT_MODELS = ALL_MODELS


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What one `disco-jax bench` run does.

    models, platforms: what to run (platforms: 'cpu-8dev' and names of `clusters.CLUSTERS`).
    style: data-parallel style of the steps. budget_s: search budget per simulated row.
    cpu_budget_s: search budget of `optimize_distributed` on the measured platform. pairs:
    interleaved timing pairs per measured configuration. out: report folder. force: redo rows
    that exist. timeout_s: per model process."""

    models: tuple[str, ...] = DEFAULT_MODELS
    platforms: tuple[str, ...] = ()
    style: str = "jit"
    budget_s: float = 20.0
    cpu_budget_s: float = 10.0
    pairs: int = 30
    out: str = "report"
    force: bool = False
    timeout_s: float = 3600.0
    seed: int = 0

    def resolved_platforms(self) -> tuple[str, ...]:
        return self.platforms or default_platforms()


# --------------------------------------------------------------------------- the worker


def worker_main(argv: list[str]) -> None:
    """``python -m disco_jax.eval.bench worker ...``: every missing row of one model."""
    p = argparse.ArgumentParser(prog="python -m disco_jax.eval.bench worker")
    p.add_argument("--model", required=True)
    p.add_argument("--platforms", nargs="+", required=True)
    p.add_argument("--style", default="jit")
    p.add_argument("--budget", type=float, default=20.0)
    p.add_argument("--cpu-budget", type=float, default=10.0)
    p.add_argument("--pairs", type=int, default=30)
    p.add_argument("--out", required=True)
    p.add_argument("--plan-dir", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true")
    a = p.parse_args(argv)
    run_model(
        a.model,
        tuple(a.platforms),
        style=a.style,
        budget_s=a.budget,
        cpu_budget_s=a.cpu_budget,
        pairs=a.pairs,
        out=a.out,
        force=a.force,
        plan_dir=a.plan_dir,
        seed=a.seed,
    )


def worker_command(model: str, platforms: list[str], config: BenchConfig, plan_dir: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "disco_jax.eval.bench",
        "worker",
        "--model",
        model,
        "--platforms",
        *platforms,
        "--style",
        config.style,
        "--budget",
        str(config.budget_s),
        "--cpu-budget",
        str(config.cpu_budget_s),
        "--pairs",
        str(config.pairs),
        "--out",
        str(config.out),
        "--plan-dir",
        plan_dir,
        "--seed",
        str(config.seed),
    ]


def worker_env(profile_dir: str) -> dict:
    """A worker's environment: 8 virtual CPU devices, and a profile database of the run's own."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(
        [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
        + [f"--xla_force_host_platform_device_count={NUM_CPU_DEVICES}"]
    )
    env["JAX_PLATFORMS"] = "cpu"
    env["DISCO_JAX_PROFILE_DIR"] = profile_dir
    return env


# --------------------------------------------------------------------------- the driver


def run(config: BenchConfig) -> Path:
    """Run every missing row (one process per model, progress shown), then write the report.
    Returns the report's README path."""
    out = Path(config.out)
    (out / "rows").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    ignore = out / ".gitignore"
    if not ignore.exists():  # worker logs hold machine paths: keep them out of the committed report
        ignore.write_text("logs/\n*.tmp\n")
    platforms = config.resolved_platforms()
    console = Console(stderr=True)
    rows = [(m, p) for m in config.models for p in platforms]

    def done() -> int:
        return sum(1 for m, p in rows if row_path(out, m, p, config.style).exists())

    if config.force:
        for m, p in rows:
            row_path(out, m, p, config.style).unlink(missing_ok=True)
    started = time.perf_counter()
    scratch = tempfile.mkdtemp(prefix="disco-jax-bench-")
    failures = []
    columns = [
        TextColumn("[bold cyan]disco-jax bench[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
    ]
    with Progress(*columns, console=console) as bar:
        task = bar.add_task("", total=len(rows), completed=done())
        for model in config.models:
            missing = [p for p in platforms if not row_path(out, model, p, config.style).exists()]
            if not missing:
                continue
            log_path = out / "logs" / f"{model}.{config.style}.log"
            cmd = worker_command(model, missing, config, os.path.join(scratch, "plans"))
            with open(log_path, "a") as log:
                log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n")
                log.flush()
                proc = subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, env=worker_env(os.path.join(scratch, "profiles"))
                )
                t0 = time.perf_counter()
                while proc.poll() is None:
                    bar.update(task, completed=done(), description=f"{model}: {_last_line(log_path)}")
                    if time.perf_counter() - t0 > config.timeout_s:
                        proc.kill()
                        break
                    time.sleep(1.0)
                proc.wait()
            bar.update(task, completed=done(), description=f"{model}: finished")
            if proc.returncode != 0:
                failures.append((model, proc.returncode, str(log_path)))
                console.print(f"[red]{model}: worker exited with {proc.returncode}; see {log_path}[/]")
    elapsed = time.perf_counter() - started
    readme = write_report(
        out,
        style=config.style,
        run_info={"elapsed_s": elapsed, "config": dataclasses.asdict(config), "failures": failures},
    )
    console.print(f"report: {readme} ({elapsed / 60:.1f} min)")
    return readme


def _last_line(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 2000))
            lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    text = lines[-1] if lines else ""
    if text.startswith("[bench"):
        text = text.split("] ", 1)[-1]
    return text[:90]


# --------------------------------------------------------------------------- the command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `disco-jax bench` (shared with scripts/bench.py --report)."""
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), help="zoo models (default: all)")
    parser.add_argument(
        "--platforms",
        nargs="+",
        default=None,
        help=f"'{CPU_PLATFORM}' (measured) and cluster names (simulated); default: all",
    )
    parser.add_argument("--style", default="jit", choices=("jit", "shard_map"))
    parser.add_argument("--budget", type=float, default=20.0, help="search budget per simulated row, seconds")
    parser.add_argument("--cpu-budget", type=float, default=10.0, help="search budget on the measured platform")
    parser.add_argument("--pairs", type=int, default=30, help="interleaved timing pairs per measured configuration")
    parser.add_argument("--out", default="report", help="report folder (rows/ inside make the run resumable)")
    parser.add_argument("--force", action="store_true", help="redo rows that exist")
    parser.add_argument("--report-only", action="store_true", help="only rewrite the report from existing rows")
    parser.add_argument("--timeout", type=float, default=3600.0, help="per model process, seconds")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        models=tuple(args.models),
        platforms=tuple(args.platforms or ()),
        style=args.style,
        budget_s=args.budget,
        cpu_budget_s=args.cpu_budget,
        pairs=args.pairs,
        out=args.out,
        force=args.force,
        timeout_s=args.timeout,
    )


def main(args: argparse.Namespace) -> None:
    """`disco-jax bench` with parsed arguments."""
    config = config_from_args(args)
    if args.report_only:
        path = write_report(config.out, style=config.style)
        print(f"report: {path}")
        return
    run(config)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker_main(sys.argv[2:])
    else:
        parser = argparse.ArgumentParser(prog="python -m disco_jax.eval.bench")
        add_arguments(parser)
        main(parser.parse_args())
