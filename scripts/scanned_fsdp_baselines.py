"""A scanned decoder's FSDP step under XLA:GPU's own loop options, compiled deviceless and costed
as compiled: the baseline a prefetch of layer l+1's parameters across loop iterations would have
to beat (docs/sharded-update.md, "Stacked parameters").

The zoo GPT with `scan_layers=True` (Flax `nn.scan` over its blocks), AdamW, lowered for a GPU
cluster's target; its weight update laid out by `sharding.update.find_layout` with every
parameter and its state sharded and gathered again for each use (`Layout.regather`: the stacked
parameters enter the loops split after their layer axis and each body gathers its own layer).
That program is compiled with XLA's defaults and with XLA:GPU's options that move a loop's
collectives across iterations: the latency-hiding scheduler; collective pipelining of the
all-gathers and reduce-scatters (`xla_gpu_pipeline_all_gather` / `..._reduce_scatter` =
`COLLECTIVE_PIPELINING_MODE_ON`: layer l+1's gather issued in iteration l); and the while loop
double-buffered (its body unrolled twice). Each is costed by the compiled-program model with the
cluster's kernel estimator, collective model and host lane, and its per-device peak read from XLA's memory
analysis. Prints, per option set: compile seconds, kernel and collective runs, where the loops'
collectives sit, simulated step, exposed communication (step minus compute), peak.

    python scripts/scanned_fsdp_baselines.py [--layers 8] [--width 4096] [--seq 2048] [--batch 8]
        [--cluster 8xH100-NVLink] [--at-use [--prefetch | --split-carries]] [--json out.json] [--hlo DIR]

`--at-use`: the parameters laid out as FSDP users write it (`Layout.at_use`, issue 44), gathered
by XLA where they are used, in place of gathered again for each use. `--prefetch` (with
`--at-use`): each loop rotated to gather the next layer one iteration early and carry it
(`Layout.prefetch`, `sharding.prefetch`; its loops' per-example carries split over the batch
too): the program disco-jax's prefetch compiles to, costed against XLA's own options above.
`--split-carries` (with `--at-use`): only the loops' per-example carries split over the batch
(`Layout.split_carries`), no rotation: what the split alone does. `--hlo DIR`: each option
set's compiled module written there.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")

import _decoder  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402

from disco_jax import backends, cost, targets, zoo  # noqa: E402
from disco_jax.eval import clusters  # noqa: E402
from disco_jax.sharding import choice, update  # noqa: E402

PIPELINE_ON = "COLLECTIVE_PIPELINING_MODE_ON"
OPTIONS = {
    "XLA defaults": {},
    "latency-hiding scheduler": {"xla_gpu_enable_latency_hiding_scheduler": True},
    "LHS + pipelined gathers and reduce-scatters": {
        "xla_gpu_enable_latency_hiding_scheduler": True,
        "xla_gpu_pipeline_all_gather": PIPELINE_ON,
        "xla_gpu_pipeline_reduce_scatter": PIPELINE_ON,
    },
    "LHS + pipelined + loop double-buffering": {
        "xla_gpu_enable_latency_hiding_scheduler": True,
        "xla_gpu_pipeline_all_gather": PIPELINE_ON,
        "xla_gpu_pipeline_reduce_scatter": PIPELINE_ON,
        "xla_gpu_enable_while_loop_double_buffering": True,
    },
}


def fsdp_lowered(spec, mesh, at_use: bool = False, prefetch: bool = False, split_carries: bool = False):
    """The step lowered with every parameter and its state sharded, gathered again for each use;
    with `at_use`, FSDP as users write it (`Layout.at_use`: each leaf split on its largest
    dimension, XLA gathers it where it is used, inside the loop bodies for the stacked layers);
    with `prefetch` too, each loop gathering the next layer one iteration early (and its
    per-example carries split over the data axis); with `split_carries`, only the latter."""
    optimizer = optax.adamw(1e-4)
    state, batch = zoo.abstract_state_and_batch(spec, optimizer, mesh)
    step = zoo.build_train_step(spec, optimizer, mesh, "jit", donate=True)
    args = (state, batch)
    default = step.lower(*args).compile()
    shardings = jax.tree.leaves(default.input_shardings)
    layout, reason = update.find_layout(step, args, {}, args, {}, shardings, largest=at_use)
    fsdp = layout.subset(
        layout.all_leaves(), regather=not at_use, at_use=at_use, prefetch=prefetch, split_carries=split_carries
    )
    lowered, _ = update.relower(step, fsdp, args, {}, (args, {}), default)
    return lowered, fsdp, reason


def exposed_by_collective(costed) -> dict[str, dict[str, float]]:
    """Per collective kind and place (entry or loop body), its simulated time and the part of it
    no compute kernel runs under (microseconds per step): where the exposed communication is."""
    busy = sorted((k.start_us, k.end_us) for k in costed.kernels if k.lane == "compute")
    merged: list[list[float]] = []
    for start, end in busy:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    out: dict[str, dict[str, float]] = {}
    for k in costed.kernels:
        if k.lane != "comm":
            continue
        covered = sum(max(0.0, min(k.end_us, e) - max(k.start_us, s)) for s, e in merged)
        entry = out.setdefault(f"{k.kind} ({'loop' if k.scope else 'entry'})", {"us": 0.0, "exposed_us": 0.0})
        entry["us"] += k.end_us - k.start_us
        entry["exposed_us"] += k.end_us - k.start_us - covered
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _decoder.add_arguments(parser, layers=8, scan=False)
    parser.add_argument("--cluster", default="8xH100-NVLink")
    parser.add_argument("--at-use", action="store_true", help="at-use FSDP (Layout.at_use) instead of regathered")
    parser.add_argument(
        "--prefetch", action="store_true", help="with --at-use: the next layer gathered one iteration early"
    )
    parser.add_argument(
        "--split-carries", action="store_true", help="with --at-use: the loops' activations batch-split"
    )
    parser.add_argument("--hlo", default=None, help="write each option set's compiled module to this folder")
    parser.add_argument("--options", nargs="+", default=list(OPTIONS), choices=list(OPTIONS), help="option sets")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    cluster = clusters.get_cluster(args.cluster)
    mesh = targets.mesh(cluster.target, cluster.gpus_per_node * cluster.nodes)
    spec = _decoder.spec(args)
    if (args.prefetch or args.split_carries) and not args.at_use:
        parser.error("--prefetch and --split-carries change the loops of at-use FSDP: add --at-use")
    lowered, layout, reason = fsdp_lowered(spec, mesh, args.at_use, args.prefetch, args.split_carries)
    form = "at-use FSDP (gathered where used)" if args.at_use else "FSDP gathered again for each use"
    form += ", next layer prefetched one iteration early" if args.prefetch else ""
    form += ", loop carries split over the batch" if args.prefetch or args.split_carries else ""
    print(f"{spec.description}; {form}; {reason}; stacked leaves split after the layer axis: {len(layout.stacked)}")
    estimator, collectives = cluster.kernel_estimator(), cluster.allreduce_model()
    found = {}
    for label in args.options:
        options = OPTIONS[label]
        start = time.perf_counter()
        compiled = lowered.compile(compiler_options=dict(options))
        compile_s = time.perf_counter() - start
        text = compiled.as_text()
        if args.hlo:
            os.makedirs(args.hlo, exist_ok=True)
            with open(os.path.join(args.hlo, label.replace(" ", "_").replace("+", "") + ".hlo"), "w") as out:
                out.write(text)
        program = cost.compiled_program(text, backends.GPU)
        costed = cost.cost_program(program, estimator, collectives, cluster.simulator_params())
        record = costed.to_json()
        in_loops = sum(1 for k in program.collectives if k.scope)
        by_kind = Counter((k.collective, "loop" if k.scope else "entry") for k in program.collectives)
        peak = choice.footprint(update.memory(compiled, {}))
        found[label] = {
            "options": {k: str(v) for k, v in options.items()},
            "compile_s": round(compile_s, 1),
            "kernel_runs": record["num_kernels"],
            "collective_runs": record["num_collectives"],
            "collectives_in_loops": in_loops,
            "loops": [(c["name"], c["trip_count"]) for c in record.get("control_flow", [])],
            "iteration_us": record["iteration_us"],
            "compute_us": record["compute_us"],
            "comm_us": record["comm_us"],
            "exposed_comm_us": record["iteration_us"] - record["compute_us"],
            "collectives_by_kind": {f"{c} ({where})": n for (c, where), n in sorted(by_kind.items())},
            "exposed_by_collective": exposed_by_collective(costed),
            "peak_bytes": peak,
        }
        f = found[label]
        print(
            f"{label:45s} compile {f['compile_s']:5.1f} s  runs {f['kernel_runs']} + {f['collective_runs']} "
            f"collectives ({in_loops} collective instructions in loop bodies), loops {f['loops']}; "
            f"step {f['iteration_us'] / 1e3:.2f} ms (compute {f['compute_us'] / 1e3:.2f}, comm "
            f"{f['comm_us'] / 1e3:.2f}, exposed {f['exposed_comm_us'] / 1e3:.2f}); peak {peak / 1e9:.2f} GB/device",
            flush=True,
        )
        print(f"{'':45s} collective instructions: {f['collectives_by_kind']}", flush=True)
        exposed = ", ".join(
            f"{kind} {v['us'] / 1e3:.2f} ms ({v['exposed_us'] / 1e3:.2f} exposed)"
            for kind, v in sorted(f["exposed_by_collective"].items(), key=lambda x: -x[1]["exposed_us"])
        )
        print(f"{'':45s} per collective: {exposed}", flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"args": vars(args), "model": spec.description, **found}, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
