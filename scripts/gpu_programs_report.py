"""What `scripts/gpu_programs.py` recorded on a GPU, set against the compiled-program cost model.

Reads the JSON lines files that script wrote (gzipped or not) and prints, on any machine:

* **launch**: per chain of N tiny kernels, the wall time of a call, the traced device time of a
  kernel, and the cost one more kernel adds to a call (the slope of wall time over N), with
  command buffers on and off;
* **library calls**: every gemm and convolution kernel of the recorded programs with its traced
  time, its work (`cost.work`) and the efficiency it achieved against the datasheet peak; and
  per kind the fit `disco_jax.eval.gpu_fit.fit_library_calls` makes of them (an overhead per
  call and an efficiency);
* **host lane**: per command-buffer setting the fit `gpu_fit.fit_host_lane` makes of the
  host-bound calls, beside the host's traced time per kernel where the records hold host events;
* **fidelity**: per recorded one-GPU step its wall time against `cost.cost_program` of its
  compiled text with the device's kernel estimator and host lane, calibrated on all models
  (fitted) and on all but the step's own (held out, leave one model out), and the median and
  worst |error| of the paper and tiny steps both ways;
* **mock**: the 8-GPU programs run under the mock topology against the 8xH100-NVLink cluster's
  compute and communication streams.

Each device kind in the records (the H100 of 2026-11-26, the H200 of 2026-11-28) is costed on
its own spec (`gpus.device_for_kind`) and calibrated on its own records.

    python scripts/gpu_programs_report.py data/gpu/2026-11-26/*.jsonl.gz [--json out.json]
        [--write-constants]
    python scripts/gpu_programs_report.py data/gpu/2026-11-28/*.jsonl.gz --write-constants

`--write-constants` stores, per device kind, the all-models calibration (`gpu_fit.Calibration`)
in its profile's `device_constants.json` (`calibration`), and for a kind whose kernels were never
sampled alone (the H200) the launch and memory efficiency fitted to its traced fusions
(`gpu_fit.fitted_constants`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from disco_jax import cost  # noqa: E402
from disco_jax.cost.simulator import SimulatorParams  # noqa: E402
from disco_jax.eval import clusters, gpu_fit, gpu_records, gpus  # noqa: E402

program_of, setting = gpu_records.program_of, gpu_records.setting


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


# ------------------------------------------------------------------------------------------ fidelity


def predict(text: str, estimator, allreduce, gap_us: float) -> cost.CompiledCost:
    params = SimulatorParams(kernel_overhead_us=gap_us)
    return cost.cost_program(program_of(text), estimator, allreduce, params)


def mock_fidelity(rows: list[dict], cluster: clusters.Cluster) -> list[dict]:
    """The 8-GPU programs run under the mock topology, costed on the cluster's two streams."""
    estimator, allreduce = cluster.kernel_estimator(), cluster.allreduce_model()
    out = []
    for r in rows:
        if r.get("mode") != "mock" or "text" not in r or r.get("model") == "allreduce" or "wall_median_us" not in r:
            continue
        costed = predict(r["text"], estimator, allreduce, 0.0)
        out.append(
            {
                "model": r["model"],
                "program": r["program"],
                "measured_us": r["wall_median_us"],
                "predicted_us": costed.iteration_us,
                "predicted_compute_us": costed.compute_us,
                "predicted_comm_us": costed.comm_us,
                "collectives": len(program_of(r["text"]).collectives),
                "traced_ops": len(r["trace"]["kernel_us"]),
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


def write_constants(
    device: gpus.DeviceSpec, calibration: gpu_fit.Calibration, rows: list[dict], files: str, summary: dict
) -> Path:
    """Store `calibration` in the device's profile (`device_constants.json`, `calibration`); where
    the profile has no constants fitted to kernels timed alone, those fitted to the traced
    fusions of the records (`gpu_fit.fitted_constants`) too; and for the H100 the launch
    chains' gap per kernel (measured, not charged: the host lane is what the model charges)."""
    path = device.constants_path
    path.parent.mkdir(parents=True, exist_ok=True)
    stored = json.loads(path.read_text()) if path.exists() else {"device_kind": device.device_kind}
    if not stored.get("samples"):  # no kernels timed alone: the traced fusions' constants
        stored["samples"] = None
        stored["constants"] = {**stored.get("constants", {}), **gpu_fit.fitted_constants(rows, device, files)}
    stored["calibration"] = {
        **calibration.to_json(),
        "fidelity": summary,  # |error| of the recorded steps' wall time, fitted and held out by model
        "command": "python scripts/gpu_programs_report.py "
        + " ".join(f"{d}/*.jsonl.gz" for d in files.split(" and "))
        + " --write-constants",
    }
    path.write_text(json.dumps(stored, indent=1) + "\n")
    return path


def print_fidelity(scored: list[dict], summary: dict) -> None:
    for f in scored:
        traced = f["traced_kernels_us"]
        print(
            f"  {f['family']:11s} {str(f['model'])[:22]:22s} {f['config']:7s} {f['program']:7s} "
            f"cb {f['command_buffers']:3s} "
            f"measured {f['measured_us']:9.1f} fitted {f['fitted_us']:9.1f} ({f['fitted_error']:+6.1%}) held out "
            f"{f['held_out_us']:9.1f} ({f['held_out_error']:+6.1%}); kernels {f['predicted_device_us']:9.1f}"
            + ("" if traced is None else f" (traced {traced:9.1f})")
            + f", host {f['predicted_host_us']:9.1f}"
        )
    for group, entry in summary.items():
        fitted, held = entry["fitted"], entry["held_out"]
        print(
            f"  {group:16s} {entry['programs']:3d} programs: |error| median {fitted['median']:6.1%} worst "
            f"{fitted['worst']:6.1%} fitted; held out by model: median {held['median']:6.1%} worst {held['worst']:6.1%}"
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--write-constants", action="store_true", help="store the calibration in the profiles")
    args = parser.parse_args(argv)
    rows = gpu_records.load(args.files)
    launch = launch_figures(rows)
    if launch:
        print("## launch: a chain of N tiny kernels (wall of a call, us)")
        for f in launch.values():
            print(
                f"  command buffers {f['command_buffers']:3s} {f['elements']:8d} floats: wall {f['wall_us']}; "
                f"per kernel {f['per_kernel_us']:.2f} us = device {f['kernel_device_us']:.2f} + gap "
                f"{f['gap_us']:.2f}; traced ops in the longest: {f['traced_ops_longest']}"
            )
    out: dict = {"launch": launch, "devices": {}}
    kinds = sorted({r["device_kind"] for r in rows if gpu_records.is_step(r)})
    for kind in kinds:
        device = gpus.device_for_kind(kind)
        if device is None:
            print(f"\n## {kind}: no device spec (gpus.DEVICES): not costed")
            continue
        mine = [r for r in rows if r.get("device_kind") == kind]
        recorded = gpu_fit.Recorded.of(mine, device)
        calls = list(recorded.calls)
        scored, calibration = gpu_fit.score(recorded)
        print(f"\n## {kind}: library calls, {len(calls)} gemm / convolution kernels")
        by_model: dict = defaultdict(list)
        for c in calls:
            by_model[(c["family"], c["config"], c["kind"], c["dtype"])].append(c)
        for (fam, cfg, kind_, dtype), cs in sorted(by_model.items()):
            big = [c for c in cs if c["flops"] >= gpu_fit.MIN_FIT_FLOPS]
            eff = f", efficiency median {np.median([c['efficiency'] for c in big]):.3f}" if big else ""
            total_ms = sum(c["measured_us"] for c in cs) / 1e3
            print(f"  {fam:11s} {cfg:11s} {kind_:4s} {dtype:10s} {len(cs):4d} kernels, {total_ms:8.2f} ms{eff}")
        for kind_, (overhead, efficiency) in (calibration.library_fit or {}).items():
            print(f"  fit {kind_}: {overhead:.1f} us per call + work at {efficiency:.3f} of the dense peak")
        print(f"\n## {kind}: host lane (per setting), and the host's traced time per kernel where recorded")
        for cb, lane in calibration.host_lanes.items():
            issue = ", ".join(f"{k} {v:.2f}" for k, v in lane.issue_us.items())
            print(
                f"  command buffers {cb:3s}: call {lane.call_us:.1f} us + {lane.per_argument_us:.2f} per argument + "
                f"{lane.per_result_us:.2f} per result; issue (us) {issue}"
            )
        traced: dict = defaultdict(list)
        for r in mine:
            if gpu_records.is_step(r):
                for k, v in gpu_records.host_events(r).items():
                    traced[k] += v
        for k, v in sorted(traced.items()):
            print(f"  traced host time per {k} kernel: median {np.median(v):.1f} us over {len(v)} (profiler on)")
        print(f"\n## {kind}: fidelity, one GPU (the compiled-program model with the host lane)")
        summary = gpu_fit.summary(scored)
        print_fidelity(scored, summary)
        out["devices"][kind] = {
            "library_calls": calls,
            "calibration": calibration.to_json(),
            "fidelity": scored,
            "summary": summary,
        }
        if args.write_constants:
            files = " and ".join(sorted({str(Path(f).parent) for f in args.files}))
            print(f"\nwrote {write_constants(device, calibration, mine, files, summary)}")
    mock = [r for r in rows if r.get("mode") == "mock"]
    if mock:
        eight = clusters.get_cluster("8xH100-NVLink")
        print("\n## mock topology 1x8x1: 8-GPU programs on one GPU against 8xH100-NVLink")
        for a in mock_allreduce(rows, eight):
            print(
                f"  all-reduce {a['bytes'] / 2**20:.0f} MiB alone: measured {a['measured_us']:.1f} us (traced "
                f"{a['traced_us']:.1f}); the cluster's model {a['cluster_us']:.1f} us"
            )
        out["mock"] = mock_fidelity(rows, eight)
        for f in out["mock"]:
            print(
                f"  {f['model']:11s} {f['program']:15s} measured {f['measured_us']:8.1f} us; cluster: compute stream "
                f"{f['predicted_compute_us']:8.1f}, comm {f['predicted_comm_us']:8.1f}, step {f['predicted_us']:8.1f} "
                f"({f['collectives']} collectives; traced ops {f['traced_ops']})"
            )
    for r in rows:
        if r.get("error"):
            print(f"  FAILED {r.get('mode')} {r.get('model')} {r.get('program')}: {r['error'][:160]}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
