"""The benchmark's experiments: one *row* per (model, platform), as a JSON-able dict.

* `measured_row`: the model's ``tiny`` config on the 8 virtual CPU devices of this machine. Each
  baseline is compiled (XLA compile options, or our rewrite for DDP / Horovod), checked on its
  compiled HLO and its outputs, and timed in interleaved pairs against JAX_default; disco-jax is
  `optimize_distributed(search=True)` (profiling, calibration, search, validation), timed the
  same way. Every configuration is also simulated with the calibrated simulator of the search
  phase (kernels: profiled), which gives the simulated-vs-measured table (DisCo's Table 2).
* `simulated_row`: the model's ``paper`` config captured from shapes alone (`capture_paper_model`),
  its kernels costed by a cluster's GPU-scaled analytical model, all-reduces by the cluster's ring /
  hierarchical model; disco-jax is the backtracking search on that simulator, started from XLA's
  plan, the unfused graph and every baseline.
* `summarize`: DisCo section 6.2's figures of a row: speed-up = (T_best_baseline - T_disco) /
  T_disco; headroom captured = (T_best_baseline - T_disco) / (T_best_baseline - FO), n/a when the
  best baseline is already within 0.1% of FO.

`run_model` writes every missing row of one model (what a worker process of
`disco_jax.eval.bench` does); rows live under ``<out>/rows/`` (`row_path`, `load_rows`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import optax

from disco_jax import (
    ChainEstimator,
    Graph,
    ProfileDatabase,
    SearchConfig,
    Strategy,
    _validate,
    backends,
    backtracking_search,
    optimize_distributed,
    simulate,
    start_candidates,
    zoo,
)
from disco_jax._compile import Captured, capture, compile_strategy, compiled_stats
from disco_jax._console import Ui
from disco_jax._files import write_json_atomic
from disco_jax._profiling import calibrate, profile
from disco_jax.eval import baselines, clusters

CPU_PLATFORM = "cpu-8dev"
NUM_CPU_DEVICES = 8
ROW_FORMAT = 1
ALL_MODELS = ("vgg19", "resnet50", "transformer", "rnnlm", "bert", "reformer", "mlp", "dlrm")
DISCO = "disco-jax"
BASELINE_ORDER = ("JAX_no_fusion", "JAX_op_fusion", "JAX_AllReduce_fusion", "JAX_default", "PyTorch_DDP", "Horovod")
STRATEGY_ORDER = (*BASELINE_ORDER, DISCO)
KERNELS_PROFILED = "profiled (CPU trace) + calibrated"
KERNELS_ANALYTICAL = "analytical-scaled"


def default_platforms() -> tuple[str, ...]:
    """The measured platform, then every simulated cluster."""
    return (CPU_PLATFORM, *clusters.CLUSTERS)


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- rows on disk


def model_config(platform: str) -> str:
    """The zoo config a platform runs: ``tiny`` on the measured platform, ``paper`` on clusters."""
    return "tiny" if platform == CPU_PLATFORM else "paper"


def row_path(out: str | os.PathLike, model: str, platform: str, style: str) -> Path:
    return Path(out) / "rows" / f"{model}.{model_config(platform)}.{style}.{platform}.json"


def load_rows(out: str | os.PathLike, style: str | None = None) -> list[dict]:
    """The rows under ``<out>/rows/`` of this format (and style, when given)."""
    rows = []
    for path in sorted((Path(out) / "rows").glob("*.json")):
        try:
            row = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if row.get("format") == ROW_FORMAT and (style is None or row.get("style") == style):
            rows.append(row)
    return rows


def common_fields(model: str, platform: str, style: str, graph_summary: dict, kernels: str, num_devices: int) -> dict:
    """The fields every row has, besides what its experiment measured."""
    return {
        "format": ROW_FORMAT,
        "model": model,
        "config": model_config(platform),
        "style": style,
        "platform": platform,
        "num_devices": num_devices,
        "kernels": kernels,
        "graph": graph_summary,
        "jax_version": jax.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def platform_order(rows: list[dict]) -> list[str]:
    known = list(default_platforms())
    present = {r["platform"] for r in rows}
    return [p for p in known if p in present] + sorted(present - set(known))


def model_order(rows: list[dict]) -> list[str]:
    present = {r["model"] for r in rows}
    return [m for m in ALL_MODELS if m in present] + sorted(present - set(ALL_MODELS))


# --------------------------------------------------------------------------- row summary


def summarize(times_us: dict[str, float], fo_us: float) -> dict:
    """Best baseline, speed-up of disco-jax over it, and the FO headroom it captured."""
    candidates = {k: v for k, v in times_us.items() if k != DISCO and v is not None}
    best = min(candidates, key=candidates.get)
    t_best, t_disco = candidates[best], times_us[DISCO]
    headroom = t_best - fo_us
    return {
        "best_baseline": best,
        "best_baseline_us": t_best,
        "disco_us": t_disco,
        "speedup": (t_best - t_disco) / t_disco,
        "fo_us": fo_us,
        "fo_speedup": (t_best - fo_us) / fo_us if fo_us > 0 else None,
        "headroom_captured": (t_best - t_disco) / headroom if headroom > 1e-3 * t_best else None,
    }


def _sim_json(step) -> dict | None:
    return None if step is None else step.to_json()


def _measured_json(timing) -> dict:
    return {
        "us": timing.plan_us,
        "default_us": timing.default_us,
        "ratio": timing.ratio,
        "ratio_iqr": [timing.ratio_low, timing.ratio_high],
        "pairs": timing.pairs,
    }


def _outputs_json(comparison) -> dict:
    return {
        "bitwise_equal": comparison.bitwise_equal,
        "within_tolerance": comparison.within_tolerance,
        "max_abs_error": comparison.max_abs_error,
    }


# --------------------------------------------------------------------------- simulated rows


def simulated_row(
    graph: Graph, cluster: clusters.Cluster, *, budget_s: float, seed: int = 0, progress: Callable | None = None
) -> dict:
    """One cluster row for a captured graph: baselines simulated (XLA's all-reduce combining is
    XLA:GPU's combiner), disco-jax searched."""
    estimator = ChainEstimator([cluster.kernel_estimator()])
    allreduce = cluster.allreduce_model()

    def simulated(s: Strategy):
        return simulate(graph, s, estimator, allreduce)

    candidates = baselines.all_baselines(
        graph, combine=baselines.xla_gpu_buckets, kernel_time_us=lambda ks: estimator.estimate(graph, ks)
    )
    strategies: dict[str, dict] = {}
    for b in candidates:
        sim = simulated(b.strategy)
        strategies[b.name] = {
            "simulated": _sim_json(sim),
            "description": b.description,
            "buckets": len(b.strategy.buckets),
            "valid": sim is not None,
        }

    def cost(s: Strategy) -> float | None:
        r = simulated(s)
        return None if r is None else r.iteration_us

    starts, seen = [], set()
    for s in start_candidates(graph) + [b.strategy for b in candidates]:
        if s.key() not in seen:
            seen.add(s.key())
            starts.append(s)
    result = backtracking_search(
        graph, cost, SearchConfig(budget_s=budget_s, seed=seed), starts=starts, progress=progress
    )
    best = simulated(result.best)
    strategies[DISCO] = {
        "simulated": best.to_json(),
        "description": f"search from {result.best.origin}",
        "buckets": len(result.best.buckets),
        "valid": True,
    }
    times = {k: (v["simulated"] or {}).get("iteration_us") for k, v in strategies.items()}
    fo = min(v["simulated"]["full_overlap_us"] for v in strategies.values() if v["simulated"])
    return {
        "strategies": strategies,
        "time_us": times,
        "time_kind": "simulated",
        **summarize(times, fo),
        "search": result.stats(),
        "search_s": result.seconds,
        "allreduce": allreduce.to_json(),
        "cluster": cluster.to_json(),
        "estimator": cluster.kernel_estimator().to_json(),
    }


def capture_paper_model(name: str, style: str) -> tuple[Graph, dict]:
    """The paper-size step of a zoo model, captured at the hook without running it."""
    spec = zoo.get_model(name, "paper")
    started = time.perf_counter()
    lowered = zoo.lower_abstract(spec, optax.adam(1e-3), zoo.data_mesh(NUM_CPU_DEVICES), style)
    graph = capture(lowered, backends.CPU, (), {}).graph
    return graph, {
        "capture_s": time.perf_counter() - started,
        "parameters": spec.param_count(),
        "global_batch": spec.default_global_batch,
        "per_device_batch": spec.default_global_batch // NUM_CPU_DEVICES,
        "description": spec.description,
    }


# --------------------------------------------------------------------------- measured rows


def _compile_baseline(captured: Captured, b: baselines.Baseline) -> tuple:
    if b.compiler_options is None:
        return compile_strategy(captured.lowered, captured.graph, b.strategy)
    if not b.compiler_options:
        return captured.default_compiled, "default"
    return captured.lowered.compile(compiler_options=b.compiler_options), "compile options"


def measured_row(name: str, style: str, *, budget_s: float, pairs: int, plan_dir: str) -> dict:
    """The measured CPU row of a tiny zoo model: every baseline compiled, checked, timed against
    JAX_default and simulated; disco-jax by `optimize_distributed`'s search phase."""
    spec = zoo.get_model(name, "tiny")
    step, state, batch = zoo.make_train_step(spec, optax.adam(1e-3), zoo.data_mesh(NUM_CPU_DEVICES), style)
    args = (state, batch)
    started = time.perf_counter()
    captured = capture(step.lower(*args), backends.CPU, args, {})
    graph = captured.graph
    capture_s = time.perf_counter() - started
    validation_pairs = max(8, pairs // 2)
    default_runner = captured.runner(captured.default_compiled)
    quiet = Ui(verbose=False)
    log(f"{name}: profiling and calibrating the simulator")
    cost_model = profile(captured, default_runner, ProfileDatabase(), quiet)
    calibration = calibrate(cost_model, captured, default_runner, validation_pairs, quiet).to_json()
    scale = cost_model.params.compute_scale
    candidates = baselines.all_baselines(
        graph, kernel_time_us=lambda ks: [t * scale for t in cost_model.estimator.estimate(graph, ks)]
    )
    reference = default_runner()
    floor = _validate.sensitivity(reference, step(*_validate.nudge(args)))
    default_counts = compiled_stats(captured.default_compiled.as_text())
    strategies: dict[str, dict] = {}
    default_samples: list[float] = []
    for b in candidates:
        log(f"{name}: {b.name} ({b.enacted_by})")
        compiled, status = _compile_baseline(captured, b)
        runner = captured.runner(compiled)
        # Bitwise equality is recorded; the check is the tolerance of `_validate` (fusion changes,
        # and our rewrite of some modules, move float results by a few ulps).
        comparison = _validate.compare_outputs(reference, runner(), bitwise=False, floor=floor)
        timing = _validate.time_interleaved(default_runner, runner, pairs=pairs)
        default_samples.append(timing.default_us)
        sim = cost_model.simulate(graph, b.strategy)
        strategies[b.name] = {
            "simulated": _sim_json(sim),
            "description": b.description,
            "enacted_by": b.enacted_by,
            "compiler_options": b.compiler_options,
            "compile_status": status,
            "hlo": compiled_stats(compiled.as_text()),
            "buckets": len(b.strategy.buckets),
            "valid": sim is not None,
            "measured": _measured_json(timing),
            "outputs": _outputs_json(comparison),
        }
    # disco-jax: the product's search phase, as a user runs it.
    log(f"{name}: disco-jax search phase (budget {budget_s:g} s)")
    optimized = optimize_distributed(
        step, search=True, budget_s=budget_s, plan_dir=plan_dir, verbose=False, validation_pairs=validation_pairs
    )
    out = jax.block_until_ready(optimized(*args))
    report = optimized.last_report
    applied = bool(report.applied)
    disco_hlo = compiled_stats(optimized.executable(*args).as_text()) if applied else default_counts
    strategy = Strategy.from_json(graph, report.plan["strategy"]) if applied else baselines.jax_default(graph).strategy
    comparison = _validate.compare_outputs(reference, out, bitwise=False, floor=floor)
    timing = _validate.time_interleaved(default_runner, lambda: optimized(*args), pairs=pairs)
    default_samples.append(timing.default_us)
    sim = cost_model.simulate(graph, strategy)
    search = report.search or {}
    strategies[DISCO] = {
        "simulated": _sim_json(sim),
        "description": ("plan applied" if applied else "XLA default kept") + f": {report.reason or ''}",
        "enacted_by": "optimize_distributed",
        "applied": applied,
        "hlo": disco_hlo,
        "buckets": len(strategy.buckets),
        "valid": sim is not None,
        "simulated_by_search": (report.simulated or {}).get("plan"),
        "measured": _measured_json(timing),
        "outputs": _outputs_json(comparison),
    }
    # One time scale for the row: each configuration's median ratio to JAX_default times the
    # median JAX_default time over all pairings (ratios of interleaved pairs are what is robust).
    default_us = sorted(default_samples)[len(default_samples) // 2]
    times = {
        k: v["measured"]["ratio"] * default_us if k != "JAX_default" else default_us for k, v in strategies.items()
    }
    # FO on the measured time scale: the simulated bound times measured / simulated JAX_default.
    fo_simulated = min(v["simulated"]["full_overlap_us"] for v in strategies.values() if v["simulated"])
    fo = fo_simulated * default_us / strategies["JAX_default"]["simulated"]["iteration_us"]
    return {
        "strategies": strategies,
        "time_us": times,
        "time_kind": "measured",
        **summarize(times, fo),
        "fo_simulated_us": fo_simulated,
        "search": {
            k: search.get(k)
            for k in ("evaluated", "invalid", "improvements", "seconds", "stop_reason", "candidates_per_second")
        },
        "search_s": search.get("seconds"),
        "calibration": calibration,
        "default_hlo": default_counts,
        "allreduce": cost_model.allreduce.to_json(),
        "capture_s": capture_s,
        "parameters": spec.param_count(),
        "global_batch": spec.default_global_batch,
        "description": spec.description,
        "graph_summary": graph.summary(),
    }


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
    """Every missing row of one model (in this process)."""
    todo = [p for p in platforms if force or not row_path(out, model, p, style).exists()]
    if CPU_PLATFORM in todo:
        started = time.perf_counter()
        log(f"{model}: measured row on {NUM_CPU_DEVICES} CPU devices")
        row = measured_row(model, style, budget_s=cpu_budget_s, pairs=pairs, plan_dir=plan_dir)
        row = {
            **common_fields(model, CPU_PLATFORM, style, row.pop("graph_summary"), KERNELS_PROFILED, NUM_CPU_DEVICES),
            **row,
            "elapsed_s": time.perf_counter() - started,
        }
        write_json_atomic(row_path(out, model, CPU_PLATFORM, style), row)
        log(f"{model}: {CPU_PLATFORM} done: disco-jax {row['speedup']:+.1%} vs {row['best_baseline']}")
    simulated = [p for p in todo if p != CPU_PLATFORM]
    if not simulated:
        return
    log(f"{model}: capturing the paper config")
    graph, info = capture_paper_model(model, style)
    log(f"{model}: captured in {info['capture_s']:.1f} s: {graph.summary()}")
    for name in simulated:
        cluster = clusters.get_cluster(name)
        started = time.perf_counter()
        log(f"{model}: simulating {name} (search budget {budget_s:g} s)")
        last = [0.0]

        def progress(best, n, elapsed, name=name, last=last):
            if elapsed - last[0] >= 5.0:
                last[0] = elapsed
                log(f"{model}: {name}: search {elapsed:.0f}/{budget_s:g} s, {n} candidates, best {best / 1e3:.2f} ms")

        row = simulated_row(graph, cluster, budget_s=budget_s, seed=seed, progress=progress)
        row = {
            **common_fields(model, name, style, graph.summary(), KERNELS_ANALYTICAL, cluster.num_devices),
            **info,
            **row,
            "elapsed_s": time.perf_counter() - started,
        }
        write_json_atomic(row_path(out, model, name, style), row)
        log(f"{model}: {name} done: disco-jax {row['speedup']:+.1%} vs {row['best_baseline']}")
