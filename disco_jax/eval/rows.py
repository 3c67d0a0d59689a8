"""The benchmark's experiments: one *row* per (model, platform), as a JSON-able dict.

* measured rows (`disco_jax.eval.measured`): the model's ``tiny`` config timed on a measured
  platform (`MEASURED_PLATFORMS`: 8 CPU devices in one process sharing the cores; 2 CPU
  devices on a 2-core machine, one core each; 2 processes over gloo);
* `simulated_row`: the model's ``paper`` config captured from shapes alone (`capture_paper_model`).
  Captured on XLA:GPU (a cluster with a shipped target), every strategy is compiled deviceless as
  XLA:GPU enacts it and costed by the compiled-program model (`cost.compiled`: its own kernels by
  the cluster's kernel estimator, its collectives by the cluster's fitted NCCL model); disco-jax is
  the backtracking search on the graph simulator, started from XLA's plan, the unfused graph and
  every baseline, whose best few candidates are compiled and ranked with XLA's own program by
  compiled cost. Captured on XLA:CPU, every strategy is costed by the graph simulator (`NOT_COMPILED`).
* `summarize`: DisCo section 6.2's figures of a row: speed-up = (T_best_baseline - T_disco) /
  T_disco; headroom captured = (T_best_baseline - T_disco) / (T_best_baseline - FO), n/a when the
  best baseline is already within 0.1% of FO.

Rows live under ``<out>/rows/`` (`row_path`, `load_rows`); `disco_jax.eval.bench` writes them.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import optax

from disco_jax import (
    ChainEstimator,
    CostModel,
    Graph,
    Program,
    SearchConfig,
    Strategy,
    backends,
    backtracking_search,
    schedule_options,
    simulate,
    start_candidates,
    targets,
    zoo,
)
from disco_jax._compile import CompiledProgram, Programs, capture, capture_program, compile_program
from disco_jax._ranking import ProgramCosts
from disco_jax._strategy import sharding_all, with_sharding, xla_default
from disco_jax._validate import median_interval
from disco_jax.cost import sharded
from disco_jax.eval import baselines, clusters
from disco_jax.eval.ranked import COMPILED_MODEL, collective_parts, ranked_plan
from disco_jax.sharding import state_search, update

CPU_PLATFORM = "cpu-8dev"
CPU_CORE_PLATFORM = "cpu-2dev"
GLOO_PLATFORM = "gloo-2x1"
# Measured platforms: name -> (processes, devices per process) of the job that measures them.
MEASURED_PLATFORMS: dict[str, tuple] = {CPU_PLATFORM: (1, 8), CPU_CORE_PLATFORM: (1, 2), GLOO_PLATFORM: (2, 1)}
PAPER_DEVICES = 8  # paper configs are captured on 8 devices (the clusters' data-parallel degree)
ROW_FORMAT = 1
ALL_MODELS = ("vgg19", "resnet50", "transformer", "rnnlm", "bert", "reformer", "mlp", "dlrm")
DISCO = "disco-jax"
BASELINE_ORDER = ("JAX_no_fusion", "JAX_op_fusion", "JAX_AllReduce_fusion", "JAX_default", "PyTorch_DDP", "Horovod")
STRATEGY_ORDER = (*BASELINE_ORDER, DISCO)
KERNELS_PROFILED = "profiled (CPU trace) + calibrated"


def default_platforms() -> tuple[str, ...]:
    """The measured platforms, then every simulated cluster."""
    return (*MEASURED_PLATFORMS, *clusters.CLUSTERS)


def num_devices(platform: str) -> int:
    """Devices of a measured platform's job (all processes)."""
    processes, per_process = MEASURED_PLATFORMS[platform]
    return processes * per_process


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- rows on disk


def model_config(platform: str) -> str:
    """The zoo config a platform runs: ``tiny`` on measured platforms, ``paper`` on clusters."""
    return "tiny" if platform in MEASURED_PLATFORMS else "paper"


def row_path(out: str | os.PathLike, model: str, platform: str, style: str) -> Path:
    """A row's file; a model variant (`zoo.get_model`'s ``transformer:scan_layers=True``) is a
    model of its own, its ``:`` written ``+`` (``transformer+scan_layers=True.paper...``)."""
    return Path(out) / "rows" / f"{model.replace(':', '+')}.{model_config(platform)}.{style}.{platform}.json"


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
    """The rows' models in the zoo's order, each variant right after its model (the scanned
    Transformer beside the unrolled one), others after them by name."""
    present = {r["model"] for r in rows}
    ordered = []
    for m in ALL_MODELS:
        ordered += ([m] if m in present else []) + sorted(v for v in present if v.partition(":")[0] == m and v != m)
    return ordered + sorted(present - set(ordered))


# --------------------------------------------------------------------------- row summary


def headroom_share(t_best: float, fo_us: float, time_us: float) -> float | None:
    """The share of FO's headroom (T_best - FO) an iteration of `time_us` captures; None where
    there is no headroom to speak of (under 0.1% of T_best)."""
    headroom = t_best - fo_us
    return (t_best - time_us) / headroom if headroom > 1e-3 * t_best else None


def full_overlap_us(strategies: dict[str, dict]) -> float:
    """FO: the lowest full-overlap bound (max(compute, comm)) of the baselines' simulated steps,
    never disco-jax's own (its plan would otherwise set the bound it is measured against)."""
    return min(
        v["simulated"]["full_overlap_us"] for k, v in strategies.items() if k in BASELINE_ORDER and v["simulated"]
    )


def summarize(times_us: dict[str, float], fo_us: float) -> dict:
    """Best baseline, speed-up of disco-jax over it, and the FO headroom it captured."""
    candidates = {k: v for k, v in times_us.items() if k != DISCO and v is not None}
    best = min(candidates, key=candidates.get)
    t_best, t_disco = candidates[best], times_us[DISCO]
    return {
        "best_baseline": best,
        "best_baseline_us": t_best,
        "disco_us": t_disco,
        "speedup": (t_best - t_disco) / t_disco,
        "fo_us": fo_us,
        "fo_speedup": (t_best - fo_us) / fo_us if fo_us > 0 else None,
        "headroom_captured": headroom_share(t_best, fo_us, t_disco),
    }


def measured_summary(strategies: dict[str, dict], reference_us: float) -> dict:
    """A measured row's figures from its configurations (`measured`: their ratios to the row's
    reference, `measured_json`; `simulated`): one time scale for the row, each configuration's
    median ratio times the reference's median time (ratios of interleaved pairs are what is
    robust); FO on that scale (the simulated bound times measured / simulated JAX_default);
    `summarize`'s figures; and the speed-up's 95% interval (`ratio_between` the best baseline and
    disco-jax), None where the row holds no per-pair ratios."""
    times = {k: v["measured"]["ratio"] * reference_us for k, v in strategies.items()}
    fo_simulated = full_overlap_us(strategies)
    fo = fo_simulated * times["JAX_default"] / strategies["JAX_default"]["simulated"]["iteration_us"]
    summary = summarize(times, fo)
    interval = ratio_between(strategies[summary["best_baseline"]]["measured"], strategies[DISCO]["measured"])
    return {
        "time_us": times,
        **summary,
        "speedup_ci95": None if interval is None else [x - 1.0 for x in interval],
        "fo_simulated_us": fo_simulated,
    }


def sim_json(step) -> dict | None:
    return None if step is None else step.to_json()


def measured_json(timing) -> dict:
    """A configuration timed against the row's reference (`_validate.Timing`: the reference is its
    `default` side): its median time, the median per-pair ratio with its spread, interval and
    every pair's ratio (which `ratio_between` compares configurations by)."""
    return {
        "us": timing.plan_us,
        "reference_us": timing.default_us,
        "ratio": timing.ratio,
        "ratio_iqr": [timing.ratio_low, timing.ratio_high],
        "ratio_ci95": list(timing.ratio_ci95),
        "pairs": timing.pairs,
        "ratios": timing.ratios,
    }


def overhead_json(timing) -> dict:
    """The decorator's per-call overhead: the decorated call timed against the executable it runs
    (`timing`'s default side), as a ratio and in microseconds per call (the ratio's excess times
    the executable's median time)."""
    per_call = lambda ratio: (ratio - 1.0) * timing.default_us  # noqa: E731
    return {
        **measured_json(timing),
        "us_per_call": per_call(timing.ratio),
        "us_per_call_iqr": [per_call(timing.ratio_low), per_call(timing.ratio_high)],
        "us_per_call_ci95": [per_call(x) for x in timing.ratio_ci95],
    }


def ratio_between(a: dict, b: dict, confidence: float = 0.95) -> tuple[float, float] | None:
    """Interval of median(a) / median(b) for two configurations timed against the same reference
    (`measured_json`): each median's distribution-free interval at 1 - (1 - confidence) / 2,
    divided crosswise, so that both hold together with at least `confidence` (Bonferroni). None
    where either holds no per-pair ratios or too few for an interval."""
    if not a.get("ratios") or not b.get("ratios"):
        return None
    each = 1.0 - (1.0 - confidence) / 2
    (a_low, a_high), (b_low, b_high) = median_interval(a["ratios"], each), median_interval(b["ratios"], each)
    if not all(map(math.isfinite, (a_low, a_high, b_low, b_high))) or b_low <= 0:
        return None
    return a_low / b_high, a_high / b_low


def outputs_json(comparison) -> dict:
    """A row's record of a configuration's outputs: the verdict, which check decided (and why not
    the float64 one), and for the float64 check the largest ratio of the plan's deviation from the
    float64 result to what it was allowed; `state_steps`: judged from the state after that many steps."""
    fields = ("bitwise_equal", "within_tolerance", "max_abs_error", "check", "fallback_reason", "state_steps")
    out = {f: getattr(comparison, f) for f in fields}
    if comparison.plan_deviation:
        shares = [p / a for p, a in zip(comparison.plan_deviation, comparison.allowed) if a]
        out["worst_share_of_allowed"] = max(shares, default=0.0)
    return out


# --------------------------------------------------------------------------- simulated rows


GRAPH_MODEL = "graph simulator"  # a row's figure costed on the captured graph (the search's model)
# Why a row captured on XLA:CPU is not costed by the compiled-program model.
NOT_COMPILED = (
    "captured on XLA:CPU: no XLA:GPU target description of this cluster's GPU is shipped "
    "(disco_jax.targets), so the program its XLA:GPU would compile cannot be compiled deviceless; "
    "XLA:CPU's own compiled program is no stand-in (its collectives are synchronous and its fusions "
    "XLA:CPU's), so every strategy is costed by the graph simulator on the captured graph"
)


def simulated_row(
    program: Program,
    cluster: clusters.Cluster,
    *,
    budget_s: float,
    seed: int = 0,
    progress: Callable | None = None,
    lowered: jax.stages.Lowered | None = None,
    relower: Callable[[frozenset[int]], CompiledProgram | None] | None = None,
    programs: Programs | None = None,
    schedule: bool | list = True,
    update_schedule: bool | list = True,
    say: Callable[[str], None] | None = None,
) -> dict:
    """One cluster row for a captured program: baselines costed, disco-jax searched, jointly over
    fusion, all-reduce buckets and which gradients' weight updates are sharded
    (`Strategy.sharded`, costed on this graph by `cost.sharded`).

    `lowered`: the step lowered for the cluster's GPU target when `program` is XLA:GPU's module
    (`capture_paper_model`). Every strategy is then compiled deviceless the way XLA:GPU enacts it
    (`_compile.compile_program`: the baselines by their compile options or the GPU rewriter,
    `baselines.compile_baselines`) and its figure (`simulated`) is the compiled-program model's
    cost of that program (`cost.compiled`: its own kernels in XLA's schedule, the cluster's kernel
    estimator and collective model), with how its kernels were costed; the graph simulator's
    figure is kept beside it as `graph_simulated`. A baseline that cannot be enacted has no
    figure, and says why (`program`). disco-jax: the search (on the graph simulator) proposes, and
    its best `RANKED_CANDIDATES` distinct candidates are compiled and ranked with XLA's own program
    by compiled cost (`_ranking.rank_by_compiled_cost`); the cheapest is what disco-jax runs (XLA's
    program where no candidate beats it). A candidate that shards updates is compiled by
    `relower(gradients)`: the step lowered again with their state sharded, as XLA compiles it.
    `programs`: the compiled programs of `lowered` (`_compile.Programs`), shared by the rows of
    one target; a fresh one when None.
    `schedule`: also search XLA:GPU's collective options on XLA's program
    (`schedule_options.search_options`; a list: the dimensions to search, False: none); the row
    records the search (`schedule_options`), the cheapest sharded update ranked is compiled again
    under the searched options and its own collectives' options searched on top (`ranked.combine`;
    `update_schedule`: the dimensions, True: the program's own, False: none), disco-jax's figure
    is the cheapest compiled of the ranked plan, the options' program and that combination, and
    `parts` gives each part's own gain over XLA's program: the weight update (a relowered sharded
    update ranked first), the rewrite (a rewritten plan ranked first), the collective options
    (None where not searched) and the combination (`combined`; None where not compiled). Every
    compiled strategy records its program's collectives (`collectives`: count, bytes, async per kind).

    Without `lowered` (XLA:CPU's module), every strategy is costed by the graph simulator, XLA's
    all-reduce combining is XLA:GPU's combiner emulated on the graph, and the row says why
    (`NOT_COMPILED`). `say(line)`: told of each option set compiled (long on paper models)."""
    graph, estimator, allreduce = program.graph, ChainEstimator([cluster.kernel_estimator()]), cluster.allreduce_model()

    def simulated(s: Strategy):
        return simulate(program, s, estimator, allreduce, bound=True)

    costs = ProgramCosts(backends.GPU, estimator, allreduce, cluster.simulator_params())  # each program once

    def costed(program: CompiledProgram) -> dict | None:
        return None if (found := costs(program)) is None else found.to_json()

    combine = backends.GPU.xla_buckets if lowered is not None else baselines.xla_gpu_buckets
    candidates = baselines.all_baselines(
        program, combine=combine, kernel_time_us=lambda ks: estimator.estimate(graph, ks)
    )
    if lowered is not None and programs is None:
        programs = Programs(lowered, program)
    compiled = baselines.compile_baselines(programs, candidates) if programs is not None else {}
    cost_model = GRAPH_MODEL if programs is None else COMPILED_MODEL
    strategies: dict[str, dict] = {}
    for b in candidates:
        enacted = compiled.get(b.name)
        on_graph = sim_json(simulated(b.strategy)) if enacted is None or enacted.enacted else None
        strategies[b.name] = {
            "simulated": on_graph if enacted is None else costed(enacted),
            "cost_model": cost_model,
            "graph_simulated": on_graph,
            "description": b.description,
            "buckets": len(b.strategy.buckets),
            "valid": on_graph is not None,
            **({} if enacted is None else {"program": enacted.to_json()}),
        }

    cost = CostModel(estimator, allreduce, {}).evaluator(program)  # incremental: `cost.kernels`
    starts, seen = [], set()
    for s in start_candidates(graph) + [b.strategy for b in candidates]:
        if s.key() not in seen:
            seen.add(s.key())
            starts.append(s)
    regions = sharded.regions_of(graph)
    if regions.shardable:
        starts.append(sharding_all(xla_default(graph), regions.shardable))
    result = backtracking_search(
        program,
        cost,
        SearchConfig(budget_s=budget_s, seed=seed),
        moves=with_sharding(regions.shardable),
        starts=starts,
        progress=progress,
    )
    best = simulated(result.best)
    disco = {
        "simulated": best.to_json(),
        "cost_model": cost_model,
        "graph_simulated": best.to_json(),
        "description": f"search from {result.best.origin}",
        "buckets": len(result.best.buckets),
        "sharded_gradients": len(result.best.sharded),
        "valid": True,
    }
    chosen = result.best.sharded
    parts = None
    if programs is not None:
        xla = compiled["JAX_default"]
        disco, chosen, best_update = ranked_plan(programs, result, xla, strategies, relower, costs)
        disco, parts, searched, changed = collective_parts(
            disco, xla, strategies, lowered, costs, schedule, best_update, relower, update_schedule, say
        )
        chosen = chosen if changed is None else changed  # the options' program or the combination's
        for name, enacted in compiled.items():
            if enacted.text is not None:
                strategies[name]["collectives"] = schedule_options.collective_summary(enacted.text)
    strategies[DISCO] = disco
    state = sum(regions.state_bytes)
    times = {k: (v["simulated"] or {}).get("iteration_us") for k, v in strategies.items()}
    fo = full_overlap_us(strategies)
    return {
        "strategies": strategies,
        "time_us": times,
        "time_kind": "simulated",
        "cost_model": cost_model,
        **({} if programs is not None else {"not_compiled": NOT_COMPILED}),
        **({} if parts is None else {"parts": parts, "schedule_options": searched}),
        **summarize(times, fo),
        # No schedule of the plan's kernels beats this (`cost.bound`; FO ignores dependencies): a
        # graph simulator figure, so only where the row's figures are the graph simulator's.
        "dependency_bound_us": best.dependency_bound_us if programs is None else None,
        "search": result.stats(),
        "weight_update": {
            "shardable_gradients": len(regions.shardable),
            "sharded_gradients": len(chosen),
            "state_bytes_per_device": {"replicated": state, DISCO: state - regions.saved_bytes(chosen)},
        },
        "search_s": result.seconds,
        "allreduce": allreduce.to_json(),
        "cluster": cluster.to_json(),
        "estimator": cluster.kernel_estimator().to_json(),
    }


@functools.lru_cache(maxsize=2)
def _paper_step(name: str, style: str, target: str, config: str) -> tuple:
    """A model's replicated step for `target`, its abstract arguments and XLA:GPU's executable of
    it (deviceless): compiled once for every sharded candidate a row ranks."""
    spec, optimizer = zoo.get_model(name, config), optax.adam(1e-3)
    mesh = targets.mesh(target, PAPER_DEVICES)
    args = zoo.abstract_state_and_batch(spec, optimizer, mesh)
    step = zoo.build_train_step(spec, optimizer, mesh, style)
    return step, args, step.lower(*args).compile()


def sharded_paper_program(
    name: str,
    style: str,
    target: str,
    graph: Graph,
    gradients: frozenset[int],
    config: str = "paper",
    options: dict | None = None,
) -> CompiledProgram | None:
    """XLA:GPU's program (deviceless, `target`) of a model's paper step lowered again with the
    optimizer state of `gradients` (of `graph`, the replicated step's module) sharded over the
    data axis (`sharding.update`), compiled with XLA's defaults (or `options`, XLA:GPU compile
    options: the sharded update under searched collective options) and XLA:GPU's hook rules, as
    the decorator captures it (`compile_program`); None where the step has no such state."""
    step, args, compiled = _paper_step(name, style, target, config)
    avals = dict(enumerate(jax.tree.leaves(args)))

    def leaves(layout):
        leaves_of = state_search.gradient_leaves(graph, layout, avals)
        return {i for g in gradients for i in leaves_of.get(g, ())}

    lowered, _, _ = update.relower_positional(step, args, compiled, leaves)
    label = "sharded update" if not options else "sharded update under options"
    return None if lowered is None else compile_program(lowered, None, label, None, dict(options or {}), backends.GPU)


def capture_paper_model(name: str, style: str, target: str | None = None) -> tuple[Program, dict, jax.stages.Lowered]:
    """The paper-size step of a zoo model, captured at the hook without running it: XLA:GPU's
    module compiled deviceless for `target` (`disco_jax.targets`), or XLA:CPU's when None."""
    spec = zoo.get_model(name, "paper")
    started = time.perf_counter()
    if target is None:
        lowered = zoo.lower_abstract(spec, optax.adam(1e-3), zoo.data_mesh(PAPER_DEVICES), style)
        program = capture(lowered, backends.CPU, (), {}).program
    else:
        lowered = zoo.lower_abstract(spec, optax.adam(1e-3), targets.mesh(target, PAPER_DEVICES), style)
        program, _ = capture_program(lowered, backends.GPU)
    return (
        program,
        {
            "captured_on": "xla-cpu" if target is None else "xla-gpu",
            "target": target,
            "capture_s": time.perf_counter() - started,
            "parameters": spec.param_count(),
            "global_batch": spec.default_global_batch,
            "per_device_batch": spec.default_global_batch // PAPER_DEVICES,
            "description": spec.description,
        },
        lowered,
    )
