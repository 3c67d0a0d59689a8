"""XLA:GPU's collective options searched per zoo model on the compiled program, beside the weight
update's gain: what the collective/schedule part of a plan gains on its own, per model and cluster.

For each model (paper size, Adam, `jax.jit` data parallel over 8 devices of the cluster's GPU,
as the simulated rows capture them: `eval.rows.PAPER_DEVICES`), the step is compiled deviceless
under XLA's defaults and under the option sets `schedule_options.search_options` tries (each
kind's combine threshold in powers of two, the latency-hiding scheduler and its memory limit, the
loop options where the program has loops), every program costed by the compiled-program model with
the cluster's kernel estimator, collective model and host lane (`offline.program_costs`: how the
rows cost theirs). Prints per model: XLA's default program (its collectives: count, MiB, async),
the chosen options and their program, the schedule part's gain (XLA's default over the chosen
program), and the weight-update part's gain as the stored row (`report/rows/`) recorded it (XLA's
default over disco-jax's program, where that program is the relowered sharded update; 1.0 where
disco-jax kept XLA's program or a rewrite). `--json` writes every search.

    python scripts/schedule_options_rows.py [--cluster 4x8xH100-IB400] [--models mlp,bert,...]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")

import optax  # noqa: E402

from disco_jax import offline, schedule_options, targets, zoo  # noqa: E402
from disco_jax.eval import clusters  # noqa: E402
from disco_jax.eval.rows import PAPER_DEVICES  # noqa: E402

ROWS = Path(__file__).resolve().parent.parent / "report" / "rows"
MODELS = ("mlp", "bert", "resnet50", "vgg19", "transformer", "dlrm", "reformer", "rnnlm")


def collectives(summary: dict) -> str:
    return ", ".join(
        f"{kind} {row['count']} ({row['bytes'] / 2**20:.1f} MiB, {row['async']} async)" for kind, row in summary.items()
    )


def weight_update_gain(model: str, cluster: str) -> tuple[float | None, str]:
    """XLA's default over disco-jax's figure in the stored row, where disco-jax's program is the
    relowered sharded update; (1.0, what it was) otherwise; (None, why) without a row."""
    path = ROWS / f"{model}.paper.jit.{cluster}.json"
    if not path.exists():
        return None, "no stored row"
    row = json.loads(path.read_text())
    disco = row["strategies"]["disco-jax"]
    enacted = (disco.get("program") or {}).get("enacted_by", "")
    times = row["time_us"]
    if enacted.startswith("relowered"):
        return times["JAX_default"] / times["disco-jax"], f"row of {row['created']}: sharded update"
    return 1.0, f"row of {row['created']}: {disco.get('chosen')}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="4x8xH100-IB400")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--json", default=None)
    a = parser.parse_args(argv)
    cluster = clusters.get_cluster(a.cluster)
    costs = offline.program_costs(cluster)
    out = {}
    for model in a.models.split(","):
        started = time.perf_counter()
        spec = zoo.get_model(model, "paper")
        lowered = zoo.lower_abstract(spec, optax.adam(1e-3), targets.mesh(cluster.target, PAPER_DEVICES), "jit")
        found = schedule_options.search_options(lowered, costs)
        record = found.to_json()
        wu_gain, wu_what = weight_update_gain(model, cluster.name)
        record["weight_update_gain"], record["weight_update_row"] = wu_gain, wu_what
        record["seconds"] = round(time.perf_counter() - started, 1)
        out[model] = record
        distinct = len({c["fingerprint"] for c in record["candidates"] if c["fingerprint"]})
        print(
            f"{model} on {cluster.name}: {len(record['candidates'])} option sets, {distinct} distinct programs, "
            f"{record['seconds']} s\n"
            f"  XLA's defaults: {found.default.compiled_us:.1f} us, peak {found.default.peak_bytes}; "
            f"{collectives(record['default']['collectives'])}\n"
            f"  chosen: {record['chosen']['label']}: {found.chosen.compiled_us:.1f} us, "
            f"peak {found.chosen.peak_bytes}; "
            f"{collectives(record['chosen']['collectives'])}\n"
            f"  schedule part's gain {found.gain:.3f}x; weight-update part's gain "
            f"{'n/a' if wu_gain is None else f'{wu_gain:.3f}x'} ({wu_what})",
            flush=True,
        )
        if a.json:
            Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
