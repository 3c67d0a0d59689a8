"""Two-axis plans in the decorator: a mesh (data x model) and a layout per layer group
(`operators.OperatorPlan`) enacted by `@optimize_distributed` on the devices at hand, through the
one mechanism `sharding.mesh_step` is: the user's step lowered again on the plan's mesh with
its parameters and optimizer state held in the plan's layout between steps.

Where a two-axis plan comes from (`layout=` of the decorator, `Options.layout`):

* forced: `layout="tp"` (tensor parallel over every device), `"DxM:CHOICE"` (a mesh of D data by
  M model devices; `CHOICE` one of `operators.CHOICES` for the blocks' group, the other groups
  read by dots taking it without sequence parallelism), `"DxM:CHOICE,Group=CHOICE2"` (a group
  named), or an `OperatorPlan`. In the search phase its outputs are checked against the unmodified
  step (moved state too) and it is timed by the acceptance rule, the ratio reported; it runs
  whatever the ratio (the user asked for it; the report says `forced: "layout option"`), but
  never with outputs outside the check.
* chosen under a memory limit (`layout="search"`, the default): when no one-axis weight update
  (replicated, optimizer state sharded, ZeRO-3, FSDP gathered where used or again for each use,
  split leaves: `choice.choose`) fits `memory_limit_bytes`, `choose_for_memory` compiles the
  two-axis candidates on the devices at hand (`memory_candidates`), reads each one's peak from
  XLA's memory analysis, measures those within the limit (output check, acceptance timing), and
  takes the fastest measured; when it is not faster with confidence than the unmodified step the
  record says memory forced it (`forced: "memory"`). The decision is stored in the unmodified
  program's plan (`Plan.layout`) and recalled by the enact phase (`layout_stage`).
* an offline plan (`offline.plan_for_target(layouts=True)`, `search["offline"]["layout"]`) whose
  chosen mesh has a model axis and as many devices as the step's: enacted on its first run only
  after it is checked and measured here like the decorator's own (faster with confidence, or
  needed for the memory limit), the verdict written back into the plan (`Plan.layout`).

`layout="data"` keeps the step on its one data axis (the behaviour before two-axis plans).

The two-axis program runs as XLA compiles it: the fusion and all-reduce bucket search is not run
on it (its collectives run over model-axis groups the bucket rewriter does not tell apart). Each
call moves its arguments to the plan's shardings (`MeshRun`): a no-op for the state the step
returned, a copy of the batch from the user's one-axis sharding (part of what is measured).

Not applicable (a warning, the one-axis step): several processes, keyword or static arguments
(`mesh_step.relower` lowers positional arguments), a step with no parameter updated from its own
optimizer state, a mesh whose size is not the step's device count.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax

from disco_jax import _plan, _warnings
from disco_jax._compile import Captured, capture
from disco_jax.sharding import choice, mesh_step, operators, remat, update
from disco_jax.sharding.layouts import put

LAYOUT_MODES = ("search", "data")
_FORCED = re.compile(r"(\d+)x(\d+):(\w+)((?:,\w+=\w+)*)")


def check_layout(value: Any) -> Any:
    """`value` if it is a valid `layout=` option (see the module docstring), else ValueError."""
    if isinstance(value, operators.OperatorPlan) or value in LAYOUT_MODES or value == "tp":
        return value
    match = _FORCED.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(
            f"layout must be 'search', 'data', 'tp', 'DxM:CHOICE[,Group=CHOICE]' or an OperatorPlan, got {value!r}"
        )
    named = [match.group(3)] + [kv.split("=")[1] for kv in match.group(4).split(",")[1:]]
    wrong = [c for c in named if c not in operators.CHOICES]
    if wrong:
        raise ValueError(f"layout {value!r}: unknown choice(s) {wrong}; choices are {', '.join(operators.CHOICES)}")
    return value


def is_forced(value: Any) -> bool:
    return value not in LAYOUT_MODES


def _without_sp(c: str) -> str:
    return c[: -len("_sp")] if operators.uses_sp(c) else c


def plan_for(found: mesh_step.Structure, data: int, model: int, block: str, named: dict | None = None):
    """The plan with `block` for the group with the most dot-read parameters (the blocks) and the
    same without sequence parallelism for the other dot-read groups (the embedding), `named`
    groups as given."""
    groups = mesh_step.dot_groups(found)
    choices = {g: block if i == 0 else _without_sp(block) for i, g in enumerate(groups)}
    choices.update(named or {})
    return operators.OperatorPlan(data, model, choices)


def forced_plan(value: Any, found: mesh_step.Structure) -> operators.OperatorPlan:
    """The `OperatorPlan` a forced `layout=` names for this step (ValueError where its mesh is not
    the step's device count)."""
    n = len(found.devices)
    if isinstance(value, operators.OperatorPlan):
        plan = value
    elif value == "tp":
        plan = plan_for(found, 1, n, "tp")
    else:
        match = _FORCED.fullmatch(value)
        named = dict(kv.split("=") for kv in match.group(4).split(",")[1:])
        plan = plan_for(found, int(match.group(1)), int(match.group(2)), match.group(3), named)
    if plan.data * plan.model != n:
        raise ValueError(f"layout {plan.label!r} needs {plan.data * plan.model} devices, the step runs on {n}")
    return plan


def plan_from_json(data: dict) -> operators.OperatorPlan:
    mesh = data["mesh"]
    return operators.OperatorPlan(
        int(mesh[operators.DATA]), int(mesh[operators.MODEL]), dict(data["choices"]), data.get("remat", "")
    )


def memory_candidates(found: mesh_step.Structure) -> list[operators.OperatorPlan]:
    """The two-axis plans the decorator's memory search compiles: every mesh with a model axis
    (`operators.mesh_shapes` over all the step's devices) with the blocks tensor parallel, and,
    where the mesh has a data axis, FSDP x TP too (5 plans on 8 devices). Sequence parallelism is
    left out: on XLA:CPU it compiles to all-reduces (DESIGN.md point 16), more collectives for
    the same memory; one-axis plans (DP, FSDP) are the weight update's candidates already."""
    n = len(found.devices)
    plans = []
    for data, model in operators.mesh_shapes(n, n):
        if model == 1:
            continue
        for block in ("tp", "fsdp_tp") if data > 1 else ("tp",):
            plans.append(plan_for(found, data, model, block))
    return plans


def not_applicable(fn, step: Captured, args: tuple, kwargs: dict, dynamic_args: tuple) -> str | None:
    """Why a two-axis plan cannot be enacted for this call (None: it can)."""
    if step.scope is not None or jax.process_count() > 1:
        return "two-axis plans are not enacted across several processes yet"
    if kwargs or len(args) != len(dynamic_args):
        return "two-axis plans need a step called with positional, non-static arguments only"
    if getattr(fn, "_jit_info", None) is None or not hasattr(fn, "__wrapped__"):
        return "the step is not a jax.jit function"
    return None


def structure_of(fn, step: Captured) -> tuple[mesh_step.Structure | None, str | None]:
    try:
        return mesh_step.structure(fn, step.args), None
    except ValueError as e:
        return None, str(e)


def relowered(fn, step: Captured, found: mesh_step.Structure, plan: operators.OperatorPlan, backend) -> tuple:
    """(the step lowered on `plan`'s mesh and captured, its `mesh_step.Enacted`): it computes
    the same call, so it shares `step`'s float64 run (the output check's reference)."""
    lowered, moved, enacted = mesh_step.relower(fn, step.args, found, plan)
    program = capture(lowered, backend, moved, {})
    program.exact = step.exact
    return program, enacted


class MeshRun:
    """What a step with a two-axis plan runs: each call's arguments moved to the plan's shardings
    (the state the previous call returned has them already: `put` leaves it), then the plan's
    executable. Arguments of another tree or count raise TypeError before anything runs (the
    decorator then prepares the call's own program)."""

    def __init__(self, program: Captured):
        self.compiled = program.default_compiled
        self.shardings = [x.sharding for x in jax.tree.leaves(program.args)]

    @property
    def steady(self) -> MeshRun:
        """What later calls run (the decorator keys the moved arguments' signature to it)."""
        return self

    def reshard(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The call's arguments in the plan's shardings."""
        leaves, tree = jax.tree.flatten(args)
        if kwargs or len(leaves) != len(self.shardings):
            raise TypeError("not the arguments of this two-axis program")
        return jax.tree.unflatten(tree, [put(x, s) for x, s in zip(leaves, self.shardings)]), {}

    def __call__(self, *args, **kwargs):
        return self.compiled(*self.reshard(args, kwargs)[0])

    def as_text(self) -> str:
        return self.compiled.as_text()


def record(program: Captured, enacted, found, **fields) -> dict:
    """What the report and the plan record of an enacted two-axis plan."""
    return {
        "mode": "mesh",
        "label": enacted.plan.label,
        "plan": enacted.to_json(found),
        "footprint_bytes": choice.executable_peak(program.default_compiled),
        "collectives": update.collectives(program.default_compiled.as_text()),
        **fields,
    }


def measured_ratio(m: dict) -> str:
    low, high = m["ratio_ci95"]
    return (
        f"measured {m['ratio']:.3f}x the unmodified step (quartiles {m['ratio_iqr'][0]:.3f}-{m['ratio_iqr'][1]:.3f}, "
        f"interval [{low:.3f}, {high:.3f}], {m['verdict']})"
    )


def checked(step: Captured, program: Captured, pairs: int, name: str) -> dict:
    """The output check (moved state too) and, where it passes, the acceptance timing of a
    two-axis program against the unmodified step (`choice.measure`)."""
    return choice.measure(step, program, pairs, name)


def forced(fn, step: Captured, found, value, backend, options, search: bool, ui) -> tuple[Any, dict]:
    """(MeshRun or None, record) of a forced `layout=`: checked and timed in the search phase."""
    plan = forced_plan(value, found)
    program, enacted = relowered(fn, step, found, plan, backend)
    info = record(program, enacted, found, requested=str(value), forced="layout option")
    if not search:
        info["reason"] = f"{plan.label}: forced by the layout option (not measured in the enact phase)"
        return MeshRun(program), info
    ui.say(f"layout: checking and measuring the forced plan {plan.label} against the unmodified step")
    info.update(checked(step, program, options.validation_pairs, "layout"))
    if not info["check"]["within_tolerance"]:
        _warnings.warn(
            f"disco-jax: the forced layout {plan.label} computes other outputs than the step "
            f"({info['check'].get('summary') or info['check']}); running the unmodified step",
            _plan.PlanWarning,
        )
        return None, {**info, "mode": "data", "reason": "the forced layout's outputs differ"}
    info["reason"] = f"{plan.label}: forced by the layout option, {measured_ratio(info['measured'])}"
    ui.say(f"layout: {info['reason']}")
    return MeshRun(program), info


def choose_for_memory(fn, step: Captured, backend, limit: int, pairs: int, measured: int, ui) -> tuple | None:
    """(program, record) of the two-axis plan for a memory limit no one-axis weight update meets:
    `memory_candidates` compiled on the step's devices, their peaks read (XLA's memory analysis),
    those within `limit` measured (at most `measured`, fewest collectives first: on CPU devices
    collectives are what a layout adds), the fastest measured chosen; where none fits, the same
    plans with their loops rematerialized (`sharding.remat`: "dots", then "full"). None where none
    fits or passes the output check."""
    found, why = structure_of(fn, step)
    if found is None:
        ui.say(f"layout: no two-axis plan ({why})")
        return None
    records, fitting, compiled = [], [], []

    def consider(plan: operators.OperatorPlan) -> None:
        try:
            program, enacted = relowered(fn, step, found, plan, backend)
        except Exception as e:  # a plan XLA refuses is a candidate that does not apply
            records.append({"label": plan.label, "why_not": f"{type(e).__name__}: {e}"[:300]})
            return
        rec = record(program, enacted, found)
        rec["within_limit"] = rec["footprint_bytes"] is not None and rec["footprint_bytes"] <= limit
        ui.say(f"layout: {plan.label}: {rec['footprint_bytes']} bytes per device")
        records.append(rec)
        compiled.append(plan)
        if rec["within_limit"]:
            fitting.append((sum(rec["collectives"].values()), rec["footprint_bytes"], len(records) - 1, program))

    for plan in memory_candidates(found):
        consider(plan)
    for policy in remat.POLICIES:  # none fits: the same plans with their loops rematerialized
        if fitting:
            break
        for plan in [p for p in compiled if not p.remat]:
            consider(dataclasses.replace(plan, remat=policy))
    ranked = sorted(fitting, key=lambda f: f[:3])[: max(1, measured)]
    best = None
    for _, _, i, program in ranked:
        ui.say(f"layout: measuring {records[i]['label']} against the unmodified step")
        records[i].update(checked(step, program, pairs, f"layout-{i}"))
        if records[i].get("measured") and (best is None or _ratio(records[i]) < _ratio(records[best[0]])):
            best = (i, program)
    info = {"memory_limit_bytes": limit, "candidates": records}
    if best is None:
        info["reason"] = f"no two-axis plan fits {limit} bytes per device and passes the output check"
        ui.say(f"layout: {info['reason']}")
        return None
    i, program = best
    chosen = records[i]
    faster = chosen["measured"]["verdict"] == "faster"
    info.update({k: v for k, v in chosen.items() if k not in ("within_limit",)})
    info["forced"] = False if faster else "memory"
    info["reason"] = (
        f"{chosen['label']}: no one-axis weight update fits {limit} bytes per device; the fastest measured "
        f"two-axis plan within it, {measured_ratio(chosen['measured'])}"
        + ("" if faster else "; applied because memory forces it")
    )
    ui.say(f"layout: {info['reason']}")
    return program, info


def _ratio(rec: dict) -> float:
    return rec["measured"]["ratio"]


def stored_layout(plan: _plan.Plan | None, num_devices: int) -> tuple[dict | None, bool]:
    """(the two-axis decision a stored plan holds, whether it was never measured): `Plan.layout`
    (the decorator's decision, or an offline layout's verdict), else an offline plan's chosen
    layout (`search["offline"]["layout"]["chosen"]`) with a model axis over `num_devices`."""
    if plan is None:
        return None, False
    if plan.layout:
        return (plan.layout if plan.layout.get("mode") == "mesh" else None), False
    chosen = ((plan.search or {}).get("offline") or {}).get("layout", {}).get("chosen") or {}
    mesh = chosen.get("mesh") or {}
    model, data = mesh.get(operators.MODEL, 1), mesh.get(operators.DATA, 1)
    # A configuration written by hand (`eval.handwritten`, chosen offline as the cheapest) is the
    # user's own shardings, not an operator plan this module lowers: the one-axis step runs.
    if model > 1 and data * model == num_devices and "by_hand" not in chosen:
        return {"mode": "mesh", "plan": chosen, "label": chosen.get("plan"), "from": "offline"}, True
    return None, False


def stale(decided: dict, limit: int | None, default_peak: int | None) -> str | None:
    """Why a stored two-axis decision does not hold under the memory limit given now (None where it
    does): its footprint is over the limit, or memory forced it (it was slower) and the unmodified
    step now fits. A decision was made under the limit of its search (`memory_limit_bytes`)."""
    if limit is None:
        return None
    footprint, under = decided.get("footprint_bytes"), decided.get("memory_limit_bytes")
    chosen_under = f" (chosen under {under})" if under is not None else ""
    if footprint is not None and footprint > limit:
        return f"needs {footprint} bytes per device, over memory_limit_bytes={limit}{chosen_under}"
    if decided.get("forced") == "memory" and default_peak is not None and default_peak <= limit:
        return (
            f"was applied because memory forced it{chosen_under}, and the unmodified step's {default_peak} "
            f"bytes per device fit memory_limit_bytes={limit}"
        )
    return None


def rechoose(decided: dict, limit: int) -> dict | None:
    """A stored two-axis decision whose plan is over `limit`, made again from the candidates its
    search recorded, measuring nothing: the fastest of those measured with outputs within the
    check whose footprint is within `limit` (forced by memory where it was not faster with
    confidence), as the decision the enact phase applies; None where none is (the one-axis step
    runs). Only a candidate measured when the decision was made is ever chosen."""
    eligible = [
        c
        for c in decided.get("candidates") or []
        if c.get("measured")
        and (c.get("check") or {}).get("within_tolerance")
        and c.get("footprint_bytes") is not None
        and c["footprint_bytes"] <= limit
    ]
    if not eligible:
        return None
    best = min(eligible, key=_ratio)
    faster = best["measured"]["verdict"] == "faster"
    return {
        **best,
        "candidates": decided["candidates"],
        "forced": False if faster else "memory",
        "memory_limit_bytes": limit,
        "stored_memory_limit_bytes": decided.get("memory_limit_bytes"),
        "reason": (
            f"{best['label']}: chosen again from the recorded candidates for memory_limit_bytes={limit} (the stored "
            f"plan, {decided.get('label')}, needs {decided.get('footprint_bytes')}); {measured_ratio(best['measured'])}"
            + ("" if faster else "; applied because memory forces it")
        ),
    }


def recall(fn, step: Captured, found, backend, options, ui) -> tuple[Any, dict] | None:
    """The enact phase's side: (MeshRun or None, record) of the stored two-axis decision for this
    program, or None where there is none. An offline layout never measured is checked and
    measured first and its verdict stored (applied when faster with confidence, or when
    `memory_limit_bytes` is below the unmodified step's peak and within the plan's); a decision
    memory forced is not enacted without a memory limit (it was slower)."""
    plan, _ = _plan.find_plan(step.graph.fingerprint, step.machine, options.plan_dir)
    decided, unmeasured = stored_layout(plan, len(step.devices))
    if decided is None:
        return None
    limit = options.memory_limit_bytes
    if decided.get("forced") == "memory" and limit is None:
        _warnings.warn(
            f"disco-jax: the stored two-axis plan {decided.get('label')} was applied because memory forced it, "
            "and no memory_limit_bytes is given now; running the one-axis step",
            _plan.PlanWarning,
        )
        return None
    why = None if unmeasured else stale(decided, limit, choice.executable_peak(step.default_compiled))
    over = why is not None and (decided.get("footprint_bytes") or 0) > limit  # not: memory no longer forces it
    again = rechoose(decided, limit) if over else None
    if again is not None:
        _warnings.warn(
            f"disco-jax: the stored two-axis plan {decided.get('label')} {why}; {again['reason']}", _plan.PlanWarning
        )
        decided = again
    elif why:
        _warnings.warn(
            f"disco-jax: the stored two-axis plan {decided.get('label')} {why}; running the one-axis step "
            "(search again with ENABLE_SEARCH=1 to choose for this limit)",
            _plan.PlanWarning,
        )
        return None
    operator_plan = plan_from_json(decided["plan"])
    try:
        program, enacted = relowered(fn, step, found, operator_plan, backend)
    except Exception as e:  # the stored plan names leaves or splits this step does not have
        _warnings.warn(
            f"disco-jax: the stored two-axis plan {operator_plan.label} cannot be lowered here ({e}); "
            "running the one-axis step",
            _plan.PlanWarning,
        )
        return None
    if not unmeasured:
        info = {**decided, "recalled": True}
        ui.say(f"layout: applying the stored two-axis plan {operator_plan.label}")
        return MeshRun(program), info
    ui.say(f"layout: the offline plan's layout {operator_plan.label} was never measured; measuring it")
    info = record(program, enacted, found, **{"from": "offline"})
    info.update(checked(step, program, options.validation_pairs, "offline-layout"))
    default_peak = choice.executable_peak(step.default_compiled)
    needed = limit is not None and (default_peak or 0) > limit and (info["footprint_bytes"] or 0) <= limit
    passed = info["check"]["within_tolerance"]
    faster = passed and info["measured"]["verdict"] == "faster"
    if passed and (faster or needed):
        info["forced"] = False if faster else "memory"
        info["reason"] = f"{operator_plan.label} (offline): {measured_ratio(info['measured'])}" + (
            "" if faster else "; applied because memory forces it"
        )
    else:
        why = "outputs differ" if not passed else measured_ratio(info["measured"])
        info = {**info, "mode": "data", "reason": f"{operator_plan.label} (offline) not applied: {why}"}
    plan.layout = info
    try:
        _plan.save_plan(plan, options.plan_dir)
    except OSError as e:
        _warnings.warn(f"disco-jax: {e}; the verdict is used for this run only", _plan.PlanWarning)
    ui.say(f"layout: {info['reason']}")
    return (MeshRun(program) if info["mode"] == "mesh" else None), info
