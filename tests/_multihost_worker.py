"""One process of a multi-process test job, started by test_multihost.py through the launcher.

    python tests/_multihost_worker.py PLAN_DIR [--width-on-process-1 W] [--handmade-plan]
        [--default-plan-on-process-1] [--pick-per-gradient] [--weight-update MODE]
        [--profile-dir DIR] [--profile-only]

Joins the job (`disco_jax.initialize_from_env`), builds a small data-parallel MLP step over every
device of the job, and calls it through `@optimize_distributed` (ENABLE_SEARCH from the
environment) before anything else runs collectively; then runs the unmodified step on the same
inputs and prints one line `RESULT {json}`: what the decorator reported, how often this process
searched, how often it measured the collectives' cost and which all-reduce fit its profile phase
took, and how the outputs compare. `{process}` in PLAN_DIR and DIR becomes the process index.

--width-on-process-1 W: process 1 builds another program (the mismatch case).
--handmade-plan: process 0 first stores a plan with one all-reduce per gradient.
--default-plan-on-process-1: process 1 first stores a plan that keeps XLA's default.
--pick-per-gradient: the search (process 0) runs, then picks one all-reduce per gradient, so
  that validation always runs.
--weight-update MODE: the decorator's `weight_update` (default "search").
--profile-dir DIR: the profile directory (`DISCO_JAX_PROFILE_DIR`) of this process.
--profile-only: no decorator: the step's profile phase (`_profile_phase.profile`) and its
  reduce-scatter / all-gather line (`with_scatter_gather`), stored by process 0 as a search stores
  them, then the profile phase again (tests seed profile directories with what it stores).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _xla_cache  # noqa: E402

_xla_cache.share()  # the test run's compilation cache, before jax is imported

import disco_jax  # noqa: E402

disco_jax.initialize_from_env()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from disco_jax import (  # noqa: E402
    _capture,
    _compile,
    _device_timing,
    _distributed,
    _graph,
    _plan,
    _profile_phase,
    _search,
    _strategy,
    _validate,
    backends,
)
from disco_jax._console import Ui  # noqa: E402
from disco_jax._output_check import OutputCheck  # noqa: E402
from disco_jax._profile_db import ProfileDatabase  # noqa: E402

from _steps import mlp_init, mlp_loss  # noqa: E402


def make_step(width: int, batch: int = 32):
    sizes = [16, width, width, 4]
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    opt = optax.adam(1e-2)

    def init():
        params = mlp_init(jax.random.PRNGKey(0), sizes)
        return params, opt.init(params)

    params, opt_state = jax.jit(init, out_shardings=replicated)()
    x = jax.jit(lambda: jax.random.normal(jax.random.PRNGKey(1), (batch, sizes[0])), out_shardings=sharded)()
    y = jax.jit(lambda: jax.random.normal(jax.random.PRNGKey(2), (batch, sizes[-1])), out_shardings=sharded)()

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(mlp_loss)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step), (params, opt_state, x, y)


def per_gradient(graph):
    return _strategy.with_buckets(_strategy.xla_default(graph), [(g.id,) for g in graph.gradients], "test")


def store_plan(step, args, plan_dir: str, use_default: bool) -> None:
    graph = _graph.build_graph(_capture.capture(step.lower(*args))[0], backends.CPU.fusible)
    machine = _plan.MachineKey.current(_compile.step_devices(args, {}))
    strategy = None if use_default else per_gradient(graph).to_json(graph)
    _plan.save_plan(
        _plan.Plan(graph.fingerprint, graph.module.name, machine, use_default, strategy, "made by a test"), plan_dir
    )


def outputs_digest(outputs) -> str:
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(_distributed.addressable(outputs)):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()[:16]


def count_collective_measurements() -> dict:
    """Counts of this process's measurements of the collectives' cost, and the stored fit each
    profile phase took (`shared_allreduce_fit`: None where it then measured), as they happen."""
    seen = {"allreduce_measured": 0, "scatter_gather_measured": 0, "allreduce_fits": []}

    def counted(module, name, key, record=None):
        original = getattr(module, name)

        def wrapper(*a, **k):
            result = original(*a, **k)
            if record is None:
                seen[key] += 1
            else:
                seen[key].append(record(result))
            return result

        setattr(module, name, wrapper)

    counted(_device_timing, "measure_allreduce_cost", "allreduce_measured")
    counted(_device_timing, "measure_scatter_gather_cost", "scatter_gather_measured")
    counted(_profile_phase, "shared_allreduce_fit", "allreduce_fits", lambda fit: fit and fit.to_json())
    return seen


def profile_only(step, step_args) -> dict:
    """The step's profile phase and its reduce-scatter / all-gather line, stored by process 0 as a
    search stores them, then the profile phase again (what the job's next search does)."""
    captured = _compile.capture(step.lower(*step_args), backends.CPU, step_args, {})
    database, ui, runner = ProfileDatabase(), Ui(verbose=False), captured.runner(captured.default_compiled)
    model = _profile_phase.profile(captured, runner, database, ui)
    allreduce = _profile_phase.with_scatter_gather(model.allreduce, captured, database, ui)
    again = _profile_phase.profile(captured, runner, database, ui)
    return {"allreduce": allreduce.to_json(), "allreduce_again": again.allreduce.to_json()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("plan_dir")
    parser.add_argument("--width-on-process-1", type=int, default=None)
    parser.add_argument("--handmade-plan", action="store_true")
    parser.add_argument("--default-plan-on-process-1", action="store_true")
    parser.add_argument("--pick-per-gradient", action="store_true")
    parser.add_argument("--weight-update", default="search")
    parser.add_argument("--profile-dir", default=None)
    parser.add_argument("--profile-only", action="store_true")
    args = parser.parse_args()
    process = jax.process_index()
    plan_dir = args.plan_dir.format(process=process)
    if args.profile_dir is not None:
        os.environ["DISCO_JAX_PROFILE_DIR"] = args.profile_dir.format(process=process)
    measurements = count_collective_measurements()
    width = args.width_on_process_1 if process == 1 and args.width_on_process_1 is not None else 32
    step, step_args = make_step(width)
    if args.profile_only:
        print("RESULT " + json.dumps({**profile_only(step, step_args), **measurements}, sort_keys=True), flush=True)
        return
    if args.handmade_plan and process == 0:
        store_plan(step, step_args, plan_dir, use_default=False)
    if args.default_plan_on_process_1 and process == 1:
        store_plan(step, step_args, plan_dir, use_default=True)

    searches = []
    search = _search.backtracking_search

    def counted_search(program, *a, **k):
        if "moves" in k:  # the weight-update search (disco_jax.sharding.choice): not the plan's search
            return search(program, *a, **k)
        searches.append(1)
        result = search(program, *a, **k)
        return dataclasses.replace(result, best=per_gradient(program.graph)) if args.pick_per_gradient else result

    _search.backtracking_search = counted_search
    # --pick-per-gradient forces a candidate into validation; the measured search would time it
    # first and keep XLA's plan if gloo makes it slower, so that check runs without the loop.
    measured = 0 if args.pick_per_gradient else 4
    optimized = disco_jax.optimize_distributed(
        budget_s=2.0,
        validation_pairs=4,
        verbose=False,
        plan_dir=plan_dir,
        measured_candidates=measured,
        weight_update=args.weight_update,
    )(step)
    out = optimized(*step_args)  # first: the decorator runs before anything collective
    check = OutputCheck.for_call(step, step_args)
    reference = check.default()
    local = _distributed.addressable
    # This process's regions of its shards of `out` (a sharded update shards the state), against
    # the float64 run of the step (every process gathers the inputs and runs it).
    comparison = check.compare(out)
    again = optimized(*step_args)
    report = optimized.last_report
    plan = report.plan or {}
    strategy = plan.get("strategy")
    print(
        "RESULT "
        + json.dumps(
            {
                "process_index": jax.process_index(),
                "process_count": jax.process_count(),
                "device_count": jax.device_count(),
                "searches": len(searches),
                "reports": len(optimized.reports),
                "phase": report.phase,
                "search_ran": report.search_ran,
                "applied": report.applied,
                "reason": report.reason,
                "plan_from_process": report.plan_from_process,
                "gradients": report.graph["gradients"],
                "default_counts": report.default_counts,
                "plan_counts": report.plan_counts,
                "num_processes": plan.get("machine", {}).get("num_processes"),
                "plan_use_default": plan.get("use_default"),
                "plan_digest": _distributed.digest(strategy),
                "plan_buckets": len(strategy["buckets"]) if strategy else None,
                "measured": plan.get("measured") or {},
                "bitwise_equal": comparison.bitwise_equal,
                "within_tolerance": comparison.within_tolerance,
                "output_check": comparison.check,
                "output_check_fallback": comparison.fallback_reason,
                "weight_update": report.weight_update or {},
                "sharded_state_leaves": sum(not x.sharding.is_fully_replicated for x in jax.tree.leaves(out[1])),
                "repeat_bitwise_equal": _validate.compare_outputs(local(out), local(again), bitwise=True).bitwise_equal,
                "output_digest": outputs_digest(out),
                "reference_digest": outputs_digest(reference),
                **measurements,
            },
            sort_keys=True,
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
