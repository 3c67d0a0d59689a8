"""Per-device peaks of a decoder's fully sharded step: FSDP as a user writes it (`NamedSharding`
on parameters and state, `eval.handwritten.fsdp_step`) against disco-jax's sharded updates of the
same step (`offline.SHARDED_UPDATES`: ZeRO-3 gathered at the step's entry, gathered again for each
use, and gathered where used, `Layout.at_use`, with the loops' state split and their residuals
recomputed, `sharding.remat`), compiled deviceless for a GPU target with the
state donated; each peak is XLA's memory analysis (arguments + outputs + temporaries - aliased).

    python scripts/fsdp_memory.py [--layers 32] [--width 4096] [--seq 2048] [--batch 8]
        [--scan] [--remat none|dots|full] [--updates at_use,zero3,regather,at_use_split,remat_dots,remat_full]
        [--json out.json]

Issue 44's check: on the 32-layer width-4096 GPT (Adam, 8 H100s), unrolled and scanned with
remat, disco-jax's fully sharded plan (`at_use`) peaks no higher than the hand-written FSDP.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")

import _decoder  # noqa: E402
import optax  # noqa: E402

from disco_jax import offline, targets, zoo  # noqa: E402
from disco_jax.eval import handwritten  # noqa: E402
from disco_jax.sharding import choice, update  # noqa: E402

UPDATES = {
    "at_use": offline.AT_USE,
    "at_use_split": offline.AT_USE_SPLIT,
    "remat_dots": offline.AT_USE_REMAT["dots"],
    "remat_full": offline.AT_USE_REMAT["full"],
    "zero3": offline.ALL_SHARDED,
    "regather": offline.REGATHERED,
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _decoder.add_arguments(parser, layers=32)
    parser.add_argument("--target", default="h100-sxm")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--updates", default="at_use", help="comma-separated: " + ",".join(UPDATES))
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    spec = _decoder.spec(args)
    optimizer = optax.adam(1e-4)
    mesh = targets.mesh(args.target, args.devices)
    print(spec.description, flush=True)
    found = {}

    def record(label, compiled, seconds):
        figures = update.memory(compiled, {})
        found[label] = {**figures, "peak_bytes": choice.footprint(figures), "compile_s": round(seconds, 1)}
        print(
            f"{label:50s} peak {found[label]['peak_bytes'] / 1e9:7.2f} GB/device "
            f"(temporaries {figures.get('temp_size_in_bytes', 0) / 1e9:.2f} GB; compile {seconds:.0f} s)",
            flush=True,
        )

    start = time.perf_counter()
    step, abstract = handwritten.fsdp_step(spec, optimizer, mesh)
    record("hand-written FSDP (NamedSharding)", step.lower(*abstract).compile(), time.perf_counter() - start)
    step = zoo.build_train_step(spec, optimizer, mesh, "jit", donate=True)
    state, batch = zoo.abstract_state_and_batch(spec, optimizer, mesh)
    replicated = step.lower(state, batch).compile()
    for name in args.updates.split(","):
        start = time.perf_counter()
        lowered, layout, why = offline.SHARDED_UPDATES[UPDATES[name]](step, (state, batch), {}, replicated)
        if lowered is None:
            print(f"{UPDATES[name]}: does not apply ({why})")
            continue
        compiled = offline._compiled_xla(lowered, layout).compiled
        record(f"disco-jax: {UPDATES[name]}", compiled, time.perf_counter() - start)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"args": vars(args), "model": spec.description, **found}, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
