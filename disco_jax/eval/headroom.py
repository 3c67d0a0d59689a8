"""What keeps a simulated row short of full overlap (FO): the dependency bound's share of FO's
headroom, and per row below `TARGET` of it, which limit applies first.

A row's headroom is T_best - FO (the best baseline against max(compute, comm)); disco-jax
captures (T_best - T_disco) / (T_best - FO) of it. Below `TARGET`, one of three things stops it,
tested in this order:

* **enactment** (rows captured on XLA:GPU): the plan the search found captures `TARGET` or more as
  searched, the program XLA:GPU compiled from it does not (a plan that shards weight updates is
  enacted under XLA's fusions; XLA:GPU's own passes run after the rewrite);
* **kernels**: no order of the plan's kernels reaches it: its dependency bound (`cost.bound`)
  allows less than `TARGET`. Only other kernels (fusions, buckets, sharded updates) can;
* **order**: the bound allows it, the simulated program order (XLA's order, which plans keep)
  does not reach it. Another order of the same kernels might, or the bound is loose (it takes
  each lane on its own); the search changes kernels, not their order.
"""

from __future__ import annotations

from disco_jax.eval.rows import DISCO, headroom_share

TARGET = 0.85

ENACTMENT, KERNELS, ORDER = "enactment", "kernels", "order"


def captured(r: dict, time_us: float | None) -> float | None:
    """The share of the row's FO headroom an iteration of `time_us` captures (`rows.headroom_share`);
    None without a time."""
    return None if time_us is None else headroom_share(r["best_baseline_us"], r["fo_us"], time_us)


def bound_allows(r: dict) -> float | None:
    """The share of FO's headroom the dependency bound of disco-jax's plan leaves reachable."""
    return captured(r, r.get("dependency_bound_us"))


def limit(r: dict) -> tuple[str, float, float] | None:
    """For a row below `TARGET`: (what limits it, the share captured, the share the limit names:
    as searched for enactment, as any order allows for kernels and order); None at or above."""
    share = r["headroom_captured"]
    if share is None or share >= TARGET:
        return None
    searched = captured(r, (r["strategies"][DISCO].get("searched") or {}).get("iteration_us"))
    if searched is not None and searched >= TARGET:
        return ENACTMENT, share, searched
    allows = bound_allows(r)
    if allows is None:
        return None
    return (KERNELS if allows < TARGET else ORDER), share, allows


def limits_text(rows: list[dict]) -> str:
    """The rows below `TARGET` of a platform, grouped by what limits them (report prose)."""
    groups: dict[str, list[str]] = {ENACTMENT: [], KERNELS: [], ORDER: []}
    for r in rows:
        found = limit(r)
        if found is not None:
            kind, share, other = found
            named = "as searched" if kind == ENACTMENT else "allowed"
            groups[kind].append(f"{r['model']} {share:.0%} ({other:.0%} {named})")
    what = {
        ENACTMENT: "enactment (the plan as searched captures it, the program XLA:GPU compiles from it does not)",
        KERNELS: "kernels (no order of the plan's kernels reaches it)",
        ORDER: "order (the plan's dependency bound allows it, its program order does not reach it)",
    }
    parts = [f"{what[kind]}: {', '.join(items)}" for kind, items in groups.items() if items]
    if not parts:
        return f"Every row captures {TARGET:.0%} of FO's headroom or more."
    return f"Below {TARGET:.0%} of FO's headroom, by what limits the row: " + "; ".join(parts) + "."
