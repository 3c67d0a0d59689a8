"""Train (or fine-tune) the GNN fused-op estimator and write its weights for a device kind.

Data flow: samples (JSON lines from scripts/collect_kernel_samples.py, only those recorded on
--device-kind) -> split (`gnn_estimator.split_samples`: the --holdout-family models are
never trained on; the rest by kernel hash into train / validation / random held-out test) ->
`train` (best validation epoch kept) -> evaluation on both held-out sets next to the core's
analytical estimator fitted on the same training samples -> `disco_jax/profiles/<device kind>/
gnn_estimator.msgpack` + `.json` (metadata: feature version, config, training summary, accuracy).

    python scripts/train_estimator.py                       # train from scratch on the shipped data
    python scripts/train_estimator.py --finetune --data new_samples.jsonl --epochs 30

Fine-tuning starts from the weights already in the output directory (keeping their feature
normalization) and trains on the given samples only.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import jax
import numpy as np
from rich.console import Console
from rich.table import Table

from disco_jax._profile_db import SHIPPED_PROFILE_DIR, device_kind_key, sanitize_device_kind
from gnn_estimator import (
    ModelConfig,
    evaluate,
    fit_analytical,
    load_samples,
    read_weights,
    split_samples,
    train,
    write_weights,
)

console = Console()
DEFAULT_HOLDOUT = ("zoo-transformer",)


def accuracy_table(accuracy: dict) -> Table:
    table = Table(title="relative error |predicted - measured| / measured")
    for col in ("set", "estimator", "kernels", "median", "p90", "within 10%", "within 20%"):
        table.add_column(col, justify="right" if col not in ("set", "estimator") else "left")
    for name in ("random_heldout", "unseen_model"):
        result = accuracy.get(name, {})
        for est in ("gnn", "gnn_without_own_times", "analytical", "measurement_noise"):
            s = result.get(est)
            if not s or not s.get("count"):
                continue
            table.add_row(
                name,
                est,
                str(s["count"]),
                f"{100 * s['median']:.1f}%",
                f"{100 * s['p90']:.1f}%",
                f"{100 * s['within_10pct']:.1f}%",
                f"{100 * s['within_20pct']:.1f}%",
            )
    return table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_kind = device_kind_key(jax.devices()[0])
    parser.add_argument("--device-kind", default=default_kind)
    parser.add_argument(
        "--data", type=Path, nargs="*", help="sample files (default: disco_jax/profiles/<kind>/kernel_samples.jsonl)"
    )
    parser.add_argument("--profiles-dir", type=Path, default=SHIPPED_PROFILE_DIR)
    parser.add_argument(
        "--holdout-family",
        nargs="*",
        default=list(DEFAULT_HOLDOUT),
        help="model families never trained on (the unseen-model test)",
    )
    parser.add_argument("--epochs", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--members", type=int, default=1, help="ensemble size (mean of log predictions)")
    parser.add_argument("--seed", type=int, default=0, help="initialization and minibatch order")
    parser.add_argument("--split-seed", type=int, default=0, help="which kernels are held out")
    parser.add_argument("--finetune", action="store_true", help="start from the weights in the output directory")
    args = parser.parse_args(argv)

    kind = sanitize_device_kind(args.device_kind)
    out_dir = args.profiles_dir / kind
    files = args.data or [out_dir / "kernel_samples.jsonl"]
    samples, seen = [], set()
    for f in files:
        for s in load_samples(f, kind):
            if (s["model"], s["key"]) not in seen:  # a resumed or merged file may repeat a sample
                seen.add((s["model"], s["key"]))
                samples.append(s)
    if not samples:
        console.print(f"[red]no samples for device kind {kind!r} in {[str(f) for f in files]}")
        return 1
    split = split_samples(samples, holdout_families=args.holdout_family, seed=args.split_seed)
    console.print(
        f"{len(samples)} samples from {len({s['model'] for s in samples})} models: "
        + ", ".join(f"{k} {len(v)}" for k, v in split.items())
    )

    init = read_weights(out_dir) if args.finetune else None
    config = ModelConfig(hidden=args.hidden, heads=args.heads, layers=args.layers, members=args.members)
    start = time.time()
    trained, history = train(
        split["train"],
        config=config,
        epochs=args.epochs,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        weight_decay=args.weight_decay,
        seed=args.seed,
        validation=split["validation"],
        init=init,
        log=console.print,
    )
    seconds = time.time() - start
    analytical = fit_analytical(split["train"])
    accuracy = {
        "random_heldout": evaluate(trained, split["test"], analytical),
        "unseen_model": evaluate(trained, split["unseen"], analytical),
        "analytical_fit": analytical.to_json(),
    }
    console.print(accuracy_table(accuracy))
    times = np.array([s["time_us"] for s in split["train"]])
    previous = init.metadata.get("training", {}) if init is not None else None
    trained.metadata = {
        "device_kind": kind,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax_version": jax.__version__,
        "training": {
            # Files beside the weights by name only, so the shipped metadata names no local path.
            "data_files": [f.name if f.resolve().parent == out_dir.resolve() else str(f) for f in files],
            "samples": {k: len(v) for k, v in split.items()},
            "models": sorted({s["model"] for s in split["train"]}),
            "holdout_families": list(args.holdout_family),
            "time_us_range": [float(times.min()), float(times.max())],
            # Kernels the GNN answers: no more ops than these (`GnnEstimator.trusted`).
            "kernel_ops_range": [
                min(len(s["kernel"]["nodes"]) for s in split["train"]),
                max(len(s["kernel"]["nodes"]) for s in split["train"]),
            ],
            # Opcodes the training kernels held (`GnnEstimator.untrained_region_ops`).
            "opcodes": sorted({n["op"] for s in split["train"] for n in s["kernel"]["nodes"]}),
            "epochs": args.epochs,
            "batch_size": args.batch_size,
            "learning_rate": args.learning_rate,
            "weight_decay": args.weight_decay,
            "seed": args.seed,
            "split_seed": args.split_seed,
            "seconds": round(seconds, 1),
            "final_train_loss": history[-1]["train_loss"],
            "best_validation_loss": min((h.get("validation_loss", np.inf) for h in history), default=None),
            "finetuned_from": previous,
        },
        "accuracy": accuracy,
    }
    path = write_weights(out_dir, trained)
    console.print(f"wrote {path} and {path.with_suffix('.msgpack').name} ({seconds:.0f} s of training)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
