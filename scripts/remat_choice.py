"""Rematerialization written by hand against rematerialization chosen by disco-jax, on a scanned
decoder's FSDP step, compiled deviceless for a GPU cluster and costed as compiled.

By hand: the zoo GPT written with `nn.remat` over its scanned block (`GPTConfig.remat`: "none",
"dots" = `dots_with_no_batch_dims_saveable`, "full" = `nothing_saveable`), laid out as FSDP users
write it following the Flax guide (`eval.handwritten.guide_fsdp_lowered`: `NamedSharding` on
parameters and state, the guide's activation constraints). disco-jax: the
same GPT written without remat, its weight update laid out at use with the loops' state split
(`offline.AT_USE_SPLIT`) and its loops rematerialized after differentiation (`sharding.remat`,
`offline.AT_USE_REMAT`: "dots", "full"). Every program is compiled by XLA:GPU for the cluster's
target, its step costed by the compiled-program model (the cluster's kernel estimator, collectives
per replica group, host lane) and its per-device peak read from XLA's memory analysis (arguments +
outputs + temporaries - aliased, state donated).

    python scripts/remat_choice.py [--layers 32] [--width 4096] [--seq 2048] [--batch 8]
        [--cluster 8xH100-NVLink] [--only hand,disco] [--json out.json]
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

from disco_jax import backends, cost, offline, targets, zoo  # noqa: E402
from disco_jax.eval import clusters, handwritten  # noqa: E402
from disco_jax.sharding import choice, update  # noqa: E402

DISCO = {"none": offline.AT_USE_SPLIT, **offline.AT_USE_REMAT}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _decoder.add_arguments(parser, layers=32, scan=False)
    parser.add_argument("--cluster", default="8xH100-NVLink")
    parser.add_argument("--only", default="hand,disco", help="comma-separated: hand, disco")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    cluster = clusters.get_cluster(args.cluster)
    mesh = targets.mesh(cluster.target, cluster.num_devices)
    costs = (cluster.kernel_estimator(), cluster.grouped_collectives(), cluster.simulator_params())
    optimizer = optax.adamw(1e-4)
    found: dict[str, dict] = {}

    def record(label: str, compiled, seconds: float) -> None:
        program = cost.compiled_program(compiled.as_text(), backends.GPU)
        costed = cost.cost_program(program, *costs)
        peak = choice.footprint(update.memory(compiled, {}))
        found[label] = {
            "iteration_us": costed.iteration_us,
            "compute_us": costed.compute_us,
            "peak_bytes": peak,
            "compile_s": round(seconds, 1),
        }
        print(
            f"{label:62s} step {costed.iteration_us / 1e3:8.2f} ms (compute {costed.compute_us / 1e3:.2f})  "
            f"peak {peak / 1e9:6.2f} GB/device  (compile {seconds:.0f} s)",
            flush=True,
        )

    parts = set(args.only.split(","))
    base = vars(args) | {"scan": True}
    print(f"{_decoder.spec(argparse.Namespace(**base)).description}; {args.cluster}", flush=True)
    if "hand" in parts:
        for policy in _decoder.REMAT:
            spec = _decoder.spec(argparse.Namespace(**base, remat=policy))
            start = time.perf_counter()
            lowered = handwritten.guide_fsdp_lowered(spec, optimizer, mesh)
            record(f"by hand: nn.remat {policy}, the Flax guide's FSDP", lowered.compile(), _since(start))
    if "disco" in parts:
        spec = _decoder.spec(argparse.Namespace(**base, remat="none"))
        step = zoo.build_train_step(spec, optimizer, mesh, "jit", donate=True)
        state, batch = zoo.abstract_state_and_batch(spec, optimizer, mesh)
        replicated = step.lower(state, batch).compile()
        for policy, label in DISCO.items():
            start = time.perf_counter()
            lowered, layout, why = offline.SHARDED_UPDATES[label](step, (state, batch), {}, replicated)
            if lowered is None:
                print(f"{label}: does not apply ({why})")
                continue
            compiled = offline._compiled_xla(lowered, layout).compiled
            record(f"disco-jax: no nn.remat, at use, remat {policy}", compiled, _since(start))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"args": vars(args), **found}, out, indent=1)
    return 0


def _since(start: float) -> float:
    return time.perf_counter() - start


if __name__ == "__main__":
    raise SystemExit(main())
