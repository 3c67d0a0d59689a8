"""An offline plan for 8 H100s, searched on a CPU-only machine, for a decoder whose replicated
parameters plus Adam state do not fit in one H100 (issue 33, item 5).

The zoo's GPT at its paper size (GPT-3 6.7B: 32 layers, width 4096, bfloat16 compute, float32
parameters and Adam state; `disco_jax.zoo._gpt`), one sequence of 2048 tokens per device, its
state donated, lowered from shapes for `disco_jax.targets.mesh("h100-sxm", 8)`, goes through
`offline.plan_for_target(..., memory_limit_bytes=...)`: every weight update (replicated, optimizer
state sharded, and any other in `offline.SHARDED_UPDATES`) is compiled deviceless by XLA:GPU, its
per-device peak read from the executable's memory analysis and its step time from the
compiled-program model on the cluster's costs (`docs/compiled-cost.md`); the cheapest within the
limit is chosen, and the fusion/bucket search runs on its program. Prints, per candidate, its peak
per device and compiled step time, then the chosen plan, its simulated step time, and the wall
time of each phase and of the whole command.

    python scripts/offline_decoder_plan.py [--layers 32] [--scan] [--limit-gb 80] [--budget 30]
        [--ranked 1] [--plan-dir DIR] [--json out.json]

`--layers N` plans a shorter stack of the same width (quicker; the tests use the tiny config);
`--scan` the same decoder with its blocks under `nn.scan` (`scan_layers=True`: one `while` loop
per pass, parameters stacked `(layers, ...)`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")

import optax  # noqa: E402

from disco_jax import _search, offline, targets, zoo  # noqa: E402
from disco_jax.eval import clusters  # noqa: E402
from disco_jax.zoo import _gpt  # noqa: E402

GB = 1e9


def decoder_step(layers: int, target: str = "h100-sxm", devices: int = 8, scan_layers: bool = False):
    """(jitted step, abstract state, abstract batch) of the paper GPT with `layers` layers on the
    target's compile-only mesh (`scan_layers`: its blocks under `nn.scan`, one loop per pass);
    the state is donated, as a training loop would."""
    config = dataclasses.replace(_gpt.CONFIGS["paper"], num_layers=layers, scan_layers=scan_layers)
    spec = _gpt.spec_of(config, f"paper-{layers}" + ("-scanned" if scan_layers else ""))
    optimizer = optax.adam(1e-4)
    mesh = targets.mesh(target, devices)
    state, batch = zoo.abstract_state_and_batch(spec, optimizer, mesh)
    return zoo.build_train_step(spec, optimizer, mesh, "jit", donate=True), state, batch, spec


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--scan", action="store_true", help="the blocks under nn.scan (scan_layers=True)")
    parser.add_argument("--limit-gb", type=float, default=80.0, help="per-device memory limit, 1e9 bytes")
    parser.add_argument("--budget", type=float, default=30.0, help="graph search seconds on the chosen program")
    parser.add_argument("--ranked", type=int, default=1, help="search candidates compiled and ranked")
    parser.add_argument("--plan-dir", default=None, help="where the plans go (default: a temporary directory)")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    step, state, batch, spec = decoder_step(args.layers, scan_layers=args.scan)
    print(f"{spec.description}: {spec.param_count() / 1e9:.2f}B parameters, 8 x h100-sxm (deviceless)", flush=True)
    limit = int(args.limit_gb * GB)
    plan_dir = args.plan_dir or tempfile.mkdtemp(prefix="offline-decoder-")
    costs = offline.program_costs(clusters.node_of("h100-sxm", 8))
    candidates = offline.weight_update_candidates(step, (state, batch), {}, costs)
    candidates_s = time.perf_counter() - started
    print(f"\nper-device memory limit {limit / GB:.1f} GB; weight updates compiled and costed in {candidates_s:.0f} s")
    header = ("peak GB/dev", "fits", "params+state GB", "compiled ms", "compile s")
    print(f"{'weight update':58} " + " ".join(header))
    for c in candidates:
        if c.xla is None:
            print(f"{c.label:58} not applicable: {c.why_not}")
            continue
        held = c.memory.get("params_and_state_bytes_per_device", 0) / GB
        compiled_ms = "-" if c.cost is None else f"{c.cost.iteration_us / 1e3:.1f}"
        print(
            f"{c.label:58} {c.peak_bytes / GB:>11.1f} {'yes' if c.peak_bytes <= limit else 'no':>4} "
            f"{held:>15.1f} {compiled_ms:>11} {c.xla.compile_s:>9.1f}",
            flush=True,
        )
    config = _search.SearchConfig(budget_s=args.budget)
    try:
        plan = offline.plan_for_target(
            step,
            state,
            batch,
            memory_limit_bytes=limit,
            plan_dir=plan_dir,
            config=config,
            ranked=args.ranked,
            weight_updates=candidates,
        )
    except offline.NothingFits as e:
        print(f"nothing fits: {e}")
        return 1
    wall_s = time.perf_counter() - started
    decided = plan.weight_update
    sim = plan.simulated
    print(f"\nchosen: {decided['chosen']} ({decided['reason']})")
    print(f"plan: {'XLA default' if plan.use_default else plan.search['offline']['chosen']}: {plan.reason}")
    print(
        f"simulated step time (compiled-program model): {sim['plan']['compiled_us'] / 1e3:.1f} ms "
        f"(XLA's program {sim['default']['compiled_us'] / 1e3:.1f} ms)"
    )
    print(f"graph search: {plan.search.get('seconds', 0):.1f} s, {plan.search.get('evaluated', 0)} candidates")
    # The candidates were compiled here, before plan_for_target (which reused them).
    phases = {**plan.search["offline"]["seconds"], "weight updates compiled and costed": candidates_s}
    print("phases (wall s): " + ", ".join(f"{k} {v:.0f}" for k, v in phases.items()))
    print(f"wall time of the command: {wall_s:.0f} s (plans in {plan_dir})")
    if args.json:
        figures = {
            "model": spec.description,
            "parameters": spec.param_count(),
            "memory_limit_bytes": limit,
            "candidates": [{k: v for k, v in c.items() if k != "compiled_cost"} for c in decided["candidates"]],
            "chosen": decided["chosen"],
            "plan_reason": plan.reason,
            "simulated": sim,
            "search": {k: plan.search.get(k) for k in ("seconds", "evaluated")},
            "phases_s": phases,
            "wall_s": wall_s,
            "cpu_count": os.cpu_count(),
        }
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
