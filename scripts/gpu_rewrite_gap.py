"""Why a zoo model's rewritten GPU candidates cost more than XLA's own program: all-reduce
reassociation (docs/collectives.md, "Why rewritten GPU candidates lost").

The model's step (SGD, `jax.jit` data parallel over 8 GPUs of the target, deviceless) is compiled
four ways and each program costed by the compiled-program model with the cluster's costs
(`offline.program_costs`): XLA's defaults; XLA with all-reduce reassociation off; with
reassociation and the combiner off (`backends.gpu.REWRITE_OPTIONS`); and XLA's own plan written
back by the GPU rewriter (what every rewritten candidate starts from). Prints per program: step,
compute and communication time, collectives, bytes all-reduced per device, compute kernels; and
the floor `_ranking.rewrite_floor_us` puts under any rewritten program.

    python scripts/gpu_rewrite_gap.py [MODEL [tiny|paper [CLUSTER]]]    # default: rnnlm tiny 8xH100-NVLink
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")

import optax  # noqa: E402

from disco_jax import _ranking, _strategy, backends, offline, targets, zoo  # noqa: E402
from disco_jax._compile import capture_program, compile_program  # noqa: E402
from disco_jax.backends import gpu  # noqa: E402
from disco_jax.cost import compiled as compiled_model  # noqa: E402
from disco_jax.eval import clusters  # noqa: E402


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    model, config = (argv + ["rnnlm", "tiny"][len(argv) :])[:2]
    cluster = clusters.get_cluster(argv[2] if len(argv) > 2 else "8xH100-NVLink")
    spec, optimizer = zoo.get_model(model, config), optax.sgd(0.1)
    mesh = targets.mesh(cluster.target, 8)
    state, batch = zoo.abstract_state_and_batch(spec, optimizer, mesh)
    lowered = zoo.build_train_step(spec, optimizer, mesh, "jit").lower(state, batch)
    costs = offline.program_costs(cluster)
    started = time.perf_counter()
    program, _ = capture_program(lowered, backends.GPU)
    graph = program.graph
    print(
        f"{model} {config} on {cluster.name}: captured in {time.perf_counter() - started:.1f} s; "
        f"{len(graph.gradients)} gradients at the hook, {sum(g.nbytes for g in graph.gradients) / 2**20:.1f} MiB",
        flush=True,
    )

    def show(label: str, compiled) -> float:
        cost = costs(compiled)
        read = compiled_model.compiled_program(compiled.text, backends.GPU)
        moved = sum(sum(k.tensor_bytes) * k.repeat for k in read.collectives)
        print(
            f"{label:40s} step {cost.iteration_us:10.1f} us  compute {cost.compute_us:9.1f}  "
            f"comm {cost.comm_us:9.1f}  collectives {len(read.collectives):4d}  {moved / 2**20:9.1f} MiB  "
            f"kernels {len(read.compute_kernels)}  (compiled in {compiled.compile_s:.0f} s)",
            flush=True,
        )
        return cost.iteration_us

    xla_us = show("XLA's defaults", compile_program(lowered, program, "xla", None, {}))
    show("XLA, reassociation off", compile_program(lowered, program, "r", None, dict(gpu.DECISIONS_OPTIONS)))
    show(
        "XLA, reassociation and combiner off", compile_program(lowered, program, "rc", None, dict(gpu.REWRITE_OPTIONS))
    )
    xla_plan = _strategy.xla_default(graph)
    show("the rewriter, XLA's own plan", compile_program(lowered, program, "rw", xla_plan, None))
    floor = _ranking.rewrite_floor_us(graph, xla_plan, costs)
    print(
        f"floor under any rewritten program: {floor:.1f} us against XLA's {xla_us:.1f} us: "
        + ("candidates cannot win, not compiled" if floor >= xla_us else "candidates are compiled and ranked")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
