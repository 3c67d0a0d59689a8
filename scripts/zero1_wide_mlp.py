"""The sharded weight update (ZeRO-1) as a user meets it: a Flax linen MLP of four 1024-wide layers
trained with Optax Adam, global batch 256, data parallel on 8 CPU devices with `jax.jit` and a
sharded batch, decorated with `@optimize_distributed(weight_update=...)`, in two fresh processes:

1. ``search``: `search=True`: the weight-update choice (and the fusion/bucketing search of the
   program it picks) runs, is measured and stored;
2. ``reuse``: a new process, `search=False`: the stored decision and plan are read back and
   enacted; then the unmodified step and the decorated one train side by side from the same
   state (each call on its own state chain, donated buffers never reused): outputs compared after
   the first step, and the two timed in interleaved pairs.

Printed: the weight-update decision and its measured ratio (sharded / replicated, 95% interval),
the fusion plan's measured ratio where one was applied, the collectives of the executable that
runs (reduce-scatters where the hook's rule applied), the rules the plan or report names, and
the A/B ratio decorated / unmodified after reuse (95% interval and IQR). Timings on a shared
machine are noisy: read the intervals.

    python scripts/zero1_wide_mlp.py [--weight-update search|sharded] [--budget 10] [--pairs 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from check_never_slower import copy, threaded  # the state-chain runner of the never-slower check

RESULT = "RESULT "
WIDTH, LAYERS, BATCH = 1024, 4, 256


def wide_mlp_adam():
    """(jitted step, state arguments, batch arguments): the step returns (params, opt_state, loss)."""
    import flax.linen as nn
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(LAYERS - 1):
                x = nn.gelu(nn.Dense(WIDTH)(x))
            return nn.Dense(WIDTH)(x)

    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    model, tx = MLP(), optax.adam(1e-3)
    x = jax.random.normal(jax.random.key(1), (BATCH, WIDTH))
    y = jax.random.normal(jax.random.key(2), (BATCH, WIDTH))
    params = model.init(jax.random.key(0), x[:1])
    state = jax.device_put((params, tx.init(params)), NamedSharding(mesh, P()))
    batch = jax.device_put((x, y), NamedSharding(mesh, P("data")))

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: ((model.apply(p, x) - y) ** 2).mean())(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1)), state, batch


def phase(which: str, weight_update: str, plan_dir: str, budget_s: float, pairs: int) -> dict:
    import jax

    from disco_jax import _validate, optimize_distributed
    from disco_jax.sharding import update

    step, state, batch = wide_mlp_adam()
    decorated = optimize_distributed(
        step,
        search=which == "search",
        weight_update=weight_update,
        budget_s=budget_s,
        validation_pairs=pairs,
        plan_dir=plan_dir,
        verbose=False,
    )
    started = time.perf_counter()
    out = jax.block_until_ready(decorated(*copy(state), *batch))
    report = decorated.last_report
    executable = decorated.executable(*out[:2], *batch)
    wu = report.weight_update or {}
    result = {
        "phase": which,
        "seconds": time.perf_counter() - started,
        "weight_update": {k: wu.get(k) for k in ("mode", "reason", "forced")},
        # Each candidate the choice measured carries its timing against the replicated step.
        "candidates": [
            {k: c.get(k) for k in ("label", "simulated_us", "footprint_bytes", "measured")}
            for c in wu.get("candidates", [])
        ],
        "plan_applied": bool(report.applied),
        "plan_reason": report.reason,
        "plan_measured": {k: (report.measured or {}).get(k) for k in ("ratio", "ratio_ci95", "pairs")},
        "collectives": update.collectives(executable.as_text()),
        "rules_applied": [{"rule": a["rule"], "at": a["at"][:3], "result": a["result"]} for a in report.rules_applied],
    }
    if which == "search":
        return result
    unmodified = step
    reference = jax.block_until_ready(unmodified(*copy(state), *batch))
    floor = _validate.sensitivity(reference, unmodified(*_validate.nudge((*copy(state), *batch))))
    comparison = _validate.compare_outputs(reference, out, bitwise=False, floor=floor)
    timing = _validate.time_interleaved(
        threaded(unmodified, state, batch), threaded(decorated, state, batch), pairs=pairs
    )
    result["outputs"] = {
        "bitwise_equal": comparison.bitwise_equal,
        "within_tolerance": comparison.within_tolerance,
        "max_abs_error": comparison.max_abs_error,
    }
    result["after"] = timing.to_json()
    return result


def run_phase(which: str, args, plan_dir: str, profile_dir: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", DISCO_JAX_PROFILE_DIR=profile_dir)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join([*flags, "--xla_force_host_platform_device_count=8"])
    cmd = [sys.executable, __file__, "--in-process", which, "--weight-update", args.weight_update]
    cmd += ["--plan-dir", plan_dir, "--budget", str(args.budget), "--pairs", str(args.pairs)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT) :])
    raise RuntimeError(f"{which} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def interval(m: dict | None) -> str:
    if not m or not m.get("ratio"):
        return "n/a"
    low, high = m["ratio_ci95"]
    return f"{m['ratio']:.3f} [95% CI {low:.3f}-{high:.3f}, {m.get('pairs')} pairs]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--in-process", choices=("search", "reuse"))
    p.add_argument("--weight-update", default="search", choices=("search", "sharded", "replicated"))
    p.add_argument("--plan-dir", help="where plans go (default: a temporary directory)")
    p.add_argument("--reuse-only", action="store_true", help="skip the search phase (plans in --plan-dir)")
    p.add_argument("--budget", type=float, default=10.0, help="fusion search budget, seconds")
    p.add_argument("--pairs", type=int, default=20, help="interleaved pairs (validation and the A/B after reuse)")
    p.add_argument("--json")
    a = p.parse_args()
    if a.in_process:
        print(RESULT + json.dumps(phase(a.in_process, a.weight_update, a.plan_dir, a.budget, a.pairs)), flush=True)
        return
    print(f"wide MLP ({LAYERS} x {WIDTH}, batch {BATCH}), Adam, 8 CPU devices, weight_update={a.weight_update!r}")
    with tempfile.TemporaryDirectory(prefix="disco-jax-zero1-") as scratch:
        plans = a.plan_dir or os.path.join(scratch, "plans")
        profiles = os.path.join(plans, "profiles")
        phases = [] if a.reuse_only else [run_phase("search", a, plans, profiles)]
        if phases:
            show(phases[-1])
        phases.append(run_phase("reuse", a, plans, profiles))
        show(phases[-1])
    reuse = phases[-1]
    after, outputs = reuse["after"], reuse["outputs"]
    print(f"A/B after reuse, decorated / unmodified: {interval(after)}, IQR {after['ratio_iqr']}")
    print(f"outputs after one step: bitwise {outputs['bitwise_equal']}, within tolerance {outputs['within_tolerance']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({r["phase"]: r for r in phases}, f, indent=1)


def show(r: dict) -> None:
    """Print one phase's figures."""
    wu = r["weight_update"]
    print(f"[{r['phase']}] {r['seconds']:.0f} s; weight update: {wu['mode']} ({wu['reason']})")
    for c in r["candidates"]:
        simulated = c["simulated_us"] or 0.0
        measured = f"; measured /replicated {interval(c['measured'])}" if c.get("measured") else ""
        print(f"  candidate {c['label']}: simulated {simulated:.0f} us, footprint {c['footprint_bytes']} B{measured}")
    print(f"  fusion plan applied: {r['plan_applied']} ({r['plan_reason']}); measured {interval(r['plan_measured'])}")
    print(f"  executable's collectives: { {k: v for k, v in r['collectives'].items() if v} }")
    print(f"  rules applied: {sorted({x['rule'] for x in r['rules_applied']})}", flush=True)


if __name__ == "__main__":
    main()
