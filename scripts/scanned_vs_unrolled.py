"""The same GPT decoder with its blocks scanned and unrolled, compiled deviceless for a GPU
cluster and costed as compiled (docs/compiled-cost.md, "Scanned against unrolled").

For each form (`scan_layers=True`: Flax `nn.scan` over the blocks, a `while` per pass; and the
blocks one after the other), prints the compile time, the kernels and collectives the
compiled-program model runs per step (`cost.cost_program`) beside the runs counted from the
module's text (each loop body's kernels times its `known_trip_count`, plus the rest), the
simulated step (the cluster's kernel estimator, collectives and host lane), and where the two
forms' compute time differs, by kind of kernel: gemms (the same arithmetic in both), the scanned
form's stacking kernels (those holding a dynamic-slice or
dynamic-update-slice: a layer's parameters sliced out of their `(layers, ...)` stack, its
activations stored into one for the backward), loop fusions that only broadcast (zeroed
buffers), and the other fusions.

    python scripts/scanned_vs_unrolled.py [--layers 2] [--width 4096] [--seq 2048] [--vocab 50257]
        [--batch 8] [--dtype bfloat16] [--cluster 8xH100-NVLink] [--remat none|dots|full]
        [--json out.json] [--timeline DIR]

`--timeline DIR` also draws both forms' steps as the model runs them (every kernel run on the
compute and communication streams, a loop body's once per layer, labelled with its iteration):
DIR/scanned_vs_unrolled.png and a Perfetto trace beside it (`disco_jax._timeline`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from collections import Counter

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")

import optax  # noqa: E402

from disco_jax import backends, cost, targets, zoo  # noqa: E402
from disco_jax._timeline import write_timelines  # noqa: E402
from disco_jax.eval import clusters  # noqa: E402

STACKING = frozenset({"dynamic-slice", "dynamic-update-slice"})


def text_runs(text: str) -> tuple[int, int]:
    """(compute kernel runs, collective runs) per step read from the module's text by regular
    expressions (not the library's reader): a loop body's kernels count its trip count times."""
    bodies: dict[str, list[str]] = {}
    name = None
    for line in text.splitlines():
        header = re.match(r"^(ENTRY )?%?([\w.\-]+) \(", line)
        if header:
            name = "ENTRY" if header.group(1) else header.group(2)
            bodies[name] = []
        elif line.strip() == "}":
            name = None
        elif name is not None:
            bodies[name].append(line)

    def runs(comp: str) -> tuple[int, int]:
        compute = collectives = 0
        for line in bodies[comp]:
            opcode = re.search(r"\s([a-z][\w\-]*)\(", line.split(" = ", 1)[1]).group(1)
            if opcode == "while":
                trips = int(re.search(r'"known_trip_count":\{"n":"(\d+)"', line).group(1))
                inner = runs(re.search(r"body=%?([\w.\-]+)", line).group(1))
                compute, collectives = compute + trips * inner[0], collectives + trips * inner[1]
            elif opcode in ("parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all"):
                continue
            elif opcode.endswith("-done"):
                continue
            elif opcode.endswith("-start") and opcode != "fusion-start":
                collectives += 1
            elif opcode in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"):
                collectives += 1
            else:
                compute += 1
        return compute, collectives

    return runs("ENTRY")


def kernel_class(program: cost.CompiledProgram, name: str, kind: str) -> str:
    if kind in ("gemm", "conv"):
        return "gemm"
    opcodes = {program.graph.ops[o].opcode for o in program.ops[name]}
    if opcodes & STACKING:
        return "stacking"
    if opcodes <= {"broadcast", "constant", "bitcast", "copy", "iota", "compare"}:
        return "broadcast"
    return "other fusions"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=None, help="default: width / 128")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--cluster", default="8xH100-NVLink")
    parser.add_argument("--remat", default="none", help="each block's rematerialization: none, dots, full")
    parser.add_argument("--json", default=None)
    parser.add_argument("--timeline", default=None, help="directory for the timeline picture and trace")
    args = parser.parse_args(argv)
    cluster = clusters.get_cluster(args.cluster)
    estimator, collectives = cluster.kernel_estimator(), cluster.allreduce_model()
    mesh = targets.mesh(cluster.target, cluster.gpus_per_node * cluster.nodes)
    found, timelines = {}, {}
    for scan in (True, False):
        spec = zoo.resized(
            "gpt",
            num_layers=args.layers,
            d_model=args.width,
            num_heads=args.heads or max(1, args.width // 128),
            seq_len=args.seq,
            vocab_size=args.vocab,
            global_batch=args.batch,
            compute_dtype=args.dtype,
            scan_layers=scan,
            remat=args.remat,
        )
        start = time.perf_counter()
        compiled = zoo.lower_abstract(spec, optax.adamw(1e-4), mesh, "jit").compile()
        compile_s = time.perf_counter() - start
        text = compiled.as_text()
        program = cost.compiled_program(text, backends.GPU)
        costed = cost.cost_program(program, estimator, collectives, cluster.simulator_params())
        record = costed.to_json()
        by_class: Counter = Counter()
        for k in costed.kernels:
            if k.lane == "compute":
                by_class[kernel_class(program, k.name, k.kind)] += k.time_us
        form = "scanned" if scan else "unrolled"
        timelines[form] = [
            [k.lane, k.name + "".join(f"[{i}]" for i in k.iteration), k.start_us, k.end_us] for k in costed.kernels
        ]
        found[form] = {
            "compile_s": round(compile_s, 1),
            "kernel_runs": record["num_kernels"],
            "collective_runs": record["num_collectives"],
            "text_runs": list(text_runs(text)),
            "kernel_instructions": len(program.kernels),
            "iteration_us": record["iteration_us"],
            "compute_us": record["compute_us"],
            "comm_us": record["comm_us"],
            "compute_us_by_kind": dict(by_class),
            "loops": [(c["name"], c["trip_count"]) for c in record.get("control_flow", [])],
        }
        f = found[form]
        print(
            f"{form:9s} compile {f['compile_s']:6.1f} s  kernel runs {f['kernel_runs']} (text {f['text_runs'][0]}), "
            f"collective runs {f['collective_runs']} (text {f['text_runs'][1]}), loops {f['loops']}; "
            f"step {f['iteration_us'] / 1e3:.2f} ms (compute {f['compute_us'] / 1e3:.2f}, "
            f"comm {f['comm_us'] / 1e3:.2f})"
        )
    scanned, unrolled = found["scanned"], found["unrolled"]
    print(f"scanned / unrolled step: {scanned['iteration_us'] / unrolled['iteration_us']:.3f}")
    for kind in ("gemm", "stacking", "broadcast", "other fusions"):
        a, b = scanned["compute_us_by_kind"].get(kind, 0.0), unrolled["compute_us_by_kind"].get(kind, 0.0)
        print(f"  {kind:14s} scanned {a / 1e3:7.2f} ms  unrolled {b / 1e3:7.2f} ms")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"args": vars(args), **found}, out, indent=1)
    if args.timeline:
        title = f"GPT, {args.layers} blocks of width {args.width}, 8 x {cluster.target} (compiled-program model)"
        for path in write_timelines(timelines, args.timeline, "scanned_vs_unrolled", title):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
