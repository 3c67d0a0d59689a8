"""Per-device memory of parameters plus optimizer state, replicated against sharded weight update.

For each zoo model (tiny config, `jax.jit` style, optax.adam) on 8 virtual CPU devices, the step is
decorated with `@optimize_distributed(search=False, weight_update="sharded")` and called once; the
figures are what the step report records from the compiled executables
(`compiled.memory_analysis()` and the input shardings): the bytes of the leaves the replicated step
holds whole on every device (parameters, optimizer state, model state), XLA's argument bytes, and
the collectives in each compiled module. The losses of the first three steps are compared with the
unmodified step's. `--pairs N`: also the step time over the replicated step's, as the median of N
interleaved rounds (the order rotated each round) with its interquartile range, of two programs:
the sharded update as disco-jax compiles it (the proven rules applied at the hook on XLA:CPU: one
reduce-scatter and grouped all-gathers, `disco_jax.sharding.apply`) and the same program as XLA's
partitioner leaves it (all-reduce + dynamic-slice, one all-gather per parameter; its collectives
are printed too).

    python scripts/sharded_update_memory.py [--models mlp transformer ...] [--pairs 30] [--json out.json]
    disco-jax launch -n 2 --devices-per-process 1 -- python scripts/sharded_update_memory.py --pairs 30

The second form runs it in 2 processes over gloo (loopback): the same figures per device.
"""

from __future__ import annotations

import argparse
import builtins
import json
import os
import time
import warnings

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "DISCO_JAX_COORDINATOR" not in os.environ:  # one process: 8 virtual devices; in a job: the launcher's
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import disco_jax  # noqa: E402
from disco_jax import PlanWarning, optimize_distributed, zoo  # noqa: E402
from disco_jax.sharding import update  # noqa: E402

disco_jax.initialize_from_env()


def scalar(x) -> float:
    """A replicated scalar's value (its local copy: in a multi-process job it is not fully addressable)."""
    return float(np.asarray(x.addressable_data(0)))


def interleaved_ratios(reference, others: list, rounds: int) -> list[list[float]]:
    """Per program of `others`, quartiles of its per-round time over `reference`'s, all run once
    per round in a rotated order."""

    def timed(f) -> float:
        start = time.perf_counter()
        jax.block_until_ready(f())
        return time.perf_counter() - start

    programs = [reference, *others]
    ratios: list[list[float]] = [[] for _ in others]
    for i in range(rounds):
        order = [(i + k) % len(programs) for k in range(len(programs))]
        times = dict((k, timed(programs[k])) for k in order)
        for k in range(len(others)):
            ratios[k].append(times[k + 1] / times[0])
    return [[float(q) for q in np.percentile(r, [25, 50, 75])] for r in ratios]


def measure(name: str, pairs: int) -> dict:
    step, state, batch = zoo.make_train_step(zoo.get_model(name, "tiny"), optax.adam(1e-3), zoo.data_mesh(), "jit")
    sharded = optimize_distributed(search=False, weight_update="sharded", verbose=False)(step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlanWarning)
        reference, mine, s_ref, s_mine = [], [], state, state
        for _ in range(3):
            s_ref, loss = step(s_ref, batch)
            reference.append(scalar(loss))
            s_mine, loss = sharded(s_mine, batch)
            mine.append(scalar(loss))
    report = sharded.last_report.weight_update
    ratio = partitioned = partitioned_collectives = None
    if pairs:
        # The same sharded program compiled by XLA alone (no rule applied at the hook).
        lowered, _, _ = update.relower_positional(step, (state, batch), step.lower(state, batch).compile())
        plain = lowered.compile()
        partitioned_collectives = update.collectives(plain.as_text())
        ratio, partitioned = interleaved_ratios(
            lambda: step(s_ref, batch), [lambda: sharded(s_mine, batch), lambda: plain(s_mine, batch)], pairs
        )
    return {
        "model": name,
        "mode": report["mode"],
        "sharded_leaves": len(report.get("leaves", {})),
        "memory": report.get("memory"),
        "collectives": report.get("collectives"),
        "max_loss_rel_diff": float(np.max(np.abs(np.subtract(mine, reference)) / np.abs(reference))),
        "prepared": len(sharded.reports),
        "rules_applied": sorted({a["rule"] for a in sharded.last_report.rules_applied or []}),
        "time_ratio_quartiles": ratio,
        "partitioned_time_ratio_quartiles": partitioned,
        "partitioned_collectives": partitioned_collectives,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(zoo.MODELS))
    parser.add_argument("--pairs", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    # Every process runs the steps (collectives); process 0 prints.
    print = builtins.print if jax.process_index() == 0 else (lambda *a, **k: None)  # noqa: A001
    where = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    print(f"{len(jax.devices())} {jax.devices()[0].platform} devices{where}, jax {jax.__version__}")
    header = f"{'model':12} {'leaves':>6} {'params+state B/dev':>26} {'ratio':>6} {'XLA args B/dev':>22}"
    print(header + "  collectives (sharded)")
    for name in args.models:
        row = measure(name, args.pairs)
        rows.append(row)
        if row["mode"] != "sharded":
            print(f"{name:12} not sharded")
            continue
        rep, sh = row["memory"]["replicated"], row["memory"]["sharded"]
        a, b = rep["params_and_state_bytes_per_device"], sh["params_and_state_bytes_per_device"]
        coll = {k: v for k, v in row["collectives"]["sharded"].items() if v}
        print(
            f"{name:12} {row['sharded_leaves']:>6} {a:>12} -> {b:>10} {b / a:>6.3f} "
            f"{rep['argument_size_in_bytes']:>10} -> {sh['argument_size_in_bytes']:>9}  {coll}  "
            f"loss rel diff {row['max_loss_rel_diff']:.1e}"
        )
        if row["time_ratio_quartiles"]:
            low, median, high = row["time_ratio_quartiles"]
            print(f"{'':12} step time sharded/replicated {median:.3f}x (IQR {low:.3f}-{high:.3f}, {args.pairs} rounds)")
            low, median, high = row["partitioned_time_ratio_quartiles"]
            coll = {k: v for k, v in row["partitioned_collectives"].items() if v}
            print(f"{'':12} without the hook rules {median:.3f}x (IQR {low:.3f}-{high:.3f}): {coll}")
    if args.json and jax.process_index() == 0:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
