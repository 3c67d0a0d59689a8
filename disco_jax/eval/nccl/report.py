"""The fit per table, as the text ``python -m disco_jax.eval.nccl`` prints (docs/collectives.md).

One row per table of `tables.TABLES` against the model of its shape and fabric (`model.table_fit`),
then the InfiniBand model on the two-node tables of other fabrics, then the regimes of the
simulated clusters' models. `TARGETS` are the issue's: median absolute relative error at most 10%
on every fitted table, at most 15% on every held-out one.
"""

from __future__ import annotations

from disco_jax.eval.nccl.model import FABRICS, collective_model, table_fit
from disco_jax.eval.nccl.tables import TABLES, Table

TARGETS = {"fitted": 0.10, "held-out": 0.15}
SHAPES = ((8, 1, "nvlink"), (8, 4, "ib"))  # the simulated H100 clusters


def _size(nbytes: int) -> str:
    for unit in ("B", "K", "M", "G"):
        if nbytes < 1024 or unit == "G":
            return f"{nbytes:.3g}{unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def _row(table: Table, fabric: str | None = None) -> str:
    fit = table_fit(table, fabric)
    target = TARGETS.get(table.role)
    verdict = "" if target is None or fabric else ("ok" if fit["median_abs_rel_error"] <= target else "MISSED")
    worst = ", ".join(f"{_size(b)} {100 * e:+.0f}%" for b, e in fit["worst"])
    role = table.role if fabric is None else f"{table.fabric} table"
    return (
        f"| {role} | {table.file} | {table.collective} {table.algorithm} | {fit['model']} | {fit['sizes']} "
        f"| {100 * fit['median_abs_rel_error']:.1f}% | {100 * fit['max_abs_rel_error']:.0f}% | {worst} | {verdict} |"
    )


def fit_report() -> str:
    head = "| role | table | collective, algorithm | model | sizes | median abs | max abs | worst sizes | target |"
    rule = "|---|---|---|---|---:|---:|---:|---|---|"
    out = ["## Fit per table (relative error = (model - measured) / measured)", "", head, rule]
    out += [_row(t) for t in TABLES]
    others = [t for t in TABLES if t.fabric in FABRICS and t.fabric != "ib"]
    out += ["", "## The InfiniBand model on the tables of other fabrics (not its fabric)", "", head, rule]
    out += [_row(t, "ib") for t in others]
    out += ["", "## Regimes of the simulated H100 clusters' models", ""]
    for g, m, fabric in SHAPES:
        model = collective_model(g, m, fabric)
        out += [f"{g} x {m} over {fabric}" + (f" (node network {model.node_bandwidth_GBps:.0f} GB/s)" if m > 1 else "")]
        for collective, regimes in model.regimes.items():
            parts = [
                f"{r['algorithm']}/{r['protocol']} {r['latency_us']:.1f} us + busbw {r['busbw_GBps']:.0f} GB/s"
                for r in (x.to_json(collective, model.num_devices) for x in regimes)
            ]
            out.append(f"- {collective}: " + "; ".join(parts))
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def main() -> None:
    print(fit_report(), end="")
