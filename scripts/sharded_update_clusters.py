"""The sharded weight update on the report's simulated H100 clusters.

For each zoo model's paper config, XLA:GPU compiles (deviceless, 8 H100 SXM devices: the
clusters' data-parallel degree, as in the report's rows) the replicated data-parallel step with
Adam and the same step with every optimizer-state group sharded over the data axis
(`disco_jax.sharding.update`: reduce-scatter of the gradients, update of one eighth, all-gather of
the parameters). Each program's XLA plan is simulated on every H100 cluster (roofline kernels, the
cluster's ring / hierarchical all-reduce model; reduce-scatter and all-gather at half its transfer,
`disco_jax.cost.allreduce.collective_time_us`), and per device the optimizer-state bytes and the
bytes sent per step (ring algorithms) are reported. This is the per-model choice
`weight_update="search"` makes, on simulated hardware: the sharded update wins where its smaller
update and the reduce-scatter/all-gather pair cost less than the replicated update and all-reduce.

    python scripts/sharded_update_clusters.py [--models mlp bert] [--out report]

Writes <out>/sharded_update.md and <out>/sharded_update.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import optax

from disco_jax import ChainEstimator, backends, simulate, targets, zoo
from disco_jax._compile import capture_program
from disco_jax._strategy import xla_default
from disco_jax.cost.allreduce import communication_bytes
from disco_jax.eval import clusters
from disco_jax.eval.rows import ALL_MODELS, PAPER_DEVICES
from disco_jax.sharding import update

TARGET = "h100-sxm"
PLATFORMS = tuple(name for name in clusters.CLUSTERS if clusters.get_cluster(name).target == TARGET)


def programs(name: str) -> dict:
    """The replicated and the sharded program of a model's paper step, captured for the target."""
    spec = zoo.get_model(name, "paper")
    optimizer = optax.adam(1e-3)
    mesh = targets.mesh(TARGET, PAPER_DEVICES)
    args = zoo.abstract_state_and_batch(spec, optimizer, mesh)
    step = zoo.build_train_step(spec, optimizer, mesh, "jit")
    started = time.perf_counter()
    replicated, compiled = capture_program(step.lower(*args), backends.GPU)
    lowered, layout, reason = update.relower_positional(step, args, compiled)
    if lowered is None:
        raise RuntimeError(f"{name}: no optimizer state to shard ({reason})")
    sharded, sharded_compiled = capture_program(lowered, backends.GPU)
    avals = dict(enumerate(jax.tree.leaves(args)))
    state = layout.state_bytes(avals) * layout.num_shards
    return {
        "programs": {"replicated": replicated, "sharded": sharded},
        "state_bytes": {"replicated": state, "sharded": layout.state_bytes(avals)},
        "collectives": {
            "replicated": update.collectives(compiled.as_text()),
            "sharded": update.collectives(sharded_compiled.as_text()),
        },
        "leaves": len(layout.inputs),
        "groups": len(layout.groups),
        "capture_s": time.perf_counter() - started,
    }


def row(name: str) -> dict:
    captured = programs(name)
    out = {k: v for k, v in captured.items() if k != "programs"}
    out["comm_bytes_per_device"] = {
        mode: communication_bytes(program, PAPER_DEVICES)["total"] for mode, program in captured["programs"].items()
    }
    out["simulated_us"] = {}
    for platform in PLATFORMS:
        cluster = clusters.get_cluster(platform)
        estimator, allreduce = ChainEstimator([cluster.kernel_estimator()]), cluster.allreduce_model()
        times = {}
        for mode, program in captured["programs"].items():
            sim = simulate(program, xla_default(program.graph), estimator, allreduce)
            times[mode] = None if sim is None else sim.iteration_us
        out["simulated_us"][platform] = times
    return out


def table(rows: dict) -> str:
    head = "| model | state groups | optimizer state MB/device: replicated → sharded "
    head += "| MB sent/device/step: replicated → sharded | collectives (sharded) |"
    head += "".join(f" {p}: sharded/replicated time |" for p in PLATFORMS)
    lines = [head, "|" + "---|" * (5 + len(PLATFORMS))]
    for name, r in rows.items():
        mb = lambda d: f"{d['replicated'] / 2**20:.1f} → {d['sharded'] / 2**20:.1f}"  # noqa: E731
        coll = ", ".join(f"{n} {k}" for k, n in r["collectives"]["sharded"].items() if n and k != "dynamic-slice")
        ratios = "".join(
            f" {t['sharded'] / t['replicated']:.3f} |" if t["sharded"] and t["replicated"] else " n/a |"
            for t in r["simulated_us"].values()
        )
        lines.append(
            f"| {name} | {r['groups']} | {mb(r['state_bytes'])} | {mb(r['comm_bytes_per_device'])} | {coll} |{ratios}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(ALL_MODELS), choices=ALL_MODELS)
    parser.add_argument("--out", default="report")
    args = parser.parse_args()
    rows = {}
    for name in args.models:
        print(f"{name}: capturing the replicated and the sharded step for {TARGET}", file=sys.stderr, flush=True)
        try:
            rows[name] = row(name)
        except Exception as e:  # a model that cannot be captured is reported, not fatal
            print(f"{name}: skipped ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
    text = table(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sharded_update.json").write_text(
        json.dumps({"target": TARGET, "platforms": PLATFORMS, "rows": rows}, indent=1)
    )
    (out / "sharded_update.md").write_text(
        "# The sharded weight update on the simulated H100 clusters\n\n"
        f"`python scripts/sharded_update_clusters.py --models {' '.join(args.models)} --out {args.out}`\n\n"
        f"{text}\n"
    )
    print(text)


if __name__ == "__main__":
    main()
