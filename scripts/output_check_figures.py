"""The output check on the zoo's tiny steps: XLA's program and one fusion plan per model against a
float64 run of the step, judged by the float64 check (`_validate.compare_to_float64`) and by the
ulp tolerance it replaced (`_validate.compare_outputs` with the one-ulp sensitivity floor).

The plan is `_strategy.unfused` (every op its own kernel, one all-reduce per gradient): the fusion
plan that changes XLA's code generation most. On 8 virtual CPU devices:

    python scripts/output_check_figures.py [--models mlp transformer ...] [--optimizer adam|adamw|lamb]
        [--json figures.json]

Printed per model: the float64 check's verdict and its worst array (the plan's deviation from the
float64 result over what it was allowed, with XLA's own deviation beside it), the largest
plan/XLA deviation ratio over the arrays, and the ulp tolerance's verdict and its worst array
(|plan - XLA| over its bound). Figures for docs/output-check.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
os.environ["XLA_FLAGS"] = " ".join([*flags, "--xla_force_host_platform_device_count=8"])

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from disco_jax import _compile, _strategy, _validate, backends, zoo  # noqa: E402
from disco_jax._output_check import Float64Run  # noqa: E402

OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(1e-3, weight_decay=1e-2),
    "lamb": lambda: optax.lamb(1e-3),
}


def ulp_bounds(default, plan, nudged) -> tuple[list[float], list[float]]:
    """Per floating output array: the ulp tolerance's bound on |plan - XLA|, and max |plan - XLA|
    over it."""
    bounds, shares = [], []
    for d, p, n in zip(*(map(np.asarray, jax.tree.leaves(t)) for t in (default, plan, nudged))):
        if np.issubdtype(d.dtype, np.floating):
            bounds.append(_validate.ulp_bound(d, _validate.sensitivity(d, n)[0]))
            shares.append(_validate.deviation(p, d.astype(np.float64)) / bounds[-1])
    return bounds, shares


def figures(model: str, optimizer: str) -> dict:
    started = time.perf_counter()
    step, state, batch = zoo.make_train_step(zoo.get_model(model, "tiny"), OPTIMIZERS[optimizer](), zoo.data_mesh(8))
    args = (state, batch)
    captured = _compile.capture(step.lower(*args), backends.CPU, args, {})
    captured.exact = Float64Run(step, args, {})
    check = captured.output_check
    compiled, _ = _compile.compile_strategy(captured.lowered, captured.program, _strategy.unfused(captured.graph))
    plan = compiled(*args)
    new = check.compare(plan)
    old = _validate.compare_outputs(check.default(), plan, bitwise=False, floor=None)
    bounds, shares = ulp_bounds(check.default(), plan, check.run_nudged())
    row = {
        "model": model,
        "optimizer": optimizer,
        "plan": "unfused",
        "bitwise_equal": new.bitwise_equal,
        "max_abs_plan_minus_xla": new.max_abs_error,
        "check": new.check,
        "fallback_reason": new.fallback_reason,
        "accepted": new.within_tolerance,
        "ulp_tolerance_accepts": max(shares, default=0.0) <= 1.0,
        "ulp_tolerance_worst_share": max(shares, default=0.0),
        "ulp_tolerance_without_sensitivity_accepts": old.within_tolerance,
        "seconds": time.perf_counter() - started,
    }
    if new.check == _validate.FLOAT64_CHECK:
        floating = [i for i, a in enumerate(new.allowed) if a]
        worst = max(floating, key=lambda i: new.plan_deviation[i] / new.allowed[i])
        ratios = [new.plan_deviation[i] / new.default_deviation[i] for i in floating if new.default_deviation[i]]
        looser = [b / new.allowed[i] for b, i in zip(bounds, floating)]
        row.update(
            arrays=len(floating),
            worst_array=worst,
            worst_share=new.plan_deviation[worst] / new.allowed[worst],
            worst_default_deviation=new.default_deviation[worst],
            worst_plan_deviation=new.plan_deviation[worst],
            largest_plan_over_xla=max(ratios, default=0.0),
            largest_default_deviation=max(new.default_deviation),
            largest_plan_deviation=max(new.plan_deviation),
            # How much looser the ulp tolerance held each array than the float64 check does.
            ulp_bound_over_float64_bound_median=float(np.median(looser)),
        )
    return row


def line(r: dict) -> str:
    verdict = {True: "accepts", False: "rejects"}
    old = (
        f"ulp tolerance {verdict[r['ulp_tolerance_accepts']]} ({r['ulp_tolerance_worst_share']:.3f}; "
        f"without its sensitivity floor {verdict[r['ulp_tolerance_without_sensitivity_accepts']]})"
    )
    if r["check"] != _validate.FLOAT64_CHECK:
        return f"{r['model']:12s} {r['check']}: {r['fallback_reason']}; {old}"
    return (
        f"{r['model']:12s} float64 check {verdict[r['accepted']]}: worst array {r['worst_array']} "
        f"at {r['worst_share']:.3f} of allowed (XLA {r['worst_default_deviation']:.3g}, plan "
        f"{r['worst_plan_deviation']:.3g}); plan/XLA up to {r['largest_plan_over_xla']:.2f}x over {r['arrays']} "
        f"arrays; largest deviation XLA {r['largest_default_deviation']:.3g}, plan {r['largest_plan_deviation']:.3g}; "
        f"|plan - XLA| {r['max_abs_plan_minus_xla']:.3g}; {old}; ulp bound / float64 bound median "
        f"{r['ulp_bound_over_float64_bound_median']:.3g}; {r['seconds']:.0f} s"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(zoo.MODELS))
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    rows = []
    for model in a.models:
        rows.append(figures(model, a.optimizer))
        print(line(rows[-1]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["accepted"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
