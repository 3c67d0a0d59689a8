"""The report's large-model section: decoders of about 1.3B and 6.7B parameters on the H100
clusters, every configuration a user writes by hand and every plan of disco-jax's layout search
compiled deviceless and costed the same way (`scripts/large_model_layouts.py --json
report/large_model/NAME.json`), the published anchor (`scripts/maxtext_anchor.py --json
report/large_model/maxtext_anchor.json`), and rematerialization by hand against disco-jax's
(`scripts/remat_choice.py --json report/large_model/remat_NAME.json`).

`blocks(out)` reads `out/large_model/*.json` and returns the section's markdown blocks (none where
the folder is missing); `write_report` appends them to README.md, and `python -m
disco_jax.eval.report_large report` writes them alone to `report/large_model.md` (no bench rerun).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ANCHOR = "maxtext_anchor.json"
REMAT = "remat_"  # `scripts/remat_choice.py --json report/large_model/remat_NAME.json`


def _row(label: str, r: dict, limit: float, chosen: str | None) -> str:
    peak = r.get("peak_bytes")
    fits = "yes" if peak is not None and peak <= limit else "**no**"
    name = f"**{label}** (chosen)" if label == chosen else label
    same = ", ".join(r.get("same_program_as") or []) or ""
    mfu = r.get("mfu")
    return (
        f"| {name} | {r['kind']} | {r['iteration_us'] / 1e3:.1f} | {peak / 1e9:.2f} | "
        f"{'n/a' if mfu is None else f'{100 * mfu:.1f}%'} | {fits} | {same} |"
    )


def table(record: dict) -> str:
    """One model on one cluster: every compiled configuration (by step time), the choice, and the
    plan's ratio to the best hand-written configuration that fits."""
    args = record["args"]
    limit = args["memory_gb"] * 1e9
    chosen = (record["search"].get("chosen") or {}).get("plan")
    duplicates = {d for r in record["rows"].values() for d in r.get("same_program_as") or []}
    rows = sorted(
        ((label, r) for label, r in record["rows"].items() if label not in duplicates),
        key=lambda item: item[1]["iteration_us"],
    )
    hand = [r for _, r in rows if r["kind"] == "by hand" and r["peak_bytes"] <= limit]
    plan = record["rows"].get(chosen) if chosen else None
    over = [label for label, r in rows if r["kind"] == "by hand" and r["peak_bytes"] > limit]
    summary = f"Chosen: {record['search']['reason']}."
    if plan and hand:
        ratio = plan["iteration_us"] / hand[0]["iteration_us"]
        summary += f" Plan / best hand-written configuration that fits: **{ratio:.3f}**."
    elif plan:
        summary += " No hand-written configuration fits; the plan does."
    if over:
        summary += f" Over {args['memory_gb']:.0f} GB by hand: {', '.join(over)}."
    skipped = [c["plan"] for c in record["search"]["candidates"] if c.get("why_not")]
    if skipped:
        summary += f" Not compiled ({len(skipped)}): {', '.join(skipped)}."
    if args.get("only"):
        summary += " Only some of disco-jax's plans were compiled (`--only`): " + args["only"] + "."
    billions = record.get("parameters", 0) / 1e9
    head = (
        f"### {record['model']} ({billions:.2f}B parameters) on {record.get('cluster', args['cluster'])}\n\n"
        f"Global batch {args['batch']}, AdamW, limit {args['memory_gb']:.0f} GB per GPU; "
        f"`python scripts/large_model_layouts.py --layers {args['layers']} --width {args['width']} "
        f"--heads {args['heads']} --vocab {args['vocab']} --seq {args['seq']} --batch {args['batch']}"
        f"{' --scan' if args['scan'] else ''} "
        f"--remat {args['remat']} --cluster {args['cluster']}`.\n\n{summary}\n\n"
        "| configuration | by | step ms | peak GB | MFU | fits | same program as |\n|---|---|---:|---:|---:|---|---|"
    )
    return head + "\n" + "\n".join(_row(label, r, limit, chosen) for label, r in rows)


def anchor(record: dict) -> str:
    b = record["breakdown"]
    return (
        "### Published anchor: MaxText Llama2-7B on one A3 node (8 H100), FSDP 8, sequence 4096\n\n"
        f"MaxText publishes {record['published_tflops_per_chip']:.0f} TFLOP/s per chip "
        f"({record['published_step_ms']:.0f} ms per step, {record['published_tokens_per_s_per_chip']:.0f} tokens/s per "
        f"chip by its own FLOP count of {record['maxtext_tflops_per_device_step']:.0f} TFLOP per device per step); "
        f"the compiled-program model predicts **{record['predicted_step_ms']:.0f} ms** "
        f"({record['predicted_tflops_per_chip']:.0f} TFLOP/s per chip, "
        f"{record['predicted_over_published_step']:.2f}x the published step) for {record['model']} "
        f"({record['parameters'] / 1e9:.2f}B), peak {record['peak_bytes'] / 1e9:.1f} GB. Predicted compute per step: "
        f"attention's sequence x sequence kernels {b['attention (seq x seq) ms']:.0f} ms, other GEMMs "
        f"{b['other gemm ms']:.0f} ms, other kernels {b['other compute ms']:.0f} ms; collectives not hidden "
        f"{b['exposed collectives ms']:.0f} ms. Why they differ: docs/operator-parallelism.md "
        "(`python scripts/maxtext_anchor.py`)."
    )


def remat(record: dict) -> str:
    """Rematerialization written into the model (`nn.remat`) against disco-jax's after
    differentiation (`sharding.remat`), one row per program (`scripts/remat_choice.py`)."""
    args = record["args"]
    rows = {label: r for label, r in record.items() if isinstance(r, dict) and "iteration_us" in r}
    lines = [f"| {label} | {r['iteration_us'] / 1e3:.2f} | {r['peak_bytes'] / 1e9:.2f} |" for label, r in rows.items()]
    return (
        f"### Rematerialization: `nn.remat` by hand against disco-jax's, {args['layers']} scanned layers of width "
        f"{args['width']} on {args['cluster']}\n\n"
        "The same decoder written with `nn.remat` and laid out as the Flax guide's FSDP, and written without it "
        "and rematerialized by disco-jax after differentiation (`sharding.remat`, at use, loops' state split); "
        f"`python scripts/remat_choice.py --layers {args['layers']} --width {args['width']} --seq {args['seq']} "
        f"--batch {args['batch']} --cluster {args['cluster']}`.\n\n"
        "| program | step ms | peak GB |\n|---|---:|---:|\n" + "\n".join(lines)
    )


def blocks(out: str | Path) -> list[str]:
    folder = Path(out) / "large_model"
    if not folder.is_dir():
        return []
    found = []
    for path in sorted(folder.glob("*.json")):
        record = json.loads(path.read_text())
        if path.name == ANCHOR:
            found.append(anchor(record))
        else:
            found.append(remat(record) if path.name.startswith(REMAT) else table(record))
    if not found:
        return []
    intro = (
        "## Large models: mesh and per-layer layout against hand-written configurations (deviceless)\n\n"
        "Every configuration compiled by XLA:GPU for the cluster (deviceless) and costed by the compiled-program "
        "model, collectives per replica group (inside a node on the NVLink nccl-tests fits, across nodes on the "
        "InfiniBand ones); peak per GPU from XLA's memory analysis; MFU = the model's FLOPs per step (6 per "
        "parameter per token plus attention's 12 x layers x width x sequence, no recomputation) over the GPUs' "
        "dense BF16 peak (989 TFLOP/s) times the step. The hand-written configurations (data parallel, FSDP, "
        "TP over a node, data x TP, FSDP x TP, as `eval.handwritten` writes them: shardings on parameters and "
        "state by name, and Flax's guide's activation constraints on each dense output) are candidates of the same "
        "search, so the plan is never costlier than the best of them that fits. Plans with the same compiled "
        "program are one row (the others named in the last column)."
    )
    return [intro, *found]


def main(argv=None) -> int:
    out = Path((argv or sys.argv[1:] or ["report"])[0])
    text = "\n\n".join(blocks(out)) + "\n"
    (out / "large_model.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
