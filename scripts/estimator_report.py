"""Accuracy report of the GNN fused-op estimator: CDF of relative error on held-out kernels, next
to the core's analytical estimator (DisCo Fig. 9 / section 6.5).

Data flow: disco_jax/profiles/<device kind>/gnn_estimator.{msgpack,json} + the sample files it was trained
from -> the same split the training used (seed and held-out model families from the metadata) ->
relative errors |predicted - measured| / measured of: the GNN with the ops' own times, the GNN
without them, the analytical estimator fitted to the same training kernels, and the measurement
noise itself (two halves of the timing rounds of each kernel) -> a table on the terminal,
disco_jax/profiles/<kind>/estimator_accuracy.png (CDFs) and disco_jax/profiles/<kind>/estimator_report.md.

    python scripts/estimator_report.py [--device-kind cpu] [--data FILE ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import numpy as np
from matplotlib.figure import Figure
from rich.console import Console

from disco_jax._profile_db import SHIPPED_PROFILE_DIR, device_kind_key, sanitize_device_kind
from disco_jax.eval import gpus
from gnn_estimator import (
    analytical_predict_us,
    error_summary,
    fit_analytical,
    load_samples,
    read_weights,
    relative_errors,
    sample_features,
    sample_work,
    split_samples,
)

console = Console()
SETS = (("test", "random held-out kernels"), ("unseen", "kernels of a model never seen in training"))


ROOFLINE = "roofline of the simulated clusters"


def _errors(trained, analytical, samples, device):
    """Relative errors per estimator. `device`: the simulated clusters' spec of this GPU, or None;
    its roofline is taken without the launch overhead, as the samples are kernels' device times
    (the clusters charge the launch on top of the GNN's time as of their roofline's)."""
    measured = np.array([s["time_us"] for s in samples])
    errors = {
        "GNN": relative_errors(trained.predict_us(sample_features(samples, True)), measured),
        "GNN, own op times unknown": relative_errors(trained.predict_us(sample_features(samples, False)), measured),
        "analytical (core, fitted)": relative_errors(analytical_predict_us(analytical, samples), measured),
    }
    if device is not None:
        roofline = gpus.RooflineEstimator(device)
        errors[ROOFLINE] = relative_errors([roofline.device_time_us(sample_work(s)) for s in samples], measured)
    errors["measurement noise"] = np.array([s.get("repeat_error", 0.0) for s in samples])
    return errors


def _row(name: str, e: np.ndarray) -> str:
    s = error_summary(e)
    return (
        f"| {name} | {s['count']} | {100 * s['median']:.1f}% | {100 * s['p90']:.1f}% | "
        f"{100 * s['within_10pct']:.1f}% | {100 * s['within_20pct']:.1f}% |"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device-kind", default=device_kind_key(jax.devices()[0]))
    parser.add_argument("--profiles-dir", type=Path, default=SHIPPED_PROFILE_DIR)
    parser.add_argument(
        "--data", type=Path, nargs="*", help="sample files (default: those the weights were trained on)"
    )
    args = parser.parse_args(argv)
    kind = sanitize_device_kind(args.device_kind)
    out_dir = args.profiles_dir / kind
    trained = read_weights(out_dir)
    info = trained.metadata.get("training", {})
    files = args.data or [Path(f) for f in info.get("data_files", [out_dir / "kernel_samples.jsonl"])]
    samples, seen = [], set()
    for f in files:
        f = f if f.exists() else out_dir / f.name
        for s in load_samples(f, kind):
            if (s["model"], s["key"]) not in seen:
                seen.add((s["model"], s["key"]))
                samples.append(s)
    split = split_samples(samples, holdout_families=info.get("holdout_families", ()), seed=info.get("split_seed", 0))
    analytical = fit_analytical(split["train"])

    lines = [
        f"# GNN fused-op estimator accuracy ({kind})",
        "",
        f"Weights: `{out_dir.name}/gnn_estimator.msgpack` (feature version {trained.metadata['feature_version']}, "
        f"config {trained.metadata['model_config']}), trained on {len(split['train'])} kernels "
        f"(+{len(split['validation'])} validation) of {len(info.get('models', []))} models; "
        f"measured times {info.get('time_us_range', ['?', '?'])[0]:.2f} us to "
        f"{info.get('time_us_range', ['?', '?'])[1]:.0f} us. Unseen model families: "
        f"{', '.join(info.get('holdout_families', [])) or 'none'}.",
        "",
        "Relative error = |predicted - measured| / measured. 'measurement noise' compares two independent "
        "halves of each kernel's timing rounds: the error a perfect model would still show against a "
        "second measurement.",
        "",
    ]
    if gpus.device_for_kind(kind) is not None:
        lines += [
            f"'{ROOFLINE}': the analytical roofline the simulated clusters charge for this GPU "
            "(`disco_jax.eval.gpus`), without its launch overhead: where weights exist, the clusters "
            "take the GNN (own op times unknown) instead for the kernels it answers.",
            "",
        ]
    fig = Figure(figsize=(12, 4.5))
    axes = fig.subplots(1, 2, sharey=True)
    summary = {}
    for ax, (key, title) in zip(axes, SETS):
        part = split[key]
        if not part:
            ax.set_title(f"{title}: none")
            continue
        errors = _errors(trained, analytical, part, gpus.device_for_kind(kind))
        summary[key] = {name: error_summary(e) for name, e in errors.items()}
        lines += [
            f"## {title} ({len(part)} kernels)",
            "",
            "| estimator | kernels | median | p90 | within 10% | within 20% |",
            "|---|---|---|---|---|---|",
        ]
        lines += [_row(name, e) for name, e in errors.items()]
        gnn, ana = summary[key]["GNN"]["median"], summary[key]["analytical (core, fitted)"]["median"]
        lines += [
            "",
            f"Median error: GNN {100 * gnn:.1f}% vs analytical {100 * ana:.1f}% ({ana / max(gnn, 1e-9):.1f}x lower).",
            "",
        ]
        # Relative error by measured time, the GNN with own times.
        measured = np.array([s["time_us"] for s in part])
        roofline = ROOFLINE in errors
        lines += [
            "| measured time | kernels | GNN median | GNN within 10% | analytical median |"
            + (" cluster roofline median |" if roofline else ""),
            "|---|---|---|---|---|" + ("---|" if roofline else ""),
        ]
        for lo, hi in ((0, 1), (1, 10), (10, 100), (100, 1e3), (1e3, 1e9)):
            m = (measured >= lo) & (measured < hi)
            if m.any():
                lines.append(
                    f"| {lo:g}-{hi:g} us | {int(m.sum())} | {100 * np.median(errors['GNN'][m]):.1f}% | "
                    f"{100 * np.mean(errors['GNN'][m] <= 0.1):.1f}% | "
                    f"{100 * np.median(errors['analytical (core, fitted)'][m]):.1f}% |"
                    + (f" {100 * np.median(errors[ROOFLINE][m]):.1f}% |" if roofline else "")
                )
        lines.append("")
        for (name, e), style in zip(errors.items(), ("-", "--", "-.", (0, (5, 1, 1, 1, 1, 1)), ":")):
            xs = np.sort(e)
            ax.plot(np.minimum(xs, 1.0) * 100, np.arange(1, len(xs) + 1) / len(xs), linestyle=style, label=name)
        ax.axvline(10, color="gray", lw=0.8)
        ax.axhline(0.9, color="gray", lw=0.8)
        ax.set_xlim(0, 100)
        ax.set_xlabel("relative error (%)")
        ax.set_title(f"{title} ({len(part)})", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of kernels (CDF)")
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle(f"GNN fused-op estimator on {kind}: CDF of relative error")
    fig.tight_layout()
    png = out_dir / "estimator_accuracy.png"
    fig.savefig(png, dpi=110)
    lines += [
        "![CDF of relative error](estimator_accuracy.png)",
        "",
        "## Reproduce",
        "",
        "```",
        "python scripts/collect_kernel_samples.py --per-model 200 --max-singles 80   "
        "# disco_jax/profiles/<kind>/kernel_samples.jsonl",
        f"python scripts/train_estimator.py --device-kind {kind} --epochs {info.get('epochs', 100)} --members "
        f"{trained.config.members} --holdout-family {' '.join(info.get('holdout_families', [])) or '(none)'}"
        "   # weights + metadata",
        f"python scripts/estimator_report.py --device-kind {kind}   # this report",
        "python scripts/train_estimator.py --finetune --data NEW.jsonl --epochs 20   # fine-tune on new samples",
        "```",
        "",
    ]
    report = out_dir / "estimator_report.md"
    report.write_text("\n".join(lines) + "\n")
    console.print("\n".join(lines))
    console.print(f"wrote {png} and {report}")
    (out_dir / "estimator_report.json").write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
