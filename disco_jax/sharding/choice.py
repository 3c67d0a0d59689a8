"""`weight_update="search"`: which optimizer-state leaves to shard, chosen by the simulator, held
to a per-device memory limit, and measured before it is applied.

The units of the choice are `Layout.groups` (a parameter's optimizer-state leaves, which are
updated together). First the joint search (`search_sharding`) runs on the replicated step's graph
with the `shard_update` move: a strategy shards the update of chosen buckets' gradients, costed as
`cost.sharded` models it (reduce-scatter, 1/N update, all-gather), each gradient's state tied to
the layout's leaves by the entry parameters its update reads (`gradient_leaves`), and under a
memory limit only strategies whose estimated footprint fits are valid. The candidates are then
programs: the replicated step, the step with every group sharded, the search's choice and, under a
memory limit, the step with the largest groups sharded until it fits (`leaf_sets`). Each is lowered
again and captured (`update.relowered`), its per-device footprint read from its compiled
executable, and its XLA plan simulated with the replicated step's cost model: the sharded update's
all-gathers and reduce-scatters go on the communication channel at the measured scatter/gather line
(`_profiling.with_scatter_gather`, stored with the all-reduce fit, so the chosen program's own
profile finds it), its update kernels cost what the estimator says for their 1/N shapes. The
cheapest candidate within the limit wins; a sharded winner is then run against the replicated step
(outputs within tolerance, interleaved timing by the acceptance rule) and kept only when measured
faster, or when the limit leaves no other choice. The decision is stored in the replicated
program's plan (`decision_plan`), which the enact phase reads back (`recall`) to lower the same
program again without searching.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax

from disco_jax import _distributed, _plan, _profiling, _search, _strategy, _validate
from disco_jax._compile import Captured
from disco_jax.cost.allreduce import communication_bytes
from disco_jax.cost.sharded import UpdateRegions, regions_of
from disco_jax.sharding import rules, update

# Memory-analysis fields a program's per-device footprint adds up (aliased bytes counted once).
FOOTPRINT = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes")


def footprint(figures: dict) -> int | None:
    """Per-device bytes an executable needs (arguments + outputs + temporaries - aliased), from
    `update.memory`'s figures; None where the backend reports no memory analysis."""
    if not all(f in figures for f in FOOTPRINT):
        return None
    return sum(figures[f] for f in FOOTPRINT) - figures.get("alias_size_in_bytes", 0)


def leaf_sets(layout: update.Layout, held: dict, memory_limit: int | None, replicated_bytes: int | None) -> list:
    """The candidates' sharded leaves: none, all and, under a limit the replicated program
    exceeds, the largest groups (by state bytes) until the bytes they save would bring it within."""
    groups = sorted(layout.groups, key=lambda g: -layout.subset(g).state_bytes(held))
    sets = [(), tuple(i for g in groups for i in g)]
    if memory_limit is not None and replicated_bytes is not None and replicated_bytes > memory_limit:
        saved, chosen = 0, []
        for g in groups[:-1]:
            chosen += g
            saved += layout.subset(g).state_bytes(held) * (layout.num_shards - 1)
            if replicated_bytes - saved <= memory_limit:
                sets.insert(1, tuple(chosen))
                break
    return sets


def gradient_leaves(graph, layout: update.Layout, held: dict) -> dict[int, tuple[int, ...]]:
    """Per gradient of `graph` whose update can be sharded, the layout's input leaves it shards:
    the groups holding the entry parameters its update's state is (`UpdateRegions.state`;
    parameter number = leaf index, which `held`, index -> aval, vouches for: `update.held_leaves`
    is empty when XLA dropped an argument)."""
    regions = regions_of(graph)
    out = {}
    for g in regions.shardable:
        numbers = set()
        for o in regions.state[g]:
            inst = graph.ops[o].inst
            number = int(inst.literal) if (inst.literal or "").strip().isdigit() else -1
            if number not in layout.inputs or tuple(held[number].shape) != inst.outputs[0].dims:
                break
            numbers.add(number)
        else:
            leaves = sorted({i for group in layout.groups if numbers.intersection(group) for i in group})
            if leaves:
                out[g] = tuple(leaves)
    return out


class _WithinLimit:
    """The search's cost with strategies whose estimated footprint exceeds the limit invalid."""

    def __init__(self, cost, regions: UpdateRegions, replicated_bytes: int, limit: int):
        self.cost, self.regions, self.excess = cost, regions, replicated_bytes - limit

    def fits(self, s: _strategy.Strategy) -> bool:
        return self.regions.saved_bytes(s.sharded) >= self.excess

    def __call__(self, s: _strategy.Strategy) -> float | None:
        return self.cost(s) if self.fits(s) else None

    def many(self, strategies, parent=None) -> list[float | None]:
        kept = [s for s in strategies if self.fits(s)]
        costs = iter(self.cost.many(kept, parent=parent) if kept else [])
        return [next(costs) if self.fits(s) else None for s in strategies]


def search_sharding(step: Captured, model, leaves_of: dict, limit: int | None, replicated_bytes: int | None, config):
    """The joint search on the replicated graph with the `shard_update` move over the gradients
    in `leaves_of`; returns (the leaves its best strategy shards, what the plan records)."""
    graph, regions = step.graph, regions_of(step.graph)
    shardable = frozenset(leaves_of)
    starts = [*_strategy.start_candidates(graph), _strategy.sharding_all(_strategy.xla_default(graph), shardable)]
    cost = model.evaluator(graph)
    if (
        limit is not None
        and replicated_bytes is not None
        and regions.saved_bytes(shardable) >= replicated_bytes - limit
    ):
        cost = _WithinLimit(cost, regions, replicated_bytes, limit)
    result = _search.backtracking_search(graph, cost, config, moves=_strategy.with_sharding(shardable), starts=starts)
    chosen = result.best.sharded
    leaves = tuple(sorted({i for g in chosen for i in leaves_of[g]}))
    info = {
        "sharded_gradients": len(chosen),
        "shardable_gradients": len(shardable),
        "simulated_us": result.best_cost,
        "evaluated": result.evaluated,
        "seconds": round(result.seconds, 2),
    }
    return leaves, info


@dataclasses.dataclass
class Candidate:
    leaves: tuple[int, ...]
    step: Captured
    layout: update.Layout | None
    memory: dict
    simulated_us: float | None = None

    @property
    def label(self) -> str:
        if self.layout is None:
            return "replicated"
        return f"sharded ({len(self.layout.groups)} groups, {len(self.leaves)} leaves)"

    def to_json(self, full: update.Layout, held: dict, limit: int | None) -> dict:
        """What the plan records of it; `full`: the layout with every shardable leaf."""
        size = footprint(self.memory)
        state = full.state_bytes(held) * full.num_shards
        if self.layout is not None:
            state -= self.layout.state_bytes(held) * (full.num_shards - 1)
        return {
            "label": self.label,
            "leaves": [] if self.layout is None else sorted(self.layout.paths.values()),
            "state_bytes_per_device": state,
            "params_and_state_bytes_per_device": self.memory.get("params_and_state_bytes_per_device"),
            "footprint_bytes": size,
            "within_limit": None if limit is None or size is None else size <= limit,
            "simulated_us": self.simulated_us,
            "collectives": update.collectives(self.step.default_compiled.as_text()),
            "comm_bytes_per_device": communication_bytes(self.step.graph, full.num_shards)["total"],
        }


def choose(
    fn, step: Captured, args: tuple, kwargs: dict, backend, costs, memory_limit: int | None, pairs: int, ui, config
):
    """(program, its `Layout` or None, what the plan records) for `weight_update="search"`.
    `costs`: the replicated step's cost model and the profile database (`_pipeline.profiled`);
    `config`: the search's `SearchConfig` (a quarter of its budget goes to `search_sharding`)."""
    info: dict[str, Any] = {"requested": "search", "memory_limit_bytes": memory_limit}
    input_shardings = jax.tree.leaves(step.default_compiled.input_shardings)
    layout, reason = update.find_layout(fn, args, kwargs, step.args, step.kwargs, input_shardings)
    if layout is not None:
        try:
            info["rules"] = {name: str(rules.require(name)) for name in update.JUSTIFYING_RULES}
        except rules.RuleNotProven as e:
            layout, reason = None, f"the rule it rests on is not proven here ({e})"
    held = update.held_leaves(step)
    replicated = Candidate((), step, None, update.memory(step.default_compiled, held))
    if layout is None:
        return step, None, {**info, "mode": "replicated", "reason": reason, **_limit_check(replicated, memory_limit)}
    cost_model, database = costs
    allreduce = _profiling.with_scatter_gather(cost_model.allreduce, step, database, ui)
    model = dataclasses.replace(cost_model, allreduce=allreduce)
    info["scatter_gather"] = {"per_byte_us": allreduce.scatter_gather[0], "latency_us": allreduce.scatter_gather[1]}
    sets = leaf_sets(layout, held, memory_limit, footprint(replicated.memory))
    leaves_of = gradient_leaves(step.graph, layout, held)
    if leaves_of:
        ui.say(f"weight update: searching which of {len(leaves_of)} gradients' updates to shard")
        budget = dataclasses.replace(config, budget_s=max(1.0, config.budget_s / 4))
        searched, info["search"] = search_sharding(
            step, model, leaves_of, memory_limit, footprint(replicated.memory), budget
        )
        if step.scope is not None:  # process 0's, so that every process compiles the same programs
            searched = tuple(_distributed.broadcast_json(f"{step.scope}/weight-update-search", list(searched)))
        if searched and set(searched) not in map(set, sets):
            sets.insert(1, searched)
    candidates = [replicated]
    for leaves in sets[1:]:
        sub = layout.subset(leaves)
        program = update.relowered(fn, step, sub, args, kwargs, backend)
        candidates.append(Candidate(leaves, program, sub, update.memory(program.default_compiled, held)))
    ui.say(f"weight update: simulating {len(candidates)} candidates (replicated, sharded over {layout.axis!r})")
    for c in candidates:
        simulated = model.simulate(c.step.graph, _strategy.xla_default(c.step.graph))
        c.simulated_us = None if simulated is None else simulated.iteration_us
    fits = [c for c in candidates if memory_limit is None or (footprint(c.memory) or 0) <= memory_limit]
    forced = memory_limit is not None and replicated not in fits
    if not fits:
        warnings.warn(
            f"disco-jax: no weight update fits the memory limit of {memory_limit} bytes per device; "
            "using the one that needs least",
            UserWarning,
            stacklevel=6,
        )
        fits = [min(candidates, key=lambda c: footprint(c.memory) or 0)]
    best = min(fits, key=lambda c: (c.simulated_us is None, c.simulated_us or 0.0))
    if step.scope is not None:  # process 0's choice, so that every process runs the same program
        best = candidates[_distributed.broadcast_json(f"{step.scope}/weight-update", candidates.index(best))]
    info["candidates"] = [c.to_json(layout, held, memory_limit) for c in candidates]
    if best is replicated:
        reason = "the replicated update simulates fastest" + (" within the memory limit" if memory_limit else "")
        return step, None, {**info, "mode": "replicated", "reason": reason}
    comparison = update.check_outputs(step, best.step)
    info["check"] = dataclasses.asdict(comparison)
    if not comparison.within_tolerance:
        reason = f"the sharded update's outputs differ: {comparison.summary()}"
        return step, None, {**info, "mode": "replicated", "reason": reason}
    timing = _validate.time_until_decided(
        step.runner(step.default_compiled),
        best.step.runner(best.step.default_compiled),
        looks=(pairs, 2 * pairs, 4 * pairs),
        merge=None if step.scope is None else _distributed.slowest_pairs(f"{step.scope}/weight-update-timing"),
    )
    info["measured"] = timing.to_json()
    ratio = f"measured {timing.ratio:.3f}x the replicated step time ({timing.verdict})"
    if not timing.faster and not forced:
        return step, None, {**info, "mode": "replicated", "reason": f"the sharded update simulates faster, {ratio}"}
    why = "the only candidate within the memory limit" if forced else "faster with confidence"
    info.update(
        best.layout.to_json(),
        mode="sharded",
        forced=forced,
        reason=f"{best.label}: {why}, {ratio}",
        program=best.step.graph.fingerprint,
    )
    return best.step, best.layout, info


def _limit_check(candidate: Candidate, limit: int | None) -> dict:
    size = footprint(candidate.memory)
    if limit is not None and size is not None and size > limit:
        warnings.warn(
            f"disco-jax: the step needs {size} bytes per device, over the memory limit of {limit}, and "
            "has no optimizer state to shard",
            UserWarning,
            stacklevel=6,
        )
    return {"footprint_bytes": size}


def decision_plan(step: Captured, info: dict) -> _plan.Plan:
    """The replicated program's plan when the search sharded its update: no fusion plan of its
    own (the sharded program's plan has it), the decision in `weight_update`."""
    graph = step.graph
    reason = f"weight update sharded: the plan is program {info['program']}'s"
    return _plan.Plan(graph.fingerprint, graph.module.name, step.machine, True, None, reason, weight_update=info)


def recall(
    fn, step: Captured, args: tuple, kwargs: dict, backend, plan_dir: str | None, memory_limit: int | None = None
):
    """The enact phase's side of `choose`: (program, layout or None, info) as the stored decision
    for this program says, without searching; the replicated program when there is none. A decision
    made under another `memory_limit` is made again from the candidates it recorded (`rechoose`)."""
    plan, _ = _plan.find_plan(step.graph.fingerprint, step.machine, plan_dir)
    if step.scope is not None:
        plan = _plan.shared_plan(f"{step.scope}/weight-update", plan)
    decided = (plan.weight_update or {}) if plan is not None else {}
    if decided.get("candidates") and decided.get("memory_limit_bytes") != memory_limit:
        decided = rechoose(decided, memory_limit)
    if decided.get("mode") != "sharded":
        return step, None, {"mode": "replicated", "requested": "search", "reason": decided.get("reason")}
    input_shardings = jax.tree.leaves(step.default_compiled.input_shardings)
    layout, reason = update.find_layout(fn, args, kwargs, step.args, step.kwargs, input_shardings)
    by_path = {} if layout is None else {path: i for i, path in layout.paths.items()}
    wanted = list(decided.get("leaves", {}))
    if layout is None or any(path not in by_path for path in wanted):
        warnings.warn(
            "disco-jax: the stored weight-update decision names optimizer-state leaves this step does not "
            f"have ({reason}); running the replicated update",
            _plan.PlanWarning,
            stacklevel=6,
        )
        return step, None, {"mode": "replicated", "requested": "search", "reason": "stored decision does not fit"}
    layout = layout.subset(by_path[path] for path in wanted)
    return update.relowered(fn, step, layout, args, kwargs, backend), layout, {**decided, **layout.to_json()}


def rechoose(decided: dict, limit: int | None) -> dict:
    """A stored decision made under another memory limit, made again for `limit` from the candidates
    it recorded (footprints, simulated times), measuring nothing: the stored choice where it fits
    and was not only forced by the old limit; else the replicated update where it fits; else the
    fastest simulated candidate that fits, or the smallest when none does. Warns when the choice
    changes; running once with ENABLE_SEARCH=1 chooses with measurements."""
    candidates, old = decided["candidates"], decided.get("memory_limit_bytes")
    fits = lambda c: limit is None or (c.get("footprint_bytes") or 0) <= limit  # noqa: E731
    stored = sorted(decided.get("leaves", {})) if decided.get("mode") == "sharded" else []
    chosen = next((c for c in candidates if c["leaves"] == stored), None)
    if chosen is not None and fits(chosen) and not (stored and decided.get("forced")):
        return {**decided, "memory_limit_bytes": limit, "stored_memory_limit_bytes": old}
    fitting = [c for c in candidates if fits(c)]
    replicated = next((c for c in fitting if not c["leaves"]), None)
    if replicated is not None:
        chosen = replicated
    elif fitting:
        chosen = min(fitting, key=lambda c: float("inf") if c.get("simulated_us") is None else c["simulated_us"])
    else:
        chosen = min(candidates, key=lambda c: c.get("footprint_bytes") or 0)
    reason = (
        f"{chosen['label']}: chosen again from the recorded candidates for a memory limit of {limit} bytes "
        f"per device (the stored decision, {decided.get('mode')}, was made for {old})"
        + ("" if fits(chosen) else "; none fits, the smallest")
    )
    warnings.warn(
        f"disco-jax: {reason}; run once with ENABLE_SEARCH=1 to choose with measurements",
        _plan.PlanWarning,
        stacklevel=7,
    )
    leaves = {path: True for path in chosen["leaves"]}
    return {
        "mode": "sharded" if leaves else "replicated",
        "leaves": leaves,
        "forced": bool(leaves) and replicated is None,
        "reason": reason,
        "candidates": candidates,
        "memory_limit_bytes": limit,
        "stored_memory_limit_bytes": old,
    }
