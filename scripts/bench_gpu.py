"""One GPU, measured: XLA's default step against disco-jax's plan for each zoo model (issue 15).

Per model, `disco_jax.eval.measured.measured_row` on the one GPU: the step is captured through the
GPU backend (PRE_SCHEDULER, XLA's decisions read at POST_SCHEDULER); the search phase's profile
measures the default step's kernels on the GPU and calibrates the simulator; every baseline is
compiled, its outputs compared with XLA's default step, timed in interleaved pairs against the row's
reference (XLA's default step compiled a second time) and simulated; then
`optimize_distributed(search=True)` searches, validates (output check and the acceptance rule) and
enacts, and its executable is timed the same way (the decorator's per-call overhead apart). On one
device there are no all-reduces: this measures the fusion decisions only.

Printed per model: XLA default (ms), disco-jax (ms) and their measured ratio with its 95% interval
(`rows.ratio_between`), JAX_default against the reference (the noise floor), the decorator's overhead,
whether the plan was applied and why, outputs equal, and the simulator's error on that GPU for XLA's
default and for disco-jax's strategy (|simulated - measured| / measured). `--json` writes the rows.

Run it on the GPU machine from the repository root (figures of a run: docs/gpu.md).

    python scripts/bench_gpu.py [--models mlp transformer ...] [--config tiny|paper] [--budget 20]
        [--pairs 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback

import jax

from disco_jax import backends, zoo
from disco_jax.eval.measured import measured_row
from disco_jax.eval.rows import DISCO, ratio_between

# Paper configs on one GPU: the per-device batch of the 8-GPU data-parallel run they describe.
PAPER_DEVICES = 8


def _error(simulated: dict | None, measured_us: float) -> float | None:
    if not simulated or not measured_us:
        return None
    return abs(simulated["iteration_us"] - measured_us) / measured_us


def summary(name: str, row: dict) -> dict:
    disco = row["strategies"][DISCO]
    default = row["strategies"]["JAX_default"]
    default_us = row["time_us"]["JAX_default"]
    m, floor = disco["measured"], default["measured"]
    return {
        "model": name,
        "default_ms": default_us / 1e3,
        "disco_ms": row["time_us"][DISCO] / 1e3,
        "ratio": m["ratio"] / floor["ratio"],
        "ratio_ci95": ratio_between(m, floor) or (float("-inf"), float("inf")),
        "default_vs_reference": floor["ratio"],
        "default_vs_reference_ci95": floor["ratio_ci95"],
        "overhead_us_per_call": disco["overhead"]["us_per_call"],
        "applied": disco["applied"],
        "reason": disco["description"],
        "outputs_within_tolerance": disco["outputs"]["within_tolerance"],
        "sim_error_default": _error(default["simulated"], default_us),
        "sim_error_disco": _error(disco["simulated"], row["time_us"][DISCO]),
        "search_candidates_per_s": (row.get("search") or {}).get("candidates_per_second"),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="*", default=list(zoo.MODELS))
    parser.add_argument("--config", default="tiny", choices=zoo.CONFIGS)
    parser.add_argument("--budget", type=float, default=20.0, help="search budget per model, seconds")
    parser.add_argument("--pairs", type=int, default=30, help="interleaved timing pairs per configuration")
    parser.add_argument("--style", default="jit", choices=zoo.STYLES)
    parser.add_argument("--json", help="write every row here (updated after each model)")
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    if jax.device_count() != 1:
        parser.error(f"this benchmark is for one device; found {jax.device_count()}")
    if backends.for_platform(jax.default_backend()) is None:
        parser.error(f"no disco-jax backend for {jax.default_backend()!r}")
    print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}", flush=True)
    rows, summaries = {}, []
    for name in args.models:
        spec = zoo.get_model(name, args.config)
        batch = spec.default_global_batch // PAPER_DEVICES if args.config == "paper" else None
        started = time.perf_counter()
        try:
            with tempfile.TemporaryDirectory(prefix="disco-gpu-plans-") as plan_dir:
                row = measured_row(
                    name,
                    args.style,
                    budget_s=args.budget,
                    pairs=args.pairs,
                    plan_dir=plan_dir,
                    config=args.config,
                    global_batch_size=batch,
                )
        except Exception as err:  # one model's failure must not lose the others' figures
            traceback.print_exc()
            rows[name] = {"error": f"{type(err).__name__}: {err}"}
            print(f"{name}: FAILED {type(err).__name__}: {str(err)[:300]}", flush=True)
        else:
            rows[name] = row
            s = summary(name, row)
            summaries.append(s)
            lo, hi = s["ratio_ci95"]
            print(
                f"{name:12s} default {s['default_ms']:9.3f} ms  disco-jax {s['disco_ms']:9.3f} ms  ratio "
                f"{s['ratio']:.3f} [{lo:.3f}, {hi:.3f}]  default/reference {s['default_vs_reference']:.3f}  "
                f"overhead {s['overhead_us_per_call']:+.1f} us  applied={s['applied']}  outputs ok="
                f"{s['outputs_within_tolerance']}  sim error default {s['sim_error_default']:.1%} "
                f"disco {s['sim_error_disco']:.1%}  ({time.perf_counter() - started:.0f} s)\n    {s['reason']}",
                flush=True,
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {"device_kind": device.device_kind, "config": args.config, "summary": summaries, "rows": rows},
                    f,
                    indent=1,
                    default=str,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
