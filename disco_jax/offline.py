"""Plans for a GPU cluster one does not have: searched deviceless, measured on the first real run.

`plan_for_target(step, *args)` takes a jitted step and abstract arguments whose shardings lie on
compile-only GPU devices (`disco_jax.targets.mesh("h100-sxm", 8)`), and on a machine without a
GPU:

1. compiles the step with XLA:GPU for those devices, capturing its module at the GPU backend's
   hook stage and XLA:GPU's own fusion and combining (`_compile.capture_program`);
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
import time
from collections.abc import Callable
from typing import Any

import jax

from disco_jax import _plan, _search, _strategy, backends, schedule_options
from disco_jax._compile import CompiledProgram, Programs, capture_program, compile_program
from disco_jax._profile_db import device_kind_key
from disco_jax._program import Program
from disco_jax._ranking import RANKED_CANDIDATES, XLA_PROGRAM, ProgramCosts, rank_by_compiled_cost, rewrite_floor_us
from disco_jax.cost import ChainEstimator, simulate
from disco_jax.cost.compiled import CompiledCost
from disco_jax.sharding import choice, params, remat, update


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


# ------------------------------------------------------------------ the weight update, by memory

REPLICATED = "replicated"
STATE_SHARDED = "optimizer state sharded"  # ZeRO-1
ALL_SHARDED = "parameters and state sharded"  # ZeRO-3 / FSDP: all-gathered before use
REGATHERED = "parameters and state sharded, gathered again for each use"  # FSDP, reshard after forward
AT_USE = "parameters and state sharded, gathered where used"  # FSDP as users write it (NamedSharding only)
AT_USE_SPLIT = f"{AT_USE}, loop state split over the batch"  # and the scans' per-example carries on the data axis
# And the loops' residuals recomputed in the backward loops (`sharding.remat`), per policy.
AT_USE_REMAT = {policy: f"{AT_USE_SPLIT}, loops rematerialized ({policy})" for policy in remat.POLICIES}
SPLIT = "parameters and state sharded, split over several dimensions"  # where no one dimension divides
WHOLE_LAYERS = "parameters and state sharded, whole layers per device"  # stacked leaves split on the layer axis


def _sharded_update(
    parameters: bool,
    regather: bool = False,
    split: bool = False,
    whole_layers: bool = False,
    at_use: bool = False,
    split_carries: bool = False,
    remat: str = "",
) -> Callable:
    """A builder of the step lowered again with every optimizer-state group sharded over the data
    axis (`sharding.update`), and with `parameters` their parameters too (`sharding.params`),
    gathered again for each use with `regather` (`sharding.regather`, applied at the hook), with
    `split` the leaves no dimension of which the axis divides split over several (only where
    there are such leaves: `find_layout(split=True)`), with `whole_layers` a scanned step's
    stacked leaves split on their layer axis (only where there are such leaves), with `at_use`
    the parameters left sharded inside the step (`Layout.at_use`: XLA gathers each where used),
    each leaf split on its largest dimension the axis divides, as FSDP guides write it, and with
    `split_carries` (at use, a scanned step only) the loops' per-example carries constrained to the
    data axis (`Layout.split_carries`: XLA's partitioner otherwise may split them on features and
    gather activations in every iteration; docs/scanned-layers.md), and with `remat` (a policy of
    `sharding.remat`) the loops' residuals recomputed in the backward loops."""

    def build(step, args: tuple, kwargs: dict, replicated_compiled) -> tuple:
        """(lowered, layout, why) of the sharded step; (None, None, why not) where it does not apply."""
        shardings = jax.tree.leaves(replicated_compiled.input_shardings)
        layout, reason = update.find_layout(
            step, args, kwargs, args, kwargs, shardings, split=split, whole_layers=whole_layers, largest=at_use
        )
        if layout is None:
            return None, None, reason
        if parameters and not layout.parameters:
            return None, None, "no parameter is updated from its own optimizer state only"
        if at_use and params.explicit_axes(layout.mesh):
            return None, None, "the mesh's axes are Explicit: parameters cannot enter the user's function sharded"
        if split and layout.step_mesh is layout.mesh:
            return (
                None,
                None,
                "no leaf is split over several dimensions (none needs it, or the mesh's axes are Explicit)",
            )
        if split_carries and not layout.stacked:
            return None, None, "no scanned loop reads a stacked leaf"
        layout = layout.subset(
            layout.all_leaves(parameters=parameters),
            regather=regather,
            at_use=at_use,
            split_carries=split_carries,
            remat=remat,
        )
        return update.relower(step, layout, args, kwargs, (args, kwargs), replicated_compiled)[0], layout, reason

    return build


# The sharded weight updates a memory limit chooses from, besides the replicated one: label ->
# builder(step, args, kwargs, replicated step's executable) -> (lowered or None, layout, why).
SHARDED_UPDATES: dict[str, Callable] = {
    STATE_SHARDED: _sharded_update(parameters=False),
    ALL_SHARDED: _sharded_update(parameters=True),
    REGATHERED: _sharded_update(parameters=True, regather=True),
    AT_USE: _sharded_update(parameters=True, at_use=True),
    AT_USE_SPLIT: _sharded_update(parameters=True, at_use=True, split_carries=True),
    **{
        label: _sharded_update(parameters=True, at_use=True, split_carries=True, remat=policy)
        for policy, label in AT_USE_REMAT.items()
    },
    SPLIT: _sharded_update(parameters=True, split=True),
    # A scanned step's stacks split on their layer axis: gathered whole around the loops, no
    # resharding of the loop bodies' activations (docs/sharded-update.md, "Stacked parameters").
    WHOLE_LAYERS: _sharded_update(parameters=True, whole_layers=True),
}


@dataclasses.dataclass
class UpdateCandidate:
    """One weight update of the step as XLA:GPU compiles it for the target: its lowered program,
    the layout of what it shards (None: replicated), XLA's own program of it (`xla`, every pass
    on: what runs without a fusion plan), its per-device memory (`update.memory`: XLA's memory
    analysis and the bytes of parameters and state held) and its compiled-program cost. `program`:
    its module at the hook stage (`_program.Program`), captured only where it is needed (the chosen program's search,
    the replicated program's fingerprint)."""

    label: str
    lowered: Any
    layout: Any
    xla: CompiledProgram | None = None
    memory: dict = dataclasses.field(default_factory=dict)
    cost: CompiledCost | None = None
    program: Program | None = None
    why_not: str | None = None  # where the update does not apply to this step

    @property
    def peak_bytes(self) -> int | None:
        """Per-device bytes of the executable: arguments + outputs + temporaries - aliased."""
        return choice.footprint(self.memory)

    def captured(self) -> UpdateCandidate:
        if self.program is None:
            self.program, _ = capture_program(self.lowered, update.hook_backend(backends.GPU, self.layout))
        return self

    def layout_json(self) -> dict:
        return {} if self.layout is None else self.layout.to_json()

    def to_json(self, limit: int | None) -> dict:
        """The record the plan keeps: label, leaves and footprint_bytes as the decorator's records
        name them, with the compiled cost; no `measured` (nothing ran on the devices), so the
        decorator's `choice.rechoose` under another memory limit does not pick it."""
        peak = self.peak_bytes
        return {
            "label": self.label,
            "leaves": [] if self.layout is None else sorted(self.layout.paths.values()),
            "footprint_bytes": peak,
            "within_limit": None if limit is None or peak is None else peak <= limit,
            "memory": self.memory,
            "compiled_us": None if self.cost is None else self.cost.iteration_us,
            "compiled_cost": None if self.cost is None else self.cost.to_json(),
            "collectives": None if self.xla is None else update.collectives(self.xla.text),
            "program": None if self.xla is None else schedule_options.program_fingerprint(self.xla.text),
            "compile_s": None if self.xla is None else round(self.xla.compile_s, 2),
            "why_not": self.why_not,
        }


def weight_update_candidates(step, args: tuple, kwargs: dict, costs: ProgramCosts | None = None) -> list:
    """The step's weight updates (the replicated one first, then `SHARDED_UPDATES`), each
    lowered and compiled by XLA:GPU for the target, with its memory and, given `costs`, its
    compiled-program cost. An update that does not apply to the step is kept with `why_not`."""
    replicated = UpdateCandidate(REPLICATED, step.lower(*args, **kwargs), None)
    replicated.xla = _compiled_xla(replicated.lowered, None)
    if replicated.xla.compiled is None:
        raise ValueError(f"XLA:GPU could not compile the step for the target: {replicated.xla.reason}")
    candidates = [replicated]
    for label, build in SHARDED_UPDATES.items():
        lowered, layout, why = build(step, args, kwargs, replicated.xla.compiled)
        candidates.append(UpdateCandidate(label, lowered, layout, why_not=None if lowered is not None else why))
    # The leaves the replicated step holds whole on every device: parameters and optimizer state.
    held = update.replicated_leaves(replicated.xla.compiled, args, kwargs)
    for c in candidates:
        if c.lowered is None:
            continue
        if c.xla is None:
            c.xla = _compiled_xla(c.lowered, c.layout)
        if c.xla.compiled is None:
            c.why_not, c.xla = c.xla.reason, None
            continue
        c.memory = update.memory(c.xla.compiled, held)
        c.cost = None if costs is None else costs(c.xla)
    return candidates


def _compiled_xla(lowered, layout) -> CompiledProgram:
    """XLA's own program of `lowered` (every pass on) with XLA:GPU's hook rules for `layout`
    (`update.hook_backend`), as the decorator captures it on the real machine: what runs
    without a fusion plan."""
    return compile_program(
        lowered, None, XLA_PROGRAM, None, {}, hook_rules_of=update.hook_backend(backends.GPU, layout)
    )


def _peak(compiled) -> int | None:
    """Per-device bytes of an executable (None where it has none or no memory analysis)."""
    return None if compiled is None else choice.footprint(update.memory(compiled, {}))


def program_costs(cluster) -> ProgramCosts:
    """The compiled-program model on `cluster`'s costs (its kernel estimator, its collectives, its host lane):
    how offline plans cost every program they compile."""
    return ProgramCosts(
        backends.GPU,
        ChainEstimator([cluster.kernel_estimator()]),
        cluster.allreduce_model(),
        cluster.simulator_params(),
    )


class NothingFits(ValueError):
    """No weight update of the step fits the memory limit (the message names the smallest)."""


def choose_weight_update(candidates: list[UpdateCandidate], limit: int | None) -> dict:
    """The cheapest candidate (compiled-program cost) whose per-device peak is within `limit`
    (None: every one fits), as the record the plan keeps (`weight_update`; a candidate that
    compiled to the program of one before it says so, `same_program_as`); `NothingFits` when
    none is within the limit."""
    built = [c for c in candidates if c.xla is not None]
    fits = [c for c in built if limit is None or (c.peak_bytes is not None and c.peak_bytes <= limit)]
    if not fits:
        smallest = min(built, key=lambda c: c.peak_bytes or 0)
        raise NothingFits(
            f"no weight update fits {limit} bytes per device: the smallest peak is {smallest.label}'s, "
            f"{smallest.peak_bytes} bytes ({', '.join(f'{c.label} {c.peak_bytes}' for c in built)})"
        )
    chosen = min(fits, key=lambda c: (c.cost is None, c.cost.iteration_us if c.cost else 0.0))
    others = [c.label for c in built if c not in fits]
    reason = (
        f"{chosen.label}: peak {chosen.peak_bytes} bytes per device"
        + (" (no memory limit)" if limit is None else f" within {limit}")
        + (f", the cheapest compiled that fits ({chosen.cost.iteration_us:.0f} us)" if chosen.cost else "")
        + (f"; over the limit: {', '.join(others)}" if others else "")
    )
    return {
        "requested": "search",
        "mode": "replicated" if chosen.layout is None else "sharded",
        "chosen": chosen.label,
        "forced": chosen.layout is not None and not any(c.layout is None for c in fits),
        "reason": f"chosen deviceless, by XLA's memory analysis and the compiled-program model: {reason}",
        "memory_limit_bytes": limit,
        "candidates": _same_programs([c.to_json(limit) for c in candidates]),
    }


def _same_programs(records: list[dict]) -> list[dict]:
    """`records` with `same_program_as`: the label of the first record whose compiled program is
    this one's (None where it is the first), so that two updates compiled alike read as one."""
    first: dict[str, str] = {}
    for r in records:
        r["same_program_as"] = None if r["program"] is None else first.setdefault(r["program"], r["label"])
        if r["same_program_as"] == r["label"]:
            r["same_program_as"] = None
    return records


def plan_for_target(
    step: Callable,
    *args,
    cluster=None,
    plan_dir: str | os.PathLike | None = None,
    config: _search.SearchConfig | None = None,
    processes: int = 1,
    memory_limit_bytes: int | None = None,
    ranked: int = RANKED_CANDIDATES,
    weight_updates: list[UpdateCandidate] | None = None,
    layouts: bool = False,
    schedule: bool = True,
    schedule_dims: list | None = None,
    weight_update: bool = False,
    **kwargs,
) -> _plan.Plan:
    """Search, check and store a plan for the GPUs `args` are sharded over (see the module
    docstring). `step`: a jitted function (or an `OptimizedStep`); `args`/`kwargs`: its arguments
    as `jax.ShapeDtypeStruct`s with shardings on a `disco_jax.targets.mesh`. `cluster`: a
    `disco_jax.eval.clusters.Cluster` (default: one node of those GPUs over NVLink,
    `clusters.node_of`). `processes`: how many processes the real job runs (part of the plan's
    key). `memory_limit_bytes`: per device; the weight update is then chosen first
    (`choose_weight_update`) and the plan is the chosen program's. `weight_update`: choose it
    also without a limit (the cheapest update as compiled; a limit always chooses it). `ranked`: how many of the
    search's best candidates are compiled and ranked (each is one compile of the step).
    `layouts`: also search the mesh and per-layer layout (`layout_search`: every data x model
    mesh and choice per layer group compiled and costed, within `memory_limit_bytes`) and record
    it in the plan (`search["offline"]["layout"]`; the decorator does not enact it yet).
    `schedule`: also search XLA:GPU's collective options on the chosen program
    (`schedule_options.search_options`, `schedule_dims` or its default dimensions: about a dozen
    compiles) and take them where they compile cheaper, or fit the limit where the plan does not
    (`schedule_options.apply_to_plan`). Returns the stored plan."""
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
    # As `MachineKey.current` reads it on the real machine: JAX's name of the devices' backend.
    machine = _plan.MachineKey(devices[0].platform, device_kind_key(devices[0]), len(devices), processes)
    costs = program_costs(cluster)
    seconds: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(phase: str) -> None:
        nonlocal clock
        seconds[phase] = round(time.perf_counter() - clock, 2)
        clock = time.perf_counter()

    if memory_limit_bytes is None and not weight_update:
        chosen = UpdateCandidate(REPLICATED, step.lower(*args, **kwargs), None)
        decision = None
    else:
        candidates = weight_updates or weight_update_candidates(step, args, kwargs, costs)
        lap("weight updates compiled and costed")
        try:
            decision = choose_weight_update(candidates, memory_limit_bytes)
        except NothingFits:
            if not schedule:
                raise
            # Another schedule of the smallest may fit where XLA's default one does not.
            decision = schedule_options.smallest_update(candidates, memory_limit_bytes)
        chosen = next(c for c in candidates if c.label == decision["chosen"])
    chosen.captured()
    lap("capture")
    config = config or _search.SearchConfig()
    plan = _fusion_plan(chosen, cluster, machine, costs, config, ranked, memory_limit_bytes)
    lap("search and ranking")
    if schedule:
        options = schedule_options.search_options(
            chosen.lowered,
            costs,
            memory_limit_bytes=memory_limit_bytes,
            hook_rules_of=update.hook_backend(backends.GPU, chosen.layout),
            dims=schedule_dims,
            default=chosen.xla,
        )
        schedule_options.apply_to_plan(plan, options)
        lap("collective options compiled and costed")
        if memory_limit_bytes is not None and not options.chosen.fits(memory_limit_bytes):
            raise NothingFits(f"{decision['reason']}; and {options.reason}")
    if decision is not None:
        plan.weight_update = {**decision, **chosen.layout_json()}
        replicated = candidates[0]
        if chosen is not replicated:  # what the decorator finds first: the replicated program's plan
            info = {**plan.weight_update, "program": chosen.program.graph.fingerprint}
            _plan.save_plan(choice.decision_plan(replicated.captured().program.graph, machine, info), plan_dir)
            lap("replicated program captured (its fingerprint)")
    if layouts:
        from disco_jax import layout_search

        plan.search["offline"]["layout"] = layout_search.offline_layout(step, args, cluster, memory_limit_bytes)
        lap("mesh and layout searched")
    plan.search["offline"]["seconds"] = seconds
    _plan.save_plan(plan, plan_dir)
    return plan


def _fusion_plan(candidate, cluster, machine, costs: ProgramCosts, config, ranked: int, limit) -> _plan.Plan:
    """Steps 2-3 of the module docstring on one program: the search on its graph, its best
    `ranked` candidates and XLA's own program compiled and ranked by the compiled-program model.
    Under a memory `limit` a candidate whose own executable exceeds it is not chosen (a plan
    regroups collectives, which moves buffers' lifetimes)."""
    program, lowered = candidate.program, candidate.lowered
    graph = program.graph

    def cost(s: _strategy.Strategy) -> float | None:
        result = simulate(program, s, costs.estimator, costs.allreduce)
        return None if result is None else result.iteration_us

    default = _strategy.xla_default(graph)
    default_us = cost(default)
    if default_us is None:
        raise ValueError("XLA:GPU's own plan, as read onto the graph, is not a valid strategy")
    result = _search.backtracking_search(program, cost, config, starts=[default, *_strategy.start_candidates(graph)])
    programs = Programs(lowered, program)
    ranked_programs = rank_by_compiled_cost(
        candidate.xla or programs.compile(XLA_PROGRAM, None, {}),  # what runs without a plan
        result.top(ranked, exclude={default.key()}),
        lambda label, s: programs.compile(label, s, None),
        costs,
        default_graph_us=default_us,
        floor_us=lambda s: rewrite_floor_us(graph, s, costs),
    )
    # A plan whose compiled program lost its planned all-reduces is one the decorator rejects.
    kept = lambda r: r.strategy is None or r.program.stats["all-reduce"] == len(r.strategy.buckets)  # noqa: E731
    peak = {id(r): _peak(r.program.compiled) for r in ranked_programs}
    fits = lambda r: limit is None or r.strategy is None or (peak[id(r)] or 0) <= limit  # noqa: E731
    chosen = next(r for r in ranked_programs if r.cost is not None and kept(r) and fits(r))
    xla = next(r for r in ranked_programs if r.strategy is None)
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
    figures = lambda r: {"iteration_us": r.graph_us, "compiled_us": r.compiled_us, "peak_bytes": peak[id(r)]}  # noqa: E731
    return _plan.Plan(
        fingerprint=graph.fingerprint,
        module_name=graph.module.name,
        machine=machine,
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
                "ranked": [{**r.to_json(), "footprint_bytes": peak[id(r)]} for r in ranked_programs],
            },
            "config": {k: v for k, v in dataclasses.asdict(config).items() if isinstance(v, int | float | str)},
        },
    )
