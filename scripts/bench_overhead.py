"""Benchmark: what `@optimize_distributed` adds to each call of a step whose plan is reused.

A data-parallel step with several hundred small parameter leaves (default 300) on
8 virtual CPU devices. A plan is made first (search phase, small budget, in a temporary plan
directory), then a fresh decorated step enacts it, as a later training run would. Timed in
interleaved rounds, each call blocked on its result:

* `jit`: the plain `jax.jit` step (JAX's C++ dispatch);
* `executable`: the executable the decorated step runs, called directly (`step.executable(...)`);
* `decorated`: the decorated step.

Printed for the dispatch (until the call returns; XLA:CPU runs the step asynchronously) and for the
whole step (until its result is ready): the median time per call of each path, and the per-round
differences `decorated - executable` (same executable: only the wrapper differs) and
`decorated - jit` (which also holds the plan's own effect on the step), as medians with their
interquartile ranges. The calling thread's CPU time during the call (`time.thread_time`) is what
the wrapper adds to and what other processes on a loaded machine do not inflate: it is the figure
to read on a shared machine; the wall times show the same on a quiet one.

Then the wrapper alone, in tight loops: a decorated step that does no work (a program without
all-reduces, which the decorator runs as XLA compiled it) on the same arguments, against its own
executable called directly; and, for comparison, the slow path every call took before the fast
one (`step.executable(...)`: keying the call by its signature and finding its executable).

    python scripts/bench_overhead.py [--leaves 300] [--rounds 400] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from disco_jax import optimize_distributed

NUM_DEVICES = 8


def use_cpu_devices(n: int) -> None:
    """`n` virtual CPU devices (JAX_PLATFORMS=cpu unless it is set); before JAX starts a backend."""
    if not os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n)


def make_step(leaves: int, width: int = 8, batch: int = 64):
    """A cheap step with `leaves` parameter vectors, each with a gradient of its own, so that the
    call's dispatch, not its arithmetic, is what differs between the timed paths."""
    mesh = jax.make_mesh((NUM_DEVICES,), ("data",), axis_types=(AxisType.Auto,))
    params = {f"p{i:03d}": jnp.full((width,), 1.0 + i / leaves) for i in range(leaves)}
    opt = optax.sgd(1e-2)

    def step(params, opt_state, x):
        def loss(params):
            return sum(jnp.mean(jnp.tanh(x * p)) for p in params.values())

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    replicated = NamedSharding(mesh, P())
    state = jax.device_put((params, opt.init(params)), replicated)
    x = jax.device_put(jax.random.normal(jax.random.PRNGKey(1), (batch, width)), NamedSharding(mesh, P("data")))
    return jax.jit(step), (*state, x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leaves", type=int, default=300, help="parameter leaves of the step")
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--budget", type=float, default=3.0, help="search budget for making the plan (s)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    use_cpu_devices(NUM_DEVICES)

    step, call_args = make_step(args.leaves)
    leaves = len(jax.tree.leaves(call_args[0]))
    with tempfile.TemporaryDirectory(prefix="disco-overhead-") as plan_dir:
        searched = optimize_distributed(
            step, search=True, budget_s=args.budget, plan_dir=plan_dir, verbose=False, validation_pairs=6
        )
        jax.block_until_ready(searched(*call_args))
        decorated = optimize_distributed(step, search=False, plan_dir=plan_dir, verbose=False)
        jax.block_until_ready(decorated(*call_args))
    report = decorated.last_report
    executable = decorated.executable(*call_args)
    calls = {"jit": step, "executable": executable, "decorated": decorated}
    for f in calls.values():  # warm every path
        for _ in range(20):
            jax.block_until_ready(f(*call_args))
    dispatch = {name: [] for name in calls}
    step_time = {name: [] for name in calls}
    cpu = {name: [] for name in calls}
    order = list(calls)
    for r in range(args.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            f = calls[name]
            cpu_start = time.thread_time_ns()
            start = time.perf_counter()
            out = f(*call_args)
            returned = time.perf_counter()
            cpu[name].append((time.thread_time_ns() - cpu_start) / 1e3)
            jax.block_until_ready(out)
            done = time.perf_counter()
            dispatch[name].append((returned - start) * 1e6)
            step_time[name].append((done - start) * 1e6)

    def spread(d):
        return [float(np.median(d)), float(np.percentile(d, 25)), float(np.percentile(d, 75))]

    result = {
        "parameter_leaves": leaves,
        "rounds": args.rounds,
        "plan_applied": bool(report.applied),
        "plan_reason": report.reason,
    }
    print(
        f"step with {leaves} parameter leaves on 8 CPU devices, plan "
        f"{'applied' if result['plan_applied'] else 'kept XLA default'} ({report.reason or ''}); "
        f"{args.rounds} interleaved rounds; median [IQR] in us"
    )
    for label, times in (
        ("cpu (the calling thread's CPU time until the call returns)", cpu),
        ("dispatch (wall time until the call returns)", dispatch),
        ("step (wall time until the result is ready)", step_time),
    ):
        t = {k: np.array(v) for k, v in times.items()}
        wrapper, versus_jit = spread(t["decorated"] - t["executable"]), spread(t["decorated"] - t["jit"])
        result[label.split()[0]] = {
            "median_us": {k: spread(v) for k, v in t.items()},
            "decorated_minus_executable_us": wrapper,
            "decorated_minus_jit_us": versus_jit,
        }
        print(f"  {label}: " + ", ".join(f"{k} {np.median(v):.1f}" for k, v in t.items()))
        print(
            f"    decorated - executable {wrapper[0]:+.1f} [{wrapper[1]:+.1f} .. {wrapper[2]:+.1f}], "
            f"decorated - jit {versus_jit[0]:+.1f} [{versus_jit[1]:+.1f} .. {versus_jit[2]:+.1f}]"
        )
    # The wrapper alone: a decorated step with nothing to run (no all-reduce: the decorator runs
    # XLA's executable) on the same arguments, against that executable called directly; what
    # remains is the Python the decorator runs per call.
    idle = optimize_distributed(jax.jit(lambda params, opt_state, x: None), search=False, verbose=False)
    idle(*call_args)
    idle_executable = idle.executable(*call_args)
    wrapper_ns = []
    for _ in range(50):
        start = time.perf_counter_ns()
        for _ in range(500):
            idle(*call_args)
        mid = time.perf_counter_ns()
        for _ in range(500):
            idle_executable(*call_args)
        wrapper_ns.append(((mid - start) - (time.perf_counter_ns() - mid)) / 500)
    result["wrapper_only_us"] = spread(np.array(wrapper_ns) / 1e3)
    median, low, high = result["wrapper_only_us"]
    print(
        f"  the decorator's own Python per call (a step that does no work, decorated vs its executable): "
        f"{median:.2f} us [{low:.2f} .. {high:.2f}]"
    )
    start = time.perf_counter_ns()
    for _ in range(200):
        decorated.executable(*call_args)
    result["slow_path_key_us"] = (time.perf_counter_ns() - start) / 200 / 1e3
    print(
        f"  for comparison, the slow path (`executable(...)`: keying a call by its signature and finding its "
        f"executable; every call before the fast path): {result['slow_path_key_us']:.1f} us"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
