"""What `scripts/gpu_programs.py` recorded on a GPU, set against the compiled-program cost model.

Reads the JSON lines files that script wrote (gzipped or not) and prints, on any machine:

* **launch**: per chain of N tiny kernels, the wall time of a call, the traced device time of a
  kernel, and the cost one more kernel adds to a call (the slope of wall time over N), with
  command buffers on and off;
* **library calls**: every gemm and convolution kernel of the recorded programs (``--config
  paper`` rows: the paper configs' own shapes and dtypes) with its traced time, its work
  (`cost.work`: flops, 16-bit or not) and the efficiency it achieved against the datasheet peak
  after the fitted launch; and the median efficiency per kind, which ``--write-constants`` stores
  in the H100 profile's ``device_constants.json`` (``dot_efficiency``, read by `gpus.H100_SXM`);
* **fidelity**: per one-GPU step (default and plan, command buffers on and off) the measured wall
  time against `cost.compiled_cost` of its compiled text with the H100's kernel estimator (GNN,
  roofline with the fitted constants) and the measured gap per kernel of its setting; the traced
  kernels against the module's; and per kernel (command buffers off) the estimator's error;
* **mock**: the 8-GPU programs run under the mock topology against the 8xH100-NVLink cluster's
  compute and communication streams.

    python scripts/gpu_programs_report.py data/gpu/2026-11-26/*.jsonl.gz [--json out.json]
        [--write-constants]
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from disco_jax import backends, cost
from disco_jax.cost.simulator import SimulatorParams
from disco_jax.cost.work import kernel_work
from disco_jax.eval import clusters, gpus


def load(paths: list[str]) -> list[dict]:
    rows = []
    for p in paths:
        opener = gzip.open if p.endswith(".gz") else open
        with opener(p, "rt") as f:
            rows += [{**json.loads(line), "file": Path(p).name} for line in f if line.strip()]
    return rows


@functools.cache
def program_of(text: str) -> cost.CompiledProgram:
    """A recorded executable read for costing, once (its graph is most of the report's time)."""
    return cost.compiled_program(text, backends.GPU)


def setting(row: dict) -> str:
    return "off" if row.get("command_buffers") == "off" else "on"


# ---------------------------------------------------------------------------------------------- launch


def launch_figures(rows: list[dict]) -> dict:
    """Per setting and size: wall and traced kernel time per chain length, and the slope."""
    out: dict = defaultdict(dict)
    for r in rows:
        if r.get("mode") != "launch" or "wall_median_us" not in r:
            continue
        kernels = r["trace"]["kernel_us"]
        out[setting(r)].setdefault(r["elements"], {})[r["length"]] = {
            "wall_us": r["wall_median_us"],
            "traced_ops": len(kernels),
            "traced_us": sum(kernels.values()),
        }
    figures = {}
    for cb, by_size in out.items():
        for elements, by_length in sorted(by_size.items()):
            lengths = sorted(by_length)
            walls = [by_length[n]["wall_us"] for n in lengths]
            slope = float(np.polyfit(lengths, walls, 1)[0])
            longest = by_length[lengths[-1]]
            kernel_us = longest["traced_us"] / lengths[-1]
            figures[f"{cb}/{elements}"] = {
                "command_buffers": cb,
                "elements": elements,
                "wall_us": {n: round(by_length[n]["wall_us"], 1) for n in lengths},
                "per_kernel_us": slope,
                "kernel_device_us": kernel_us,
                "gap_us": slope - kernel_us,
                "traced_ops_longest": longest["traced_ops"],
            }
    return figures


def kernel_gap_us(launch: dict, cb: str) -> float:
    """The median over sizes of what a kernel adds to a call beyond its own device time."""
    gaps = [f["gap_us"] for f in launch.values() if f["command_buffers"] == cb]
    return float(np.median(gaps)) if gaps else 0.0


# ------------------------------------------------------------------------------------- library calls


def library_calls(rows: list[dict], device: gpus.DeviceSpec) -> list[dict]:
    """Every gemm / convolution kernel of the command-buffers-off step programs with its trace time."""
    calls = []
    seen = set()
    for r in rows:
        if r.get("mode") != "steps" or setting(r) != "off" or "text" not in r:
            continue
        times = r["trace"]["kernel_us"]
        program = program_of(r["text"])
        for k in program.compute_kernels:
            if k.kind not in ("gemm", "conv") or k.name not in times:
                continue
            work = kernel_work(program.graph, program.ops[k.name])
            if not work.dot:
                continue
            key = (r["model"], r["config"], r["program"], k.name)
            if key in seen:
                continue
            seen.add(key)
            measured = times[k.name]
            sixteen = work.dot_16bit >= work.dot / 2
            peak = (device.dot16_flops or device.dot_flops).value if sixteen else device.dot_flops.value
            device_s = max(measured - device.launch_us.value, 1e-3) / 1e6
            calls.append(
                {
                    "model": r["model"],
                    "config": r["config"],
                    "program": r["program"],
                    "kernel": k.name,
                    "kind": k.kind,
                    "flops": work.dot,
                    "bytes": work.bytes,
                    "dtype": "16-bit" if sixteen else "f32 (TF32)",
                    "measured_us": measured,
                    "device_us": device_s * 1e6,
                    "at_peak_us": work.dot / peak * 1e6,
                    "efficiency": work.dot / device_s / peak,
                }
            )
    return calls


def efficiency_fit(calls: list[dict], min_flops: float) -> dict:
    """Achieved efficiency per kind over the calls of at least `min_flops` (smaller ones are
    launch- or memory-bound, where the roofline's other terms answer): the median of the calls',
    its spread, and the aggregate (their work at the peak over their summed time: the one
    efficiency that gives their total time)."""
    out = {}
    for kind in ("gemm", "conv", "all"):
        chosen = [c for c in calls if (kind == "all" or c["kind"] == kind) and c["flops"] >= min_flops]
        if chosen:
            eff = np.array([c["efficiency"] for c in chosen])
            at_peak = sum(c["at_peak_us"] for c in chosen)
            out[kind] = {
                "calls": len(chosen),
                "aggregate": at_peak / sum(c["device_us"] for c in chosen),
                "median": float(np.median(eff)),
                "p10": float(np.percentile(eff, 10)),
                "p90": float(np.percentile(eff, 90)),
            }
    return out


# ------------------------------------------------------------------------------------------ fidelity


def predict(text: str, estimator, allreduce, gap_us: float) -> cost.CompiledCost:
    params = SimulatorParams(kernel_overhead_us=gap_us)
    return cost.cost_program(program_of(text), estimator, allreduce, params)


def fidelity(rows: list[dict], launch: dict, cluster: clusters.Cluster) -> list[dict]:
    estimator, allreduce = cluster.kernel_estimator(), cluster.allreduce_model()
    out = []
    for r in rows:
        if r.get("mode") not in ("steps", "mock") or "text" not in r or r.get("model") == "allreduce":
            continue
        if (r["mode"] == "mock") != (cluster.num_devices > 1):
            continue
        cb = setting(r)
        costed = predict(r["text"], estimator, allreduce, kernel_gap_us(launch, cb))
        bare = predict(r["text"], estimator, allreduce, 0.0)
        program = program_of(r["text"])
        traced = r["trace"]["kernel_us"]
        compute = {k.name for k in program.compute_kernels}
        per_kernel = []
        if cb == "off":
            for k in costed.kernels:
                if k.lane == "compute" and k.name in traced and traced[k.name] > 0:
                    predicted = k.time_us - kernel_gap_us(launch, cb)
                    per_kernel.append(abs(predicted - traced[k.name]) / traced[k.name])
        measured = r["wall_median_us"]
        out.append(
            {
                "mode": r["mode"],
                "model": r["model"],
                "config": r["config"],
                "program": r["program"],
                "command_buffers": cb,
                "measured_us": measured,
                "predicted_us": costed.iteration_us,
                "error": (costed.iteration_us - measured) / measured,
                "predicted_kernels_only_us": bare.iteration_us,
                "predicted_compute_us": costed.compute_us,
                "predicted_comm_us": costed.comm_us,
                "kernels": len(compute),
                "collectives": len(program.collectives),
                "traced_ops": len(traced),
                "traced_kernels_of_module": len(compute & set(traced)),
                "traced_sum_us": sum(traced.values()),
                # Kernels only, against the traced kernels' sum: where every kernel was traced.
                "device_error": (bare.iteration_us - sum(traced.values())) / sum(traced.values())
                if cb == "off" and traced
                else None,
                "costed_by": costed.costed_by,
                "kernel_median_error": float(np.median(per_kernel)) if per_kernel else None,
            }
        )
    return out


def mock_allreduce(rows: list[dict], cluster: clusters.Cluster) -> list[dict]:
    model = cluster.allreduce_model()
    return [
        {
            "bytes": r["bytes"],
            "measured_us": r["wall_median_us"],
            "traced_us": sum(r["trace"]["kernel_us"].values()),
            "cluster_us": model.time_us(r["bytes"]),
        }
        for r in rows
        if r.get("mode") == "mock" and r.get("model") == "allreduce" and "wall_median_us" in r
    ]


# ------------------------------------------------------------------------------------------- output


def write_constants(fit: dict, launch: dict, command: str) -> Path:
    """Store in the H100 profile's device constants the measured gemm/convolution efficiency (a
    `DeviceSpec` constant, `gpus.H100_SXM` reads it) and, as measurements beside the constants,
    what a kernel adds to a step with command buffers on and off."""
    path = gpus.SHIPPED_PROFILE_DIR / "nvidia-h100-80gb-hbm3" / gpus.CONSTANTS_FILE
    stored = json.loads(path.read_text())
    f = fit["all"]
    stored["constants"]["dot_efficiency"] = {
        "value": f["aggregate"],
        "unit": "fraction",
        "source": f"measured on an H100 (NVIDIA H100 80GB HBM3): the achieved fraction of the datasheet's dense "
        f"peak (16-bit or TF32 by the operands), their work at the peak over their summed time (median of the "
        f"calls {f['median']:.3f}), over {f['calls']} gemm and convolution kernels of the zoo's "
        f"paper configs (per-device batch of the 8-GPU rows) as XLA:GPU ran them, after the fitted launch "
        f"(`{command}`, docs/gpu.md)",
        "fit": {k: v for k, v in fit.items()},
    }
    stored["measured"] = {
        "kernel_gap_us": {
            "command_buffers_on": kernel_gap_us(launch, "on"),
            "command_buffers_off": kernel_gap_us(launch, "off"),
            "unit": "us",
            "source": "measured on an H100: what one more kernel adds to a call beyond its own device time, the "
            "slope of wall time over chains of 1, 50 and 200 tiny kernels minus the traced kernel time, median "
            f"over three sizes (`{command}`, docs/gpu.md, 'Launch cost of a kernel'); not charged by the cost "
            "models (with command buffers, XLA's default, it is under 2% of the paper configs' steps)",
            "chains": launch,
        }
    }
    path.write_text(json.dumps(stored, indent=1) + "\n")
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--min-flops", type=float, default=1e9, help="library calls fitted: at least this much work")
    parser.add_argument("--write-constants", action="store_true", help="store the measured constants (H100 profile)")
    args = parser.parse_args(argv)
    rows = load(args.files)
    one, eight = clusters.node_of("h100-sxm", 1), clusters.get_cluster("8xH100-NVLink")
    launch = launch_figures(rows)
    print("## launch: a chain of N tiny kernels (wall of a call, us)")
    for f in launch.values():
        print(
            f"  command buffers {f['command_buffers']:3s} {f['elements']:8d} floats: wall {f['wall_us']}; "
            f"per kernel {f['per_kernel_us']:.2f} us = device {f['kernel_device_us']:.2f} + gap {f['gap_us']:.2f}; "
            f"traced ops in the longest: {f['traced_ops_longest']}"
        )
    for cb in ("on", "off"):
        print(f"  gap per kernel, command buffers {cb}: {kernel_gap_us(launch, cb):.2f} us (median over sizes)")
    calls = library_calls(rows, one.device)
    fit = efficiency_fit(calls, args.min_flops)
    print(f"\n## library calls: {len(calls)} gemm / convolution kernels; efficiency (>= {args.min_flops:.0e} flops)")
    for kind, f in fit.items():
        print(
            f"  {kind:5s} {f['calls']:4d} calls: aggregate {f['aggregate']:.3f}, median {f['median']:.3f} "
            f"(p10 {f['p10']:.3f}, p90 {f['p90']:.3f})"
        )
    by_model: dict = defaultdict(list)
    for c in calls:
        by_model[(c["model"], c["kind"], c["dtype"])].append(c)
    for (model, kind, dtype), cs in sorted(by_model.items()):
        eff = [c["efficiency"] for c in cs if c["flops"] >= args.min_flops]
        total_ms = sum(c["measured_us"] for c in cs) / 1e3
        median = f", median efficiency {np.median(eff):.3f}" if eff else ""
        print(f"  {model:11s} {kind:4s} {dtype:10s} {len(cs):4d} kernels, {total_ms:7.2f} ms{median}")
    print("\n## fidelity: one GPU, compiled-program model (H100 estimator, measured gap) against the wall time")
    rows_fid = fidelity(rows, launch, one)
    for f in rows_fid:
        km = f["kernel_median_error"]
        device = f["device_error"]
        print(
            f"  {f['model']:11s} {f['config']:5s} {f['program']:8s} cb {f['command_buffers']:3s} measured "
            f"{f['measured_us']:9.1f} predicted {f['predicted_us']:9.1f} ({f['error']:+6.1%}); kernels "
            f"{f['kernels']:5d}, traced {f['traced_kernels_of_module']:5d} of {f['traced_ops']:<5d} events; "
            f"kernel time: traced {f['traced_sum_us']:9.1f}, predicted {f['predicted_kernels_only_us']:9.1f}"
            + ("" if device is None else f" ({device:+6.1%})")
            + ("" if km is None else f"; per kernel median {km:.1%}")
        )
    for cb in ("on", "off"):
        for config in ("tiny", "paper"):
            chosen = [f for f in rows_fid if f["command_buffers"] == cb and f["config"] == config]
            if chosen:
                step = np.median([abs(f["error"]) for f in chosen])
                line = f"  median |error|, {config}, command buffers {cb}, {len(chosen)} programs: step {step:.1%}"
                device = [abs(f["device_error"]) for f in chosen if f["device_error"] is not None]
                print(line + (f", kernel time {np.median(device):.1%}" if device else ""))
    print("\n## mock topology 1x8x1: 8-GPU programs on one GPU against 8xH100-NVLink")
    for a in mock_allreduce(rows, eight):
        print(
            f"  all-reduce {a['bytes'] / 2**20:.0f} MiB alone: measured {a['measured_us']:.1f} us (traced "
            f"{a['traced_us']:.1f}); the cluster's model {a['cluster_us']:.1f} us"
        )
    rows_mock = fidelity(rows, launch, eight)
    for f in rows_mock:
        print(
            f"  {f['model']:11s} {f['program']:15s} measured {f['measured_us']:8.1f} us; cluster: compute stream "
            f"{f['predicted_compute_us']:8.1f}, comm {f['predicted_comm_us']:8.1f}, step {f['predicted_us']:8.1f} "
            f"({f['collectives']} collectives; traced ops {f['traced_ops']})"
        )
    errors = [r for r in rows if r.get("error")]
    for r in errors:
        print(f"  FAILED {r.get('mode')} {r.get('model')} {r.get('program')}: {r['error'][:160]}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"launch": launch, "library_calls": calls, "efficiency": fit, "fidelity": rows_fid, "mock": rows_mock},
                indent=1,
            )
        )
    if args.write_constants and "all" in fit:
        print(f"\nwrote {write_constants(fit, launch, 'python scripts/gpu_programs_report.py ... --write-constants')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
