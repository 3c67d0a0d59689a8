"""The GPT decoder the large-model scripts build from the same flags (`fsdp_memory.py`,
`large_model_layouts.py`, `scanned_fsdp_baselines.py`): `add_arguments` declares them with a
script's defaults, `spec` makes the paper-size GPT (`zoo.resized`) they describe, `target_step` its
AdamW step for a cluster. A module beside
the scripts, found because a script's own folder is on `sys.path`."""

from __future__ import annotations

import argparse

import optax

from disco_jax import targets, zoo

REMAT = ("none", "dots", "full")


def add_arguments(
    parser: argparse.ArgumentParser,
    *,
    layers: int,
    width: int = 4096,
    vocab: int = 50257,
    heads: int | None = None,
    scan: bool = True,
) -> None:
    """--layers --width --seq --vocab --batch, with --heads (default `heads`) where given (else
    width / 128), and --scan --remat where `scan` (else the layers are scanned, no remat)."""
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--width", type=int, default=width)
    if heads is not None:
        parser.add_argument("--heads", type=int, default=heads)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=vocab)
    parser.add_argument("--batch", type=int, default=8)
    if scan:
        parser.add_argument("--scan", action="store_true")
        parser.add_argument("--remat", default="none", choices=REMAT)


def spec(args: argparse.Namespace) -> zoo.ModelSpec:
    """The paper-size GPT of the parsed flags."""
    return zoo.resized(
        "gpt",
        "paper",
        num_layers=args.layers,
        d_model=args.width,
        num_heads=getattr(args, "heads", None) or max(1, args.width // 128),
        seq_len=args.seq,
        vocab_size=args.vocab,
        global_batch=args.batch,
        scan_layers=getattr(args, "scan", True),
        remat=getattr(args, "remat", "none"),
    )


def target_step(args: argparse.Namespace, cluster) -> tuple:
    """(spec, the donated AdamW step lowered for `cluster`'s devices, its abstract (state, batch)):
    the decoder of the parsed flags on the cluster's mesh, from shapes only (deviceless)."""
    model = spec(args)
    optimizer, mesh = optax.adamw(1e-4), targets.mesh(cluster.target, cluster.num_devices)
    step = zoo.build_train_step(model, optimizer, mesh, "jit", donate=True)
    return model, step, zoo.abstract_state_and_batch(model, optimizer, mesh)
