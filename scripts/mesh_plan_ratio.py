"""Benchmark: a two-axis plan enacted by `@optimize_distributed(layout=...)` against the unmodified
step, on 8 virtual CPU devices, a tiny Flax GPT (Adam), measured in one run.

For each plan (default: tensor parallel over 8, `"tp"`, and the 2-D `"2x4:fsdp_tp"`): the
decorator's search phase with the forced layout (output check against the float64 run, moved
state too, and the acceptance rule's timing, whose ratio it records), then the decorated step
and the unmodified one timed in interleaved pairs (the order alternating), each sample `--steps`
training steps through the call path a user has (the decorated step moves the user's batch to
the plan's mesh on every call: counted). Printed per plan: the median of the per-pair ratios
plan/unmodified, its quartiles and its extremes, and the peak bytes per device of both programs
(XLA's memory analysis).

    python scripts/mesh_plan_ratio.py [--plans tp 2x4:fsdp_tp] [--pairs 30] [--steps 5]

The 8 devices share the machine's cores: a plan that splits the work over the model axis trades
the replicated update's repeated work for collectives, and which wins on CPU devices says little
about GPUs (docs/operator-parallelism.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    + ["--xla_force_host_platform_device_count=8"]
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from disco_jax import optimize_distributed, zoo  # noqa: E402
from disco_jax.sharding import choice  # noqa: E402


def gpt(args):
    spec = zoo.resized(
        "gpt",
        d_model=args.width,
        num_heads=8,
        vocab_size=args.vocab,
        num_layers=args.layers,
        seq_len=args.seq,
        scan_layers=True,
        compute_dtype="params",
    )
    return zoo.make_train_step(spec, optax.adam(1e-3), zoo.data_mesh(), "jit", global_batch_size=args.batch)


def timed(step, state, batch, steps: int) -> tuple[float, object]:
    start = time.perf_counter()
    for _ in range(steps):
        state, loss = step(state, batch)
    jax.block_until_ready((state, loss))
    return time.perf_counter() - start, state


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plans", nargs="+", default=["tp", "2x4:fsdp_tp"])
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--steps", type=int, default=5, help="training steps per sample")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args(argv)
    step, state0, batch = gpt(args)
    print(
        f"GPT width {args.width}, vocab {args.vocab}, {args.layers} scanned layers, seq {args.seq}, batch "
        f"{args.batch}, Adam; {len(jax.devices())} CPU devices on {os.cpu_count()} cores"
    )
    default_peak = choice.executable_peak(step.lower(state0, batch).compile())
    for plan in args.plans:
        with tempfile.TemporaryDirectory() as plan_dir:
            run = optimize_distributed(search=True, plan_dir=plan_dir, layout=plan, validation_pairs=10, verbose=False)(
                step
            )
            plan_state = run(state0, batch)[0]  # the search phase: check, acceptance timing
            report = run.reports[0]
            if not report.applied:
                print(f"{plan}: not applied: {report.reason}")
                continue
            info = report.layout
            default_state = step(state0, batch)[0]
            timed(step, default_state, batch, 2)  # warm both
            timed(run, plan_state, batch, 2)
            ratios = []
            for i in range(args.pairs):
                if i % 2 == 0:
                    d, default_state = timed(step, default_state, batch, args.steps)
                    p, plan_state = timed(run, plan_state, batch, args.steps)
                else:
                    p, plan_state = timed(run, plan_state, batch, args.steps)
                    d, default_state = timed(step, default_state, batch, args.steps)
                ratios.append(p / d)
            r = np.asarray(ratios)
            q1, med, q3 = np.percentile(r, [25, 50, 75])
            m = info["measured"]
            print(
                f"{info['label']}: plan/unmodified median {med:.3f} (quartiles {q1:.3f}-{q3:.3f}, range "
                f"{r.min():.3f}-{r.max():.3f}, {args.pairs} interleaved pairs of {args.steps} steps); "
                f"decorator's acceptance timing {m['ratio']:.3f} ({m['verdict']}, {m['pairs']} pairs); "
                f"output check {info['check']['check']} within tolerance: {info['check']['within_tolerance']}; "
                f"peak {info['footprint_bytes'] / 1e6:.2f} MB vs {default_peak / 1e6:.2f} MB per device"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
