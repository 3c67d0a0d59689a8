"""Plans for a GPU cluster one does not have: searched deviceless, measured on the first real run.

`plan_for_target(step, *args)` takes a jitted step and abstract arguments whose shardings lie on
compile-only GPU devices (`disco_jax.targets.mesh("h100-sxm", 8)`), and on a machine without a
GPU:

1. compiles the step with XLA:GPU for those devices, capturing its module at the GPU backend's
   hook stage and XLA:GPU's own fusion and combining (`_compile.capture_graph`);
2. searches a plan on the simulator with the cluster's cost models (`disco_jax.eval.clusters`:
   the GPU's roofline, NVLink ring all-reduce; `cluster=` for another topology);
3. compiles the search's best few distinct candidates through the GPU rewriter and XLA's own
   program, and ranks them by the compiled-program model (`_ranking.rank_by_compiled_cost`:
   each program's own kernels in XLA's schedule): the cheapest compiled candidate that keeps its
   planned all-reduces is the plan, and only where it beats XLA's program compiled;
4. stores it in the plan directory under the key the decorator looks it up by on the real
   machine (the module's fingerprint; backend, device kind and count, processes, versions),
   with no measurement: `Plan.measured` is empty and `Plan.search["offline"]` says where it
   came from. The decorator's enact phase measures such a plan against XLA's step on its first
   run and keeps it only when it is faster (README "Never slower"), storing the verdict.

The plan records both figures: the graph simulator's (what proposed it) and the compiled
program's (what chose it). It is only as good as those models' costs for the target (no GPU
kernel profile on this machine), which is why it is never applied unmeasured.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import jax

from disco_jax import _plan, _search, _strategy, backends
from disco_jax._compile import Programs, capture_graph
from disco_jax._profile_db import device_kind_key
from disco_jax._ranking import RANKED_CANDIDATES, XLA_PROGRAM, rank_by_compiled_cost
from disco_jax.cost import ChainEstimator, simulate


def _devices_of(args: tuple, kwargs: dict) -> list:
    for leaf in jax.tree.leaves((args, kwargs)):
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None and hasattr(sharding, "mesh"):
            return list(sharding.mesh.devices.flat)
    raise ValueError(
        "plan_for_target needs arguments sharded over compile-only GPU devices, e.g. "
        "jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(disco_jax.targets.mesh('h100-sxm', 8), P()))"
    )


def _target_of(device_kind: str) -> str:
    """The shipped target whose config names this device kind (its `device_description_str`)."""
    from disco_jax import targets

    for name in targets.TARGETS:
        if f'device_description_str: "{device_kind}"' in targets.target_config(name):
            return name
    raise ValueError(f"no shipped GPU target has device kind {device_kind!r}; pass cluster=")


def plan_for_target(
    step: Callable,
    *args,
    cluster=None,
    plan_dir: str | os.PathLike | None = None,
    config: _search.SearchConfig | None = None,
    processes: int = 1,
    **kwargs,
) -> _plan.Plan:
    """Search, check and store a plan for the GPUs `args` are sharded over (see the module
    docstring). `step`: a jitted function (or an `OptimizedStep`); `args`/`kwargs`: its arguments
    as `jax.ShapeDtypeStruct`s with shardings on a `disco_jax.targets.mesh`. `cluster`: a
    `disco_jax.eval.clusters.Cluster` (default: one node of those GPUs over NVLink,
    `clusters.node_of`). `processes`: how many processes the real job runs (part of the plan's
    key). Returns the stored plan."""
    from disco_jax.eval import clusters

    if not hasattr(step, "lower"):
        raise TypeError(f"plan_for_target expects a jitted function, got {step!r}")
    devices = _devices_of(args, kwargs)
    if backends.for_platform(devices[0].platform) is not backends.GPU:
        raise ValueError(f"plan_for_target plans for GPU targets; the arguments are on {devices[0].platform!r}")
    if cluster is None:
        cluster = clusters.node_of(_target_of(devices[0].device_kind), len(devices))
    elif cluster.num_devices != len(devices):  # the module's replica groups are the job's
        raise ValueError(f"cluster {cluster.name} has {cluster.num_devices} GPUs, the step's mesh {len(devices)}")
    config = config or _search.SearchConfig()
    lowered = step.lower(*args, **kwargs)
    graph, _ = capture_graph(lowered, backends.GPU)
    estimator, allreduce = ChainEstimator([cluster.kernel_estimator()]), cluster.allreduce_model()

    def cost(s: _strategy.Strategy) -> float | None:
        result = simulate(graph, s, estimator, allreduce)
        return None if result is None else result.iteration_us

    default = _strategy.xla_default(graph)
    default_us = cost(default)
    if default_us is None:
        raise ValueError("XLA:GPU's own plan, as read onto the graph, is not a valid strategy")
    result = _search.backtracking_search(graph, cost, config, starts=[default, *_strategy.start_candidates(graph)])
    programs = Programs(lowered, graph)
    ranked = rank_by_compiled_cost(
        programs.compile(XLA_PROGRAM, None, {}),  # what runs without a plan
        result.top(RANKED_CANDIDATES, exclude={default.key()}),
        lambda label, s: programs.compile(label, s, None),
        backends.GPU,
        estimator,
        allreduce,
        default_graph_us=default_us,
    )
    # A plan whose compiled program lost its planned all-reduces is one the decorator rejects.
    kept = lambda r: r.strategy is None or r.program.stats["all-reduce"] == len(r.strategy.buckets)  # noqa: E731
    chosen = next(r for r in ranked if r.cost is not None and kept(r))
    xla = next(r for r in ranked if r.strategy is None)
    use_default = chosen.strategy is None
    best = default if use_default else chosen.strategy
    if use_default:
        reason = (
            f"searched deviceless for {cluster.name}: no candidate's compiled program costs less than XLA's "
            f"({xla.compiled_us:.1f} us compiled; the search's best {result.best_cost:.1f} us on the graph, "
            f"XLA's plan {default_us:.1f} us)"
        )
    else:
        reason = (
            f"searched deviceless for {cluster.name}: {chosen.label} compiles to {chosen.compiled_us:.1f} us "
            f"against XLA's {xla.compiled_us:.1f} us; not measured yet: measured against XLA's step on its first run"
        )
    figures = lambda r: {"iteration_us": r.graph_us, "compiled_us": r.compiled_us}  # noqa: E731
    plan = _plan.Plan(
        fingerprint=graph.fingerprint,
        module_name=graph.module.name,
        # As `MachineKey.current` reads it on the real machine: JAX's name of the devices' backend.
        machine=_plan.MachineKey(devices[0].platform, device_kind_key(devices[0]), len(devices), processes),
        use_default=use_default,
        strategy=None if use_default else best.to_json(graph),
        reason=reason,
        # iteration_us: the graph simulator's figure; compiled_us: the compiled-program model's.
        simulated={"default": figures(xla), "plan": figures(chosen)},
        measured={},
        search={
            **result.stats(),
            "offline": {
                "cluster": cluster.to_json(),
                "plan_counts": chosen.program.stats,
                "chosen": chosen.label,
                "ranked": [r.to_json() for r in ranked],
            },
            "config": {k: v for k, v in dataclasses.asdict(config).items() if isinstance(v, int | float | str)},
        },
    )
    _plan.save_plan(plan, plan_dir)
    return plan
