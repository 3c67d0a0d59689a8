"""The graph simulator's ranking of the layout search's candidates against the compiled cost (issue
44): a decoder's candidate plans (`layout_search.candidate_plans`: every mesh shape x choice per
layer group, and the configurations written by hand) compiled deviceless for a GPU cluster and
costed by the compiled-program model (`layout_search.search_layouts`), then each distinct program
captured at the hook stage and simulated by the graph simulator with XLA's default strategy, as an
offline plan's `simulated.iteration_us` is (`eval.layout_ranks`). Prints per program the compiled
and graph-simulated step times, then Spearman's rho and Kendall's tau-b between them and where
the compiled choice stands in the graph simulator's order.

    python scripts/layout_rank_correlation.py [--layers 2] [--width 1024] [--heads 8] [--seq 1024]
        [--batch 8] [--vocab 8192] [--scan] [--remat none] [--cluster 8xH100-NVLink] [--no-hand]
        [--json out.json]

Two compiles per distinct program (the search's, and the capture's at the hook stage): pick a
shape whose candidates compile in well under a minute each on busy cores.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")

import _decoder  # noqa: E402

from disco_jax import layout_search  # noqa: E402
from disco_jax.eval import clusters, layout_ranks  # noqa: E402
from disco_jax.sharding import mesh_step  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _decoder.add_arguments(parser, layers=2, width=1024, vocab=8192, heads=8)
    parser.set_defaults(seq=1024)
    parser.add_argument("--cluster", default="8xH100-NVLink")
    parser.add_argument("--no-hand", action="store_true", help="skip the hand-written configurations")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    cluster = clusters.get_cluster(args.cluster)
    spec, step, (state, batch) = _decoder.target_step(args, cluster)
    found = mesh_step.structure(step, (state, batch))
    plans = layout_search.candidate_plans(found, cluster.gpus_per_node, hand=not args.no_hand)
    print(f"{spec.description} on {cluster.name}: {len(plans)} plans to compile", flush=True)
    search = layout_search.search_layouts(
        step, (state, batch), found, cluster, None, plans, say=lambda line: print("  " + line, flush=True)
    )
    print("graph simulator on each distinct program (capture at the hook stage, XLA's default strategy):")
    ranks = layout_ranks.layout_ranks(
        step, (state, batch), found, search.candidates, cluster, say=lambda line: print("  " + line, flush=True)
    )
    print("\n| plan (and plans that compiled to the same program) | compiled | graph simulator |")
    print("|---|---:|---:|")
    for p in sorted(ranks.points, key=lambda p: p.compiled_us):
        same = f" (= {'; '.join(p.same_program)})" if p.same_program else ""
        graph = f"{p.graph_us / 1e3:.2f} ms" if p.graph_us is not None else f"- ({p.why_not})"
        print(f"| {p.label}{same} | {p.compiled_us / 1e3:.2f} ms | {graph} |")
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    print(
        f"\n{len(plans)} plans, {len(ranks.points)} distinct compiled programs ({ranks.not_compiled} plans did not"
        f" compile); {len(ranks.simulated)} simulated by the graph simulator, {len(ranks.left_out)} left out"
    )
    print(f"Spearman rho {fmt(ranks.spearman)}, Kendall tau-b {fmt(ranks.kendall)} (compiled against graph)")
    print(
        f"the compiled cheapest ({search.chosen.plan.label if search.chosen else '-'}) is number "
        f"{ranks.graph_rank_of_compiled_best()} of {len(ranks.simulated)} in the graph simulator's order"
    )
    if args.json:
        record = {
            "args": vars(args),
            "model": spec.description,
            "cluster": cluster.name,
            "ranks": ranks.to_json(),
            "search": search.to_json(found),
        }
        with open(args.json, "w") as out:
            json.dump(record, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
