"""The compiled-program cost model against the graph-level simulator, on measured XLA:CPU steps.

For each zoo model (``tiny`` config, the ``jit`` style, Adam) on ``cpu-8dev`` (8 CPU devices in one
process), the search phase's own machinery runs: `_profile_phase.profile` (the default executable's
kernels traced, times by instruction name; the all-reduce fit, from the profile database) and
`_profile_phase.calibrate` (the step and three more configurations measured in interleaved pairs
against it, plus the null program). Then the default step is predicted by

* the graph-level simulator (`cost.simulate` of XLA's plan on the captured graph, with the
  profile's estimator chain), and
* the compiled-program model (`cost.cost_program` of the default executable's module, its
  kernels costed by the same trace's times by name, `cost.measured_table`, and the profile's
  fitted analytical estimator for any kernel the trace missed; the same all-reduce fit),

each treated the same way twice: **uncalibrated** (no device parameters: `SimulatorParams()`), and
**calibrated** (each model fitted by `cost.calibrate` to the same measured configurations, with the
same free parameters and the same measured step overhead as `_profile_phase.calibrate` fits the
graph-level simulator; the compiled model costs each configuration's compiled executable).
Printed: the measured default step, each model's prediction and error, and each calibrated fit's
misfit over the configurations.

    python scripts/compiled_fidelity.py [--models mlp transformer ...] [--pairs 8] [--json out.json]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    + ["--xla_force_host_platform_device_count=8"]
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import optax  # noqa: E402

from disco_jax import _profile_phase, backends, cost, zoo  # noqa: E402
from disco_jax._compile import capture, compile_strategy  # noqa: E402
from disco_jax._console import Ui  # noqa: E402
from disco_jax._profile_db import ProfileDatabase  # noqa: E402

DEFAULT_MODELS = ("mlp", "transformer", "rnnlm", "dlrm", "bert", "resnet50", "vgg19", "reformer")


def measure_model(name: str, pairs: int) -> dict:
    """Profile, calibrate and predict one model's default step (see the module docstring)."""
    started = time.perf_counter()
    spec = zoo.get_model(name, "tiny")
    step, state, batch = zoo.make_train_step(spec, optax.adam(1e-3), zoo.data_mesh(), "jit")
    captured = capture(step.lower(state, batch), backends.CPU, (state, batch), {})
    graph, quiet = captured.graph, Ui(verbose=False)
    runner = captured.runner(captured.default_compiled)
    model = _profile_phase.profile(captured, runner, ProfileDatabase(), quiet)
    calibration = _profile_phase.calibrate(model, captured, runner, pairs, quiet)
    fitted_graph = calibration.fitted
    strategies = _profile_phase.calibration_strategies(captured.program)
    labels = [p.label for p in fitted_graph.points]
    measured = [p.measured_us for p in fitted_graph.points]

    # The compiled model: each configuration's executable, the trace's kernels by name first.
    texts = {"default": captured.default_compiled.as_text()}
    for label in labels[1:]:
        texts[label] = compile_strategy(captured.lowered, captured.program, strategies[label])[0].as_text()
    programs = {label: cost.compiled_program(text, backends.CPU) for label, text in texts.items()}
    analytical = cost.AnalyticalEstimator(tuple(model.sources["analytical"]["coefficients"]))
    estimator = cost.chain(cost.measured_table(programs["default"], model.kernel_times_us), analytical)

    def compiled_at(params: cost.SimulatorParams) -> list[float]:
        return [cost.cost_program(programs[x], estimator, model.allreduce, params).iteration_us for x in labels]

    def graph_at(params: cost.SimulatorParams) -> list[float]:
        return [
            cost.simulate(captured.program, strategies[x], model.estimator, model.allreduce, params).iteration_us
            for x in labels
        ]

    start = cost.SimulatorParams(
        step_overhead_us=calibration.params.step_overhead_us,
        allreduce_tensor_us=float(getattr(model.allreduce, "per_tensor_us", 0.0)),
    )
    free = fitted_graph.free
    copies = 2 if len(labels) == 1 else 1  # one configuration only: its point twice, as `calibrate` does
    fitted_compiled = cost.calibrate(
        lambda p: compiled_at(p) * copies, measured * copies, free=free, start=start, labels=labels * copies
    )
    default_us = measured[labels.index("default")]
    bare = cost.SimulatorParams()
    uncalibrated_compiled = cost.cost_program(programs["default"], estimator, model.allreduce, bare)
    rows = {
        "graph": {
            "uncalibrated_us": graph_at(bare)[0],
            "calibrated_us": fitted_graph.points[0].simulated_us,
            "misfit": fitted_graph.misfit,
            "params": fitted_graph.params.to_json(),
        },
        "compiled": {
            "uncalibrated_us": uncalibrated_compiled.iteration_us,
            "calibrated_us": fitted_compiled.points[0].simulated_us,
            "misfit": fitted_compiled.misfit,
            "params": fitted_compiled.params.to_json(),
            "costed_by": uncalibrated_compiled.costed_by,
        },
    }
    for r in rows.values():
        r["uncalibrated_error"] = (r["uncalibrated_us"] - default_us) / default_us
        r["calibrated_error"] = (r["calibrated_us"] - default_us) / default_us
    return {
        "model": name,
        "measured_default_us": default_us,
        "configurations": dict(zip(labels, measured)),
        "free": list(free),
        "kernels": {"graph_groups": len(strategies["default"].groups) + len(graph.opaque_ops)},
        "compiled_kernels": uncalibrated_compiled.to_json()["num_kernels"],
        **rows,
        "elapsed_s": time.perf_counter() - started,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    parser.add_argument("--pairs", type=int, default=8, help="interleaved pairs per measured configuration")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    results = []
    print(
        "| model | measured default (ms) | graph sim.: uncalibrated, calibrated (misfit) | compiled model: "
        "uncalibrated, calibrated (misfit) | compiled kernels (costed by) |"
    )
    print("|---|---:|---:|---:|---|")
    for name in args.models:
        r = measure_model(name, args.pairs)
        results.append(r)
        g, c = r["graph"], r["compiled"]
        print(
            f"| {name} | {r['measured_default_us'] / 1e3:.2f} "
            f"| {g['uncalibrated_error']:+.1%}, {g['calibrated_error']:+.1%} ({g['misfit']:.1%}) "
            f"| {c['uncalibrated_error']:+.1%}, {c['calibrated_error']:+.1%} ({c['misfit']:.1%}) "
            f"| {r['compiled_kernels']} ({c['costed_by']}) |",
            flush=True,
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
