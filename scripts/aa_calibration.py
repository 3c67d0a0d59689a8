"""A/A calibration of the timing intervals: one compiled executable timed against itself as if it
were two configurations, many times. Every such comparison must read 1, so the fraction of its
intervals that hold 1 is the coverage the intervals really have on this machine.

Per comparison the script times `4 * pairs` interleaved pairs of the executable against itself
(alternating which goes first, as `_validate` does) and judges them the two ways the project does:

* the acceptance rule (`_validate.time_until_decided`): looks after `pairs`, `2 * pairs` and
  `4 * pairs` pairs at 1 - 0.05/3 each; a comparison that ends "faster" or "slower" is a false
  decision (the rule claims 95% overall);
* the report's interval (`_validate.summarize` at 95%) over the first `report_pairs` pairs, as the
  measured rows time each configuration; an interval without 1 is a miss.

Each is computed with the interval of `_validate.ratio_interval` (the binomial order statistics of
the median and the same allowing for neighbouring pairs that move together, whichever is wider)
and, for comparison, with the binomial interval alone (`_validate.median_interval`, the rule
before the A/A runs). Printed: coverage per rule and method, the ratios' spread, and the
comparisons that missed. `--json` keeps every pair's ratio; `--rejudge FILE` judges a kept run
again without timing anything (after a change of the intervals).

    python scripts/aa_calibration.py [--model transformer] [--devices 8] [--processes 1]
        [--comparisons 40] [--pairs 20] [--report-pairs 30] [--json out.json] [--rejudge out.json]

`--devices 2` on a 2-core machine gives each device its own core (cpu-2dev); 8 devices share the
cores (cpu-8dev). `--processes 2 --devices 1` is gloo-2x1: the script starts itself as a job of two
processes over loopback gloo (`disco-jax launch`), every process times the same pairs, and each
pair's ratio counts with its slowest process (`_distributed.slowest_pairs`), as the measured rows
and the acceptance rule judge a multi-process job; process 0's own ratios are judged too, to show
what that merge does, and so is each pair as the job's step (max(q) / max(d) over processes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

COORDINATOR_ENV = "DISCO_JAX_COORDINATOR"  # set in the processes `disco-jax launch` starts


def judge(records: list[dict], pairs: int, report_pairs: int, field: str = "ratios") -> dict:
    """Coverage of the acceptance rule and of the report's interval over `records` (each with
    its per-pair ratios under `field`), per interval method; prints it, returns it."""
    import numpy as np

    from disco_jax import _validate

    looks = (pairs, 2 * pairs, 4 * pairs)
    each = 1.0 - (1.0 - _validate.CONFIDENCE) / len(looks)
    methods = {"ratio_interval": _validate.ratio_interval, "binomial only": _validate.median_interval}
    records = [{**r, "ratios": r[field]} for r in records]
    n = len(records)
    all_ratios = np.concatenate([r["ratios"] for r in records])
    q5, q25, q75, q95 = np.percentile(all_ratios, [5, 25, 75, 95])
    print(f"per-pair ratios: median {np.median(all_ratios):.3f}, IQR {q25:.3f}-{q75:.3f}, 5-95% {q5:.3f}-{q95:.3f}")
    rho = [_validate.sign_autocorrelation(r["ratios"][:report_pairs]) for r in records]
    print(f"sign autocorrelation of neighbouring pairs (bias-corrected): median {np.median(rho):.2f}")
    summary = {}
    for name, interval in methods.items():
        false, missed = [], []
        for c, r in enumerate(records):
            ratios = r["ratios"]
            for look in looks:
                low, high = interval(ratios[:look], each)
                if high < 1.0 or low > 1.0:
                    false.append((c, "faster" if high < 1.0 else "slower", look, low, high))
                    break
            low, high = interval(ratios[:report_pairs], _validate.CONFIDENCE)
            if not low <= 1.0 <= high:
                missed.append((c, float(np.median(ratios[:report_pairs])), low, high))
        summary[name] = {"acceptance_coverage": 1 - len(false) / n, "report_coverage": 1 - len(missed) / n}
        print(
            f"{name:>15}: acceptance rule (looks {looks}, 95% overall) {1 - len(false) / n:.1%} "
            f"({len(false)} false decisions of {n}); report interval (95%, {report_pairs} pairs) "
            f"{1 - len(missed) / n:.1%} ({len(missed)} of {n} exclude 1)"
        )
        for c, median, low, high in missed:
            print(f"{'':>17}report miss: comparison {c + 1}: {median:.3f} [{low:.3f}, {high:.3f}]")
        for c, decision, look, low, high in false:
            print(f"{'':>17}false decision: comparison {c + 1}: {decision} at {look} pairs [{low:.3f}, {high:.3f}]")
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="transformer")
    p.add_argument("--devices", type=int, default=8, help="CPU devices (per process)")
    p.add_argument("--processes", type=int, default=1, help="2: two processes over loopback gloo (gloo-2x1)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before a launched job is stopped")
    p.add_argument("--comparisons", type=int, default=40)
    p.add_argument("--pairs", type=int, default=20, help="the acceptance rule's first look (validation_pairs)")
    p.add_argument("--report-pairs", type=int, default=30, help="pairs per configuration of a measured row")
    p.add_argument("--json", default=None)
    p.add_argument("--rejudge", default=None, help="a --json file of an earlier run: judge its ratios again")
    args = p.parse_args()
    if args.rejudge:
        with open(args.rejudge) as f:
            kept = json.load(f)
        config = kept["config"]
        print(f"A/A (kept run {args.rejudge}): {config['model']} tiny, {where(config)}")
        judge_all(kept)
        if args.json:  # the kept ratios with the new verdicts
            with open(args.json, "w") as f:
                json.dump(kept, f, indent=1)
        return
    if args.processes > 1 and not os.environ.get(COORDINATOR_ENV):
        # Start this script again as a job of `--processes` processes on loopback; the launcher
        # stops every process on a failure or after `--timeout` (exit 124).
        launch = [sys.executable, "-m", "disco_jax.cli", "launch", "-n", str(args.processes)]
        launch += ["--devices-per-process", str(args.devices), "--timeout", str(args.timeout), "--"]
        sys.exit(subprocess.call(launch + [sys.executable, *sys.argv]))
    os.environ["XLA_FLAGS"] = " ".join(
        [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
        + [f"--xla_force_host_platform_device_count={args.devices}"]
    )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import numpy as np
    import optax

    import disco_jax
    from disco_jax import _distributed, _validate, zoo
    from disco_jax._compile import Runner

    disco_jax.initialize_from_env()  # joins the launched job (gloo); a no-op in one process
    import jax

    main_process = jax.process_index() == 0
    spec = zoo.get_model(args.model, "tiny")
    step, state, batch = zoo.make_train_step(spec, optax.adam(1e-3), zoo.data_mesh(), "jit")
    lowered = step.lower(state, batch)
    runner = Runner(lowered.compile(), lowered, (state, batch), {})
    total = max(4 * args.pairs, args.report_pairs)
    scope = _distributed.new_scope("aa") if _distributed.is_multiprocess() else None
    records = []
    started = time.perf_counter()
    for _ in range(3):
        _validate._timed(runner)
    for c in range(args.comparisons):
        d, q = _validate._pairs(runner, runner, total)
        own = [float(r) for r in np.array(q) / np.array(d)]
        record = {"ratios": own, "median_us": float(np.median(d + q))}
        if scope is not None:  # each pair as the job's steps, as a row and the acceptance rule judge it
            merged = _distributed.slowest_pairs(f"{scope}/{c}")(d, q)
            # Every process's times too, to judge other merges: the slowest of the processes'
            # ratios, max(q / d), the merge before 2026-11-29.
            times = _distributed.gather_json(f"{scope}/{c}/times", [d, q])
            slowest = [float(r) for r in np.max([np.array(t[1]) / np.array(t[0]) for t in times], 0)]
            record = {**record, "ratios": merged, "own_ratios": own, "max_ratio_ratios": slowest, "times": times}
        records.append(record)
        low, high = _validate.ratio_interval(record["ratios"][: args.report_pairs])
        if main_process:
            print(
                f"comparison {c + 1}/{args.comparisons}: median {np.median(record['ratios']):.3f}, "
                f"report {low:.3f}-{high:.3f}",
                file=sys.stderr,
                flush=True,
            )
    if not main_process:
        return
    print(
        f"A/A: {args.model} tiny, {where(vars(args))} on {os.cpu_count()} cores; "
        f"{len(records)} comparisons of one executable against itself, {total} pairs each, "
        f"median step {np.median([r['median_us'] for r in records]) / 1e3:.2f} ms, "
        f"{time.perf_counter() - started:.0f} s"
    )
    kept = {"config": vars(args), "comparisons": records}
    judge_all(kept)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(kept, f, indent=1)


# The per-pair ratios a run keeps, by field (those of a multi-process run), and what each is.
MERGES = {
    "ratios": "as the rows and the acceptance rule judge",
    "own_ratios": "process 0's own ratios, no merge across processes",
    "max_ratio_ratios": "the slowest of the processes' ratios, max(q / d) (the merge before 2026-11-29)",
    # Runs kept before that day: "ratios" held max(q / d) and this field the job's steps.
    "job_ratios": "the job's steps, max(q) / max(d)",
}


def judge_all(kept: dict) -> None:
    """`kept["summary"]` (the judged ratios) and, for a multi-process run, `kept["summaries"]`:
    every merge it kept, judged."""
    config, records = kept["config"], kept["comparisons"]
    fields = [f for f in MERGES if f in records[0]]
    kept["summaries"] = {}
    for field in fields:
        if len(fields) > 1:
            old = field == "ratios" and "job_ratios" in fields  # a run kept before 2026-11-29
            print(f"{field}: {MERGES['max_ratio_ratios'] if old else MERGES[field]}")
        kept["summaries"][field] = judge(records, config["pairs"], config["report_pairs"], field)
    kept["summary"] = kept["summaries"]["ratios"]


def where(config: dict) -> str:
    """The platform of a run's `config`, in words."""
    processes = config.get("processes", 1)
    if processes > 1:
        return f"{processes} processes x {config['devices']} CPU device(s) over loopback gloo"
    return f"{config['devices']} CPU devices in one process"


if __name__ == "__main__":
    main()
