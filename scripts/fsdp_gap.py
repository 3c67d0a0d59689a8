"""Why one sharded program of a decoder costs more than another: the hand-written FSDP against
disco-jax's FSDP (or any two candidates of the layout search, by label), compiled deviceless for a
GPU cluster as `large_model_layouts.py` compiles them, and broken down from the compiled programs:
collectives per kind, scope (the entry or a loop body), group size and bytes per device (per step:
a loop body's count times its trip count), their costed time and how much of it is not hidden
under compute, compute kernels' time by kind, the per-device peak, and XLA's warnings about
activations it rematerialized ("Involuntary full rematerialization", counted from stderr).

    python scripts/fsdp_gap.py --layers 2 --width 2048 --heads 16 --vocab 50304 --batch 32 --scan \
        --cluster 4x8xH100-IB400 [--plans "32x1 by hand: FSDP;32x1 Embed: fsdp, blocks: fsdp"]

Deviceless compiles: minutes each on 2 busy cores at the 1.3B width; run under `nice -n 19`.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")

import _decoder  # noqa: E402

from disco_jax import layout_search  # noqa: E402
from disco_jax.cost.compiled import COLLECTIVE_METHOD  # noqa: E402
from disco_jax.eval import clusters, handwritten  # noqa: E402
from disco_jax.sharding import mesh_step  # noqa: E402


class _Stderr:
    """XLA's C++ warnings go to file descriptor 2: catch them to count the rematerializations."""

    def __enter__(self):
        sys.stderr.flush()
        self.file = tempfile.TemporaryFile(mode="w+b")
        self.saved = os.dup(2)
        os.dup2(self.file.fileno(), 2)
        return self

    def __exit__(self, *exc):
        sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)
        self.file.seek(0)
        self.text = self.file.read().decode(errors="replace")
        self.file.close()


def breakdown(c: layout_search.LayoutCandidate) -> dict:
    """The compiled program of a candidate, by collective (kind, scope, group size) and compute."""
    program, cost = c.program, c.cost
    collectives = collections.defaultdict(lambda: {"count": 0, "bytes": 0.0, "us": 0.0})
    key_of = {}
    for k in program.collectives:
        key_of[k.name] = f"{k.collective} {'loop' if k.scope else 'entry'} group {len(k.group) or '?'}"
        collectives[key_of[k.name]]["count"] += k.repeat
        collectives[key_of[k.name]]["bytes"] += k.repeat * sum(k.tensor_bytes)
    compute = collections.defaultdict(float)
    for k in cost.kernels:  # every run (a loop body's once per iteration)
        if k.method == COLLECTIVE_METHOD:
            collectives[key_of[k.name]]["us"] += k.time_us
        else:
            compute[k.kind] += k.time_us
    return {
        "iteration_us": cost.iteration_us,
        "compute_us": cost.compute_us,
        "comm_us": cost.comm_us,
        "exposed_comm_us": cost.iteration_us - cost.compute_us - cost.step_overhead_us,
        "peak_bytes": c.peak_bytes,
        "collectives": {k: dict(v) for k, v in sorted(collectives.items())},
        "compute_by_kind_us": dict(sorted(compute.items(), key=lambda kv: -kv[1])),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _decoder.add_arguments(parser, layers=2, width=2048, vocab=50304, heads=16)
    parser.add_argument("--cluster", default="4x8xH100-IB400")
    parser.add_argument("--plans", default=None, help="';'-separated labels (default: the hand FSDP and disco-jax's)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    cluster = clusters.get_cluster(args.cluster)
    n = cluster.num_devices
    spec, step, (state, batch) = _decoder.target_step(args, cluster)
    found = mesh_step.structure(step, (state, batch))
    wanted = (args.plans or f"{n}x1 by hand: FSDP;{n}x1 Embed: fsdp, blocks: fsdp").split(";")
    plans = {p.label: p for p in layout_search.candidate_plans(found, cluster.gpus_per_node)}
    plans.update({p.label: p for p in handwritten.hand_plans(n, cluster.gpus_per_node, constrained=False)})
    print(f"{spec.description}; {spec.param_count() / 1e9:.2f}B parameters; {cluster.name}", flush=True)
    costs = (cluster.kernel_estimator(), cluster.grouped_collectives(), cluster.simulator_params())
    out = {"args": vars(args), "model": spec.description, "plans": {}}
    for label in wanted:
        with _Stderr() as err:
            c = layout_search.compile_candidate(step, (state, batch), found, plans[label], cluster, costs)
        if c.cost is None:
            print(f"{label}: {c.why_not}")
            continue
        b = breakdown(c)
        b["involuntary_rematerializations"] = err.text.count("Involuntary full rematerialization")
        b["compile_s"] = c.compile_s
        b["fingerprint"] = c.fingerprint
        b["input_specs"] = {
            found.parameters[p]: [str(e) for e in c.enacted.input_specs[p]] for p in sorted(found.parameters)
        }
        out["plans"][label] = b
        kind = "by hand" if isinstance(c.plan, handwritten.HandPlan) else "disco-jax"
        print(
            f"\n{label} ({kind}, {c.compile_s:.0f} s): step {b['iteration_us'] / 1e3:.2f} ms, compute"
            f" {b['compute_us'] / 1e3:.2f} ms, collectives {b['comm_us'] / 1e3:.2f} ms (not hidden"
            f" {b['exposed_comm_us'] / 1e3:.2f} ms), peak {b['peak_bytes'] / 1e9:.2f} GB,"
            f" involuntary rematerializations {b['involuntary_rematerializations']}, program {c.fingerprint}"
        )
        for key, v in b["collectives"].items():
            print(f"  {key:40s} x{v['count']:5d} {v['bytes'] / 1e6:10.1f} MB {v['us'] / 1e3:9.2f} ms")
        top = list(b["compute_by_kind_us"].items())
        print("  compute: " + ", ".join(f"{k} {us / 1e3:.2f} ms" for k, us in top))
        for path, s in b["input_specs"].items():
            print(f"  {path}: {s}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
