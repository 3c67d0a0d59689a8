"""Hand-written sharded configurations of a decoder against disco-jax's searched mesh and layout,
compiled deviceless for a GPU cluster and costed the same way: every program by the compiled-
program model (`cost.cost_program`, collectives per replica group), its per-device peak from
XLA's memory analysis, its model FLOP utilization from the model's FLOPs per step.

The configurations a user writes (`eval.handwritten`): data parallel, FSDP (NamedSharding on
parameters and state), TP over a node (Megatron column/row by parameter name, vocabulary-parallel
embedding), data x TP, FSDP x TP. disco-jax's candidates: `layout_search.candidate_plans` (every
mesh shape x choice per layer group), found from the step's own dots, enacted with activation
constraints. The hand-written configurations are candidates of the same search
(`candidate_plans(hand=True)`), so the plan, the cheapest within `--memory-gb`, is never worse than
the best of them that fits; rows say which compiled to the same program.

On 4x8xH100-IB400 (32 GPUs, `--cluster 4x8xH100-IB400`) the meshes are 32x1, 16x2, 8x4, 4x8: the
model axis inside a node (device ids numbered node by node, model the faster mesh axis);
collectives inside a node are costed on the 8-GPU NVLink nccl-tests fits (groups of 2 and 4 by the
ring's bus factor), groups across nodes on the 2-node InfiniBand fits carried to their node count
(`clusters.GroupedCollectives`).

    python scripts/large_model_layouts.py [--layers 2] [--width 2048] [--heads 16] [--seq 2048]
        [--batch 8] [--vocab 50304] [--cluster 8xH100-NVLink] [--memory-gb 80] [--scan] [--remat none]
        [--json out.json]

Compile time is minutes per program on 2 busy cores: run a few layers (scanned, `--scan`) and
say so; the step time of L layers is then not extrapolated here.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")

import _decoder  # noqa: E402

from disco_jax import layout_search  # noqa: E402
from disco_jax.eval import clusters, handwritten  # noqa: E402
from disco_jax.sharding import mesh_step  # noqa: E402


def model_flops(spec_cfg: dict, params: int) -> float:
    """Model FLOPs of one training step (forward and backward, no recomputation): 6 per parameter
    per token plus attention's 12 x layers x width x sequence per token (PaLM's appendix B)."""
    tokens = spec_cfg["batch"] * spec_cfg["seq"]
    return tokens * (6 * params + 12 * spec_cfg["layers"] * spec_cfg["width"] * spec_cfg["seq"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _decoder.add_arguments(parser, layers=2, width=2048, vocab=50304, heads=16)
    parser.add_argument("--cluster", default="8xH100-NVLink")
    parser.add_argument("--memory-gb", type=float, default=80.0)
    parser.add_argument(
        "--only", default=None, help="';'-separated labels of disco-jax's plans to compile (default: all; by hand: all)"
    )
    parser.add_argument("--no-hand", action="store_true", help="skip the hand-written configurations")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    cluster = clusters.get_cluster(args.cluster)
    n = cluster.num_devices
    spec, step, (state, batch) = _decoder.target_step(args, cluster)
    params = spec.param_count()
    flops = model_flops({"batch": args.batch, "seq": args.seq, "layers": args.layers, "width": args.width}, params)
    peak_flops = (cluster.device.dot16_flops or cluster.device.dot_flops).value
    limit = int(args.memory_gb * 1e9)
    print(f"{spec.description}; {params / 1e9:.2f}B parameters; {cluster.name}; limit {args.memory_gb} GB", flush=True)
    rows = {}

    def row(label, iteration_us, peak, compile_s, kind):
        mfu = None if not iteration_us else flops / (n * peak_flops * iteration_us * 1e-6)
        rows[label] = {
            "kind": kind,
            "iteration_us": iteration_us,
            "peak_bytes": peak,
            "mfu": mfu,
            "compile_s": compile_s,
        }
        return mfu

    def rows_of(result):
        rows.clear()
        for c in result.candidates:
            if c.cost is not None:
                kind = "by hand" if isinstance(c.plan, handwritten.HandPlan) else "disco-jax"
                row(c.plan.label, c.iteration_us, c.peak_bytes, c.compile_s, kind)
                rows[c.plan.label]["same_program_as"] = list(c.same_program)
                rows[c.plan.label]["mesh"] = [c.plan.data, c.plan.model]

    def write(result, partial: bool):
        """The rows so far as JSON (`partial`: the run has not compiled every plan yet)."""
        if not args.json:
            return
        rows_of(result)
        record = {
            "args": vars(args),
            "model": spec.description,
            "parameters": params,
            "cluster": cluster.name,
            "model_flops_per_step": flops,
            "peak_flops_per_device": peak_flops,
            "partial": partial,
            "rows": rows,
            "search": result.to_json(found),
        }
        with open(args.json + ".tmp", "w") as out:
            json.dump(record, out, indent=1)
        os.replace(args.json + ".tmp", args.json)

    found = mesh_step.structure(step, (state, batch))
    plans = layout_search.candidate_plans(found, cluster.gpus_per_node, hand=not args.no_hand)
    if args.only:
        wanted = set(args.only.split(";"))
        unknown = wanted - {p.label for p in plans}
        if unknown:  # a label that names no candidate would be skipped silently
            parser.error(f"--only names no candidate: {sorted(unknown)}; candidates: {[p.label for p in plans]}")
        plans = [p for p in plans if p.label in wanted or isinstance(p, handwritten.HandPlan)]
    print(f"{len(plans)} plans to compile (program time, peak, compile seconds as each is done):", flush=True)
    result = layout_search.search_layouts(
        step,
        (state, batch),
        found,
        cluster,
        limit,
        plans,
        say=lambda line: print("  " + line, flush=True),
        after=lambda partial: write(partial, True),
    )
    write(result, False)
    rows_of(result)
    for c in result.candidates:
        kind = "by hand" if isinstance(c.plan, handwritten.HandPlan) else "disco-jax"
        if c.cost is None:
            print(f"{kind:10s} {c.plan.label}: {c.why_not}")
            continue
        r = rows[c.plan.label]
        over = "" if r["peak_bytes"] <= limit else "  (over the limit)"
        print(
            f"{kind:10s} {c.plan.label:60s} step {r['iteration_us'] / 1e3:8.2f} ms"
            f"  peak {r['peak_bytes'] / 1e9:6.2f} GB  MFU {100 * r['mfu']:5.1f}%  ({r['compile_s']:.0f} s){over}",
            flush=True,
        )
    print(f"chosen: {result.reason}")
    best_hand = min(
        (r for r in rows.values() if r["kind"] == "by hand" and r["peak_bytes"] <= limit),
        key=lambda r: r["iteration_us"],
        default=None,
    )
    if result.chosen is not None and best_hand is not None:
        print(f"plan / best hand-written that fits: {result.chosen.iteration_us / best_hand['iteration_us']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
