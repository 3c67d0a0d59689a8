"""`disco-jax bench`: DisCo's evaluation (section 6) rebuilt as one reproducible run.

For every zoo model and platform the benchmark produces one *row*: the iteration time of each
baseline (`disco_jax.eval.baselines`) and of disco-jax, the speed-up of disco-jax over the best
baseline, the full-overlap bound FO, the fraction of FO's headroom disco-jax captured, and the
search time. Platforms:

* ``cpu-8dev`` (measured): the model's ``tiny`` config on 8 virtual CPU devices of this machine.
  Each baseline is compiled (XLA compile options, or our rewrite for DDP / Horovod), checked on
  its compiled HLO and its outputs, and timed in interleaved pairs against JAX_default;
  disco-jax is `optimize_distributed` in its search phase (profiling, calibration, search,
  validation), timed the same way. Every configuration is also simulated with the calibrated
  simulator of the search phase (kernels: profiled), which gives the simulated-vs-measured
  table (DisCo's Table 2).
* each cluster of `disco_jax.eval.clusters.CLUSTERS` (simulated): the model's ``paper`` config,
  captured from shapes alone (`zoo.lower_abstract`, compiled for 8 CPU devices, never run), its
  kernels costed by the GPU-scaled analytical model (kernels: analytical-scaled), all-reduces by
  the cluster's ring / hierarchical model; disco-jax is the backtracking search on that simulator,
  started from XLA's plan, the unfused graph and every baseline.

Definitions (DisCo section 6.2): speed-up = (T_best_baseline - T_disco) / T_disco. FO = the
smallest max(compute, comm) among the strategies of the row (all baselines and disco-jax), so
no strategy of the row is simulated faster than FO; on the measured platform it is put on the
measured time scale (times measured / simulated JAX_default). Headroom captured = (T_best_baseline - T_disco) /
(T_best_baseline - FO); n/a when the best baseline is already within 0.1% of FO.

Every row is a JSON file under ``<out>/rows/``; a run skips rows already there unless
``force``, so a long run is resumable. Each model runs in its own process (its log under
``<out>/logs/``, git-ignored); the report (``README.md`` and PNG figures) is written from the rows
at the end (``--report-only`` rewrites it from the rows alone).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CPU_PLATFORM = "cpu-8dev"
NUM_CPU_DEVICES = 8
ROW_FORMAT = 1
ALL_MODELS = ("vgg19", "resnet50", "transformer", "rnnlm", "bert", "reformer", "mlp", "dlrm")
DEFAULT_MODELS = ALL_MODELS
DISCO = "disco-jax"
BASELINE_ORDER = ("JAX_no_fusion", "JAX_op_fusion", "JAX_AllReduce_fusion", "JAX_default", "PyTorch_DDP", "Horovod")
KERNELS_PROFILED = "profiled (CPU trace) + calibrated"
KERNELS_ANALYTICAL = "analytical-scaled"


def default_platforms() -> tuple[str, ...]:
    from disco_jax import backends, _compile
    from disco_jax.eval import clusters as _clusters
    return (CPU_PLATFORM, *_clusters.CLUSTERS)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What one `disco-jax bench` run does.

    models, platforms: what to run (platforms: 'cpu-8dev' and names of `_clusters.CLUSTERS`).
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


def row_path(out: str | os.PathLike, model: str, platform: str, style: str) -> Path:
    config = "tiny" if platform == CPU_PLATFORM else "paper"
    return Path(out) / "rows" / f"{model}.{config}.{style}.{platform}.json"


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- row summary


def summarize(times_us: dict[str, float], fo_us: float) -> dict:
    """Best baseline, speed-up of disco-jax over it, and the FO headroom it captured."""
    baselines = {k: v for k, v in times_us.items() if k != DISCO and v is not None}
    best = min(baselines, key=baselines.get)
    t_best, t_disco = baselines[best], times_us[DISCO]
    headroom = t_best - fo_us
    return {
        "best_baseline": best, "best_baseline_us": t_best, "disco_us": t_disco,
        "speedup": (t_best - t_disco) / t_disco,
        "fo_us": fo_us, "fo_speedup": (t_best - fo_us) / fo_us if fo_us > 0 else None,
        "headroom_captured": (t_best - t_disco) / headroom if headroom > 1e-3 * t_best else None,
    }


# --------------------------------------------------------------------------- simulated rows


def _sim_json(step) -> dict | None:
    return None if step is None else step.to_json()


def simulated_row(graph, cluster, *, budget_s: float, seed: int = 0, progress=None) -> dict:
    """One cluster row for a captured graph: baselines simulated, disco-jax searched."""
    from disco_jax import _cost, _search, _strategy
    from disco_jax.eval import baselines as _baselines

    estimator = _cost.ChainEstimator([cluster.kernel_estimator()])
    allreduce = cluster.allreduce_model()

    def simulate(s):
        return _cost.simulate(graph, s, estimator, allreduce)

    baselines = _baselines.all_baselines(graph, "gpu", kernel_time_us=lambda ks: estimator.estimate(graph, ks))
    strategies: dict[str, dict] = {}
    for b in baselines:
        sim = simulate(b.strategy)
        strategies[b.name] = {"simulated": _sim_json(sim), "description": b.description,
                              "buckets": len(b.strategy.buckets), "valid": sim is not None}

    def cost(s):
        r = simulate(s)
        return None if r is None else r.iteration_us

    starts, seen = [], set()
    for s in _strategy.start_candidates(graph) + [b.strategy for b in baselines]:
        if s.key() not in seen:
            seen.add(s.key())
            starts.append(s)
    config = _search.SearchConfig(budget_s=budget_s, seed=seed)
    result = _search.backtracking_search(graph, cost, config, starts=starts, progress=progress)
    best = simulate(result.best)
    strategies[DISCO] = {"simulated": best.to_json(), "description": f"search from {result.best.origin}",
                         "buckets": len(result.best.buckets), "valid": True}
    times = {k: (v["simulated"] or {}).get("iteration_us") for k, v in strategies.items()}
    fo = min(v["simulated"]["full_overlap_us"] for v in strategies.values() if v["simulated"])
    return {"strategies": strategies, "time_us": times, "time_kind": "simulated", **summarize(times, fo),
            "search": result.stats(), "search_s": result.seconds, "allreduce": cluster.allreduce_model().to_json(),
            "cluster": cluster.to_json(), "estimator": cluster.kernel_estimator().to_json()}


def capture_paper_model(name: str, style: str):
    """The paper-size step of a zoo model, captured at the hook without running it."""
    import optax

    from disco_jax import _capture, _graph, zoo

    spec = zoo.get_model(name, "paper")
    started = time.perf_counter()
    lowered = zoo.lower_abstract(spec, optax.adam(1e-3), zoo.data_mesh(NUM_CPU_DEVICES), style)
    text, _ = _capture.capture(lowered)
    graph = _graph.build_graph(text, backends.CPU)
    return graph, {"capture_s": time.perf_counter() - started, "parameters": spec.param_count(),
                   "global_batch": spec.default_global_batch,
                   "per_device_batch": spec.default_global_batch // NUM_CPU_DEVICES,
                   "description": spec.description}


# --------------------------------------------------------------------------- measured rows


def measured_row(name: str, style: str, *, budget_s: float, pairs: int, plan_dir: str) -> dict:
    """The measured CPU row of a tiny zoo model: every baseline compiled, checked, timed against
    JAX_default and simulated; disco-jax by `optimize_distributed`'s search phase."""
    import jax
    import optax

    from disco_jax import _api, _capture, _graph, _profile, _strategy, _validate, optimize_distributed, zoo
    from disco_jax.eval import baselines as _baselines

    spec = zoo.get_model(name, "tiny")
    step, state, batch = zoo.make_train_step(spec, optax.adam(1e-3), zoo.data_mesh(NUM_CPU_DEVICES), style)
    args = (state, batch)
    started = time.perf_counter()
    lowered = step.lower(*args)
    text, default_compiled = _capture.capture(lowered)
    graph = _graph.build_graph(text, backends.CPU)
    capture_s = time.perf_counter() - started
    devices = _compile.step_devices(args, {})
    options = _api.Options(budget_s=budget_s, verbose=False, validation_pairs=max(8, pairs // 2))
    default_runner = _compile.Runner(default_compiled, lowered, args, {})
    _log(f"{name}: profiling and calibrating the simulator")
    cost_model = _api.profile_step(graph, default_runner, _capture.module_name(lowered), devices,
                                   _profile.ProfileDatabase(), options)
    calibration = _api.calibrate_simulator(cost_model, graph, lowered, default_runner, args, {}, options)
    scale = cost_model.params.compute_scale
    baselines = _baselines.all_baselines(
        graph, "cpu", kernel_time_us=lambda ks: [t * scale for t in cost_model.estimator.estimate(graph, ks)])
    reference = default_runner()
    floor = _validate.sensitivity(reference, step(*_validate.nudge(args)))
    default_counts = _compile.compiled_stats(default_compiled.as_text())
    strategies: dict[str, dict] = {}
    default_samples: list[float] = []
    for b in baselines:
        _log(f"{name}: {b.name} ({b.enacted_by})")
        if b.compiler_options is None:
            compiled, status = _compile.compile_strategy(lowered, graph, b.strategy)
        elif not b.compiler_options:
            compiled, status = default_compiled, "default"
        else:
            compiled, status = lowered.compile(compiler_options=b.compiler_options), "compile options"
        runner = _compile.Runner(compiled, lowered, args, {})
        counts = _compile.compiled_stats(compiled.as_text())
        # Bitwise equality is recorded; the check is the tolerance of `_validate` (fusion changes,
        # and our rewrite of some modules, move float results by a few ulps).
        comparison = _validate.compare_outputs(reference, runner(), bitwise=False, floor=floor)
        timing = _validate.time_interleaved(default_runner, runner, pairs=pairs)
        default_samples.append(timing.default_us)
        sim = cost_model.simulate(graph, b.strategy)
        strategies[b.name] = {
            "simulated": _sim_json(sim), "description": b.description, "enacted_by": b.enacted_by,
            "compiler_options": b.compiler_options, "compile_status": status, "hlo": counts,
            "buckets": len(b.strategy.buckets), "valid": sim is not None,
            "measured": {"us": timing.plan_us, "default_us": timing.default_us, "ratio": timing.ratio,
                         "ratio_iqr": [timing.ratio_low, timing.ratio_high], "pairs": timing.pairs},
            "outputs": {"bitwise_equal": comparison.bitwise_equal, "within_tolerance": comparison.within_tolerance,
                        "max_abs_error": comparison.max_abs_error},
        }
    # disco-jax: the product's search phase, as a user runs it.
    _log(f"{name}: disco-jax search phase (budget {budget_s:g} s)")
    previous = os.environ.get("ENABLE_SEARCH")
    os.environ["ENABLE_SEARCH"] = "1"
    try:
        optimized = optimize_distributed(budget_s=budget_s, plan_dir=plan_dir, verbose=False,
                                         validation_pairs=options.validation_pairs)(step)
        out = jax.block_until_ready(optimized(*args))
    finally:
        if previous is None:
            os.environ.pop("ENABLE_SEARCH", None)
        else:
            os.environ["ENABLE_SEARCH"] = previous
    report = optimized.last_report
    plan = report.plan or {}
    applied = bool(report.applied)
    enacted = optimized.executable(*args)
    disco_hlo = (_compile.compiled_stats(enacted.as_text()) if applied and hasattr(enacted, "as_text")
                 else default_counts)
    if applied:
        strategy = _strategy.Strategy.from_json(graph, plan["strategy"])
    else:
        strategy = _baselines.jax_default(graph).strategy
    comparison = _validate.compare_outputs(reference, out, bitwise=False, floor=floor)
    timing = _validate.time_interleaved(default_runner, lambda: optimized(*args), pairs=pairs)
    default_samples.append(timing.default_us)
    sim = cost_model.simulate(graph, strategy)
    search = report.search or {}
    strategies[DISCO] = {
        "simulated": _sim_json(sim), "description": ("plan applied" if applied else "XLA default kept") +
        f": {report.reason or ''}", "enacted_by": "optimize_distributed", "applied": applied,
        "hlo": disco_hlo,
        "buckets": len(strategy.buckets), "valid": sim is not None,
        "simulated_by_search": (report.simulated or {}).get("plan"),
        "measured": {"us": timing.plan_us, "default_us": timing.default_us, "ratio": timing.ratio,
                     "ratio_iqr": [timing.ratio_low, timing.ratio_high], "pairs": timing.pairs},
        "outputs": {"bitwise_equal": comparison.bitwise_equal, "within_tolerance": comparison.within_tolerance,
                    "max_abs_error": comparison.max_abs_error},
    }
    # One time scale for the row: each configuration's median ratio to JAX_default times the
    # median JAX_default time over all pairings (ratios of interleaved pairs are what is robust).
    default_us = sorted(default_samples)[len(default_samples) // 2]
    times = {k: v["measured"]["ratio"] * default_us if k != "JAX_default" else default_us
             for k, v in strategies.items()}
    # FO on the measured time scale: the simulated bound times measured / simulated JAX_default.
    fo_simulated = min(v["simulated"]["full_overlap_us"] for v in strategies.values() if v["simulated"])
    fo = fo_simulated * default_us / strategies["JAX_default"]["simulated"]["iteration_us"]
    return {"strategies": strategies, "time_us": times, "time_kind": "measured", **summarize(times, fo),
            "fo_simulated_us": fo_simulated,
            "search": {k: search.get(k) for k in ("evaluated", "invalid", "improvements", "seconds",
                                                   "stop_reason", "candidates_per_second")},
            "search_s": search.get("seconds"), "calibration": calibration, "default_hlo": default_counts,
            "allreduce": cost_model.allreduce.to_json(), "capture_s": capture_s,
            "parameters": spec.param_count(), "global_batch": spec.default_global_batch,
            "description": spec.description, "graph_summary": graph.summary()}


# --------------------------------------------------------------------------- the worker


def _common_fields(model: str, platform: str, style: str, graph_summary: dict, kernels: str, num_devices: int) -> dict:
    import jax
    return {"format": ROW_FORMAT, "model": model, "config": "tiny" if platform == CPU_PLATFORM else "paper",
            "style": style, "platform": platform, "num_devices": num_devices, "kernels": kernels,
            "graph": graph_summary, "jax_version": jax.__version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S")}


def run_model(model: str, platforms: tuple[str, ...], *, style: str, budget_s: float, cpu_budget_s: float,
              pairs: int, out: str, force: bool, plan_dir: str, seed: int = 0) -> None:
    """Every missing row of one model (in this process)."""
    from disco_jax.eval import clusters as _clusters

    todo = [p for p in platforms if force or not row_path(out, model, p, style).exists()]
    if CPU_PLATFORM in todo:
        started = time.perf_counter()
        _log(f"{model}: measured row on {NUM_CPU_DEVICES} CPU devices")
        row = measured_row(model, style, budget_s=cpu_budget_s, pairs=pairs, plan_dir=plan_dir)
        row = {**_common_fields(model, CPU_PLATFORM, style, row.pop("graph_summary"), KERNELS_PROFILED,
                                NUM_CPU_DEVICES), **row, "elapsed_s": time.perf_counter() - started}
        _write_json(row_path(out, model, CPU_PLATFORM, style), row)
        _log(f"{model}: {CPU_PLATFORM} done: disco-jax {row['speedup']:+.1%} vs {row['best_baseline']}")
    clusters = [p for p in todo if p != CPU_PLATFORM]
    if not clusters:
        return
    _log(f"{model}: capturing the paper config")
    graph, info = capture_paper_model(model, style)
    _log(f"{model}: captured in {info['capture_s']:.1f} s: {graph.summary()}")
    for name in clusters:
        cluster = _clusters.get_cluster(name)
        started = time.perf_counter()
        _log(f"{model}: simulating {name} (search budget {budget_s:g} s)")
        last = [0.0]

        def progress(best, n, elapsed):
            if elapsed - last[0] >= 5.0:
                last[0] = elapsed
                _log(f"{model}: {name}: search {elapsed:.0f}/{budget_s:g} s, {n} candidates, best {best / 1e3:.2f} ms")

        row = simulated_row(graph, cluster, budget_s=budget_s, seed=seed, progress=progress)
        row = {**_common_fields(model, name, style, graph.summary(), KERNELS_ANALYTICAL, cluster.num_devices),
               **info, **row, "elapsed_s": time.perf_counter() - started}
        _write_json(row_path(out, model, name, style), row)
        _log(f"{model}: {name} done: disco-jax {row['speedup']:+.1%} vs {row['best_baseline']}")


def _worker_main(argv: list[str]) -> None:
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
    run_model(a.model, tuple(a.platforms), style=a.style, budget_s=a.budget, cpu_budget_s=a.cpu_budget,
              pairs=a.pairs, out=a.out, force=a.force, plan_dir=a.plan_dir, seed=a.seed)


# --------------------------------------------------------------------------- the driver


def _worker_env(profile_dir: str) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(
        [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
        + [f"--xla_force_host_platform_device_count={NUM_CPU_DEVICES}"])
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("ENABLE_SEARCH", None)
    env["DISCO_JAX_PROFILE_DIR"] = profile_dir
    return env


def run(config: BenchConfig) -> Path:
    """Run every missing row (one process per model, progress shown), then write the report.
    Returns the report's README path."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    out = Path(config.out)
    (out / "rows").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    ignore = out / ".gitignore"
    if not ignore.exists():  # worker logs hold machine paths: keep them out of the committed report
        ignore.write_text("logs/\n*.tmp\n")
    platforms = config.resolved_platforms()
    console = Console(stderr=True)
    rows = [(m, p) for m in config.models for p in platforms]
    done = lambda: sum(1 for m, p in rows if row_path(out, m, p, config.style).exists())  # noqa: E731
    if config.force:
        for m, p in rows:
            row_path(out, m, p, config.style).unlink(missing_ok=True)
    started = time.perf_counter()
    scratch = tempfile.mkdtemp(prefix="disco-jax-bench-")
    failures = []
    columns = [TextColumn("[bold cyan]disco-jax bench[/]"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.description}"), TimeElapsedColumn()]
    with Progress(*columns, console=console) as bar:
        task = bar.add_task("", total=len(rows), completed=done())
        for model in config.models:
            missing = [p for p in platforms if not row_path(out, model, p, config.style).exists()]
            if not missing:
                continue
            log_path = out / "logs" / f"{model}.{config.style}.log"
            cmd = [sys.executable, "-m", "disco_jax.eval.bench", "worker", "--model", model, "--platforms", *missing,
                   "--style", config.style, "--budget", str(config.budget_s), "--cpu-budget", str(config.cpu_budget_s),
                   "--pairs", str(config.pairs), "--out", str(out), "--plan-dir", os.path.join(scratch, "plans"),
                   "--seed", str(config.seed)]
            with open(log_path, "a") as log:
                log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n")
                log.flush()
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                        env=_worker_env(os.path.join(scratch, "profiles")))
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
    readme = write_report(out, style=config.style, run_info={"elapsed_s": elapsed, "config": dataclasses.asdict(config),
                                                              "failures": failures})
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


def load_rows(out: str | os.PathLike, style: str | None = None) -> list[dict]:
    rows = []
    for path in sorted((Path(out) / "rows").glob("*.json")):
        try:
            row = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if row.get("format") == ROW_FORMAT and (style is None or row.get("style") == style):
            rows.append(row)
    return rows


def write_report(out: str | os.PathLike, *, style: str | None = None, run_info: dict | None = None) -> Path:
    """README.md and the figures of the report folder, from its rows."""
    out = Path(out)
    rows = load_rows(out, style)
    info_path = out / "run.json"
    if run_info:
        previous = json.loads(info_path.read_text()) if info_path.exists() else {}
        run_info = {**run_info, "runs": previous.get("runs", []) + [
            {"finished": time.strftime("%Y-%m-%dT%H:%M:%S"), "elapsed_s": run_info.get("elapsed_s")}]}
        _write_json(info_path, run_info)
    elif info_path.exists():
        run_info = json.loads(info_path.read_text())
    figures = write_figures(out, rows)
    readme = out / "README.md"
    readme.write_text(report_markdown(rows, figures, run_info or {}))
    return readme


# --------------------------------------------------------------------------- the report

STRATEGY_ORDER = (*BASELINE_ORDER, DISCO)
COLORS = {"JAX_no_fusion": "#bdbdbd", "JAX_op_fusion": "#9ecae1", "JAX_AllReduce_fusion": "#fdd0a2",
          "JAX_default": "#3182bd", "PyTorch_DDP": "#a1d99b", "Horovod": "#31a354", DISCO: "#e6550d"}


def _platform_order(rows: list[dict]) -> list[str]:
    known = list(default_platforms())
    present = {r["platform"] for r in rows}
    return [p for p in known if p in present] + sorted(present - set(known))


def _model_order(rows: list[dict]) -> list[str]:
    present = {r["model"] for r in rows}
    return [m for m in ALL_MODELS if m in present] + sorted(present - set(ALL_MODELS))


def _ms(us: float | None) -> str:
    if us is None:
        return "n/a"
    ms = us / 1e3
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def _frac(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


def _geomean(xs: list[float]) -> float:
    import math
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def write_figures(out: Path, rows: list[dict], dpi: int = 80) -> dict[str, str]:
    """Fig. 6-style bars per platform, Fig. 7-style compute/comm breakdowns, Table 2-style
    simulated vs measured scatter. Returns {figure key: file name}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures: dict[str, str] = {}
    platforms, models = _platform_order(rows), _model_order(rows)
    by_key = {(r["platform"], r["model"]): r for r in rows}
    if not rows:
        return figures
    # Fig. 6: iteration time of every strategy, relative to JAX_default, FO as a tick.
    fig, axes = plt.subplots(len(platforms), 1, figsize=(11, 2.6 * len(platforms)), squeeze=False)
    width = 0.8 / len(STRATEGY_ORDER)
    for ax, platform in zip(axes[:, 0], platforms):
        names = [m for m in models if (platform, m) in by_key]
        for j, name in enumerate(STRATEGY_ORDER):
            xs, hs = [], []
            for i, m in enumerate(names):
                r = by_key[(platform, m)]
                t, ref = r["time_us"].get(name), r["time_us"].get("JAX_default")
                if t is not None and ref:
                    xs.append(i - 0.4 + (j + 0.5) * width)
                    hs.append(t / ref)
            ax.bar(xs, hs, width, color=COLORS[name], label=name, edgecolor="black" if name == DISCO else None,
                   linewidth=0.6)
        for i, m in enumerate(names):
            r = by_key[(platform, m)]
            ref = r["time_us"].get("JAX_default")
            if ref:
                ax.hlines(r["fo_us"] / ref, i - 0.42, i + 0.42, colors="black", linestyles="dashed", linewidth=1.0,
                          label="FO" if i == 0 else None)
        r0 = by_key[(platform, names[0])]
        kind = "measured" if r0["time_kind"] == "measured" else f"simulated, kernels: {r0['kernels']}"
        ax.set_title(f"{platform} ({r0['num_devices']} devices; {kind})", fontsize=9, loc="left")
        ax.set_xticks(range(len(names)), names, fontsize=8)
        ax.set_ylabel("time / JAX_default", fontsize=8)
        ax.axhline(1.0, color="grey", linewidth=0.5)
        ax.tick_params(axis="y", labelsize=7)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.suptitle("Per-iteration time relative to JAX_default (DisCo Fig. 6): lower is better", fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 0.97))
    fig.legend(handles, labels, loc="lower center", ncol=8, fontsize=7, frameon=False)
    figures["fig6"] = "fig6_iteration_time.png"
    fig.savefig(out / figures["fig6"], dpi=dpi)
    plt.close(fig)
    # Fig. 7: simulated iteration / compute / comm per strategy, one figure per platform.
    for platform in platforms:
        names = [m for m in models if (platform, m) in by_key]
        cols = min(4, len(names))
        nrows = (len(names) + cols - 1) // cols
        fig, axes = plt.subplots(nrows, cols, figsize=(3.1 * cols, 2.5 * nrows), squeeze=False)
        for ax in axes.flat[len(names):]:
            ax.axis("off")
        for ax, m in zip(axes.flat, names):
            r = by_key[(platform, m)]
            strategies = [s for s in STRATEGY_ORDER if (r["strategies"].get(s) or {}).get("simulated")]
            for k, (field, hatch) in enumerate((("iteration_us", None), ("compute_us", "//"), ("comm_us", ".."))):
                vals = [r["strategies"][s]["simulated"][field] / 1e3 for s in strategies]
                ax.bar([i + (k - 1) * 0.27 for i in range(len(strategies))], vals, 0.27,
                       color=[COLORS[s] for s in strategies], hatch=hatch, edgecolor="black", linewidth=0.3)
            ax.set_xticks(range(len(strategies)), [s.replace("JAX_", "").replace("_fusion", "") for s in strategies],
                          rotation=60, fontsize=6)
            ax.set_title(m, fontsize=8)
            ax.tick_params(axis="y", labelsize=6)
            ax.set_ylabel("ms (simulated)", fontsize=6)
        from matplotlib.patches import Patch
        legend = [Patch(facecolor="white", edgecolor="black", label="iteration"),
                  Patch(facecolor="white", edgecolor="black", hatch="//", label="compute"),
                  Patch(facecolor="white", edgecolor="black", hatch="..", label="communication")]
        fig.suptitle(f"Iteration / computation / communication time on {platform} (DisCo Fig. 7)", fontsize=9)
        fig.tight_layout(rect=(0, 0.06 / nrows, 1, 0.95))
        fig.legend(handles=legend, loc="lower center", fontsize=7, frameon=False, ncol=3)
        key = f"fig7_{platform}"
        figures[key] = f"fig7_breakdown_{platform}.png"
        fig.savefig(out / figures[key], dpi=dpi)
        plt.close(fig)
    # Table 2: simulated vs measured on the measured platform.
    measured = [r for r in rows if r["time_kind"] == "measured"]
    if measured:
        fig, ax = plt.subplots(figsize=(5.2, 4.6))
        lo, hi = float("inf"), 0.0
        for name in STRATEGY_ORDER:
            xs, ys = [], []
            for r in measured:
                st = r["strategies"].get(name) or {}
                if st.get("simulated") and st.get("measured"):
                    xs.append(r["time_us"][name] / 1e3)
                    ys.append(st["simulated"]["iteration_us"] / 1e3)
            if xs:
                ax.scatter(xs, ys, s=28 if name == DISCO else 16, color=COLORS[name], label=name,
                           edgecolors="black", linewidths=0.4, marker="D" if name == DISCO else "o")
                lo, hi = min(lo, *xs, *ys), max(hi, *xs, *ys)
        if hi > 0:
            line = [lo * 0.8, hi * 1.25]
            ax.plot(line, line, color="black", linewidth=0.8)
            ax.fill_between(line, [v * 0.8 for v in line], [v * 1.2 for v in line], color="grey", alpha=0.15,
                            label="±20%")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("measured step time (ms)", fontsize=8)
        ax.set_ylabel("simulated step time (ms)", fontsize=8)
        ax.set_title(f"Simulator vs measurement, {measured[0]['platform']} (DisCo Table 2)", fontsize=9)
        ax.legend(fontsize=6, frameon=False)
        ax.tick_params(labelsize=7)
        fig.tight_layout()
        figures["table2"] = "table2_simulated_vs_measured.png"
        fig.savefig(out / figures["table2"], dpi=dpi)
        plt.close(fig)
    return figures


def report_markdown(rows: list[dict], figures: dict[str, str], run_info: dict) -> str:
    """The report's README.md."""
    from disco_jax.eval import baselines as _baselines, clusters as _clusters

    platforms, models = _platform_order(rows), _model_order(rows)
    by_key = {(r["platform"], r["model"]): r for r in rows}
    lines: list[str] = []
    add = lines.append
    add("# disco-jax benchmark report")
    add("")
    add("DisCo's evaluation (section 6 of the paper) rebuilt: per model and platform, the per-iteration time of "
        "every baseline and of disco-jax, the speed-up over the best baseline, the full-overlap bound (FO) and "
        "the share of FO's headroom disco-jax captured. Produced by one command from the repository root:")
    add("")
    config = run_info.get("config") or {}
    add("```bash")
    add("disco-jax bench --out report")
    add("```")
    add("")
    runs = run_info.get("runs") or []
    if runs:
        total = sum((r.get("elapsed_s") or 0) for r in runs)
        add(f"This report: {len(rows)} rows; wall time {total / 60:.0f} min over {len(runs)} run(s) "
            f"(2 shared CPU cores); search budget {config.get('budget_s', '?')} s per simulated row, "
            f"{config.get('cpu_budget_s', '?')} s on the measured platform; {config.get('pairs', '?')} timed pairs "
            f"per measured configuration; style `{config.get('style', 'jit')}`. Rows are JSON files in `rows/` "
            "(a rerun skips them; `--force` redoes them; `--report-only` rewrites this page).")
        add("")
    # Headline.
    add("## Headline")
    add("")
    losses = []
    for platform in platforms:
        prow = [by_key[(platform, m)] for m in models if (platform, m) in by_key]
        if not prow:
            continue
        ratios = [r["best_baseline_us"] / r["disco_us"] for r in prow]
        captured = [r["headroom_captured"] for r in prow if r["headroom_captured"] is not None]
        kind = prow[0]["time_kind"]
        best = max(prow, key=lambda r: r["speedup"])
        worst = min(prow, key=lambda r: r["speedup"])
        med = sorted(captured)[len(captured) // 2] if captured else None
        add(f"- **{platform}** ({kind}, {prow[0]['num_devices']} devices, {len(prow)} models): disco-jax vs the best "
            f"baseline {_pct(_geomean(ratios) - 1)} (geometric mean of T_best/T_disco - 1); best "
            f"{_pct(best['speedup'])} ({best['model']}), worst {_pct(worst['speedup'])} ({worst['model']}); "
            f"median FO headroom captured {_frac(med)}; FO itself "
            f"{_pct(_geomean([r['best_baseline_us'] / r['fo_us'] for r in prow if r['fo_us'] > 0]) - 1)} "
            "over the best baseline (geometric mean).")
        for r in prow:
            if r["speedup"] < 0:
                losses.append(r)
    add("")
    add("### Where disco-jax loses to a baseline")
    add("")
    if not losses:
        add("Nowhere in this report: on every row disco-jax is at least as fast as the best baseline.")
    for r in losses:
        d = r["strategies"][DISCO]
        extra = ""
        if r["time_kind"] == "measured":
            m = d["measured"]
            b = r["strategies"][r["best_baseline"]]["measured"]
            extra = (f" Measured ratios to JAX_default (median [IQR]): disco-jax {m['ratio']:.3f} "
                     f"[{m['ratio_iqr'][0]:.3f}-{m['ratio_iqr'][1]:.3f}], {r['best_baseline']} {b['ratio']:.3f} "
                     f"[{b['ratio_iqr'][0]:.3f}-{b['ratio_iqr'][1]:.3f}]; disco-jax: {d['description']}.")
        add(f"- {r['model']} on {r['platform']}: {_ms(r['disco_us'])} ms vs {r['best_baseline']} "
            f"{_ms(r['best_baseline_us'])} ms ({_pct(r['speedup'])}).{extra}")
    add("")
    # Per-platform tables.
    add("## Iteration time per model and platform (ms)")
    add("")
    add("Speed-up = (T_best baseline - T_disco-jax) / T_disco-jax (DisCo section 6.2). FO = the smallest "
        "simulated max(compute, comm) among the row's strategies (measured platform: scaled by measured / simulated "
        "JAX_default); FO speed-up = (T_best - FO) / FO (DisCo Table 1). "
        "Headroom captured = (T_best - T_disco) / (T_best - FO). "
        "Search = disco-jax's search time (budget-bound).")
    add("")
    short = {"JAX_no_fusion": "no_fusion", "JAX_op_fusion": "op_fusion", "JAX_AllReduce_fusion": "AR_fusion",
             "JAX_default": "default", "PyTorch_DDP": "DDP", "Horovod": "Horovod", DISCO: "**disco-jax**"}
    for platform in platforms:
        prow = [by_key[(platform, m)] for m in models if (platform, m) in by_key]
        if not prow:
            continue
        r0 = prow[0]
        kind = ("measured: medians of interleaved pairs against JAX_default, one time scale per row"
                if r0["time_kind"] == "measured" else "simulated")
        add(f"### {platform}: {r0['num_devices']} devices, {kind}; kernels: {r0['kernels']}")
        add("")
        if r0["time_kind"] != "measured":
            c = r0.get("cluster") or {}
            add(f"{c.get('description', '')}. Models at their paper config (per-device batch = global / 8).")
            add("")
        header = ["model", *[short[s] for s in STRATEGY_ORDER], "best baseline", "speed-up", "FO", "FO speed-up",
                  "FO headroom captured", "search s", "kernels"]
        add("| " + " | ".join(header) + " |")
        add("|" + "|".join(["---"] + ["---:"] * (len(header) - 2) + ["---"]) + "|")
        for r in prow:
            cells = [r["model"]] + [(f"**{_ms(r['time_us'].get(s))}**" if s == DISCO else _ms(r["time_us"].get(s)))
                                    for s in STRATEGY_ORDER]
            search_s = r.get("search_s")
            cells += [r["best_baseline"], _pct(r["speedup"]), _ms(r["fo_us"]), _pct(r.get("fo_speedup")),
                      _frac(r["headroom_captured"]),
                      "n/a" if search_s is None else f"{search_s:.1f}", r["kernels"]]
            add("| " + " | ".join(cells) + " |")
        add("")
        if r0["time_kind"] == "measured":
            add("Measured ratio to JAX_default per configuration, median [25th-75th percentile] of interleaved "
                "pairs; `AR` all-reduces / tensors they carry and multi-op loop fusions in the compiled HLO; "
                "outputs checked against JAX_default (bitwise where fusion is unchanged, else within the "
                "tolerance of `_validate`).")
            add("")
            add("| model | " + " | ".join(short[s] for s in STRATEGY_ORDER) + " |")
            add("|---|" + "|".join(["---:"] * len(STRATEGY_ORDER)) + "|")
            for r in prow:
                cells = [r["model"]]
                for s in STRATEGY_ORDER:
                    st = r["strategies"].get(s) or {}
                    m, h, o = st.get("measured"), st.get("hlo") or {}, st.get("outputs") or {}
                    if not m:
                        cells.append("n/a")
                        continue
                    ok = "=" if o.get("bitwise_equal") else ("≈" if o.get("within_tolerance") else "✗")
                    cells.append(f"{m['ratio']:.2f} [{m['ratio_iqr'][0]:.2f}-{m['ratio_iqr'][1]:.2f}] "
                                 f"AR {h.get('all-reduce', '?')}/{h.get('all-reduce-operands', '?')} "
                                 f"F {h.get('multi_op_loop_fusions', '?')} {ok}")
                add("| " + " | ".join(cells) + " |")
            add("")
            add("`=` bitwise equal outputs, `≈` within tolerance, `✗` outside it. disco-jax per model: " + "; ".join(
                f"{r['model']}: {r['strategies'][DISCO]['description']}" for r in prow))
            add("")
    # Figures.
    add("## Figures")
    add("")
    if "fig6" in figures:
        add(f"![per-iteration time]({figures['fig6']})")
        add("")
    for platform in platforms:
        key = f"fig7_{platform}"
        if key in figures:
            add(f"![compute/comm breakdown on {platform}]({figures[key]})")
            add("")
    # Table 2.
    measured = [by_key[(p, m)] for p in platforms for m in models
                if (p, m) in by_key and by_key[(p, m)]["time_kind"] == "measured"]
    if measured:
        add("## Simulator accuracy (DisCo Table 2)")
        add("")
        add("Simulated step time (the calibrated simulator of the search phase: profiled kernels, all-reduce fit "
            "measured on the 8 devices, compute scale and all-reduce blocking fitted to two measured runs) against "
            "the measured one. Error = |simulated - measured| / measured.")
        add("")
        add("The simulator reproduces JAX_default exactly as measured when it was calibrated (column `at "
            "calibration`), minutes before the timed pairs; on a shared machine the load changes in between, which "
            "is most of the JAX_default error.")
        add("")
        add("| model | JAX_default at calibration | JAX_default measured | simulated | error | disco-jax measured | "
            "simulated | error | mean error over all 7 configurations | mean error of the ratio to JAX_default |")
        add("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        all_errors, all_ratio_errors = [], []
        for r in measured:
            errs, ratio_errs = {}, {}
            sim_default = r["strategies"]["JAX_default"]["simulated"]["iteration_us"]
            for s in STRATEGY_ORDER:
                st = r["strategies"].get(s) or {}
                if st.get("simulated") and st.get("measured"):
                    errs[s] = abs(st["simulated"]["iteration_us"] - r["time_us"][s]) / r["time_us"][s]
                    if s != "JAX_default":  # drift-free: what the search compares is the ratio
                        measured_ratio = r["time_us"][s] / r["time_us"]["JAX_default"]
                        ratio_errs[s] = abs(st["simulated"]["iteration_us"] / sim_default - measured_ratio) / measured_ratio
            all_errors.extend(errs.values())
            all_ratio_errors.extend(ratio_errs.values())
            d, x = r["strategies"][DISCO], r["strategies"]["JAX_default"]
            at_calibration = (r.get("calibration") or {}).get("measured_default_us")
            add(f"| {r['model']} | {_ms(at_calibration)} | {_ms(r['time_us']['JAX_default'])} | "
                f"{_ms(x['simulated']['iteration_us'])} | "
                f"{errs.get('JAX_default', float('nan')):.1%} | {_ms(r['time_us'][DISCO])} | "
                f"{_ms(d['simulated']['iteration_us'])} | {errs.get(DISCO, float('nan')):.1%} | "
                f"{sum(errs.values()) / max(1, len(errs)):.1%} | "
                f"{sum(ratio_errs.values()) / max(1, len(ratio_errs)):.1%} |")
        if all_errors:
            srt, rsrt = sorted(all_errors), sorted(all_ratio_errors)
            add("")
            add(f"Over all {len(srt)} (model, configuration) pairs: median error {srt[len(srt) // 2]:.1%}, "
                f"90th percentile {srt[int(0.9 * (len(srt) - 1))]:.1%}; of the ratio to JAX_default (free of the "
                f"drift): median {rsrt[len(rsrt) // 2]:.1%}, 90th percentile {rsrt[int(0.9 * (len(rsrt) - 1))]:.1%}. "
                "DisCo reports 11-18% on its cluster A.")
        add("")
        if "table2" in figures:
            add(f"![simulated vs measured]({figures['table2']})")
            add("")
    # Paper-size models: what was captured and how long it took.
    paper = {}
    for r in rows:
        if r["time_kind"] == "simulated" and r["model"] not in paper:
            paper[r["model"]] = r
    if paper:
        add("## Paper-size models (simulated platforms)")
        add("")
        add("Lowered from shapes alone and compiled for 8 CPU devices at the hook (never run); capture = lowering + "
            "XLA:CPU compile + graph IR. Every zoo model captures in well under a minute, so all are in the default run.")
        add("")
        add("| model | parameters | global batch (8 devices) | capture s | ops | gradients | all-reduced MiB | "
            "XLA:CPU all-reduces |")
        add("|---|---:|---:|---:|---:|---:|---:|---:|")
        for m in models:
            r = paper.get(m)
            if r is None:
                continue
            g = r.get("graph") or {}
            add(f"| {m} | {r.get('parameters', 0) / 1e6:.1f} M | {r.get('global_batch', '?')} | "
                f"{r.get('capture_s', 0):.1f} | {g.get('ops', '?')} | {g.get('gradients', '?')} | "
                f"{g.get('gradient_bytes', 0) / 2 ** 20:.0f} | {g.get('xla_allreduces', '?')} |")
        add("")
        heavy = [(m, paper[m]["graph"]["gradient_bytes"] / (4 * paper[m]["parameters"])) for m in models
                 if m in paper and paper[m].get("parameters") and (paper[m].get("graph") or {}).get("gradient_bytes")]
        heavy = [(m, x) for m, x in heavy if x > 1.5]
        if heavy:
            add("All-reduced bytes per step well above the float32 parameter bytes: " + ", ".join(
                f"{m} ({x:.1f}x)" for m, x in heavy) + ". In the jit style XLA's SPMD partitioner all-reduces "
                "partial gradients where they are produced (for the unrolled RNNLM: each time step's contribution "
                "to the LSTM weights) instead of summing them locally first; this is the program the baselines "
                "and disco-jax start from.")
            add("")
    # Baselines and clusters.
    add("## Baselines")
    add("")
    add("Each baseline is a `Strategy` on the captured graph (simulated everywhere) and, on the measured platform, "
        "a compile configuration (`disco_jax/eval/baselines.py`). DDP and Horovod bucketings are enacted by our "
        "rewriter (XLA has no option for them) and use XLA's op fusion (the strongest version of their policy); "
        "on simulated GPU clusters XLA's all-reduce combining is the XLA:GPU combiner (30 MiB), on CPU what "
        "XLA:CPU did (everything it can). Ready times for DDP's order and Horovod's 1 ms cycles come from the "
        "platform's kernel costs.")
    add("")
    add("| baseline | measured platform (XLA:CPU) | source |")
    add("|---|---|---|")
    enact = {"JAX_no_fusion": f"`xla_disable_hlo_passes={_baselines.NO_FUSION_PASS},{_baselines.ALLREDUCE_COMBINER_PASS}`",
             "JAX_op_fusion": f"`xla_disable_hlo_passes={_baselines.ALLREDUCE_COMBINER_PASS}`",
             "JAX_AllReduce_fusion": f"`xla_disable_hlo_passes={_baselines.NO_FUSION_PASS}`",
             "JAX_default": "XLA's defaults", "PyTorch_DDP": "rewrite (`_api.compile_strategy`)",
             "Horovod": "rewrite (`_api.compile_strategy`)"}
    for name in BASELINE_ORDER:
        add(f"| {name} | {enact[name]} | {_baselines.SOURCES[name]} |")
    add("")
    add("## Simulated clusters")
    add("")
    add("Kernels: analytical-scaled, per kernel `launch + max(bytes / (eff_mem x HBM), (elementwise + 8 x "
        "transcendental) / fp32 peak + dot/conv flops / (eff_dot x dot peak))` over the XLA:CPU-fused module of the "
        "paper-size step (no GPU profile exists yet). All-reduce: ring `2(N-1)/N x bytes / bandwidth + latency` in a "
        "node, hierarchical across nodes, NCCL's latency model, the faster of its LL and Simple protocols.")
    add("")
    add("| cluster | devices | GPU | intra-node | inter-node | all-reduce time |")
    add("|---|---:|---|---|---|---|")
    for c in _clusters.CLUSTERS.values():
        add(f"| {c.name} | {c.num_devices} ({c.nodes} x {c.gpus_per_node}) | {c.device.name} | {c.intra.name} | "
            f"{c.inter.name if c.inter else '-'} | {_clusters.describe_allreduce(c)} |")
    add("")
    add("<details><summary>Every number and its source</summary>")
    add("")
    for c in _clusters.CLUSTERS.values():
        add(f"**{c.name}** — {c.source}")
        add("")
        for key, q in c.sources().items():
            if isinstance(q, dict):
                flag = " *(assumption)*" if q.get("assumption") else ""
                add(f"- `{key}` = {q['value']:g} {q['unit']}: {q['source']}{flag}")
        add("")
    add("</details>")
    add("")
    add("## Caveats")
    add("")
    add("- Measured numbers come from 8 virtual XLA:CPU devices in one process on a shared 2-core machine: "
        "collectives there block the executor (DESIGN.md point 7), so overlap gains are small and noise is large; "
        "the IQR columns say how large.")
    add("- Simulated clusters use modules captured on XLA:CPU: XLA:GPU would fuse differently (e.g. reductions "
        "into their producers), so absolute times are indicative; the analytical kernel model is not calibrated "
        "against a GPU profile (e.g. ResNet-50 at 32 images on one GTX 1080 Ti simulates at about twice the "
        "~0.16 s per iteration DisCo reports for cluster A). Every row names its kernel-cost source.")
    add("- disco-jax's search on simulated clusters starts from XLA's plan, the unfused graph and every baseline, "
        "so in simulation it cannot lose to a baseline; its margin is what the search found within the budget.")
    add("- Forward-pass all-reduces (batch-norm statistics of the jit-style ResNet-50) count as all-reduces too; "
        "bucket builders never merge an all-reduce with one that depends on it.")
    add("")
    failures = run_info.get("failures") or []
    if failures:
        add("## Failed models in the last run")
        add("")
        for model, code, log in failures:
            add(f"- {model}: exit code {code}, log `{log}`")
        add("")
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `disco-jax bench` (shared with scripts/bench.py --report)."""
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), help="zoo models (default: all)")
    parser.add_argument("--platforms", nargs="+", default=None,
                        help=f"'{CPU_PLATFORM}' (measured) and cluster names (simulated); default: all")
    parser.add_argument("--style", default="jit", choices=("jit", "shard_map"))
    parser.add_argument("--budget", type=float, default=20.0, help="search budget per simulated row, seconds")
    parser.add_argument("--cpu-budget", type=float, default=10.0, help="search budget on the measured platform")
    parser.add_argument("--pairs", type=int, default=30, help="interleaved timing pairs per measured configuration")
    parser.add_argument("--out", default="report", help="report folder (rows/ inside make the run resumable)")
    parser.add_argument("--force", action="store_true", help="redo rows that exist")
    parser.add_argument("--report-only", action="store_true", help="only rewrite the report from existing rows")
    parser.add_argument("--timeout", type=float, default=3600.0, help="per model process, seconds")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(models=tuple(args.models), platforms=tuple(args.platforms or ()), style=args.style,
                       budget_s=args.budget, cpu_budget_s=args.cpu_budget, pairs=args.pairs, out=args.out,
                       force=args.force, timeout_s=args.timeout)


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
        _worker_main(sys.argv[2:])
    else:
        parser = argparse.ArgumentParser(prog="python -m disco_jax.eval.bench")
        add_arguments(parser)
        main(parser.parse_args())
