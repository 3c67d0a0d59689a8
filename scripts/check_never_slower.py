"""Never slower, checked as a user would: training steps written with Flax and Optax (not the zoo),
through `@optimize_distributed` on 8 CPU devices, in three fresh processes each:

1. ``search``: `search=True`, the first call searches, validates and stores a plan (or XLA's);
2. ``reuse``: a new process, `search=False`: the stored plan is loaded and enacted;
3. in that same process, the unmodified step and the decorated one train side by side from the same
   state: outputs compared after each step, and the two timed in interleaved pairs (each call on its
   own state chain, as a training loop runs it; donated buffers are never reused).

Printed per step: what the search phase decided and on what evidence (ratio, 95% interval), the
reuse's all-reduce and fusion counts, whether outputs are equal, and the ratio decorated /
unmodified with its 95% interval afterwards. The claim checked: no applied plan is measured slower
(the interval above 1.0 would say so with confidence), every applied plan's search-phase interval
is below 1.0, outputs are equal (bitwise when only all-reduces were regrouped, else by the output
check of `_output_check`: no further from a float64 run of the step than XLA's own program).

    python scripts/check_never_slower.py [--steps linen-mlp-adamw linen-cnn-momentum shard-map-mlp-lamb]
        [--budget 20] [--pairs 40] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time

RESULT = "CHECK "


# --------------------------------------------------------------------------- the steps


def data_mesh():
    """8 devices on one `data` axis, Auto (as in JAX 0.10 and before: no shardings in the types)."""
    import jax

    return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def linen_classifier(model, x, y, tx):
    """A Flax linen classifier's training step (softmax cross-entropy) with a donated TrainState,
    replicated, and the batch sharded over the data axis by NamedSharding."""
    import jax
    import optax
    from flax.training import train_state
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = data_mesh()
    params = model.init(jax.random.key(0), x)["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    state = jax.device_put(state, NamedSharding(mesh, P()))
    batch = jax.device_put((x, y), NamedSharding(mesh, P("data")))

    def step(state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch[0])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    return step, dict(donate_argnums=(0,)), (state,), (batch,)


def linen_mlp_adamw():
    """A Flax linen MLP (GELU) with AdamW."""
    import flax.linen as nn
    import jax
    import optax

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for width in (256, 256, 128):
                x = nn.gelu(nn.Dense(width)(x))
            return nn.Dense(10)(x)

    x = jax.random.normal(jax.random.key(1), (256, 64))
    y = jax.random.randint(jax.random.key(2), (256,), 0, 10)
    return linen_classifier(MLP(), x, y, optax.adamw(1e-3))


def linen_cnn_momentum():
    """A Flax linen CNN (conv, layer norm, pooling) with SGD + momentum and gradient clipping."""
    import flax.linen as nn
    import jax
    import optax

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            for features in (16, 32):
                x = nn.relu(nn.LayerNorm()(nn.Conv(features, (3, 3))(x)))
                x = nn.avg_pool(x, (2, 2), strides=(2, 2))
            return nn.Dense(10)(x.reshape(x.shape[0], -1))

    x = jax.random.normal(jax.random.key(1), (64, 16, 16, 3))
    y = jax.random.randint(jax.random.key(2), (64,), 0, 10)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.05, momentum=0.9))
    return linen_classifier(CNN(), x, y, tx)


def shard_map_mlp_lamb():
    """A plain-JAX MLP under `jax.shard_map` with explicit `pmean`, LAMB from Optax."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = data_mesh()
    keys = jax.random.split(jax.random.key(0), 4)
    sizes = (32, 128, 128, 128, 8)
    params = [
        {"w": jax.random.normal(k, (a, b)) / jnp.sqrt(a), "b": jnp.zeros((b,))}
        for k, a, b in zip(keys, sizes, sizes[1:])
    ]
    tx = optax.lamb(1e-3)
    opt_state = tx.init(params)
    params, opt_state = jax.device_put((params, opt_state), NamedSharding(mesh, P()))
    x = jax.device_put(jax.random.normal(jax.random.key(1), (128, 32)), NamedSharding(mesh, P("data")))
    y = jax.device_put(jax.random.normal(jax.random.key(2), (128, 8)), NamedSharding(mesh, P("data")))

    def loss_fn(params, x, y):
        for layer in params[:-1]:
            x = jnp.tanh(x @ layer["w"] + layer["b"])
        return jnp.mean((x @ params[-1]["w"] + params[-1]["b"] - y) ** 2)

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")), out_specs=(P(), P(), P()))
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        grads = jax.lax.pmean(grads, "data")
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")

    return step, dict(donate_argnums=(0, 1)), (params, opt_state), (x, y)


# name -> () -> (step, jax.jit options, state arguments, batch arguments); the step returns the new
# state arguments, then the loss.
STEPS = {
    "linen-mlp-adamw": linen_mlp_adamw,
    "linen-cnn-momentum": linen_cnn_momentum,
    "shard-map-mlp-lamb": shard_map_mlp_lamb,
}


# --------------------------------------------------------------------------- in a fresh process


def threaded(fn, state: tuple, batch: tuple):
    """A runner for `time_interleaved`: each call trains one step on its own state chain (the
    outputs replace the state arguments), so donated buffers are never used twice."""
    chain = [copy(state)]

    def run():
        out = fn(*chain[0], *batch)
        chain[0] = tuple(out[: len(state)])
        return out

    return run


def copy(tree):
    import jax

    return jax.tree.map(lambda a: a.copy(), tree)


def phase(name: str, which: str, plan_dir: str, budget_s: float, pairs: int) -> dict:
    import jax

    from disco_jax import _validate, optimize_distributed
    from disco_jax._output_check import Float64Run, OutputCheck

    step, jit_options, state, batch = STEPS[name]()

    def fresh():  # donated buffers die with each call
        return (*copy(state), *batch)

    decorated = optimize_distributed(
        jax.jit(step, **jit_options), search=which == "search", budget_s=budget_s, plan_dir=plan_dir, verbose=False
    )
    started = time.perf_counter()
    out = jax.block_until_ready(decorated(*fresh()))
    seconds = time.perf_counter() - started
    report = decorated.last_report
    result = {
        "step": name,
        "phase": which,
        "seconds": seconds,
        "applied": bool(report.applied),
        "reason": report.reason,
        "plan_counts": report.plan_counts,
        "default_counts": report.default_counts,
    }
    if which == "search":
        m = report.measured or {}
        keys = ("ratio", "ratio_ci95", "ratio_iqr", "pairs", "verdict", "bitwise_required")
        result["search_measured"] = {k: m.get(k) for k in keys}
        return result
    # Reuse: the unmodified step beside the decorated one, from the same state.
    unmodified = jax.jit(step, **jit_options)
    check = OutputCheck(
        lambda: unmodified(*fresh()), lambda: unmodified(*_validate.nudge(fresh())), Float64Run(unmodified, fresh(), {})
    )
    comparison = check.compare(out)
    timing = _validate.time_interleaved(
        threaded(unmodified, state, batch), threaded(decorated, state, batch), pairs=pairs
    )
    result.update(
        outputs={
            "bitwise_equal": comparison.bitwise_equal,
            "within_tolerance": comparison.within_tolerance,
            "check": comparison.check,
        },
        after=timing.to_json(),
    )
    return result


def in_process(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--step", required=True)
    p.add_argument("--phase", choices=("search", "reuse"), required=True)
    p.add_argument("--plan-dir", required=True)
    p.add_argument("--budget", type=float, default=20.0)
    p.add_argument("--pairs", type=int, default=40)
    a = p.parse_args(argv)
    print(RESULT + json.dumps(phase(a.step, a.phase, a.plan_dir, a.budget, a.pairs)), flush=True)


# --------------------------------------------------------------------------- the driver


def run_phase(step: str, which: str, plan_dir: str, budget: float, pairs: int, profile_dir: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", DISCO_JAX_PROFILE_DIR=profile_dir)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join([*flags, "--xla_force_host_platform_device_count=8"])
    cmd = [sys.executable, __file__, "--in-process", "--step", step, "--phase", which, "--plan-dir", plan_dir]
    cmd += ["--budget", str(budget), "--pairs", str(pairs)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT) :])
    raise RuntimeError(f"{step} {which} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def interval(m: dict) -> str:
    if not m.get("ratio"):
        return "n/a"
    return f"{m['ratio']:.3f} [{m['ratio_ci95'][0]:.3f}-{m['ratio_ci95'][1]:.3f}]"


def main() -> None:
    if "--in-process" in sys.argv:
        in_process([a for a in sys.argv[1:] if a != "--in-process"])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", nargs="+", default=list(STEPS), choices=list(STEPS))
    p.add_argument("--budget", type=float, default=20.0, help="search budget per step, seconds")
    p.add_argument("--pairs", type=int, default=40, help="interleaved pairs of the timing after reuse")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    results, failures = [], []
    print("| step | search phase | its ratio [95% CI] | reuse: AR, fusions (default's) | outputs | after | verdict |")
    print("|---|---|---:|---|---|---:|---|")
    with tempfile.TemporaryDirectory(prefix="disco-jax-check-") as scratch:
        for name in a.steps:
            plans = os.path.join(scratch, name)
            search = run_phase(name, "search", plans, a.budget, a.pairs, os.path.join(scratch, "profiles"))
            reuse = run_phase(name, "reuse", plans, a.budget, a.pairs, os.path.join(scratch, "profiles"))
            results.append({"search": search, "reuse": reuse})
            sm, after = search.get("search_measured") or {}, reuse["after"]
            applied = search["applied"] and reuse["applied"]
            problems = []
            if applied and not (sm.get("ratio_ci95") and sm["ratio_ci95"][1] < 1.0):
                problems.append("applied without a search-phase interval below 1")
            if applied and after["ratio_ci95"][0] > 1.0:
                problems.append("measured slower after reuse")
            outputs = reuse["outputs"]
            if not outputs["within_tolerance"] or (sm.get("bitwise_required") and not outputs["bitwise_equal"]):
                problems.append("outputs differ")
            failures += [f"{name}: {x}" for x in problems]
            counts, default = reuse["plan_counts"] or {}, reuse["default_counts"] or {}
            enacted = (
                f"{counts.get('all-reduce')} AR, {counts.get('multi_op_loop_fusions')} fusions" if counts else "XLA's"
            )
            same = (
                "bitwise"
                if outputs["bitwise_equal"]
                else "within tolerance"
                if outputs["within_tolerance"]
                else "DIFFER"
            )
            print(
                f"| {name} | {'applied' if search['applied'] else 'XLA kept'} ({search['seconds']:.0f} s) "
                f"| {interval(sm)} | {enacted} ({default.get('all-reduce')} AR, "
                f"{default.get('multi_op_loop_fusions')} fusions) | {same} "
                f"| {interval(after)} over {after['pairs']} pairs | {'; '.join(problems) or 'ok'} |",
                flush=True,
            )
            if not search["applied"]:
                print(f"  ({name}: {search['reason']})", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    print("never slower: " + ("every check held" if not failures else "FAILED: " + "; ".join(failures)))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
