"""On one GPU: do the kernel costs the simulated clusters charge hold on that GPU?

The simulated H100 clusters of the report (`disco_jax.eval.clusters`) cost every kernel of a zoo
model's paper-size step without a GPU. This script measures those kernels on a real one and sets
estimators beside the measurement:

* ``cluster, as charged``: `Cluster.kernel_estimator` (what the report uses: on the H100 the GNN
  plus the launch overhead for fusible kernels, the roofline for the rest);
* ``roofline, device time``: the cluster GPU's roofline without its launch overhead;
* ``gnn for this GPU``: the GNN weights shipped for the device kind of the GPU it runs on, as the
  clusters use them (no own op times, no calibration), the roofline's device time for the rest.

The trace measures a kernel's time on the device, so the last two compare like with like; the
first shows what the launch overhead adds.

Per zoo model, at the paper config's per-device batch (global batch / 8, the cluster rows'
program): the step is captured through the GPU backend (the graph the cluster rows search, with
XLA's fusions), XLA's executable is profiled (`_device_timing.measure_kernel_times`, every kernel XLA
made and every opaque op), and each kernel is predicted by each. Printed per model and estimator:
the summed kernel time against the measured one, the per-kernel median error, and the share of
kernels within 10% (all of them, and those of 100 us or more). ``--json`` writes it all.

Run it on the GPU machine from the repository root (figures of a run: docs/gpu.md):

    python scripts/gpu_kernel_fidelity.py [--models resnet50 bert ...] [--config paper] [--cluster 8xH100-NVLink]
        [--time-budget-s 300] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import jax
import numpy as np
import optax

from disco_jax import _device_timing, backends, cost, zoo
from disco_jax._compile import capture_program
from disco_jax._profile_db import device_kind_key
from disco_jax._profile_phase import kernels_by_name
from disco_jax.eval import clusters, gpus
from disco_jax.eval.rows import PAPER_DEVICES


class DeviceTime:
    """The cluster's roofline without its launch overhead: the kernel's time on the device, which
    is what the trace measures (`gpus.RooflineEstimator.device_time_us`)."""

    name = "roofline, device time"

    def __init__(self, roofline: gpus.RooflineEstimator):
        self.roofline = roofline

    def estimate(self, graph, kernels):
        return [self.roofline.device_time_us(cost.kernel_work(graph, k)) for k in kernels]


def errors_summary(predicted: np.ndarray, measured: np.ndarray) -> dict:
    err = np.abs(predicted - measured) / measured
    big = measured >= 100.0
    return {
        "sum_us": float(predicted.sum()),
        "sum_error": float(abs(predicted.sum() - measured.sum()) / measured.sum()),
        "median_error": float(np.median(err)),
        "within_10pct": float(np.mean(err <= 0.1)),
        "kernels_100us": int(big.sum()),
        "within_10pct_100us": float(np.mean(err[big] <= 0.1)) if big.any() else None,
    }


def model_row(name: str, config: str, estimators: dict) -> dict:
    spec = zoo.get_model(name, config)
    batch = spec.default_global_batch // PAPER_DEVICES if config == "paper" else spec.default_global_batch
    step, state, data = zoo.make_train_step(spec, optax.adam(1e-3), zoo.data_mesh(1), global_batch_size=batch)
    started = time.perf_counter()
    program, compiled = capture_program(step.lower(state, data), backends.for_platform(jax.default_backend()))
    graph = program.graph
    capture_s = time.perf_counter() - started
    times = _device_timing.measure_kernel_times(compiled, (state, data), steps=5)
    wall = []
    for _ in range(10):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(state, data))
        wall.append((time.perf_counter() - t0) * 1e6)
    by_name = kernels_by_name(graph)  # as the profile phase maps the trace
    named = [(n, k) for n, k in by_name.items() if n in times and times[n] > 0]
    measured = np.array([times[n] for n, _ in named])
    kernels = [k for _, k in named]
    unmatched = sorted(((n, float(t)) for n, t in times.items() if n not in by_name), key=lambda x: -x[1])
    row = {
        "model": name,
        "config": config,
        "per_device_batch": batch,
        "capture_s": capture_s,
        "step_wall_us": float(np.median(wall)),
        "kernels": len(named),
        "measured_sum_us": float(measured.sum()),
        # The 50 longest events the trace names that are no kernel of the graph: where the time
        # went when few kernels matched (on an H200, most of a paper step's did not: docs/gpu.md).
        "trace_only_us": dict(unmatched[:50]),
        "measured_us": {n: float(t) for (n, _), t in zip(named, measured)},
        "estimators": {},
    }
    if not named:
        return row
    for est_name, estimator in estimators.items():
        predicted = np.array([float(t) for t in estimator.estimate(graph, kernels)])
        row["estimators"][est_name] = errors_summary(predicted, measured)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="*", default=list(zoo.MODELS))
    parser.add_argument("--config", default="paper", choices=zoo.CONFIGS, help="tiny: a quick run of the script")
    parser.add_argument("--cluster", default="8xH100-NVLink", choices=list(clusters.CLUSTERS))
    parser.add_argument("--time-budget-s", type=float, default=float("inf"), help="no new model is started after")
    parser.add_argument("--json", help="write every row here (updated after each model)")
    args = parser.parse_args(argv)
    if backends.for_platform(jax.default_backend()) is None:
        parser.error(f"no disco-jax backend for {jax.default_backend()!r}")
    device = jax.devices()[0]
    cluster = clusters.CLUSTERS[args.cluster]
    roofline = DeviceTime(gpus.RooflineEstimator(cluster.device))
    estimators = {"cluster, as charged": cluster.kernel_estimator(), roofline.name: roofline}
    for plugin in cost.plugin_estimators(device_kind_key(device)):
        estimators[f"{plugin.name} for this GPU"] = cost.chain(plugin, roofline)
    print(f"device: {device.device_kind}, jax {jax.__version__}; estimators: {list(estimators)}", flush=True)
    started, rows = time.time(), []
    for name in args.models:
        if time.time() - started > args.time_budget_s:
            print(f"{name}: skipped, the time budget is spent", flush=True)
            continue
        try:
            row = model_row(name, args.config, estimators)
        except Exception as err:  # one model's failure must not lose the others' figures
            traceback.print_exc()
            row = {"model": name, "error": f"{type(err).__name__}: {err}"}
            print(f"{name}: FAILED {row['error'][:300]}", flush=True)
        else:
            print(
                f"{name:10s} {row['kernels']:5d} kernels, measured {row['measured_sum_us'] / 1e3:8.3f} ms "
                f"(step {row['step_wall_us'] / 1e3:8.3f} ms, capture {row['capture_s']:.0f} s; "
                f"{sum(row['trace_only_us'].values()) / 1e3:.3f} ms in events of no kernel of the graph)",
                flush=True,
            )
            for est_name, s in row["estimators"].items():
                big = "" if s["within_10pct_100us"] is None else f"{s['within_10pct_100us']:.0%}"
                print(
                    f"    {est_name:22s} sum {s['sum_us'] / 1e3:8.3f} ms ({s['sum_error']:6.1%} off)  "
                    f"per kernel: median {s['median_error']:6.1%}, within 10% {s['within_10pct']:4.0%}, "
                    f"of {s['kernels_100us']} kernels >= 100 us {big}",
                    flush=True,
                )
        rows.append(row)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device_kind": device.device_kind, "cluster": args.cluster, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
