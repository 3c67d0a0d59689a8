"""The compiled-program cost model against the graph-level simulator, on one paper-size step for a GPU cluster.

For a zoo model's ``paper`` config lowered for a cluster's GPU target (deviceless, 8 devices,
`rows.capture_paper_model`'s capture), prints:

* XLA's default program: the compiled module's kernels (`backends.compiled.read_kernels`) and
  its step as the compiled-program model costs it (`cost.compiled_cost`), beside the graph-level
  simulator's figure for the same program read back onto the graph (`with_xla_decisions`), and
  how many of that reading's kernel groups lie on a kernel XLA scheduled;
* with ``--budget S`` > 0, the plan a short search picks on the graph-level simulator, enacted by
  the GPU rewriter and compiled (`compile_strategy`), costed both ways as well.

Both use the cluster's kernel estimator and collective model, with the H100's fitted constants
(``fitted``) and as they were assumed before the fit (``assumed``: 5 us launch added to every
kernel, GNN included; 80% of the HBM bandwidth; the graph simulator's 50.8 ms of issue 30), to
separate what the constants change from what the model changes. The search uses the first.

    python scripts/compiled_cost.py [--model transformer] [--cluster 8xH100-NVLink] [--budget 30]
        [--constants fitted assumed] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import optax

from disco_jax import (
    ChainEstimator,
    CostModel,
    SearchConfig,
    backends,
    backtracking_search,
    cost,
    simulate,
    targets,
    zoo,
)
from disco_jax._compile import capture_program, compile_strategy
from disco_jax._strategy import xla_default
from disco_jax.eval import clusters, gpus, rows

ASSUMED = {"launch_us": (5.0, "us"), "memory_efficiency": (0.8, "fraction")}  # before the fit (issue 30)


def estimator_for(cluster: clusters.Cluster, constants: str):
    """The cluster's kernel estimator with the fitted constants, or as it was before the fit."""
    if constants == "fitted":
        return cluster.kernel_estimator()
    device = dataclasses.replace(
        cluster.device,
        **{k: gpus.Quantity(v, unit, "as assumed before the fit", assumption=True) for k, (v, unit) in ASSUMED.items()},
    )
    launch = device.launch_us.value
    gnn = [cost.OverheadEstimator(p, launch) for p in cost.plugin_estimators(device.device_kind)]
    return cost.chain(*gnn, gpus.RooflineEstimator(device))


def graph_reading(program, estimator, allreduce) -> dict:
    """The graph-level simulator on XLA's program read back onto the graph: its time, and its
    kernel groups split by whether they lie on a kernel XLA scheduled (and what each part costs)."""
    graph = program.graph
    sim = simulate(program, xla_default(graph), estimator, allreduce)
    scheduled = {k.name for k in graph.xla_schedule}
    groups = [frozenset(g) for g in graph.xla_groups]
    times = estimator.estimate(graph, groups)
    on = [t for t, n in zip(times, graph.xla_kernel_names) if n in scheduled]
    off = [t for t, n in zip(times, graph.xla_kernel_names) if n not in scheduled]
    return {
        "simulated": None if sim is None else sim.to_json(),
        "groups": len(groups),
        "groups_on_a_kernel": len(on),
        "groups_on_a_kernel_us": sum(on),
        "groups_on_no_kernel": len(off),
        "groups_on_no_kernel_us": sum(off),
    }


def compiled_figures(text: str, estimator, allreduce) -> dict:
    program = cost.compiled_program(text, backends.GPU)
    costed = cost.cost_program(program, estimator, allreduce)
    kinds: dict[str, int] = {}
    for k in program.kernels:
        kinds[k.kind] = kinds.get(k.kind, 0) + 1
    # Where the time goes: per (kind, method), the kernels' count and summed time.
    split: dict[str, list[float]] = {}
    for k in costed.kernels:
        entry = split.setdefault(f"{k.kind} by {k.method}", [0, 0.0])
        entry[0] += 1
        entry[1] += k.time_us
    largest = max(program.compute_kernels, key=lambda k: len(program.ops[k.name]))
    return {
        "module_kernels": kinds,
        "time_by_kind_and_method_us": split,
        "largest_kernel": {"name": largest.name, "ops": len(program.ops[largest.name])},
        **costed.to_json(),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="transformer")
    parser.add_argument("--cluster", default="8xH100-NVLink")
    parser.add_argument("--budget", type=float, default=0.0, help="search budget (s); 0: XLA's program only")
    parser.add_argument("--constants", nargs="+", choices=("fitted", "assumed"), default=["fitted", "assumed"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    cluster = clusters.get_cluster(args.cluster)
    allreduce = cluster.allreduce_model()
    started = time.perf_counter()
    spec = zoo.get_model(args.model, "paper")
    lowered = zoo.lower_abstract(spec, optax.adam(1e-3), targets.mesh(cluster.target, rows.PAPER_DEVICES), "jit")
    program, compiled = capture_program(lowered, backends.GPU)
    programs = {"default": (program, compiled.as_text())}
    out = {"model": args.model, "cluster": cluster.name, "capture_s": time.perf_counter() - started}
    print(f"captured in {out['capture_s']:.0f} s", flush=True)
    if args.budget > 0:  # searched on the first constants' graph-level simulator
        estimator = ChainEstimator([estimator_for(cluster, args.constants[0])])
        search_cost = CostModel(estimator, allreduce, {}).evaluator(program)
        result = backtracking_search(program, search_cost, SearchConfig(budget_s=args.budget, seed=0))
        plan_compiled, status = compile_strategy(lowered, program, result.best)
        text = plan_compiled.as_text()
        read = backends.GPU.read_decisions(program.graph, text)
        programs["searched"] = (dataclasses.replace(program, graph=read), text)
        out["search"] = {"status": status, "constants": args.constants[0], "searched_us": search_cost(result.best)}
        print(f"searched and compiled ({status}) at {time.perf_counter() - started:.0f} s", flush=True)
    for constants in args.constants:
        estimator = ChainEstimator([estimator_for(cluster, constants)])
        for label, (read, text) in programs.items():
            figures = out.setdefault(constants, {})[label] = {
                "graph": graph_reading(read, estimator, allreduce),
                "compiled": compiled_figures(text, estimator, allreduce),
            }
            g, c = figures["graph"], figures["compiled"]
            print(
                f"{args.model} {label} ({constants} constants): compiled module {c['num_kernels']} kernels + "
                f"{c['num_collectives']} collectives ({c['module_kernels']}), compiled-program model "
                f"{c['iteration_us'] / 1e3:.2f} ms (compute {c['compute_us'] / 1e3:.2f}, "
                f"comm {c['comm_us'] / 1e3:.2f}, "
                f"FO {c['full_overlap_us'] / 1e3:.2f}; costed by {c['costed_by']}); graph simulator "
                f"{(g['simulated'] or {}).get('iteration_us', float('nan')) / 1e3:.2f} ms over {g['groups']} groups, "
                f"{g['groups_on_a_kernel']} on a scheduled kernel ({g['groups_on_a_kernel_us'] / 1e3:.2f} ms), "
                f"{g['groups_on_no_kernel']} on none ({g['groups_on_no_kernel_us'] / 1e3:.2f} ms)",
                flush=True,
            )
    out["elapsed_s"] = time.perf_counter() - started
    print(f"{out['elapsed_s']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
