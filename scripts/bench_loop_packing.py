"""Packing a loop body's all-reduces (issue 43, `Strategy.packed_loops`), measured on XLA:CPU.

The zoo's tiny GPT with its blocks under `nn.scan` (`scan_layers=True`) and AdamW, data parallel
on 8 CPU devices in one process. XLA:CPU's backward loop body all-reduces each layer's gradients
as one variadic all-reduce, one rendezvous per operand; the plan packs them into one flat buffer
per iteration. Two parts:

1. ``A/B``: XLA's executable against the same program with only its loop bodies' all-reduces
   packed (XLA's fusions and entry buckets kept), compiled through the hook; outputs compared
   bitwise, the compiled bodies' variadic all-reduces counted, then the two timed in interleaved
   pairs (`_validate.time_interleaved`): median step times, the median ratio packed / XLA, its
   interquartile range and 95% interval.
2. ``search``: the step through `@optimize_distributed(search=True, weight_update="replicated")`:
   the plan the search picks (does it pack the loop?), its simulated and validated ratios.

A CPU figure: XLA:GPU combines a body's all-reduces into one NCCL call already (docs/xla-facts.md,
DESIGN point 22), so nothing here says anything about GPUs. On a shared machine the ratios are
noisy: read the intervals.

    python scripts/bench_loop_packing.py [--layers 8] [--pairs 30] [--budget 10] [--no-search]
        [--json out.json] [--timeline DIR]

`--timeline DIR` traces one step of each program (XLA:CPU's profiler: every run of a loop body's
ops is an event of its own) and draws device 0's ops as they ran, the body's once per iteration
(labels `op[i]`), all-reduces on the comm lane: DIR/loop_packing.png and a Perfetto trace beside
it (`disco_jax._timeline`); the median all-reduce run inside the loop of each is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    + ["--xla_force_host_platform_device_count=8"]
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--budget", type=float, default=10.0, help="search budget in seconds")
    parser.add_argument("--no-search", action="store_true", help="the A/B part only")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--timeline", help="directory for the traced timelines of one step of each")
    args = parser.parse_args()

    import dataclasses

    import optax

    from disco_jax import _strategy, _validate, backends, optimize_distributed, zoo
    from disco_jax._compile import capture, compile_strategy, compiled_stats

    spec = zoo.resized("gpt", num_layers=args.layers, scan_layers=True)
    step, state, batch = zoo.make_train_step(spec, optax.adamw(1e-3), zoo.data_mesh(), "jit")
    captured = capture(step.lower(state, batch), backends.CPU, (state, batch), {})
    graph = captured.graph
    packed = dataclasses.replace(_strategy.xla_default(graph), packed_loops=True, origin="xla+packed-loop-allreduce")
    compiled, status = compile_strategy(captured.lowered, captured.program, packed)
    default_stats, packed_stats = (
        compiled_stats(captured.default_compiled.as_text()),
        compiled_stats(compiled.as_text()),
    )
    default_run, packed_run = captured.runner(captured.default_compiled), captured.runner(compiled)
    check = _validate.compare_outputs(default_run(), packed_run(), bitwise=True)
    timing = _validate.time_interleaved(default_run, packed_run, pairs=args.pairs)
    out = {
        "model": f"gpt tiny, {args.layers} scanned blocks, AdamW, 8 CPU devices (data parallel)",
        "loop_allreduces": [list(x) for x in graph.loop_allreduces],
        "compile_status": status,
        "loop_variadic_allreduces": {
            "xla": default_stats["loop_variadic_all-reduces"],
            "packed": packed_stats["loop_variadic_all-reduces"],
        },
        "bitwise_equal": check.bitwise_equal,
        "xla_ms": timing.default_us / 1e3,
        "packed_ms": timing.plan_us / 1e3,
        "ratio": timing.ratio,
        "ratio_iqr": [timing.ratio_low, timing.ratio_high],
        "ratio_interval": list(timing.ratio_ci95),
        "pairs": timing.pairs,
    }
    print(f"{out['model']}: loop all-reduces {out['loop_allreduces']}, compile {status}")
    print(
        f"  variadic all-reduces in loop bodies: XLA {default_stats['loop_variadic_all-reduces']}, "
        f"packed {packed_stats['loop_variadic_all-reduces']}; outputs bitwise equal: {check.bitwise_equal}"
    )
    print(
        f"  A/B over {timing.pairs} interleaved pairs: XLA {out['xla_ms']:.2f} ms, packed {out['packed_ms']:.2f} ms, "
        f"packed / XLA {timing.ratio:.3f} [IQR {timing.ratio_low:.3f}-{timing.ratio_high:.3f}], "
        f"95% interval {timing.ratio_ci95[0]:.3f}-{timing.ratio_ci95[1]:.3f}"
    )
    if args.timeline:
        from disco_jax._timeline import write_timelines

        timelines, body_ops = {}, {name for _, name in graph.loop_allreduces}
        for label, executable, run in (
            ("XLA", captured.default_compiled, default_run),
            ("packed", compiled, packed_run),
        ):
            timelines[label], reduce_us = traced_step(executable, run)
            body = [t for op, t in reduce_us if op in body_ops or op.startswith("disco_all-reduce.loop")]
            out.setdefault("loop_allreduce_us", {})[label] = sorted(body)[len(body) // 2] if body else None
        print(f"  traced, device 0: the loop body's all-reduce per iteration, median {out['loop_allreduce_us']} us")
        title = f"GPT tiny, {args.layers} scanned blocks, 8 CPU devices: one traced step, device 0"
        for path in write_timelines(timelines, args.timeline, "loop_packing", title, "traced"):
            print(f"  wrote {path}")
    if not args.no_search:
        with tempfile.TemporaryDirectory() as plan_dir:
            decorated = optimize_distributed(
                step, search=True, plan_dir=plan_dir, budget_s=args.budget, verbose=False, weight_update="replicated"
            )
            decorated(state, batch)
            report = decorated.last_report
        plan = report.plan or {}
        strategy = plan.get("strategy", plan)
        out["search"] = {
            "applied": report.applied,
            "reason": report.reason,
            "origin": strategy.get("origin"),
            "packed_loops": strategy.get("packed_loops"),
            "packed": strategy.get("packed"),
            "simulated": report.simulated,
            "measured": report.measured,
        }
        print(
            f"  search: applied {report.applied} ({report.reason}); plan origin {strategy.get('origin')}, "
            f"packed_loops {strategy.get('packed_loops')}, packed {strategy.get('packed')}"
        )
        print(f"  simulated {json.dumps(report.simulated)}")
        print(f"  measured {json.dumps(report.measured)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)


def traced_step(executable, run) -> tuple[list, list[tuple[str, float]]]:
    """One step of `executable` (called by `run`) under XLA:CPU's profiler: device 0's op events
    as `_timeline` lanes (`[lane, op[i], start_us, end_us]`, the i-th run of the op in the step,
    times from the step's first op; the loops' own events left out, their bodies' ops drawn) and
    every all-reduce run as (op, microseconds)."""
    import tempfile
    from collections import Counter
    from pathlib import Path

    import jax

    from disco_jax import _device_timing

    jax.block_until_ready(run())
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready(run())
        traces = [jax.profiler.ProfileData.from_file(str(p)) for p in Path(trace_dir).rglob("*.xplane.pb")]
    events = _device_timing.module_op_events(traces, _device_timing.hlo_module_name(executable.as_text()))
    first = min(e.device for e in events)
    mine = sorted((e for e in events if e.device == first and not e.op.startswith("while")), key=lambda e: e.start_ns)
    t0, seen, lanes, reduces = mine[0].start_ns, Counter(), [], []
    for e in mine:
        comm = "all-reduce" in e.op
        lanes.append(
            ["comm" if comm else "compute", f"{e.op}[{seen[e.op]}]", (e.start_ns - t0) / 1e3, (e.end_ns - t0) / 1e3]
        )
        seen[e.op] += 1
        if comm:
            reduces.append((e.op, (e.end_ns - e.start_ns) / 1e3))
    return lanes, reduces


if __name__ == "__main__":
    main()
