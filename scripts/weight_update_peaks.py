"""Every weight update of a zoo model as XLA:GPU compiles it for a GPU target, deviceless: its
per-device peak (the executable's memory analysis), the parameters and state it holds per device,
its compiled-program step time, and how many leaves it keeps whole. One JSON line per update
(`offline.weight_update_candidates`: replicated, then `offline.SHARDED_UPDATES`), then the wall time.

    python scripts/weight_update_peaks.py [--model rnnlm] [--size paper] [--target h100-sxm] [--devices 8]

The paper RNNLM is the case of leaves split over several dimensions (`offline.SPLIT`,
docs/sharded-update.md): its 1500 x 1500 kernels have no dimension 8 divides.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")

import optax  # noqa: E402

from disco_jax import offline, targets, zoo  # noqa: E402
from disco_jax.eval import clusters  # noqa: E402

MB = 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="rnnlm", choices=sorted(zoo.MODELS))
    parser.add_argument("--size", default="paper", choices=zoo.CONFIGS)
    parser.add_argument("--target", default="h100-sxm", choices=sorted(targets.TARGETS))
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args()

    started = time.perf_counter()
    spec, optimizer = zoo.get_model(args.model, args.size), optax.adam(1e-3)
    mesh = targets.mesh(args.target, args.devices)
    state, batch = zoo.abstract_state_and_batch(spec, optimizer, mesh)
    step = zoo.build_train_step(spec, optimizer, mesh, "jit", donate=True)
    costs = offline.program_costs(clusters.node_of(args.target, args.devices))
    for c in offline.weight_update_candidates(step, (state, batch), {}, costs):
        held = c.memory.get("params_and_state_bytes_per_device")
        row = {
            "update": c.label,
            "peak_MB": None if c.peak_bytes is None else round(c.peak_bytes / MB, 1),
            "held_MB": None if held is None else round(held / MB, 1),
            "compiled_ms": None if c.cost is None else round(c.cost.iteration_us / 1e3, 2),
            "kept_whole": None if c.layout is None else len(c.layout.kept_whole),
            "why_not": c.why_not,
        }
        print(json.dumps(row), flush=True)
    print(json.dumps({"wall_s": round(time.perf_counter() - started)}), flush=True)


if __name__ == "__main__":
    main()
