"""What each XLA:GPU collective option does to one program: a tiny zoo model's Adam step for 8
H100s (deviceless), its first sharded weight update that compiles (reduce-scatters and
all-gathers beside all-reduces), compiled under each option set on its own, and for each: the
same program as XLA's defaults or not (fingerprint), its cost by the compiled-program model (one
8xH100-NVLink node) and its collectives (count, bytes, async per kind). The check behind the
dimensions `schedule_options` searches and those it leaves out (docs/schedule-options.md).

    JAX_PLATFORMS=cpu python scripts/option_effects.py [--model transformer]
"""

from __future__ import annotations

import argparse
import time

import optax

from disco_jax import _compile, backends, offline, targets, zoo
from disco_jax import schedule_options as so
from disco_jax.eval import clusters
from disco_jax.sharding import update

OPTION_SETS = [
    {so.EARLY_START: True},
    *({so.OVERLAP_LIMIT: v} for v in so.OVERLAP_LIMIT_VALUES),
    *({so.COMBINE_COUNT: v} for v in so.COMBINE_COUNT_VALUES),
    {"xla_gpu_experimental_enable_heuristic_collective_combining": False},
    {"xla_gpu_experimental_enable_heuristic_collective_combining": True},
    {"xla_gpu_enable_all_gather_combine_by_dim": False},
    {"xla_gpu_enable_reduce_scatter_combine_by_dim": False},
    {so.THRESHOLDS["all-gather"]: "0"},
    {so.THRESHOLDS["reduce-scatter"]: "0"},
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="transformer", help="a zoo model (its tiny config)")
    a = p.parse_args()
    spec, optimizer = zoo.get_model(a.model, "tiny"), optax.adam(1e-3)
    mesh = targets.mesh("h100-sxm", 8)
    args = zoo.abstract_state_and_batch(spec, optimizer, mesh)
    step = zoo.build_train_step(spec, optimizer, mesh, "jit", donate=True)
    costs = offline.program_costs(clusters.node_of("h100-sxm", 8))
    candidates = offline.weight_update_candidates(step, args, {}, costs)
    sharded = next(c for c in candidates if c.layout is not None and c.xla is not None)
    base = so.program_fingerprint(sharded.xla.text)
    print(f"{a.model}, {sharded.label}: {sharded.cost.iteration_us:.1f} us, {so.collective_summary(sharded.xla.text)}")
    rules = update.hook_backend(backends.GPU, sharded.layout)
    for options in OPTION_SETS:
        started = time.perf_counter()
        program = _compile.compile_program(sharded.lowered, None, "option", None, options, hook_rules_of=rules)
        if program.text is None:
            print(f"{options}: not compiled ({program.reason})")
            continue
        same = "XLA's defaults' program" if so.program_fingerprint(program.text) == base else "a program of its own"
        print(
            f"{options}: {same}, {costs(program).iteration_us:.1f} us, {so.collective_summary(program.text)} "
            f"({time.perf_counter() - started:.0f} s)"
        )


if __name__ == "__main__":
    main()
