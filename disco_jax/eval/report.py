"""The benchmark report: ``README.md`` and the figures of a report folder, from its rows.

The report's prose is `report_template.md` (package data, beside this file): named sections, each
a `string.Template`. This module computes the numbers and tables and fills them in; which sections
appear depends on the rows (e.g. the simulator-accuracy section needs a measured platform).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import statistics
import string
import time
from importlib import resources
from pathlib import Path

from disco_jax._files import write_json_atomic
from disco_jax.backends import CPU, GPU, Backend
from disco_jax.eval import baselines, clusters, headroom
from disco_jax.eval.figures import write_figures
from disco_jax.eval.rows import (
    BASELINE_ORDER,
    DISCO,
    STRATEGY_ORDER,
    load_rows,
    model_order,
    platform_order,
)

TEMPLATE = "report_template.md"
_SECTION = re.compile(r"^<!-- (\w+) -->$", re.MULTILINE)
SHORT_NAMES = {
    "JAX_no_fusion": "no_fusion",
    "JAX_op_fusion": "op_fusion",
    "JAX_AllReduce_fusion": "AR_fusion",
    "JAX_default": "default",
    "PyTorch_DDP": "DDP",
    "Horovod": "Horovod",
    DISCO: "**disco-jax**",
}


@functools.cache
def sections() -> dict[str, string.Template]:
    """The template's sections by name."""
    text = resources.files("disco_jax.eval").joinpath(TEMPLATE).read_text(encoding="utf-8")
    parts = _SECTION.split(text)  # [preamble, name, body, name, body, ...]
    return {name: string.Template(body.strip("\n")) for name, body in zip(parts[1::2], parts[2::2])}


def _t(name: str, **values) -> str:
    return sections()[name].substitute(values)


def write_report(out: str | os.PathLike, *, style: str | None = None, run_info: dict | None = None) -> Path:
    """README.md and the figures of the report folder, from its rows. `run_info` (a run's
    config, elapsed time and failures) is added to ``run.json``; without it the stored one is used."""
    out = Path(out)
    rows = load_rows(out, style)
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
    readme.write_text(report_markdown(rows, figures, run_info or {}))
    return readme


# --------------------------------------------------------------------------- number formats


def _ms(us: float | None) -> str:
    if us is None:
        return "n/a"
    ms = us / 1e3
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def _frac(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def _table_row(cells: list) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _iqr(m: dict, digits: int) -> str:
    return f"{m['ratio']:.{digits}f} [{m['ratio_iqr'][0]:.{digits}f}-{m['ratio_iqr'][1]:.{digits}f}]"


# --------------------------------------------------------------------------- the report


def report_markdown(rows: list[dict], figures: dict[str, str], run_info: dict) -> str:
    """The report's README.md."""
    platforms, models = platform_order(rows), model_order(rows)
    by_key = {(r["platform"], r["model"]): r for r in rows}
    by_platform = {p: [by_key[(p, m)] for m in models if (p, m) in by_key] for p in platforms}
    by_platform = {p: prow for p, prow in by_platform.items() if prow}
    blocks = [_t("header")]
    runs = run_info.get("runs") or []
    if runs:
        config = run_info.get("config") or {}
        total = sum((r.get("elapsed_s") or 0) for r in runs)
        blocks.append(
            _t(
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
    blocks += _headline(by_platform)
    blocks.append(_t("tables"))
    for prow in by_platform.values():
        blocks += _platform_tables(prow)
    blocks.append(_t("figures"))
    if "fig6" in figures:
        blocks.append(_t("fig6", file=figures["fig6"]))
    for platform in by_platform:
        if f"fig7_{platform}" in figures:
            blocks.append(_t("fig7", platform=platform, file=figures[f"fig7_{platform}"]))
    measured = {p: prow for p, prow in by_platform.items() if prow[0]["time_kind"] == "measured"}
    if measured:
        blocks.append(_t("accuracy"))
        for prow in measured.values():
            blocks += _accuracy(prow, figures)
    blocks += _paper_models(rows, models)
    blocks += _baselines_and_clusters()
    blocks.append(_t("caveats"))
    failures = run_info.get("failures") or []
    if failures:
        blocks.append(
            _t(
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
        fo = _geomean([r["best_baseline_us"] / r["fo_us"] for r in prow if r["fo_us"] > 0]) - 1
        items.append(
            _t(
                "headline_platform",
                platform=platform,
                kind=prow[0]["time_kind"],
                devices=prow[0]["num_devices"],
                models=len(prow),
                geomean=_pct(_geomean(ratios) - 1),
                best=_pct(best["speedup"]),
                best_model=best["model"],
                worst=_pct(worst["speedup"]),
                worst_model=worst["model"],
                captured=_frac(statistics.median(captured) if captured else None),
                fo=_pct(fo),
                bound=_bound_headline(prow),
                plans=_plans(prow) if prow[0]["time_kind"] == "measured" else "",
            )
        )
        losses += [r for r in prow if r["speedup"] < 0]
    loss_items = []
    for r in losses:
        extra = ""
        if r["time_kind"] == "measured":
            d = r["strategies"][DISCO]
            extra = _t(
                "loss_measured",
                disco_ratio=_iqr(d["measured"], 3),
                best=r["best_baseline"],
                best_ratio=_iqr(r["strategies"][r["best_baseline"]]["measured"], 3),
                description=d["description"],
            )
        loss_items.append(
            _t(
                "loss",
                model=r["model"],
                platform=r["platform"],
                disco_ms=_ms(r["disco_us"]),
                best=r["best_baseline"],
                best_ms=_ms(r["best_baseline_us"]),
                speedup=_pct(r["speedup"]),
                measured=extra,
            )
        )
    return [_t("headline"), "\n".join(items), _t("losses"), "\n".join(loss_items) if loss_items else _t("no_losses")]


def _bound_headline(prow: list[dict]) -> str:
    allows = {r["model"]: a for r in prow if (a := headroom.bound_allows(r)) is not None}
    if not allows:
        return ""
    gap = {r["model"]: r["disco_us"] / r["dependency_bound_us"] - 1 for r in prow if r["model"] in allows}
    limited = ", ".join(f"{m} {_frac(a)}" for m, a in allows.items() if a < headroom.TARGET)
    target = _frac(headroom.TARGET)
    return _t(
        "headline_bound",
        allowed=_frac(statistics.median(allows.values())),
        limited=f"below {target} on {limited}" if limited else f"{target} or more on every row",
        gap=_pct(statistics.median(gap.values())),
        ordered=", ".join(f"{m} {_pct(g)}" for m, g in gap.items() if g > 0.05) or "none",
        limits=headroom.limits_text(prow),
    )


def _plans(prow: list[dict]) -> str:
    """What the product did on a measured platform: plans applied and rejected by the acceptance
    rule, and applied plans that measured slower than JAX_default in the row's own timing."""
    applied = [r for r in prow if r["strategies"][DISCO].get("applied")]
    slower = [r for r in applied if r["strategies"][DISCO]["measured"]["ratio"] > 1.0]
    significant = [r for r in slower if (r["strategies"][DISCO]["measured"].get("ratio_ci95") or [0.0])[0] > 1.0]
    return _t(
        "headline_plans",
        applied=len(applied),
        rejected=len(prow) - len(applied),
        slower=len(slower),
        slower_models="".join(f"; {r['model']} {_iqr(r['strategies'][DISCO]['measured'], 3)}" for r in slower),
        significant=len(significant),
    )


def _platform_tables(prow: list[dict]) -> list[str]:
    r0 = prow[0]
    strategies = " | ".join(SHORT_NAMES[s] for s in STRATEGY_ORDER)
    align = "|".join(["---:"] * len(STRATEGY_ORDER))
    measured = r0["time_kind"] == "measured"
    if measured:
        heading = _t("platform_measured", platform=r0["platform"], devices=r0["num_devices"], kernels=r0["kernels"])
    else:
        heading = _t(
            "platform_simulated",
            platform=r0["platform"],
            devices=r0["num_devices"],
            kernels=r0["kernels"],
            cluster=(r0.get("cluster") or {}).get("description", ""),
            captured=(
                f"XLA:GPU for `{r0.get('target')}`, deviceless"
                if r0.get("captured_on") == "xla-gpu"
                else "XLA:CPU (its fusion; XLA:GPU's all-reduce combiner emulated)"
            ),
        )
    lines = []
    for r in prow:
        search_s = r.get("search_s")
        lines.append(
            _table_row(
                [
                    r["model"],
                    *[
                        (f"**{_ms(r['time_us'].get(s))}**" if s == DISCO else _ms(r["time_us"].get(s)))
                        for s in STRATEGY_ORDER
                    ],
                    r["best_baseline"],
                    _pct(r["speedup"]),
                    _ms(r["fo_us"]),
                    _pct(r.get("fo_speedup")),
                    _frac(r["headroom_captured"]),
                    _ms(r.get("dependency_bound_us")),
                    _frac(headroom.bound_allows(r)),
                    "n/a" if search_s is None else f"{search_s:.1f}",
                    r["kernels"],
                ]
            )
        )
    blocks = [heading, _t("platform_table", strategies=strategies, strategy_align=align, rows="\n".join(lines))]
    sharded = [
        f"{r['model']} {u['sharded_gradients']} of {u['shardable_gradients']} gradients "
        f"({_gb(u['state_bytes_per_device']['replicated'])} → {_gb(u['state_bytes_per_device'][DISCO])})"
        for r in prow
        if (u := r.get("weight_update")) and u["sharded_gradients"]
    ]
    if not measured and any(r.get("weight_update") for r in prow):
        blocks.append(_t("sharded_updates", rows="; ".join(sharded) or "none"))
    if measured:
        details = [
            _table_row([r["model"], *[_measured_cell(r["strategies"].get(s) or {}) for s in STRATEGY_ORDER]])
            for r in prow
        ]
        blocks.append(
            _t(
                "measured_details",
                strategies=strategies,
                strategy_align=align,
                rows="\n".join(details),
                disco_per_model="; ".join(f"{r['model']}: {r['strategies'][DISCO]['description']}" for r in prow),
            )
        )
    return blocks


def _measured_cell(st: dict) -> str:
    m, h, o = st.get("measured"), st.get("hlo") or {}, st.get("outputs") or {}
    if not m:
        return "n/a"
    ok = "=" if o.get("bitwise_equal") else ("≈" if o.get("within_tolerance") else "✗")
    return (
        f"{_iqr(m, 2)} AR {h.get('all-reduce', '?')}/{h.get('all-reduce-operands', '?')} "
        f"F {h.get('multi_op_loop_fusions', '?')} {ok}"
    )


def _accuracy(measured: list[dict], figures: dict[str, str]) -> list[str]:
    """DisCo's Table 2: simulated against measured step times on one measured platform."""
    lines, all_errors, all_ratio_errors = [], [], []
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
        lines.append(
            _table_row(
                [
                    r["model"],
                    _ms(at_calibration),
                    _ms(r["time_us"]["JAX_default"]),
                    _ms(x["simulated"]["iteration_us"]),
                    f"{errs.get('JAX_default', float('nan')):.1%}",
                    _ms(r["time_us"][DISCO]),
                    _ms(d["simulated"]["iteration_us"]),
                    f"{errs.get(DISCO, float('nan')):.1%}",
                    f"{sum(errs.values()) / max(1, len(errs)):.1%}",
                    f"{sum(ratio_errs.values()) / max(1, len(ratio_errs)):.1%}",
                ]
            )
        )
    platform = measured[0]["platform"]
    blocks = [
        _t(
            "accuracy_platform",
            platform=platform,
            devices=measured[0]["num_devices"],
            configurations=len(STRATEGY_ORDER),
            rows="\n".join(lines),
        )
    ]
    if all_errors:
        srt, rsrt = sorted(all_errors), sorted(all_ratio_errors)
        blocks.append(
            _t(
                "accuracy_summary",
                pairs=len(srt),
                median=f"{srt[len(srt) // 2]:.1%}",
                p90=f"{srt[int(0.9 * (len(srt) - 1))]:.1%}",
                ratio_median=f"{rsrt[len(rsrt) // 2]:.1%}",
                ratio_p90=f"{rsrt[int(0.9 * (len(rsrt) - 1))]:.1%}",
            )
        )
    if f"table2_{platform}" in figures:
        blocks.append(_t("table2", file=figures[f"table2_{platform}"]))
    return blocks


def _paper_models(rows: list[dict], models: list[str]) -> list[str]:
    """What was captured of the paper-size models and how long it took."""
    paper: dict[str, dict] = {}
    for r in rows:
        if r["time_kind"] == "simulated" and r["model"] not in paper:
            paper[r["model"]] = r
    if not paper:
        return []
    lines = []
    for m in models:
        r = paper.get(m)
        if r is None:
            continue
        g = r.get("graph") or {}
        lines.append(
            _table_row(
                [
                    m,
                    f"{r.get('parameters', 0) / 1e6:.1f} M",
                    r.get("global_batch", "?"),
                    f"{r.get('capture_s', 0):.1f}",
                    g.get("ops", "?"),
                    g.get("gradients", "?"),
                    f"{g.get('gradient_bytes', 0) / 2**20:.0f}",
                    g.get("xla_allreduces", "?"),
                ]
            )
        )
    blocks = [_t("paper_models", rows="\n".join(lines))]
    heavy = [
        (m, paper[m]["graph"]["gradient_bytes"] / (4 * paper[m]["parameters"]))
        for m in models
        if m in paper and paper[m].get("parameters") and (paper[m].get("graph") or {}).get("gradient_bytes")
    ]
    heavy = [(m, x) for m, x in heavy if x > 1.5]
    if heavy:
        blocks.append(_t("heavy_gradients", models=", ".join(f"{m} ({x:.1f}x)" for m, x in heavy)))
    return blocks


def _enacted_by(name: str, backend: Backend = CPU) -> str:
    """How `backend` enacts a baseline: its compile options, or our rewrite."""
    options = backend.baseline_options.get(name)
    if options is None:
        return _t("enacted_by_rewrite")
    if not options:
        return _t("enacted_by_defaults")
    return _t("enacted_by_options", options="; ".join(f"{k}={v}" for k, v in options.items()))


def _baselines_and_clusters() -> list[str]:
    blocks = [
        _t(
            "baselines",
            rows="\n".join(
                _table_row([name, _enacted_by(name), _enacted_by(name, GPU), baselines.SOURCES[name]])
                for name in BASELINE_ORDER
            ),
        )
    ]
    cluster_rows = [
        _table_row(
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
    blocks.append(_t("clusters", rows="\n".join(cluster_rows)))
    for c in clusters.CLUSTERS.values():
        numbers = [
            _t(
                "cluster_number",
                key=key,
                value=f"{q['value']:g}",
                unit=q["unit"],
                source=q["source"],
                assumption=_t("assumption") if q.get("assumption") else "",
            )
            for key, q in c.sources().items()
            if isinstance(q, dict)
        ]
        blocks.append(_t("cluster_sources", cluster=c.name, source=c.source, numbers="\n".join(numbers)))
    blocks.append(_t("clusters_end"))
    return blocks
