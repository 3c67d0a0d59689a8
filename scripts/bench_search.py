"""Benchmark: how fast the search (DisCo's Algorithm 1) evaluates candidates, per zoo model.

Each model's step is captured at the hook without running it (8 virtual CPU devices; the
``paper`` configs from shapes alone, as the benchmark harness's simulated rows are) and searched
for `--budget-s` seconds with the search's defaults (alpha 1.05, beta 10, stop when the best is
unchanged for 1000 candidates):

* ``tiny`` configs: the cost model of the search phase on this machine, built offline: the kernel
  table of the profile database for the CPU (`ProfileDatabase`, the user cache first), then the GNN
  (when weights ship for the CPU), then the analytical roofline, both calibrated to the XLA kernels
  the table holds; the stored all-reduce fit (a default line when none is stored).
* ``paper`` configs: a simulated cluster (`--cluster`, default 8xH100-NVLink): its kernel costs
  (`Cluster.kernel_estimator`: on the H100 the GNN trained there, the GPU-scaled roofline for the
  rest) and its all-reduce model; starts include DisCo's baselines, as in the report.

Printed per model: graph size (ops), candidates per second, share of invalid candidates, time to
Algorithm 1's stop criterion (or "not reached in budget", or when the queue emptied), and the
simulated speed-up of the best candidate over the best start. `--mode restarts` / `mcmc` run the
search's other modes (`SearchConfig.mode`; several, comma-separated, search the same capture). Progress goes to stderr.

    python scripts/bench_search.py [--models transformer:tiny,bert:paper] [--budget-s 20]
        [--mode backtracking] [--json out.json] [--cprofile out.prof]
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import argparse  # noqa: E402
import cProfile  # noqa: E402
import json  # noqa: E402
import pstats  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import optax  # noqa: E402

from disco_jax import SearchConfig, backends, backtracking_search, cost, start_candidates, zoo  # noqa: E402
from disco_jax._compile import capture  # noqa: E402
from disco_jax._profile_db import ProfileDatabase  # noqa: E402

DEFAULT_MODELS = ("transformer:tiny", "bert:tiny", "resnet50:tiny", "bert:paper", "resnet50:paper")
DEVICES = 8


def log(message: str) -> None:
    print(f"[bench_search {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def capture_model(name: str, config: str):
    spec = zoo.get_model(name, config)
    lowered = zoo.lower_abstract(spec, optax.adam(1e-3), zoo.data_mesh(DEVICES), "jit")
    return capture(lowered, backends.CPU, (), {}).program


def profiled_cost_model(graph, use_gnn: bool) -> tuple[cost.CostModel, str]:
    """The search phase's cost model without running the step: stored kernel times, plugins
    (the GNN) and the analytical roofline calibrated to the XLA kernels the table holds."""
    stored = ProfileDatabase().load("cpu", "cpu", DEVICES)
    known = dict(stored.kernel_times_us) if stored is not None else {}
    measured = {}
    for members in graph.xla_groups:
        t = known.get(graph.kernel_signature(members))
        if t is not None:
            measured[members] = t
    for op in graph.ops:
        if op.kind == "opaque":
            t = known.get(graph.kernel_signature(frozenset([op.id])))
            if t is not None:
                measured[frozenset([op.id])] = t
    analytical = cost.AnalyticalEstimator.fit([(cost.kernel_features(graph, k), t) for k, t in measured.items()])
    plugins = [cost.with_op_times(p, known) for p in cost.plugin_estimators("cpu")] if use_gnn else []
    estimators = [cost.TableEstimator(known)]
    estimators += [cost.CalibratedEstimator(base, graph, measured) for base in plugins or [analytical]]
    if plugins:
        estimators.append(cost.CalibratedEstimator(analytical, graph, measured))
    allreduce = stored.allreduce if stored is not None and stored.allreduce is not None else None
    if allreduce is None:
        allreduce = cost.AllReduceCostModel(per_byte_us=1e-3, latency_us=20.0)
    names = "+".join(e.name for e in estimators)
    return cost.CostModel(cost.chain(*estimators), allreduce, {}), f"{names} ({len(measured)} XLA kernels in the table)"


def cluster_cost_model(program, cluster_name: str):
    from disco_jax.eval import baselines, clusters

    cluster = clusters.get_cluster(cluster_name)
    estimator = cost.ChainEstimator([cluster.kernel_estimator()])
    model = cost.CostModel(estimator, cluster.allreduce_model(), {})
    extra = baselines.all_baselines(
        program, combine=baselines.xla_gpu_buckets, kernel_time_us=lambda ks: estimator.estimate(program.graph, ks)
    )
    return model, [b.strategy for b in extra], f"{cluster_name} ({estimator.name})"


def run_model(name: str, config: str, args) -> list[dict]:
    started = time.perf_counter()
    log(f"{name}:{config}: capturing")
    program = capture_model(name, config)
    graph = program.graph
    log(f"{name}:{config}: {len(graph.ops)} ops captured in {time.perf_counter() - started:.1f} s")
    records = []
    for mode in args.mode.split(","):
        # A new cost model per mode: its estimators' caches would flatter the modes run later.
        extra = []
        if config == "paper":
            model, extra, kernels = cluster_cost_model(program, args.cluster)
        else:
            model, kernels = profiled_cost_model(graph, not args.no_gnn)
        starts, seen = [], set()
        for s in start_candidates(graph) + extra:
            if s.key() not in seen:
                seen.add(s.key())
                starts.append(s)
        records.append(search(name, config, program, kernels, model.evaluator(program), starts, mode, args))
    return records


def search(name, config, program, kernels, evaluate, starts, mode, args) -> dict:
    graph = program.graph
    search_config = SearchConfig(budget_s=args.budget_s, seed=args.seed, mode=mode)

    last = [0.0]

    def progress(best, evaluated, elapsed):
        if elapsed - last[0] >= 5.0:
            last[0] = elapsed
            log(f"{name}:{config}: {evaluated} candidates in {elapsed:.0f} s, best {best:.1f} us")

    profiler = cProfile.Profile() if args.cprofile else None
    if profiler is not None:
        profiler.enable()
    result = backtracking_search(program, evaluate, search_config, starts=starts, progress=progress)
    if profiler is not None:
        profiler.disable()
        path = f"{args.cprofile}.{name}.{config}.{mode}"
        profiler.dump_stats(path)
        pstats.Stats(path, stream=sys.stderr).sort_stats("cumulative").print_stats(25)
    start_best = min(result.start_costs.values())
    reached = result.stop_reason.startswith("best unchanged")
    record = {
        "model": name,
        "config": config,
        "ops": len(graph.ops),
        "fusible_ops": len(graph.fusible_ops),
        "gradients": len(graph.gradients),
        "kernels": kernels,
        "mode": mode,
        "restarts": result.restarts,
        "budget_s": args.budget_s,
        "candidates": result.evaluated,
        "candidates_per_second": round(result.candidates_per_second, 1),
        "invalid_share": round(result.invalid / max(1, result.evaluated), 4),
        "duplicates": result.duplicates,
        "stop_reason": result.stop_reason,
        "stop_criterion_s": round(result.seconds, 2) if reached else None,
        "search_s": round(result.seconds, 2),
        "start_best_us": start_best,
        "best_us": result.best_cost,
        "speedup_over_start": (start_best - result.best_cost) / result.best_cost,
        "xla_us": result.start_costs.get("xla"),
    }
    return record


def describe(r: dict) -> str:
    if r["stop_criterion_s"] is not None:
        stop = f"stop criterion at {r['stop_criterion_s']:.1f} s"
    elif r["stop_reason"] == "queue empty":
        stop = f"queue empty at {r['search_s']:.1f} s"
    else:
        stop = "stop criterion not reached in budget"
    return (
        f"{r['model']:>12}:{r['config']:<5} {r['ops']:>6} ops  {r['candidates_per_second']:>8.1f} cand/s  "
        f"{r['invalid_share']:>6.1%} invalid  {stop:<40} speed-up {r['speedup_over_start']:+.2%} "
        f"({r['candidates']} candidates, {r['mode']})"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help="name[:config],... (config: tiny|paper)")
    parser.add_argument("--budget-s", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--mode", default="backtracking", help="search modes, comma-separated: backtracking,restarts,mcmc"
    )
    parser.add_argument("--cluster", default="8xH100-NVLink", help="simulated cluster for paper configs")
    parser.add_argument("--no-gnn", action="store_true", help="tiny configs: leave the GNN out of the chain")
    parser.add_argument("--json", help="write one record per model to this file")
    parser.add_argument("--cprofile", help="profile each search; stats to PATH.<model>.<config>, top to stderr")
    args = parser.parse_args(argv)
    records = []
    for item in args.models.split(","):
        name, _, config = item.strip().partition(":")
        for c in [config] if config else list(zoo.CONFIGS):
            for r in run_model(name, c, args):
                records.append(r)
                print(describe(r), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
        log(f"wrote {len(records)} records to {args.json}")


if __name__ == "__main__":
    main()
