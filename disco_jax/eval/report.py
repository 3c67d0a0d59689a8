"""The benchmark report: ``README.md`` and the figures of a report folder, from its rows.

The report's prose is `report_template.md` (package data, beside this file): named sections, each
a `string.Template` (`report_text.fill`, with the number formats). This module computes the numbers
and tables and fills them in, the measured platforms' parts in `report_measured`; which sections
appear depends on the rows (e.g. the simulator-accuracy section needs a measured platform).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

from disco_jax._files import write_json_atomic
from disco_jax.backends import CPU, GPU, Backend
from disco_jax.eval import baselines, clusters, gpus, headroom, report_large, report_measured
from disco_jax.eval import report_text as fmt
from disco_jax.eval.figures import write_figures
from disco_jax.eval.ranked import ranked_parts
from disco_jax.eval.rows import (
    BASELINE_ORDER,
    COMPILED_MODEL,
    DISCO,
    STRATEGY_ORDER,
    load_rows,
    model_order,
    platform_order,
)

SHORT_NAMES = {
    "JAX_no_fusion": "no_fusion",
    "JAX_op_fusion": "op_fusion",
    "JAX_AllReduce_fusion": "AR_fusion",
    "JAX_default": "default",
    "PyTorch_DDP": "DDP",
    "Horovod": "Horovod",
    DISCO: "**disco-jax**",
}


def write_report(out: str | os.PathLike, *, style: str | None = None, run_info: dict | None = None) -> Path:
    """README.md and the figures of the report folder, from its rows. `run_info` (a run's
    config, elapsed time and failures) is added to ``run.json``; without it the stored one is used."""
    out = Path(out)
    rows = [report_measured.readable(r) for r in load_rows(out, style)]
    info_path = out / "run.json"
    if run_info:
        previous = json.loads(info_path.read_text()) if info_path.exists() else {}
        run_info = {
            **run_info,
            "runs": previous.get("runs", [])
            + [{"finished": time.strftime("%Y-%m-%dT%H:%M:%S"), "elapsed_s": run_info.get("elapsed_s")}],
        }
        write_json_atomic(info_path, run_info)
    elif info_path.exists():
        run_info = json.loads(info_path.read_text())
    figures = write_figures(out, rows)
    readme = out / "README.md"
    calibration = out / AA_CALIBRATION
    if calibration.exists():  # the A/A run kept beside the rows (scripts/aa_calibration.py --json)
        run_info = {**(run_info or {}), "aa_calibration": json.loads(calibration.read_text())}
    readme.write_text(report_markdown(rows, figures, run_info or {}, extra=report_large.blocks(out)))
    return readme


AA_CALIBRATION = "aa_calibration.json"  # `scripts/aa_calibration.py --json`, kept in the report folder


def aa_coverage_text(calibration: dict | None) -> str:
    """What the A/A calibration kept beside the rows says of the intervals, in one sentence."""
    if not calibration:
        return (
            "No A/A calibration is kept with these rows: how often the intervals hold at their stated 95% "
            f"on this machine is measured by `scripts/aa_calibration.py --json {AA_CALIBRATION}`"
        )
    config, summary = calibration["config"], calibration["summary"]["ratio_interval"]
    n = len(calibration["comparisons"])
    processes = config.get("processes", 1)  # 2: a gloo job, each pair at its slowest process
    platform = f"{processes} processes x {config['devices']}" if processes > 1 else f"{config['devices']}"
    return (
        f"A/A calibration ({config['model']} tiny on {platform} CPU devices, one executable timed "
        f"against itself {n} times): the acceptance rule's intervals held 1 in "
        f"{summary['acceptance_coverage']:.1%} of the comparisons and the report's in "
        f"{summary['report_coverage']:.1%} (stated: 95%)"
    )


# --------------------------------------------------------------------------- the report


def report_markdown(rows: list[dict], figures: dict[str, str], run_info: dict, extra: list[str] = ()) -> str:
    """The report's README.md; `extra`: sections kept beside the rows (`report_large.blocks`), after
    the paper's models."""
    platforms, models = platform_order(rows), model_order(rows)
    by_key = {(r["platform"], r["model"]): r for r in rows}
    by_platform = {p: [by_key[(p, m)] for m in models if (p, m) in by_key] for p in platforms}
    by_platform = {p: prow for p, prow in by_platform.items() if prow}
    blocks = [fmt.fill("header")]
    runs = run_info.get("runs") or []
    if runs:
        config = run_info.get("config") or {}
        total = sum((r.get("elapsed_s") or 0) for r in runs)
        blocks.append(
            fmt.fill(
                "run_summary",
                rows=len(rows),
                minutes=f"{total / 60:.0f}",
                runs=len(runs),
                budget_s=config.get("budget_s", "?"),
                cpu_budget_s=config.get("cpu_budget_s", "?"),
                pairs=config.get("pairs", "?"),
                style=config.get("style", "jit"),
            )
        )
    # A variant (`transformer:scan_layers=True`) would count its model twice in the aggregates.
    models_only = {p: [r for r in prow if ":" not in r["model"]] for p, prow in by_platform.items()}
    blocks += _headline({p: prow for p, prow in models_only.items() if prow})
    blocks.append(fmt.fill("tables"))
    for prow in by_platform.values():
        blocks += _platform_tables(prow)
    blocks += _parts(rows)
    blocks += _variants(by_key, platforms, models)
    blocks.append(fmt.fill("figures"))
    if "fig6" in figures:
        blocks.append(fmt.fill("fig6", file=figures["fig6"]))
    for platform in by_platform:
        if f"fig7_{platform}" in figures:
            blocks.append(fmt.fill("fig7", platform=platform, file=figures[f"fig7_{platform}"]))
    measured = {p: prow for p, prow in by_platform.items() if prow[0]["time_kind"] == "measured"}
    if measured:
        blocks.append(fmt.fill("accuracy"))
        for prow in measured.values():
            blocks += report_measured.accuracy(prow, figures)
    blocks += _paper_models(rows, models)
    blocks += list(extra)
    blocks += _baselines_and_clusters()
    blocks.append(
        fmt.fill(
            "caveats",
            h100_calibration=gpus.calibration_text(gpus.H100_SXM),
            aa_coverage=aa_coverage_text(run_info.get("aa_calibration")),
        )
    )
    failures = run_info.get("failures") or []
    if failures:
        blocks.append(
            fmt.fill(
                "failures",
                failures="\n".join(f"- {model}: exit code {code}, log `{log}`" for model, code, log in failures),
            )
        )
    return "\n\n".join(blocks) + "\n\n"


def _headline(by_platform: dict[str, list[dict]]) -> list[str]:
    items, losses = [], []
    for platform, prow in by_platform.items():
        ratios = [r["best_baseline_us"] / r["disco_us"] for r in prow]
        captured = sorted(r["headroom_captured"] for r in prow if r["headroom_captured"] is not None)
        best = max(prow, key=lambda r: r["speedup"])
        worst = min(prow, key=lambda r: r["speedup"])
        fo = fmt.geomean([r["best_baseline_us"] / r["fo_us"] for r in prow if r["fo_us"] > 0]) - 1
        items.append(
            fmt.fill(
                "headline_platform",
                platform=platform,
                kind=prow[0]["time_kind"],
                devices=prow[0]["num_devices"],
                models=len(prow),
                geomean=fmt.pct(fmt.geomean(ratios) - 1),
                best=fmt.speedup(best),
                best_model=best["model"],
                worst=fmt.speedup(worst),
                worst_model=worst["model"],
                captured=fmt.frac(statistics.median(captured) if captured else None),
                fo=fmt.pct(fo),
                bound=_bound_headline(prow),
                plans=report_measured.plans_headline(prow) + report_measured.fair_headline(prow)
                if prow[0]["time_kind"] == "measured"
                else "",
            )
        )
        losses += [r for r in prow if r["speedup"] < 0]
    loss_items = []
    for r in losses:
        extra = ""
        if r["time_kind"] == "measured":
            d = r["strategies"][DISCO]
            extra = fmt.fill(
                "loss_measured",
                reference=fmt.reference(r),
                disco_ratio=fmt.iqr(d["measured"], 3),
                best=r["best_baseline"],
                best_ratio=fmt.iqr(r["strategies"][r["best_baseline"]]["measured"], 3),
                description=report_measured.disco_summary(r),
            )
        loss_items.append(
            fmt.fill(
                "loss",
                model=r["model"],
                platform=r["platform"],
                disco_ms=fmt.ms(r["disco_us"]),
                best=r["best_baseline"],
                best_ms=fmt.ms(r["best_baseline_us"]),
                speedup=fmt.speedup(r),
                measured=extra,
            )
        )
    return [
        fmt.fill("headline"),
        "\n".join(items),
        fmt.fill("losses"),
        "\n".join(loss_items) if loss_items else fmt.fill("no_losses"),
    ]


def _parts(rows: list[dict]) -> list[str]:
    """Each part's own gain over XLA's program per compiled row (model and cluster): the weight
    update, the rewrite, XLA's collective options; and the collectives disco-jax's program runs,
    as compiled. Rows made before the parts were recorded say so."""
    compiled = [r for r in rows if r.get("cost_model") == COMPILED_MODEL]
    if not compiled:
        return []
    gain = lambda g: "not searched" if g is None else f"{g:.3f}x"  # noqa: E731
    lines = [
        "| model | cluster | XLA (ms) | disco-jax (ms) | weight update | rewrite | collective options "
        "| update under options | disco-jax's collectives |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in compiled:
        disco = r["strategies"][DISCO]
        # Rows made before the parts were recorded: the ranked program's part, options not searched.
        parts = r.get("parts") or ranked_parts(r["time_us"]["JAX_default"], disco)
        ran = disco.get("collectives")
        ran = (
            "not recorded"
            if ran is None
            else ", ".join(
                f"{k} {v['count']} ({v['bytes'] / 2**20:.0f} MiB, {v['async']} async)" for k, v in ran.items()
            )
        )
        cells = [gain(parts.get(k)) for k in ("weight_update", "rewrite", "collective_options", "combined")]
        lines.append(
            f"| {r['model']} | {r['platform']} | {r['time_us']['JAX_default'] / 1e3:.2f} | "
            f"{r['time_us'][DISCO] / 1e3:.2f} | {' | '.join(cells)} | {ran} |"
        )
    return [fmt.fill("parts", table="\n".join(lines))]


def _bound_headline(prow: list[dict]) -> str:
    allows = {r["model"]: a for r in prow if (a := headroom.bound_allows(r)) is not None}
    if not allows:
        return ""
    gap = {r["model"]: r["disco_us"] / r["dependency_bound_us"] - 1 for r in prow if r["model"] in allows}
    limited = ", ".join(f"{m} {fmt.frac(a)}" for m, a in allows.items() if a < headroom.TARGET)
    target = fmt.frac(headroom.TARGET)
    return fmt.fill(
        "headline_bound",
        allowed=fmt.frac(statistics.median(allows.values())),
        limited=f"below {target} on {limited}" if limited else f"{target} or more on every row",
        gap=fmt.pct(statistics.median(gap.values())),
        ordered=", ".join(f"{m} {fmt.pct(g)}" for m, g in gap.items() if g > 0.05) or "none",
        limits=headroom.limits_text(prow),
    )


def _platform_tables(prow: list[dict]) -> list[str]:
    r0 = prow[0]
    strategies = " | ".join(SHORT_NAMES[s] for s in STRATEGY_ORDER)
    align = "|".join(["---:"] * len(STRATEGY_ORDER))
    measured = r0["time_kind"] == "measured"
    if measured:
        heading = fmt.fill(
            "platform_measured",
            platform=r0["platform"],
            devices=r0["num_devices"],
            reference=fmt.reference(r0),
            kernels=r0["kernels"],
        )
    else:
        heading = fmt.fill(
            "platform_simulated",
            platform=r0["platform"],
            devices=r0["num_devices"],
            kernels=r0["kernels"],
            cluster=(r0.get("cluster") or {}).get("description", ""),
            captured=(
                f"XLA:GPU for `{r0.get('target')}`, deviceless; every strategy costed as XLA:GPU compiled it"
                if r0.get("captured_on") == "xla-gpu"
                else "XLA:CPU (its fusion; XLA:GPU's all-reduce combiner emulated); costed by the graph simulator"
            ),
        )
    lines = []
    for r in prow:
        search_s = r.get("search_s")
        lines.append(
            fmt.table_row(
                [
                    r["model"],
                    *[
                        (f"**{fmt.ms(r['time_us'].get(s))}**" if s == DISCO else fmt.ms(r["time_us"].get(s)))
                        for s in STRATEGY_ORDER
                    ],
                    r["best_baseline"],
                    fmt.speedup(r),
                    fmt.ms(r["fo_us"]),
                    fmt.pct(r.get("fo_speedup")),
                    fmt.frac(r["headroom_captured"]),
                    fmt.ms(r.get("dependency_bound_us")),
                    fmt.frac(headroom.bound_allows(r)),
                    "n/a" if search_s is None else f"{search_s:.1f}",
                    r["kernels"],
                ]
            )
        )
    blocks = [heading, fmt.fill("platform_table", strategies=strategies, strategy_align=align, rows="\n".join(lines))]
    sharded = [
        f"{r['model']} {u['sharded_gradients']} of {u['shardable_gradients']} gradients "
        f"({fmt.gb(u['state_bytes_per_device']['replicated'])} → {fmt.gb(u['state_bytes_per_device'][DISCO])})"
        for r in prow
        if (u := r.get("weight_update")) and u["sharded_gradients"]
    ]
    if not measured and any(r.get("weight_update") for r in prow):
        blocks.append(fmt.fill("sharded_updates", rows="; ".join(sharded) or "none"))
    if measured:
        details = [
            fmt.table_row(
                [r["model"], *[report_measured.measured_cell(r["strategies"].get(s) or {}) for s in STRATEGY_ORDER]]
            )
            for r in prow
        ]
        blocks.append(
            fmt.fill(
                "measured_details",
                reference=fmt.reference(r0),
                strategies=strategies,
                strategy_align=align,
                rows="\n".join(details),
                disco_per_model="; ".join(f"{r['model']}: {report_measured.disco_summary(r)}" for r in prow),
            )
        )
        searched = [line for r in prow if (line := report_measured.search_summary(r))]
        if searched:
            blocks.append(fmt.fill("search_records", rows="\n".join(f"- {line}" for line in searched)))
        if all(r.get("reference") for r in prow):
            blocks.append(report_measured.fair_details(prow))
    return blocks


def _variants(by_key: dict, platforms: list[str], models: list[str]) -> list[str]:
    """Each model variant's row (`zoo.get_model`'s ``transformer:scan_layers=True``) beside its
    model's on every platform both ran: JAX default's and disco-jax's times and their ratios."""
    lines = []
    for variant in (m for m in models if ":" in m):
        model = variant.partition(":")[0]
        for p in platforms:
            base, var = by_key.get((p, model)), by_key.get((p, variant))
            if base is None or var is None:
                continue
            times = [(base["time_us"][s], var["time_us"][s]) for s in ("JAX_default", DISCO)]
            capture = [r.get("capture_s") for r in (base, var)]
            cells = [p, model, variant]
            for b, v in times:
                cells += [f"{b / 1e3:.2f} / {v / 1e3:.2f}", f"{v / b:.3f}"]
            cells.append(" / ".join("?" if c is None else f"{c:.0f}" for c in capture))
            lines.append(fmt.table_row(cells))
    return [fmt.fill("variants", rows="\n".join(lines))] if lines else []


def _paper_models(rows: list[dict], models: list[str]) -> list[str]:
    """What was captured of the paper-size models and how long it took: per model its XLA:GPU
    capture where a row has one (the H100 clusters'), else its XLA:CPU one (cluster A's)."""
    paper: dict[str, dict] = {}
    simulated = [r for r in rows if r["time_kind"] == "simulated"]
    for r in sorted(simulated, key=lambda r: r.get("captured_on") != "xla-gpu"):
        paper.setdefault(r["model"], r)
    if not paper:
        return []
    lines = []
    for m in models:
        r = paper.get(m)
        if r is None:
            continue
        g = r.get("graph") or {}
        lines.append(
            fmt.table_row(
                [
                    m,
                    f"{r.get('parameters', 0) / 1e6:.1f} M",
                    r.get("global_batch", "?"),
                    f"{r.get('capture_s', 0):.1f}",
                    g.get("ops", "?"),
                    g.get("gradients", "?"),
                    f"{g.get('gradient_bytes', 0) / 2**20:.0f}",
                    g.get("xla_allreduces", "?"),
                    "XLA:GPU " + r["target"] if r.get("captured_on") == "xla-gpu" else "XLA:CPU",
                ]
            )
        )
    blocks = [fmt.fill("paper_models", rows="\n".join(lines))]
    heavy = [
        (m, paper[m]["graph"]["gradient_bytes"] / (4 * paper[m]["parameters"]))
        for m in models
        if m in paper and paper[m].get("parameters") and (paper[m].get("graph") or {}).get("gradient_bytes")
    ]
    heavy = [(m, x) for m, x in heavy if x > 1.5]
    if heavy:
        blocks.append(fmt.fill("heavy_gradients", models=", ".join(f"{m} ({x:.1f}x)" for m, x in heavy)))
    return blocks


def _enacted_by(name: str, backend: Backend = CPU) -> str:
    """How `backend` enacts a baseline: its compile options, or our rewrite."""
    options = backend.baseline_options.get(name)
    if options is None:
        return fmt.fill("enacted_by_rewrite")
    if not options:
        return fmt.fill("enacted_by_defaults")
    return fmt.fill("enacted_by_options", options="; ".join(f"{k}={v}" for k, v in options.items()))


def _baselines_and_clusters() -> list[str]:
    blocks = [
        fmt.fill(
            "baselines",
            rows="\n".join(
                fmt.table_row([name, _enacted_by(name), _enacted_by(name, GPU), baselines.SOURCES[name]])
                for name in BASELINE_ORDER
            ),
        )
    ]
    cluster_rows = [
        fmt.table_row(
            [
                c.name,
                f"{c.num_devices} ({c.nodes} x {c.gpus_per_node})",
                c.device.name,
                c.intra.name,
                c.inter.name if c.inter else "-",
                clusters.describe_allreduce(c),
            ]
        )
        for c in clusters.CLUSTERS.values()
    ]
    blocks.append(fmt.fill("clusters", rows="\n".join(cluster_rows)))
    for c in clusters.CLUSTERS.values():
        numbers = [
            fmt.fill(
                "cluster_number",
                key=key,
                value=f"{q['value']:g}",
                unit=q["unit"],
                source=q["source"],
                assumption=fmt.fill("assumption") if q.get("assumption") else "",
            )
            for key, q in c.sources().items()
            if isinstance(q, dict)
        ]
        blocks.append(fmt.fill("cluster_sources", cluster=c.name, source=c.source, numbers="\n".join(numbers)))
    blocks.append(fmt.fill("clusters_end"))
    return blocks
