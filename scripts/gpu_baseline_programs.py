"""Every baseline of zoo models compiled deviceless for a GPU target the way a simulated row
compiles them (`baselines.compile_baselines`: XLA:GPU's compile options, or the GPU rewriter for
PyTorch DDP and Horovod, whose buckets follow the cluster's kernel costs as in the row): per
baseline, how it was enacted, what the compiled module holds, and the compile's wall and process
CPU seconds (CPU seconds are what to compare on a shared machine).

    python scripts/gpu_baseline_programs.py --models mlp bert --config paper
    python scripts/gpu_baseline_programs.py --models mlp --config tiny --json /tmp/programs.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only CUDA devices come from the topology
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")

import optax  # noqa: E402

from disco_jax import ChainEstimator, backends, targets, zoo  # noqa: E402
from disco_jax._compile import Programs, capture_program  # noqa: E402
from disco_jax.eval import baselines, clusters  # noqa: E402
from disco_jax.eval.rows import PAPER_DEVICES  # noqa: E402

# compiled_stats key -> column heading
COLUMNS = {
    "fusion": "fusions",
    "multi_op_loop_fusions": "multi-op",
    "custom_fusions": "custom",
    "multi_op_custom_fusions": "multi-op custom",
    "all-reduce": "all-reduces",
}


def model_programs(model: str, config: str, cluster: clusters.Cluster) -> dict:
    spec = zoo.get_model(model, config)
    lowered = zoo.lower_abstract(spec, optax.adam(1e-3), targets.mesh(cluster.target, PAPER_DEVICES), "jit")
    started = time.perf_counter()
    program, _ = capture_program(lowered, backends.GPU)
    capture_s = time.perf_counter() - started
    estimator = ChainEstimator([cluster.kernel_estimator()])
    candidates = baselines.all_baselines(
        program, combine=backends.GPU.xla_buckets, kernel_time_us=lambda ks: estimator.estimate(program.graph, ks)
    )
    compiled = baselines.compile_baselines(Programs(lowered, program), candidates)
    return {
        "model": model,
        "config": config,
        "target": cluster.target,
        "gradients": len(program.graph.gradients),
        "capture_s": capture_s,
        "baselines": {
            name: {**p.to_json(), "buckets": len(b.strategy.buckets)}
            for (name, p), b in zip(compiled.items(), candidates)
        },
    }


def print_table(found: dict) -> None:
    print(
        f"\n{found['model']} ({found['config']}, {found['target']} x {PAPER_DEVICES}): "
        f"{found['gradients']} gradients, capture {found['capture_s']:.1f} s"
    )
    widths = {k: max(8, len(h)) for k, h in COLUMNS.items()}
    headings = " ".join(f"{h:>{widths[k]}}" for k, h in COLUMNS.items())
    print(f"{'baseline':22s} {'enacted by':16s} {'status':12s} {headings}   wall s   cpu s")
    for name, p in found["baselines"].items():
        stats = p["compiled"] or {}
        cells = " ".join(f"{stats.get(k, '-'):>{widths[k]}}" for k in COLUMNS)
        times = f"{p['compile_s']:8.1f} {p['compile_cpu_s']:7.1f}"
        print(f"{name:22s} {p['enacted_by']:16s} {p['status']:12s} {cells} {times}")
        if p["reason"]:
            print(f"    not enacted: {p['reason']}")
        if p["same_program_as"]:
            print(f"    the same program as {p['same_program_as']} (compiled once)")
        print(f"    options: {p['compiler_options']}")
    own = [p for p in found["baselines"].values() if not p["same_program_as"]]
    total, cpu = sum(p["compile_s"] for p in own), sum(p["compile_cpu_s"] for p in own)
    print(f"compiling the baselines: {total:.1f} s wall, {cpu:.1f} s CPU")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["mlp"])
    p.add_argument("--config", default="paper", choices=("tiny", "paper"))
    p.add_argument("--cluster", default="8xH100-NVLink", help="a simulated cluster with a GPU target")
    p.add_argument("--json", help="write the records here")
    a = p.parse_args()
    cluster = clusters.get_cluster(a.cluster)
    if cluster.target is None:
        raise SystemExit(f"{a.cluster} has no GPU target XLA:GPU compiles for")
    found = []
    for model in a.models:
        found.append(model_programs(model, a.config, cluster))
        print_table(found[-1])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(found, f, indent=1)


if __name__ == "__main__":
    main()
