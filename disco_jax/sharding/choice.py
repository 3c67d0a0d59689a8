"""`weight_update="search"`: which optimizer-state leaves to shard, chosen by the simulator, held
to a per-device memory limit, and measured before it is applied.

The units of the choice are `Layout.groups` (a parameter's optimizer-state leaves, which are
updated together). First the joint search (`state_search`) runs on the replicated step's graph
with the `shard_update` move. The candidates are then programs: the replicated step, the step with
every group sharded, the search's choice and, under a memory limit, the step with the largest
groups sharded until it fits (`leaf_sets`); when no state-only candidate fits, state plus the
parameters of the 1, 2, 4, ... largest layers (ZeRO-3, `parameter_candidates`); when none of those
fits either, every leaf sharded, those no dimension of which N divides split over several
(`split_layout`). Each is lowered again and captured (`update.relowered`), its per-device footprint
read from its compiled executable, and its XLA plan simulated with the replicated step's cost
model: the sharded update's all-gathers and reduce-scatters go on the communication channel at the
measured scatter/gather line (`_profile_phase.with_scatter_gather`, stored with the all-reduce fit,
so the chosen program's own profile finds it), its update kernels cost what the estimator says
for their 1/N shapes. Every
sharded candidate the simulator prefers to the replicated update (simulated faster within the
limit; under a limit the replicated program exceeds, every one within it) is then run against
the replicated step: outputs within tolerance, interleaved timing by the acceptance rule
(`measure`); each candidate's record keeps its check and timing. `pick` chooses from what was
measured: the fastest measured faster with confidence, else the replicated update, else (the
limit leaves no other choice) the fastest measured. The decision is stored in the replicated
program's plan (`decision_plan`), which the enact phase reads back (`recall`) to lower the same
program again without searching; under another memory limit it applies `pick` to the recorded
candidates again (`rechoose`), so it never switches to a candidate that was not measured.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

from disco_jax import _distributed, _plan, _profile_phase, _strategy, _validate, _warnings
from disco_jax._compile import Captured
from disco_jax.cost.allreduce import communication_bytes
from disco_jax.sharding import layouts, params, remat, rules, state_search, update

# Memory-analysis fields a program's per-device footprint adds up (aliased bytes counted once).
FOOTPRINT = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes")


def footprint(figures: dict) -> int | None:
    """Per-device bytes an executable needs (arguments + outputs + temporaries - aliased), from
    `update.memory`'s figures; None where the backend reports no memory analysis."""
    if not all(f in figures for f in FOOTPRINT):
        return None
    return sum(figures[f] for f in FOOTPRINT) - figures.get("alias_size_in_bytes", 0)


def executable_peak(compiled: Any) -> int | None:
    """Per-device bytes of a compiled executable (`footprint` of its memory analysis); None where
    there is none."""
    return None if compiled is None else footprint(update.memory(compiled, {}))


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
        if self.layout.gathered:
            return (
                f"parameters and state sharded ({len(self.layout.gathered)} parameters, "
                f"{len(self.layout.groups)} groups, {len(self.leaves)} leaves{self.layout.gathering_label()})"
            )
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
            **{k: self.layout is not None and getattr(self.layout, k) for k in layouts.GATHERING},
            "state_bytes_per_device": state,
            "choices": {} if self.layout is None else self.layout.choices(),
            "params_and_state_bytes_per_device": self.memory.get("params_and_state_bytes_per_device"),
            "footprint_bytes": size,
            "within_limit": None if limit is None or size is None else size <= limit,
            "simulated_us": self.simulated_us,
            "collectives": update.collectives(self.step.default_compiled.as_text()),
            "comm_bytes_per_device": communication_bytes(self.step.program, full.num_shards)["total"],
        }


def choose(
    fn,
    step: Captured,
    args: tuple,
    kwargs: dict,
    backend,
    costs,
    memory_limit: int | None,
    pairs: int,
    ui,
    config,
    beyond=None,
):
    """(program, its `Layout` or None, what the plan records) for `weight_update="search"`.
    `costs`: the replicated step's cost model and the profile database (`_search_phase.Profiled`);
    `config`: the search's `SearchConfig` (a quarter of its budget goes to `search_sharding`).
    `beyond()`: where no candidate fits `memory_limit`, (program, record) of the two-axis plan that
    does (`mesh_plan.choose_for_memory`), returned as mode "mesh" with the record under "layout"."""
    info: dict[str, Any] = {"requested": "search", "memory_limit_bytes": memory_limit}
    input_shardings = jax.tree.leaves(step.default_compiled.input_shardings)
    layout, reason = update.find_layout(fn, args, kwargs, step.args, step.kwargs, input_shardings)
    if layout is not None:
        try:
            info["rules"] = update.cited_rules(layout)
        except rules.RuleNotProven as e:
            layout, reason = None, f"the rule it rests on is not proven here ({e})"
    held = update.held_leaves(step)
    replicated = Candidate((), step, None, update.memory(step.default_compiled, held))
    if layout is None:
        return (
            step,
            None,
            {**info, "mode": "replicated", "reason": reason, **_limit_check(replicated, memory_limit, reason)},
        )
    cost_model, database = costs
    allreduce = _profile_phase.with_scatter_gather(cost_model.allreduce, step, database, ui)
    model = dataclasses.replace(cost_model, allreduce=allreduce)
    info["scatter_gather"] = {"per_byte_us": allreduce.scatter_gather[0], "latency_us": allreduce.scatter_gather[1]}
    sets = leaf_sets(layout, held, memory_limit, footprint(replicated.memory))
    leaves_of = state_search.gradient_leaves(step.graph, layout, held)
    if leaves_of:
        ui.say(f"weight update: searching which of {len(leaves_of)} gradients' updates to shard")
        budget = dataclasses.replace(config, budget_s=max(1.0, config.budget_s / 4))
        searched, info["search"] = state_search.search_sharding(
            step, model, leaves_of, memory_limit, footprint(replicated.memory), budget
        )
        if step.scope is not None:  # process 0's, so that every process compiles the same programs
            searched = tuple(_distributed.broadcast_json(f"{step.scope}/weight-update-search", list(searched)))
        if searched and set(searched) not in map(set, sets):
            sets.insert(1, searched)
    candidates = [replicated]
    for leaves in sets[1:]:
        candidates.append(candidate(fn, step, layout, leaves, args, kwargs, backend, held))
    if memory_limit is not None and not any(within(c, memory_limit) for c in candidates):
        try:  # sharding the state is not enough: the parameters of the largest layers too
            for name in update.PARAMETER_RULES:
                rules.require(name)
        except rules.RuleNotProven as e:
            info["parameters"] = f"not sharded: {e}"
        else:
            ui.say(f"weight update: sharding the state does not fit {memory_limit} bytes; sharding parameters too")
            candidates += parameter_candidates(fn, step, layout, args, kwargs, backend, held, memory_limit)
            wide = None if within(candidates[-1], memory_limit) else split_layout(fn, args, kwargs, step, layout)
            if wide is not None:  # the last resort: leaves no dimension of which N divides, split over several
                ui.say("weight update: still over the limit; splitting leaves over several dimensions too")
                gathering = candidates[-1].layout.gathering()
                candidates.append(
                    candidate(fn, step, wide, wide.all_leaves(), args, kwargs, backend, held, **gathering)
                )
                layout = wide  # the records' account of the state: every leaf that can be sharded
    if memory_limit is not None and beyond is not None and not any(within(c, memory_limit) for c in candidates):
        ui.say(f"weight update: no one-axis candidate fits {memory_limit} bytes per device; trying two-axis plans")
        meshed = beyond()
        if meshed is not None:
            program, record = meshed
            records = [c.to_json(layout, held, memory_limit) for c in candidates]
            reason = record["reason"]
            return program, None, {**info, "mode": "mesh", "candidates": records, "reason": reason, "layout": record}
    ui.say(f"weight update: simulating {len(candidates)} candidates (replicated, sharded over {layout.axis!r})")
    for c in candidates:
        c.simulated_us = simulated_us(model, c.step)
    preferred = preferred_by_simulation(candidates, memory_limit)
    if step.scope is not None:  # process 0's, so that every process measures the same programs
        shared = _distributed.broadcast_json(f"{step.scope}/weight-update", [candidates.index(c) for c in preferred])
        preferred = [candidates[i] for i in shared]
    records = [c.to_json(layout, held, memory_limit) for c in candidates]
    info["candidates"] = records
    if not preferred:
        reason = "the replicated update simulates fastest" + (" within the memory limit" if memory_limit else "")
        return step, None, {**info, "mode": "replicated", "reason": reason}
    for c in preferred:
        i = candidates.index(c)
        simulated = "not simulated" if c.simulated_us is None else f"simulated {c.simulated_us:.0f} us"
        ui.say(f"weight update: measuring {c.label} against the replicated update ({simulated})")
        records[i].update(measure(step, c.step, pairs, f"candidate-{i}"))
    index, why, forced = pick(records, memory_limit)
    if step.scope is not None:  # the verdicts are merged already; process 0's word settles it
        index, why, forced = _distributed.broadcast_json(f"{step.scope}/weight-update-pick", [index, why, forced])
    if index == 0:
        return step, None, {**info, "mode": "replicated", "reason": f"sharded candidates simulate faster; {why}"}
    best = candidates[index]
    info["rules"] = update.cited_rules(best.layout)
    info.update(
        best.layout.to_json(),
        mode="sharded",
        forced=forced,
        reason=f"{best.label}: {why}",
        program=best.step.graph.fingerprint,
    )
    return best.step, best.layout, info


def candidate(
    fn,
    step: Captured,
    layout: update.Layout,
    leaves,
    args,
    kwargs,
    backend,
    held: dict,
    **gathering: bool,
) -> Candidate:
    """The step lowered again with `leaves` sharded, its parameters gathered as `gathering` says
    (`layouts.GATHERING`: again for each use, only where used, each loop's next layer one iteration
    early, the loops' per-example state split over the batch), compiled, its memory read."""
    sub = layout.subset(leaves, **gathering)
    program = update.relowered(fn, step, sub, args, kwargs, backend)
    return Candidate(tuple(leaves), program, sub, update.memory(program.default_compiled, held))


def within(c: Candidate, limit: int | None) -> bool:
    size = footprint(c.memory)
    return limit is None or (size is not None and size <= limit)


def layers_by_size(layout: update.Layout, held: dict) -> list[tuple[int, ...]]:
    """The parameter leaves of each layer (`Layout.layers`) with their groups' state, the
    layers whose parameters hold most bytes first."""
    names, param_of = layout.group_names(), layout.parameter_of
    out = []
    for members in layout.layers().values():
        groups = [names[n] for n in members if names[n] in param_of]
        if groups:
            out.append(tuple(sorted(i for g in groups for i in (*g, param_of[g]))))

    def parameter_bytes(leaves) -> int:
        return sum(held[i].size * held[i].dtype.itemsize for i in leaves if i in layout.parameters and i in held)

    return sorted(out, key=lambda leaves: -parameter_bytes(leaves))


def parameter_candidates(fn, step, layout, args, kwargs, backend, held: dict, limit: int) -> list[Candidate]:
    """Candidates with parameters and state sharded (ZeRO-3), for a limit that sharding every
    group's state does not meet: every group's state plus the parameters of the 1, 2, 4, ...
    largest layers (`layers_by_size`), each compiled and its footprint read, until one fits
    (the last: every parameter sharded); when none fits, every parameter gathered only where it
    is used (`Layout.at_use`: FSDP as users write it, each leaf split on its largest dimension,
    XLA gathers per use and frees after; where that fits, also with each loop's next layer
    prefetched, `sharding.prefetch`; where it does not, with the loops' residuals recomputed,
    `sharding.remat`), then gathered again for each use (`sharding.regather`)."""
    layers = layers_by_size(layout, held)
    state = layout.all_leaves(parameters=False)
    out, k = [], 1
    while layers:
        k = min(k, len(layers))
        leaves = tuple(sorted({*state, *(i for layer in layers[:k] for i in layer)}))
        out.append(candidate(fn, step, layout, leaves, args, kwargs, backend, held))
        if within(out[-1], limit) or k == len(layers):
            break
        k *= 2
    if out and not within(out[-1], limit):
        shardings = jax.tree.leaves(step.default_compiled.input_shardings)
        widest, _ = update.find_layout(fn, args, kwargs, step.args, step.kwargs, shardings, largest=True)
        if widest is not None and not params.explicit_axes(widest.mesh):
            at_use = functools.partial(candidate, fn, step, widest, widest.all_leaves(), args, kwargs, backend, held)
            out.append(at_use(at_use=True))
            if within(out[-1], limit) and widest.stacked:  # loops: their state split, then also rotated
                out += [at_use(at_use=True, split_carries=True), at_use(at_use=True, prefetch=True)]
            for policy in remat.POLICIES if widest.stacked and not within(out[-1], limit) else ():
                out.append(at_use(at_use=True, split_carries=True, remat=policy))  # recomputed in the backward
                if within(out[-1], limit):
                    break
    if out and not any(within(c, limit) for c in out[-2:]):
        leaves = next(c.leaves for c in reversed(out) if not c.layout.at_use)
        out.append(candidate(fn, step, layout, leaves, args, kwargs, backend, held, regather=True))
    return out


def split_layout(fn, args: tuple, kwargs: dict, step: Captured, layout: update.Layout) -> update.Layout | None:
    """The layout with leaves no dimension of which the data axis divides split over several
    (`find_layout(split=True)`), where that shards more leaves than `layout` does; else None."""
    shardings = jax.tree.leaves(step.default_compiled.input_shardings)
    wide, _ = update.find_layout(fn, args, kwargs, step.args, step.kwargs, shardings, split=True)
    return wide if wide is not None and len(wide.all_leaves()) > len(layout.all_leaves()) else None


def simulated_us(model, step: Captured) -> float | None:
    """A candidate program's step time as the replicated step's cost model simulates XLA's plan
    of it (None where the simulation is invalid)."""
    simulated = model.simulate(step.program, _strategy.xla_default(step.graph))
    return None if simulated is None else simulated.iteration_us


def preferred_by_simulation(candidates: list[Candidate], limit: int | None) -> list[Candidate]:
    """The sharded candidates the simulator prefers to the replicated update (`candidates[0]`), in
    simulated order: those within the limit simulated faster than it; every one within the limit
    when it is not within; the one that needs least when none is (with a warning)."""
    replicated, sharded = candidates[0], candidates[1:]
    fits = [c for c in sharded if limit is None or (footprint(c.memory) or 0) <= limit]
    by_time = lambda c: (c.simulated_us is None, c.simulated_us or 0.0)  # noqa: E731
    if limit is None or (footprint(replicated.memory) or 0) <= limit:
        if replicated.simulated_us is None:
            return []
        return sorted(
            (c for c in fits if c.simulated_us is not None and c.simulated_us < replicated.simulated_us), key=by_time
        )
    if not fits:
        smallest = min(sharded, key=lambda c: footprint(c.memory) or 0)
        _warnings.warn(
            f"disco-jax: no weight update fits the memory limit of {limit} bytes per device; the smallest "
            f"per-device peak found is {footprint(smallest.memory)} bytes ({smallest.label}); measuring it",
            UserWarning,
        )
        return [smallest]
    return sorted(fits, key=by_time)


def measure(replicated: Captured, candidate: Captured, pairs: int, name: str) -> dict:
    """What a candidate's record gains from measuring it against the replicated program: its
    outputs' check (validation tolerance, `update.check_outputs`) and, where they pass, its
    timing by the acceptance rule (`time_candidate`). Every process of a job measures; `name`
    keeps this candidate's exchanges apart from the others'."""
    scoped = (
        replicated if replicated.scope is None else dataclasses.replace(replicated, scope=f"{replicated.scope}/{name}")
    )
    comparison = update.check_outputs(scoped, candidate)
    record: dict[str, Any] = {"check": dataclasses.asdict(comparison)}
    if comparison.within_tolerance:
        merge = None if scoped.scope is None else _distributed.slowest_pairs(f"{scoped.scope}/weight-update-timing")
        record["measured"] = time_candidate(replicated, candidate, pairs, merge).to_json()
    return record


def time_candidate(replicated: Captured, candidate: Captured, pairs: int, merge) -> _validate.Timing:
    """A candidate program timed against the replicated one by the acceptance rule
    (`_validate.time_until_decided`, looks at `pairs`, twice and four times that; `merge`: the
    multi-process pair merge, or None)."""
    return _validate.time_until_decided(
        replicated.runner(replicated.default_compiled),
        candidate.runner(candidate.default_compiled),
        looks=(pairs, 2 * pairs, 4 * pairs),
        merge=merge,
    )


def pick(records: list[dict], limit: int | None) -> tuple[int, str, bool]:
    """The choice among recorded candidates (`Candidate.to_json`; the replicated update has no
    leaves), the one rule of `choose` and `rechoose`: only the replicated update and sharded
    candidates measured (outputs within tolerance, timed by the acceptance rule) are eligible, so a
    candidate never measured is never chosen. Within `limit`: the lowest measured ratio among those
    faster with confidence; else the replicated update; else the lowest measured ratio (the limit
    leaves no other choice: forced). When no eligible candidate fits, the one that needs least.
    Returns (index, why, forced)."""
    replicated = next(i for i, c in enumerate(records) if not c["leaves"])
    size = lambda i: records[i].get("footprint_bytes") or 0  # noqa: E731
    ratio = lambda i: records[i]["measured"]["ratio"]  # noqa: E731
    measured = [i for i, c in enumerate(records) if c["leaves"] and c.get("measured")]
    within = [i for i in [replicated, *measured] if limit is None or size(i) <= limit]
    told = lambda i: _told(records[i]["measured"])  # noqa: E731
    faster = [i for i in within if i != replicated and records[i]["measured"]["verdict"] == "faster"]
    if faster:
        best = min(faster, key=ratio)
        return best, f"faster with confidence, {told(best)}", False
    tried = "; ".join(f"{records[i]['label']} {told(i)}" for i in measured) or "no sharded candidate was measured"
    if replicated in within:
        return replicated, f"none measured faster ({tried})", False
    if within:
        best = min(within, key=ratio)
        return best, f"the only kind within the memory limit, {told(best)}", True
    smallest = min([replicated, *measured], key=size)
    return (
        smallest,
        f"no measured candidate fits the memory limit, the one that needs least ({tried})",
        smallest != replicated,
    )


def _told(m: dict) -> str:
    low, high = m["ratio_ci95"]
    return f"measured {m['ratio']:.3f}x the replicated step time, interval [{low:.3f}, {high:.3f}] ({m['verdict']})"


def _limit_check(candidate: Candidate, limit: int | None, reason: str) -> dict:
    size = footprint(candidate.memory)
    if limit is not None and size is not None and size > limit:
        _warnings.warn(
            f"disco-jax: the step needs {size} bytes per device, over the memory limit of {limit}, and "
            f"disco-jax cannot shard its parameters or optimizer state: {reason}",
            UserWarning,
        )
    return {"footprint_bytes": size}


def decision_plan(graph, machine: _plan.MachineKey, info: dict) -> _plan.Plan:
    """The replicated program's plan (`graph`: its graph) when another weight update was chosen:
    no fusion plan of its own (the chosen program's, `info["program"]`, has it), the decision in
    `weight_update`, which the enact phase reads first (`recall`). The decorator's search and
    `offline.plan_for_target` both store it."""
    if info.get("mode") == "mesh":  # a two-axis plan (`mesh_plan`): its record in `Plan.layout`
        wu = {k: v for k, v in info.items() if k != "layout"}
        reason = f"two-axis plan: {info['reason']}"
        return _plan.Plan(
            graph.fingerprint, graph.module.name, machine, True, None, reason, weight_update=wu, layout=info["layout"]
        )
    reason = f"weight update {info.get('chosen', 'sharded')}: the plan is program {info['program']}'s"
    return _plan.Plan(graph.fingerprint, graph.module.name, machine, True, None, reason, weight_update=info)


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
    shardings, at_use = jax.tree.leaves(step.default_compiled.input_shardings), bool(decided.get("at_use"))
    layout, reason = update.find_layout(fn, args, kwargs, step.args, step.kwargs, shardings, largest=at_use)
    wanted = list(decided.get("leaves", {}))
    if layout is not None and not set(wanted) <= layout.all_paths().keys():  # leaves split over several dimensions
        layout = split_layout(fn, args, kwargs, step, layout) or layout
    by_path = {} if layout is None else layout.all_paths()
    if layout is None or any(path not in by_path for path in wanted):
        _warnings.warn(
            "disco-jax: the stored weight-update decision names parameter or optimizer-state leaves this step does not "
            f"have ({reason}); running the replicated update",
            _plan.PlanWarning,
        )
        return step, None, {"mode": "replicated", "requested": "search", "reason": "stored decision does not fit"}
    gathering = {k: decided.get(k) or False for k in layouts.GATHERING}  # flags, and remat's policy
    layout = layout.subset((by_path[path] for path in wanted), **gathering)
    recalled = {**decided, **layout.to_json(), "rules": update.cited_rules(layout)}
    return update.relowered(fn, step, layout, args, kwargs, backend), layout, recalled


def rechoose(decided: dict, limit: int | None) -> dict:
    """A stored decision made under another memory limit, made again for `limit` from the candidates
    it recorded, measuring nothing: `pick`, so the stored choice stays where it is still within the
    limit and was measured (or is the replicated update) and nothing better measured fits, and the
    choice may only move to the replicated update or to a candidate measured when the decision was
    made, never to one that was not. Warns when the choice changes or nothing eligible fits;
    running once with ENABLE_SEARCH=1 measures again."""
    candidates, old = decided["candidates"], decided.get("memory_limit_bytes")
    index, why, forced = pick(candidates, limit)
    chosen = candidates[index]
    stored = sorted(decided.get("leaves", {})) if decided.get("mode") == "sharded" else []
    reason = (
        f"{chosen['label']}: chosen again from the recorded candidates for a memory limit of {limit} bytes "
        f"per device (the stored decision, {decided.get('mode')}, was made for {old}): {why}"
    )
    fits = limit is None or (chosen.get("footprint_bytes") or 0) <= limit
    gathering = layouts.GATHERING
    moved = any((chosen.get(k) or False) != (decided.get(k) or False) for k in gathering)
    if chosen["leaves"] != stored or moved or not fits:
        again = "run once with ENABLE_SEARCH=1 to measure the candidates for this limit"
        _warnings.warn(f"disco-jax: {reason}; {again}", _plan.PlanWarning)
    leaves = {path: True for path in chosen["leaves"]}
    return {
        "mode": "sharded" if leaves else "replicated",
        "leaves": leaves,
        **{k: chosen[k] for k in gathering if chosen.get(k)},
        "forced": forced,
        "reason": reason,
        "candidates": candidates,
        "memory_limit_bytes": limit,
        "stored_memory_limit_bytes": old,
    }
