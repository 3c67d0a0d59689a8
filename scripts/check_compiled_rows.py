"""Issue 45's row checks over the stored simulated rows costed on the compiled program
(`report/rows/*.paper.*.json` whose cost model is the compiled program's): no disco-jax program
costs more than XLA's own (JAX_default's compiled cost), and each part's own gain over XLA's
program per model and cluster (the weight update, the rewrite, XLA:GPU's collective options, and
the sharded update compiled under the searched options with its own collectives' options searched
on top: "combined", "not searched" in rows made before it was), with the weight-update choice as
it was made (how many gradients' updates each compiled program shards, the graph simulator's
figure that proposed it and the compiled figure that decided) and that search on the sharded
update (from its start to the cheapest, with the options it added).
Reads the rows only; exits 1 when a check fails.

    python scripts/check_compiled_rows.py [--rows report/rows] [--platforms 8xH100-NVLink 4x8xH100-IB400]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from disco_jax.eval.ranked import COMPILED_MODEL
from disco_jax.eval.rows import ALL_MODELS, DISCO

PARTS = ("weight_update", "rewrite", "collective_options", "combined")  # the order the header names them


def gain(g: float | None) -> str:
    return "not searched" if g is None else f"{g:.3f}x"


def combined_search(row: dict) -> str:
    """The sharded update's own collectives' options searched in the row (`ranked.combine`): from
    the sharded update under the replicated step's options to the cheapest, option sets and
    distinct programs; what rows made before that search recorded otherwise."""
    combined = (row.get("schedule_options") or {}).get("combined")
    if combined is None:
        return "not compiled"
    search = combined.get("search")
    if search is None:
        return f"{combined['compiled_us'] / 1e3:.2f} ms under {combined['options'] or 'XLA defaults'}, no search on it"
    sets = search["candidates"]
    distinct = sum(1 for c in sets if c["same_program_as"] is None and c["compiled_us"] is not None)
    start, chosen = search["default"]["compiled_us"], search["chosen"]["compiled_us"]
    added = {k: v for k, v in search["options"].items() if k not in search["default"]["options"]}
    return (
        f"{start / 1e3:.2f} -> {chosen / 1e3:.2f} ms ({start / chosen:.4f}x; {len(sets)} sets, {distinct} "
        f"distinct) adding {added or 'nothing'}; = {combined['same_program_as'] or 'own program'}"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=str(Path(__file__).resolve().parent.parent / "report" / "rows"))
    p.add_argument("--platforms", nargs="+", default=["8xH100-NVLink", "4x8xH100-IB400"])
    a = p.parse_args()
    failures = []
    parts = "weight update / rewrite / options / combined"
    print(f"{'model':12} {'cluster':16} {'XLA ms':>8} {'disco ms':>9} {'ratio':>6}  {parts}")
    for platform in a.platforms:
        for model in ALL_MODELS:
            path = Path(a.rows) / f"{model}.paper.jit.{platform}.json"
            if not path.exists():
                print(f"{model:12} {platform:16} no row")
                failures.append(f"{model} {platform}: no row")
                continue
            row = json.loads(path.read_text())
            if row.get("cost_model") != COMPILED_MODEL:
                failures.append(f"{model} {platform}: not costed on the compiled program")
                continue
            xla, disco = row["time_us"]["JAX_default"], row["time_us"][DISCO]
            parts = row.get("parts")
            cells = "parts not recorded" if parts is None else " / ".join(gain(parts.get(k)) for k in PARTS)
            print(f"{model:12} {platform:16} {xla / 1e3:8.2f} {disco / 1e3:9.2f} {xla / disco:6.3f}  {cells}")
            entry = row["strategies"][DISCO]
            choices = entry.get("weight_update_choice")
            if choices:
                shardable = row["weight_update"]["shardable_gradients"]
                told = "; ".join(
                    f"{c['sharded_gradients']}/{shardable} sharded: graph "
                    + ("n/a" if c["graph_simulated_us"] is None else f"{c['graph_simulated_us'] / 1e3:.2f}")
                    + f" ms, compiled {c['compiled_us'] / 1e3:.2f} ms"
                    for c in sorted(choices, key=lambda c: c["compiled_us"] or float("inf"))
                    if c["compiled_us"] is not None
                )
                print(f"{'':30} weight-update choice by compiled program: {told}")
            print(f"{'':30} update under options: {combined_search(row)}")
            if disco > xla:
                failures.append(f"{model} {platform}: disco-jax {disco:.1f} us > XLA's {xla:.1f} us")
            if parts is None:
                failures.append(f"{model} {platform}: each part's gain not recorded")
    print("\n" + ("every check holds" if not failures else "FAILED:\n  " + "\n  ".join(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
