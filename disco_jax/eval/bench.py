"""`disco-jax bench`: DisCo's evaluation (section 6) rebuilt as one reproducible run.

For every zoo model and platform the benchmark produces one *row* (`disco_jax.eval.rows`): the
iteration time of each baseline (`disco_jax.eval.baselines`) and of disco-jax, the speed-up of
disco-jax over the best baseline, the full-overlap bound FO, the fraction of FO's headroom
disco-jax captured, and the search time. Platforms:

* ``cpu-8dev`` (measured): the model's ``tiny`` config on 8 virtual CPU devices of this machine
  (`measured.measured_row`);
* ``gloo-2x1`` (measured): the same on 2 processes x 1 CPU device, collectives over gloo on
  loopback: the worker runs as a 2-process job started by ``disco-jax launch``;
* each cluster of `disco_jax.eval.clusters.CLUSTERS` (simulated): the model's ``paper`` config,
  captured from shapes alone and costed by the cluster's models (`rows.simulated_row`).

FO = the smallest max(compute, comm) among the strategies of the row (all baselines and
disco-jax), so no strategy of the row is simulated faster than FO; on the measured platform it is
put on the measured time scale (times measured / simulated JAX_default).

Every row is a JSON file under ``<out>/rows/``; a run skips rows already there unless ``force``,
so a long run is resumable. Each model runs in its own worker (``python -m disco_jax.eval.bench
worker ...``: one process for the in-process platforms, a job of several for a multi-process
one; its log under ``<out>/logs/``, git-ignored); the report
(`disco_jax.eval.report`: ``README.md`` and PNG figures) is written from the rows at the end
(``--report-only`` rewrites it from the rows alone).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from disco_jax import initialize_from_env
from disco_jax._compile import Programs
from disco_jax._files import write_json_atomic
from disco_jax.eval import clusters
from disco_jax.eval.measured import measured_row
from disco_jax.eval.report import write_report
from disco_jax.eval.rows import (
    ALL_MODELS,
    KERNELS_PROFILED,
    MEASURED_PLATFORMS,
    PAPER_DEVICES,
    capture_paper_model,
    common_fields,
    default_platforms,
    log,
    num_devices,
    row_path,
    sharded_paper_program,
    simulated_row,
)

DEFAULT_MODELS = ALL_MODELS


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What one `disco-jax bench` run does.

    models, platforms: what to run (platforms: `rows.MEASURED_PLATFORMS` and names of
    `clusters.CLUSTERS`).
    style: data-parallel style of the steps. budget_s: search budget per simulated row.
    cpu_budget_s: search budget of `optimize_distributed` on the measured platforms. pairs:
    interleaved timing pairs per measured configuration. out: report folder. force: redo rows
    that exist (each kept until its new row replaces it). timeout_s: per model process."""

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


# --------------------------------------------------------------------------- one model's rows


def run_model(
    model: str,
    platforms: tuple[str, ...],
    *,
    style: str,
    budget_s: float,
    cpu_budget_s: float,
    pairs: int,
    out: str,
    force: bool,
    plan_dir: str,
    seed: int = 0,
) -> None:
    """Every missing row of one model, in this process (every process of the job runs it): the
    measured platforms' (the job must be the platform's, `rows.MEASURED_PLATFORMS`), then the
    simulated clusters' (process 0)."""
    todo = [p for p in platforms if force or not row_path(out, model, p, style).exists()]
    for platform in [p for p in todo if p in MEASURED_PLATFORMS]:
        job = (jax.process_count(), jax.local_device_count())
        if job != MEASURED_PLATFORMS[platform]:
            raise RuntimeError(
                f"{platform} is measured by a job of {MEASURED_PLATFORMS[platform][0]} process(es) x "
                f"{MEASURED_PLATFORMS[platform][1]} device(s); this one is {job[0]} x {job[1]}"
            )
        started = time.perf_counter()
        log(f"{model}: measured row on {platform} ({job[0]} process(es) x {job[1]} device(s))")
        row = measured_row(model, style, budget_s=cpu_budget_s, pairs=pairs, plan_dir=plan_dir)
        if row is None:  # not process 0
            continue
        fields = common_fields(
            model, platform, style, row.pop("graph_summary"), KERNELS_PROFILED, num_devices(platform)
        )
        row = {**fields, **row, "elapsed_s": time.perf_counter() - started}
        write_json_atomic(row_path(out, model, platform, style), row)
        log(f"{model}: {platform} done: disco-jax {row['speedup']:+.1%} vs {row['best_baseline']}")
    simulated = [p for p in todo if p not in MEASURED_PLATFORMS]
    if not simulated or jax.process_index() != 0:
        return
    captures: dict[str | None, tuple] = {}  # one capture per target (None: XLA:CPU)
    programs: dict[str, Programs] = {}  # one target's compiled programs serve each of its clusters
    for name in simulated:
        cluster = clusters.get_cluster(name)
        if cluster.target not in captures:
            on = cluster.target or "XLA:CPU"
            log(f"{model}: capturing the paper config ({on})")
            captures[cluster.target] = capture_paper_model(model, style, cluster.target)
            log(f"{model}: captured in {captures[cluster.target][1]['capture_s']:.1f} s")
            if cluster.target:
                programs[cluster.target] = Programs(captures[cluster.target][2], captures[cluster.target][0])
        program, info, lowered = captures[cluster.target]
        started = time.perf_counter()
        log(f"{model}: simulating {name} (search budget {budget_s:g} s)")
        last = [0.0]

        def progress(best, n, elapsed, name=name, last=last):
            if elapsed - last[0] >= 5.0:
                last[0] = elapsed
                log(f"{model}: {name}: search {elapsed:.0f}/{budget_s:g} s, {n} candidates, best {best / 1e3:.2f} ms")

        row = simulated_row(
            program,
            cluster,
            budget_s=budget_s,
            seed=seed,
            progress=progress,
            lowered=lowered if cluster.target else None,
            relower=functools.partial(sharded_paper_program, model, style, cluster.target, program.graph)
            if cluster.target
            else None,
            programs=programs.get(cluster.target),
            say=lambda line, name=name: log(f"{model}: {name}: options {line}"),
        )
        row = {
            **common_fields(
                model, name, style, program.graph.summary(), cluster.kernel_estimator().name, cluster.num_devices
            ),
            **info,
            **row,
            "elapsed_s": time.perf_counter() - started,
        }
        write_json_atomic(row_path(out, model, name, style), row)
        log(f"{model}: {name} done: disco-jax {row['speedup']:+.1%} vs {row['best_baseline']}")


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
    initialize_from_env()  # a multi-process platform's worker is one process of a job
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
        *(["--force"] if config.force else []),  # the old rows stay until replaced
    ]


def worker_env(profile_dir: str, devices: int) -> dict:
    """A worker's environment: `devices` virtual CPU devices (per process), and a profile
    database of its own (kernel times of 8 devices sharing the cores are not those of one)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(
        [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
        + [f"--xla_force_host_platform_device_count={devices}"]
    )
    env["JAX_PLATFORMS"] = "cpu"
    env["DISCO_JAX_PROFILE_DIR"] = profile_dir
    return env


def worker_jobs(model: str, platforms: list[str], config: BenchConfig, scratch: str) -> list[tuple[list[str], dict]]:
    """The worker runs (command, environment) for one model's missing platforms, one per job shape
    (processes x devices per process; the simulated clusters capture on `PAPER_DEVICES` devices in
    one process): a plain process, or a job started by ``disco-jax launch``."""
    shapes: dict[tuple[int, int], list[str]] = {}
    for p in platforms:
        shapes.setdefault(MEASURED_PLATFORMS.get(p, (1, PAPER_DEVICES)), []).append(p)
    jobs = []
    for (processes, devices), group in shapes.items():
        cmd = worker_command(model, group, config, os.path.join(scratch, "plans"))
        if processes > 1:
            launch = [sys.executable, "-m", "disco_jax.cli", "launch", "-n", str(processes)]
            cmd = launch + ["--devices-per-process", str(devices), "--timeout", str(config.timeout_s), "--", *cmd]
        jobs.append((cmd, worker_env(os.path.join(scratch, "profiles", f"{processes}x{devices}"), devices)))
    return jobs


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

    begun = math.floor(time.time())  # whole seconds: some file systems keep no finer mtime

    def written(model: str, platform: str) -> bool:
        # Under `force` an old row stays until its new one replaces it (atomically): a run stopped
        # early loses nothing, and only rows written by this run count as done.
        path = row_path(out, model, platform, config.style)
        return path.exists() and (not config.force or path.stat().st_mtime >= begun)

    def done() -> int:
        return sum(1 for m, p in rows if written(m, p))

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
            missing = [p for p in platforms if not written(model, p)]
            if not missing:
                continue
            log_path = out / "logs" / f"{model}.{config.style}.log"

            def progress(line: str, model: str = model) -> None:
                bar.update(task, completed=done(), description=f"{model}: {line}")

            for cmd, env in worker_jobs(model, missing, config, scratch):
                code = run_worker(cmd, env, log_path, config.timeout_s, progress)
                bar.update(task, completed=done(), description=f"{model}: finished")
                if code != 0:
                    failures.append((model, code, str(log_path)))
                    console.print(f"[red]{model}: worker exited with {code}; see {log_path}[/]")
    elapsed = time.perf_counter() - started
    readme = write_report(
        out,
        style=config.style,
        run_info={"elapsed_s": elapsed, "config": dataclasses.asdict(config), "failures": failures},
    )
    console.print(f"report: {readme} ({elapsed / 60:.1f} min)")
    return readme


def run_worker(cmd: list[str], env: dict, log_path: Path, timeout_s: float, progress) -> int:
    """Run one worker (its own process group, output appended to `log_path`), calling
    `progress(last log line)` every second; on timeout the whole group is killed (a launched job's
    children too). Returns its exit code (-9 when killed)."""
    with open(log_path, "a") as log_file:
        log_file.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n")
        log_file.flush()
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        started = time.perf_counter()
        try:
            while proc.poll() is None:
                progress(_last_line(log_path))
                if time.perf_counter() - started > timeout_s:
                    os.killpg(proc.pid, signal.SIGKILL)
                    break
                time.sleep(1.0)
        finally:
            if proc.poll() is None:  # interrupted: take the worker's group down with us
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


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
        help=f"{', '.join(MEASURED_PLATFORMS)} (measured) and cluster names (simulated); default: all",
    )
    parser.add_argument("--style", default="jit", choices=("jit", "shard_map"))
    parser.add_argument("--budget", type=float, default=20.0, help="search budget per simulated row, seconds")
    parser.add_argument("--cpu-budget", type=float, default=10.0, help="search budget on the measured platforms")
    parser.add_argument("--pairs", type=int, default=30, help="interleaved timing pairs per measured configuration")
    parser.add_argument("--out", default="report", help="report folder (rows/ inside make the run resumable)")
    parser.add_argument("--force", action="store_true", help="redo rows that exist")
    parser.add_argument("--report-only", action="store_true", help="only rewrite the report from existing rows")
    parser.add_argument("--timeout", type=float, default=3600.0, help="per model worker, seconds")


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
