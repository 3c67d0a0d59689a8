"""The report's figures, drawn from the rows: DisCo's Fig. 6 (iteration time per strategy), Fig. 7
(compute / communication breakdown) and Table 2 (simulated vs measured) as PNG files.

Figures are drawn on `matplotlib.figure.Figure` objects (no pyplot, no global backend state).
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from disco_jax.eval.rows import DISCO, STRATEGY_ORDER, model_order, platform_order

COLORS = {
    "JAX_no_fusion": "#bdbdbd",
    "JAX_op_fusion": "#9ecae1",
    "JAX_AllReduce_fusion": "#fdd0a2",
    "JAX_default": "#3182bd",
    "PyTorch_DDP": "#a1d99b",
    "Horovod": "#31a354",
    DISCO: "#e6550d",
}


def write_figures(out: Path, rows: list[dict], dpi: int = 80) -> dict[str, str]:
    """Fig. 6-style bars per platform, Fig. 7-style compute/comm breakdowns, Table 2-style
    simulated vs measured scatter. Returns {figure key: file name}."""
    figures: dict[str, str] = {}
    if not rows:
        return figures
    platforms, models = platform_order(rows), model_order(rows)
    by_key = {(r["platform"], r["model"]): r for r in rows}
    figures["fig6"] = "fig6_iteration_time.png"
    _iteration_times(platforms, models, by_key).savefig(Path(out) / figures["fig6"], dpi=dpi)
    for platform in platforms:
        key = f"fig7_{platform}"
        figures[key] = f"fig7_breakdown_{platform}.png"
        _breakdown(platform, [by_key[(platform, m)] for m in models if (platform, m) in by_key]).savefig(
            Path(out) / figures[key], dpi=dpi
        )
    for platform in platforms:
        measured = [by_key[(platform, m)] for m in models if (platform, m) in by_key]
        if measured[0]["time_kind"] == "measured":
            key = f"table2_{platform}"
            figures[key] = f"table2_simulated_vs_measured_{platform}.png"
            _simulated_vs_measured(measured).savefig(Path(out) / figures[key], dpi=dpi)
    return figures


def _iteration_times(platforms: list[str], models: list[str], by_key: dict) -> Figure:
    """Fig. 6: iteration time of every strategy, relative to JAX_default, FO as a tick."""
    fig = Figure(figsize=(11, 2.6 * len(platforms)))
    axes = fig.subplots(len(platforms), 1, squeeze=False)
    width = 0.8 / len(STRATEGY_ORDER)
    for ax, platform in zip(axes[:, 0], platforms):
        names = [m for m in models if (platform, m) in by_key]
        for j, name in enumerate(STRATEGY_ORDER):
            xs, hs = [], []
            for i, m in enumerate(names):
                r = by_key[(platform, m)]
                t, ref = r["time_us"].get(name), r["time_us"].get("JAX_default")
                if t is not None and ref:
                    xs.append(i - 0.4 + (j + 0.5) * width)
                    hs.append(t / ref)
            ax.bar(
                xs,
                hs,
                width,
                color=COLORS[name],
                label=name,
                edgecolor="black" if name == DISCO else None,
                linewidth=0.6,
            )
        for i, m in enumerate(names):
            r = by_key[(platform, m)]
            ref = r["time_us"].get("JAX_default")
            if ref:
                ax.hlines(
                    r["fo_us"] / ref,
                    i - 0.42,
                    i + 0.42,
                    colors="black",
                    linestyles="dashed",
                    linewidth=1.0,
                    label="FO" if i == 0 else None,
                )
        r0 = by_key[(platform, names[0])]
        kind = "measured" if r0["time_kind"] == "measured" else f"simulated, kernels: {r0['kernels']}"
        ax.set_title(f"{platform} ({r0['num_devices']} devices; {kind})", fontsize=9, loc="left")
        ax.set_xticks(range(len(names)), names, fontsize=8)
        ax.set_ylabel("time / JAX_default", fontsize=8)
        ax.axhline(1.0, color="grey", linewidth=0.5)
        ax.tick_params(axis="y", labelsize=7)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.suptitle("Per-iteration time relative to JAX_default (DisCo Fig. 6): lower is better", fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 0.97))
    fig.legend(handles, labels, loc="lower center", ncol=8, fontsize=7, frameon=False)
    return fig


def _breakdown(platform: str, rows: list[dict]) -> Figure:
    """Fig. 7: simulated iteration / compute / comm per strategy, one panel per model."""
    cols = min(4, len(rows))
    nrows = (len(rows) + cols - 1) // cols
    fig = Figure(figsize=(3.1 * cols, 2.5 * nrows))
    axes = fig.subplots(nrows, cols, squeeze=False)
    for ax in axes.flat[len(rows) :]:
        ax.axis("off")
    for ax, r in zip(axes.flat, rows):
        strategies = [s for s in STRATEGY_ORDER if (r["strategies"].get(s) or {}).get("simulated")]
        for k, (field, hatch) in enumerate((("iteration_us", None), ("compute_us", "//"), ("comm_us", ".."))):
            vals = [r["strategies"][s]["simulated"][field] / 1e3 for s in strategies]
            ax.bar(
                [i + (k - 1) * 0.27 for i in range(len(strategies))],
                vals,
                0.27,
                color=[COLORS[s] for s in strategies],
                hatch=hatch,
                edgecolor="black",
                linewidth=0.3,
            )
        ax.set_xticks(
            range(len(strategies)),
            [s.replace("JAX_", "").replace("_fusion", "") for s in strategies],
            rotation=60,
            fontsize=6,
        )
        ax.set_title(r["model"], fontsize=8)
        ax.tick_params(axis="y", labelsize=6)
        ax.set_ylabel("ms (simulated)", fontsize=6)
    legend = [
        Patch(facecolor="white", edgecolor="black", label="iteration"),
        Patch(facecolor="white", edgecolor="black", hatch="//", label="compute"),
        Patch(facecolor="white", edgecolor="black", hatch="..", label="communication"),
    ]
    fig.suptitle(f"Iteration / computation / communication time on {platform} (DisCo Fig. 7)", fontsize=9)
    fig.tight_layout(rect=(0, 0.06 / nrows, 1, 0.95))
    fig.legend(handles=legend, loc="lower center", fontsize=7, frameon=False, ncol=3)
    return fig


def _simulated_vs_measured(measured: list[dict]) -> Figure:
    """Table 2: simulated vs measured step time on one measured platform."""
    fig = Figure(figsize=(5.2, 4.6))
    ax = fig.subplots()
    lo, hi = float("inf"), 0.0
    for name in STRATEGY_ORDER:
        xs, ys = [], []
        for r in measured:
            st = r["strategies"].get(name) or {}
            if st.get("simulated") and st.get("measured"):
                xs.append(r["time_us"][name] / 1e3)
                ys.append(st["simulated"]["iteration_us"] / 1e3)
        if xs:
            ax.scatter(
                xs,
                ys,
                s=28 if name == DISCO else 16,
                color=COLORS[name],
                label=name,
                edgecolors="black",
                linewidths=0.4,
                marker="D" if name == DISCO else "o",
            )
            lo, hi = min(lo, *xs, *ys), max(hi, *xs, *ys)
    if hi > 0:
        line = [lo * 0.8, hi * 1.25]
        ax.plot(line, line, color="black", linewidth=0.8)
        ax.fill_between(line, [v * 0.8 for v in line], [v * 1.2 for v in line], color="grey", alpha=0.15, label="±20%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured step time (ms)", fontsize=8)
    ax.set_ylabel("simulated step time (ms)", fontsize=8)
    ax.set_title(f"Simulator vs measurement, {measured[0]['platform']} (DisCo Table 2)", fontsize=9)
    ax.legend(fontsize=6, frameon=False)
    ax.tick_params(labelsize=7)
    fig.tight_layout()
    return fig
