"""Measured rows: a zoo model's ``tiny`` config timed on this machine's devices.

Measured platforms (`rows.MEASURED_PLATFORMS`, name -> processes x devices per process):

* ``cpu-8dev``: 8 virtual CPU devices in one process (XLA:CPU's in-process collectives), sharing
  the machine's cores;
* ``cpu-2dev``: 2 virtual CPU devices in one process on a 2-core machine, each device its own core
  (`report_measured.PLATFORM_LABELS` says what each can and cannot predict);
* ``gloo-2x1``: 2 processes x 1 CPU device, collectives over gloo on loopback (the job is started
  by ``disco-jax launch``): communication between processes, as on a real cluster.

Every configuration is timed the same way: in interleaved pairs against one *reference*, XLA's
default executable of the step compiled a second time (`Captured.default_copy`). JAX_default is a
configuration like the others (the capture's executable), so its ratio to the reference is the
noise floor of the row (1.0 up to noise), with its spread. Each baseline is compiled (XLA compile
options, or our rewrite for DDP / Horovod) and checked on its compiled HLO and its outputs;
disco-jax is `optimize_distributed(search=True)` (profile, calibrate, search, measured
candidates, the acceptance rule), and what is timed afterwards is the executable the decorated
step runs (`OptimizedStep.executable`), like the baselines'. The decorator's own per-call cost is
timed apart: the decorated call against that executable, interleaved (`overhead`). The row's
times are each configuration's median ratio times the reference's median time; the best baseline
is the fastest on that scale, and the speed-up's interval compares the two configurations'
per-pair ratios (`rows.ratio_between`). Every configuration is also simulated with the
calibrated simulator of the search phase, which gives the simulated-vs-measured table (DisCo's
Table 2).

In a job of several processes every process runs `measured_row` (each compile and each timed run
is a collective, so they run in the same order everywhere): a pair's ratio is that of the job's
steps, each configuration at its slowest process (as the acceptance rule judges), each process
compares its own output shards and the verdicts are merged, and process 0 alone returns the row.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from typing import Any

import jax
import optax

from disco_jax import ProfileDatabase, Strategy, _distributed, _validate, backends, optimize_distributed, zoo
from disco_jax._compile import Captured, Runner, capture, compile_program, compile_strategy, compiled_stats
from disco_jax._console import Ui
from disco_jax._options import StepReport
from disco_jax._output_check import Float64Run
from disco_jax._profile_phase import calibrate, profile
from disco_jax.eval import baselines
from disco_jax.eval.rows import (
    DISCO,
    log,
    measured_json,
    measured_summary,
    outputs_json,
    overhead_json,
    sim_json,
)
from disco_jax.sharding import update

REFERENCE = "a second compile of XLA's default executable"


class Job:
    """The measuring side of one row in one process of the job (of one process or several)."""

    def __init__(self, name: str):
        self.scope = _distributed.new_scope(f"bench/{name}") if _distributed.is_multiprocess() else None
        self.count = itertools.count()

    def time(self, reference: Callable, runner: Callable, pairs: int) -> _validate.Timing:
        """`runner` in interleaved pairs against `reference`; with several processes, each pair as
        the job's steps, each at its slowest process (`_distributed.slowest_pairs`)."""
        merge = None if self.scope is None else _distributed.slowest_pairs(f"{self.scope}/timing/{next(self.count)}")
        return _validate.time_interleaved(reference, runner, pairs=pairs, merge=merge)

    def agree(self, b: baselines.Baseline, graph) -> baselines.Baseline:
        """Process 0's version of a baseline: its strategy can depend on measured kernel times
        (Horovod's cycles), and every process must compile the same program."""
        if self.scope is None:
            return b
        found = _distributed.broadcast_json(f"{self.scope}/baseline/{b.name}", b.strategy.to_json(graph))
        return dataclasses.replace(b, strategy=Strategy.from_json(graph, found))

    def compare(self, captured: Captured, runner: Runner) -> _validate.Comparison:
        """A row's outputs against JAX_default's by the step's output check (`captured.output_check`:
        the float64 run of the step where it runs; again from a moved state, `runner.on`), every
        process's verdict merged."""
        merge_key = None if self.scope is None else f"{self.scope}/outputs/{next(self.count)}"
        return captured.output_check.compare(runner(), merge_key=merge_key, rerun=runner.on)


def compile_baseline(captured: Captured, b: baselines.Baseline) -> tuple:
    if b.compiler_options is None:
        return compile_strategy(captured.lowered, captured.program, b.strategy)
    if not b.compiler_options:
        return captured.default_compiled, "default"
    # XLA's program under the options, with the backend's hook rules as the capture's has them.
    program = compile_program(captured.lowered, captured.program, b.name, None, b.compiler_options)
    if program.compiled is None:
        raise ValueError(f"{b.name} did not compile: {program.reason}")
    return program.compiled, "compile options"


def plan_executable(optimized, args: tuple) -> tuple[Any, tuple]:
    """What a decorated step runs on `args` from its second call on, and the arguments it takes:
    the compiled executable of its program (`OptimizedStep.executable`); for a sharded weight
    update the steady executable, on the state resharded as the first call reshards it once."""
    run = optimized.executable(*args)
    if isinstance(run, update.Resharding):
        resharded, _ = run.reshard(args, {})
        return run.steady, resharded
    return run, args


def _timed(m: dict | None) -> dict:
    """A timing record's ratio, interval, pairs and verdict (`_validate.Timing.to_json`), or {}."""
    return {k: m.get(k) for k in ("ratio", "ratio_ci95", "pairs", "verdict")} if m else {}


def search_record(report: StepReport, packs: bool) -> dict:
    """What disco-jax's search phase did for a measured row's step, from the decorator's own
    report (`StepReport`: the weight-update choice's records and the stored plan's `search`
    record), so that a row says what was proposed, measured, rejected and kept:

    * ``weight_update``: the choice's mode and reason, and each program it considered (replicated,
      sharded, ...) with its simulated time and, where measured against the replicated step, its
      output check, ratio, interval and verdict (`sharding.choice`);
    * ``fusion_search``: the simulated search on the program that runs (candidates costed, why it
      stopped, its starts by origin with their simulated times) and whether packing was offered
      (`packs`: the backend packs buckets, so the ``pack_allreduce`` move and, where XLA's plan has
      a bucket of several gradients, the ``xla+packed-allreduce`` start were in the search);
    * ``measured_candidates``: each candidate the measured loop timed against XLA's plan (origin,
      packed, predicted and measured ratio, interval, verdict, why it could not be chosen, whether
      it went to validation: `_tuning.Record`), and why the measured loop stopped (its budget is
      half the search's: under load the first candidate can spend it);
    * ``validation``: the acceptance rule's timing of the candidate validated, None where none was
      (the measured loop found none faster, or the search none better than XLA's plan);
    * ``chosen``: what runs (fusion/bucket plan applied or not, weight update, packed, buckets)."""
    search, choice = report.search or {}, report.weight_update or {}
    strategy = ((report.plan or {}).get("strategy") or {}) if report.applied else {}
    starts = search.get("start_costs") or {}
    return {
        "weight_update": {
            "mode": choice.get("mode"),
            "reason": choice.get("reason"),
            "candidates": [
                {
                    "label": c.get("label"),
                    "simulated_us": c.get("simulated_us"),
                    "outputs_within_tolerance": (c.get("check") or {}).get("within_tolerance"),
                    **_timed(c.get("measured")),
                }
                for c in choice.get("candidates") or []
            ],
        },
        "fusion_search": {
            **{k: search.get(k) for k in ("evaluated", "stop_reason", "seconds")},
            "starts_us": starts,
            "packing_offered": packs,
            "packed_start_us": starts.get("xla+packed-allreduce"),
        },
        "measured_candidates": [
            {
                k: c.get(k)
                for k in (
                    "round",
                    "origin",
                    "packed",
                    "predicted_ratio",
                    "measured_ratio",
                    "ratio_ci95",
                    "pairs",
                    "verdict",
                    "ineligible",
                    "picked",
                )
            }
            for c in search.get("measured_candidates") or []
        ],
        "measured_loop_stop": (search.get("tuning") or {}).get("stop_reason"),
        # Only `_search_phase.validate` records whether bitwise equality was required: without that
        # key `report.measured` is the measured loop's evidence for keeping XLA's plan, not a validation.
        "validation": _timed(report.measured) if "bitwise_required" in (report.measured or {}) else None,
        "chosen": {
            "applied": bool(report.applied),
            "weight_update": choice.get("mode"),
            "packed": bool(strategy.get("packed")),
            "buckets": len(strategy["buckets"]) if "buckets" in strategy else None,
            "origin": strategy.get("origin"),
            "reason": report.reason,
        },
    }


def measured_row(
    name: str,
    style: str,
    *,
    budget_s: float,
    pairs: int,
    plan_dir: str,
    config: str = "tiny",
    global_batch_size: int | None = None,
) -> dict | None:
    """The measured row of a zoo model (`config`, at the spec's global batch unless given) on
    every device of the job, on the default backend's devices: every baseline compiled, checked,
    timed against the reference and simulated; disco-jax by `optimize_distributed`'s search phase,
    its executable timed against the reference and the decorated call against its executable.
    Process 0 returns the row, the others None."""
    spec = zoo.get_model(name, config)
    step, state, batch = zoo.make_train_step(
        spec, optax.adam(1e-3), zoo.data_mesh(), style, global_batch_size=global_batch_size
    )
    args = (state, batch)
    job = Job(name)
    started = time.perf_counter()
    backend = backends.for_platform(jax.default_backend())
    if backend is None:
        raise ValueError(f"disco-jax has no backend for {jax.default_backend()!r}")
    captured = capture(step.lower(*args), backend, args, {})
    captured.exact = Float64Run(step, args, {})
    graph = captured.graph
    capture_s = time.perf_counter() - started
    validation_pairs = max(8, pairs // 2)
    default_runner = captured.runner(captured.default_compiled)
    quiet = Ui(verbose=False)
    log(f"{name}: profiling and calibrating the simulator")
    cost_model = profile(captured, default_runner, ProfileDatabase(), quiet)
    calibration = calibrate(cost_model, captured, default_runner, validation_pairs, quiet).to_json()
    scale = cost_model.params.compute_scale
    candidates = baselines.all_baselines(
        captured.program, kernel_time_us=lambda ks: [t * scale for t in cost_model.estimator.estimate(graph, ks)]
    )
    default_counts = compiled_stats(captured.default_compiled.as_text())
    reference_runner = captured.runner(captured.default_copy())
    strategies: dict[str, dict] = {}
    reference_samples: list[float] = []
    for b in candidates:
        b = job.agree(b, graph)
        log(f"{name}: {b.name} ({b.enacted_by})")
        compiled, status = compile_baseline(captured, b)
        runner = captured.runner(compiled)
        # Bitwise equality is recorded; the check is the output check's (fusion changes, and our
        # rewrite of some modules, move float results by a few ulps).
        comparison = job.compare(captured, runner)
        timing = job.time(reference_runner, runner, pairs)
        reference_samples.append(timing.default_us)
        sim = cost_model.simulate(captured.program, b.strategy)
        strategies[b.name] = {
            "simulated": sim_json(sim),
            "description": b.description,
            "enacted_by": b.enacted_by,
            "compiler_options": b.compiler_options,
            "compile_status": status,
            "hlo": compiled_stats(compiled.as_text()),
            "buckets": len(b.strategy.buckets),
            "valid": sim is not None,
            "measured": measured_json(timing),
            "outputs": outputs_json(comparison),
        }
    # disco-jax: the product's search phase, as a user runs it.
    log(f"{name}: disco-jax search phase (budget {budget_s:g} s)")
    optimized = optimize_distributed(
        step, search=True, budget_s=budget_s, plan_dir=plan_dir, verbose=False, validation_pairs=validation_pairs
    )
    jax.block_until_ready(optimized(*args))  # the search phase, as a user runs it
    report = optimized.last_report
    applied = bool(report.applied)
    sharded = (report.weight_update or {}).get("mode") == "sharded"
    executable, plan_args = plan_executable(optimized, args)
    strategy = None
    if not sharded:  # else the plan is the sharded program's, another graph than this row's
        strategy = (
            Strategy.from_json(graph, report.plan["strategy"])
            if applied
            else baselines.jax_default(captured.program).strategy
        )
    plan_runner = captured.runner(executable, plan_args)
    comparison = job.compare(captured, plan_runner)
    log(f"{name}: disco-jax {'plan applied' if applied else 'XLA default kept'}; timing its executable")
    timing = job.time(reference_runner, plan_runner, pairs)
    reference_samples.append(timing.default_us)
    log(f"{name}: the decorator's per-call overhead (decorated call vs its executable)")
    overhead = job.time(plan_runner, captured.runner(optimized, plan_args), pairs)
    if jax.process_index() != 0:
        return None
    if sharded:  # the step lowered again with its state sharded: as the search phase costed it
        simulated, simulated_by = (report.simulated or {}).get("plan" if applied else "default"), "search phase"
    else:
        simulated, simulated_by = sim_json(cost_model.simulate(captured.program, strategy)), "row"
    search = report.search or {}
    strategies[DISCO] = {
        "simulated": simulated,
        "simulated_by": simulated_by,
        "description": ("fusion/bucket plan applied" if applied else "XLA's fusion and buckets kept")
        + f": {report.reason or ''}",
        "enacted_by": "optimize_distributed",
        "applied": applied,
        "acceptance": {k: (report.measured or {}).get(k) for k in ("ratio", "ratio_ci95", "rule", "pairs")},
        "hlo": compiled_stats(executable.as_text()),
        "buckets": len(strategy.buckets)
        if strategy
        else len(((report.plan or {}).get("strategy") or {}).get("buckets", [])),
        "valid": simulated is not None,
        "simulated_by_search": (report.simulated or {}).get("plan"),
        "weight_update": (report.weight_update or {}).get("mode"),
        "weight_update_reason": (report.weight_update or {}).get("reason"),
        "search": search_record(report, backend.packs_buckets),
        "measured": measured_json(timing),
        "overhead": overhead_json(overhead),
        "outputs": outputs_json(comparison),
    }
    reference_us = sorted(reference_samples)[len(reference_samples) // 2]
    return {
        "strategies": strategies,
        "time_kind": "measured",
        "reference": {"executable": REFERENCE, "us": reference_us, "pairs": pairs},
        **measured_summary(strategies, reference_us),
        "search": {
            k: search.get(k)
            for k in ("evaluated", "invalid", "improvements", "seconds", "stop_reason", "candidates_per_second")
        },
        "measured_candidates": search.get("measured_candidates"),
        "search_s": search.get("seconds"),
        "calibration": calibration,
        "default_hlo": default_counts,
        "allreduce": cost_model.allreduce.to_json(),
        "capture_s": capture_s,
        "processes": jax.process_count(),
        "parameters": spec.param_count(),
        "global_batch": spec.default_global_batch if global_batch_size is None else global_batch_size,
        "description": spec.description,
        "graph_summary": graph.summary(),
    }
