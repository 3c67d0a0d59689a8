"""disco-jax's entry of a compiled simulated row (`rows.simulated_row`): the search's best
candidates compiled and ranked with XLA's own program by the compiled-program model
(`ranked_plan`), XLA:GPU's collective options searched on XLA's program (`collective_parts`), and
each part's own gain over XLA's program (`ranked_parts`: the weight update, the rewrite, the
collective options). Every figure is a compiled program's cost; disco-jax's is the cheapest of
them, so never above XLA's own."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from disco_jax import schedule_options
from disco_jax._compile import CompiledProgram, Programs
from disco_jax._ranking import (
    RANKED_CANDIDATES,
    XLA_PROGRAM,
    ProgramCosts,
    Ranked,
    rank_by_compiled_cost,
    rewrite_floor_us,
)
from disco_jax._strategy import Strategy, sharding_all, xla_default
from disco_jax.cost import simulate
from disco_jax.cost.sharded import regions_of

COMPILED_MODEL = "compiled program"  # a row's figure costed on the program XLA compiled (`cost.compiled`)
# Sharded sets compiled for the weight-update choice besides the ranked candidates' and all of them.
WEIGHT_UPDATE_SETS = 2


def weight_update_proposals(program, result, costs: ProgramCosts, taken: set) -> list[tuple[Strategy, float | None]]:
    """Candidates that shard other gradients' updates than the ranked ones (`taken`: their sharded
    sets), for the weight-update choice to be made on compiled programs: every shardable
    gradient's update sharded on XLA's plan, then the search's cheapest kept candidate of each
    further sharded set (`WEIGHT_UPDATE_SETS` at most), each with its graph simulator figure.
    Relowered, a candidate compiles to XLA's program of the step with that state sharded, so one
    sharded set is one program. The graph simulator alone does not decide which: on the sharded
    update it is 2-3x off the compiled cost (DLRM on 8 H100s: it preferred 6 of 39 gradients
    sharded, 10.7 ms compiled, to all 39, 7.8 ms)."""
    shardable = regions_of(program.graph).shardable
    out: list[tuple[Strategy, float | None]] = []
    if shardable and frozenset(shardable) not in taken:
        every = sharding_all(xla_default(program.graph), frozenset(shardable))
        simulated = simulate(program, every, costs.estimator, costs.allreduce)
        out.append((every, None if simulated is None else simulated.iteration_us))
        taken = taken | {frozenset(shardable)}
    further = 0
    for cost, s in result.candidates:
        if further >= WEIGHT_UPDATE_SETS:
            break
        if s.sharded and s.sharded not in taken:
            taken, further = taken | {s.sharded}, further + 1
            out.append((s, cost))
    return out


def weight_update_choice(ranked: list, xla_label: str) -> list[dict]:
    """The weight-update choice's record: per distinct compiled program of the ranked candidates
    (cheapest first), how many gradients' updates it shards, both figures (the graph simulator's,
    which proposed it, and the compiled program's, which decides) and the candidates that compiled
    to it."""
    by_program: dict[str, dict] = {}
    for r in ranked:
        if r.program.text is None:
            continue
        key = schedule_options.program_fingerprint(r.program.text)
        entry = by_program.setdefault(
            key,
            {
                "program": key,
                "sharded_gradients": 0 if r.strategy is None else len(r.strategy.sharded),
                "graph_simulated_us": r.graph_us,
                "compiled_us": r.compiled_us,
                "candidates": [],
            },
        )
        entry["candidates"].append(xla_label if r.strategy is None else r.label)
    return list(by_program.values())


def ranked_plan(
    programs: Programs,
    result,
    xla: CompiledProgram,
    strategies: dict[str, dict],
    relower: Callable | None,
    costs: ProgramCosts,
) -> tuple[dict, frozenset[int], Ranked | None]:
    """disco-jax's entry of a compiled row, the gradients whose updates it shards, and the
    cheapest sharded update compiled (None: none was; `collective_parts` compiles it under the
    searched options): the search's best distinct candidates (besides XLA's plan) compiled (by
    the rewriter, or by `relower` for one that shards updates) and ranked with XLA's own program
    (`xla`, JAX_default's) by compiled cost (`costs`, the row's: programs its baselines compiled
    to are not costed again); the cheapest is disco-jax's figure, every ranked one is recorded."""

    relowered: dict[frozenset[int], CompiledProgram | None] = {}  # one program per sharded set

    def compile_candidate(label: str, s: Strategy) -> CompiledProgram:
        if not s.sharded:
            return programs.compile(label, s, None)
        if s.sharded not in relowered:  # XLA's plan of the relowered step: fusions and buckets are XLA's
            relowered[s.sharded] = relower(s.sharded) if relower is not None else None
        program = relowered[s.sharded]
        if program is None:
            return CompiledProgram(label, "relowered", {}, "not enacted", reason="the step could not be lowered again")
        return dataclasses.replace(program, name=label, enacted_by="relowered (sharded update, XLA's plan)")

    default = xla_default(programs.program.graph)
    proposed = result.top(RANKED_CANDIDATES, exclude={default.key()})
    proposed += weight_update_proposals(programs.program, result, costs, {s.sharded for s, _ in proposed})
    ranked = rank_by_compiled_cost(
        xla,
        proposed,
        compile_candidate,
        costs,
        default_graph_us=strategies["JAX_default"]["graph_simulated"]["iteration_us"],
        floor_us=lambda s: rewrite_floor_us(programs.program.graph, s, costs),  # None for a relowered one
    )
    first = ranked[0]
    plan = first.strategy
    graph_figure = strategies["JAX_default"]["graph_simulated"] if plan is None else None
    if plan is not None:
        graph_figure = simulate(programs.program, plan, costs.estimator, costs.allreduce)
        graph_figure = None if graph_figure is None else graph_figure.to_json()
    disco = {
        "simulated": None if first.cost is None else first.cost.to_json(),
        "cost_model": COMPILED_MODEL,
        "graph_simulated": graph_figure,
        "description": f"search from {result.best.origin}; chosen by compiled cost: {first.label}",
        "chosen": first.label,
        "buckets": strategies["JAX_default"]["buckets"] if plan is None else len(plan.buckets),
        "sharded_gradients": 0 if plan is None else len(plan.sharded),
        "valid": True,
        "program": first.program.to_json(),
        # What the program runs, as compiled (not the plan's buckets).
        "collectives": None if first.program.text is None else schedule_options.collective_summary(first.program.text),
        "ranked": [r.to_json() for r in ranked],
        # Which gradients' updates to shard, chosen on compiled programs (one per sharded set).
        "weight_update_choice": weight_update_choice(ranked, XLA_PROGRAM),
        "searched_best_graph_us": result.best_cost,
    }
    updates = [r for r in ranked if r.strategy is not None and r.strategy.sharded and r.cost is not None]
    best_update = min(updates, key=lambda r: r.compiled_us, default=None)
    return disco, frozenset() if plan is None else plan.sharded, best_update


def ranked_parts(xla_us: float, disco: dict) -> dict:
    """The gain over XLA's program (`xla_us`) of the part of a plan disco-jax's ranked program
    (`disco`, its row entry) is: a relowered sharded update's or a rewrite's; 1.0 for the other
    parts, and for both where XLA's program ranked first. `collective_options`: None (not
    searched; `collective_parts` fills it) and `combined` (None: not compiled)."""
    ranked_us = disco["simulated"]["iteration_us"] if disco.get("simulated") else None
    enacted_by = (disco.get("program") or {}).get("enacted_by", "")
    gain = None if not ranked_us else xla_us / ranked_us
    return {
        "weight_update": gain if enacted_by.startswith("relowered") else 1.0,
        "rewrite": gain if enacted_by == "rewrite" else 1.0,
        "collective_options": None,
        "combined": None,
    }


def combined_options(found: schedule_options.OptionsChoice) -> schedule_options.OptionsCandidate | None:
    """The option set a sharded update is compiled under (`collective_parts`): the search's choice
    where it is not XLA's defaults, else its cheapest other distinct program's (options that lose
    on the replicated program may still win on the sharded one, whose collectives differ); None
    where no option set compiled to a program of its own."""
    if found.options:
        return found.chosen
    others = [c for c in found.candidates if c.options and c.same_as is None and c.cost is not None]
    return min(others, key=lambda c: c.compiled_us, default=None)


def combine(
    best_update: Ranked,
    found: schedule_options.OptionsChoice,
    relower: Callable,
    costs: ProgramCosts,
    dims: bool | list = True,
    say: Callable[[str], None] | None = None,
) -> tuple[dict, CompiledProgram, object] | None:
    """The cheapest sharded update (`best_update`, ranked) compiled again by `relower` under the
    searched options (`combined_options`), then the options of its own collectives searched on
    top of that program or, where it costs more than the ranked one, of XLA's defaults (`dims`:
    True, `schedule_options.update_dimensions` of that program: the all-gather and reduce-scatter
    thresholds, the count bound, their order against compute, which the search on the replicated
    program never tries; a list: those dimensions; False: none), each candidate relowered and
    costed as compiled. Returns the cheapest one's record (options, sharded gradients, compiled
    cost, fingerprint and the earlier program it equals, if any, collectives, and the search on
    the sharded program), the program and its cost; None where there is nothing to combine or
    search."""
    with_options = combined_options(found)
    sharded = best_update.strategy.sharded
    start_options = {} if with_options is None else dict(with_options.options)
    start = best_update.program if not start_options else relower(sharded, options=start_options)
    if start is None:
        return None
    searched = schedule_options.update_dimensions(start.text or "") if dims is True else list(dims or [])
    if not start_options and not searched:
        return None
    cost, search = costs(start), None
    under_options_us = None if cost is None or not start_options else cost.iteration_us
    start_label = "sharded update" + (f" under {with_options.label}" if start_options else "")
    if searched and start_options and (cost is None or best_update.compiled_us < cost.iteration_us):
        # The replicated step's options slow the sharded program down: its search starts from
        # XLA's defaults (the ranked program), and may take any of them back.
        start, start_options, cost, start_label = best_update.program, {}, best_update.cost, "sharded update"
    chosen_options, program = start_options, start
    if cost is not None and searched:
        search = schedule_options.search_options(
            None,
            costs,
            dims=searched,
            default=start,
            compile=lambda _label, options: relower(sharded, options=options),
            start=(start_label, start_options),
            progress=None if say is None else (lambda line: say(f"sharded update: {line}")),
        )
        chosen_options, program, cost = search.options, search.chosen.program, search.chosen.cost
    fingerprint = None if program.text is None else schedule_options.program_fingerprint(program.text)
    earlier = {schedule_options.program_fingerprint(best_update.program.text): best_update.label}
    earlier.update({c.fingerprint: c.label for c in found.candidates if c.fingerprint and c.same_as is None})
    described = ", ".join(f"{k}={v}" for k, v in sorted(chosen_options.items())) or schedule_options.DEFAULTS
    record = {
        "label": f"{best_update.label} under {described}",
        "options": {k: str(v) for k, v in chosen_options.items()},
        "options_chosen": bool(found.options),
        "sharded_gradients": len(sharded),
        "update_compiled_us": best_update.compiled_us,
        "options_compiled_us": None if with_options is None else with_options.compiled_us,
        # The sharded update under those options (None: not compiled under any), and where the
        # search on it started: there, or at XLA's defaults where those were cheaper.
        "under_options_us": under_options_us,
        "search_start": start_label,
        "compiled_us": None if cost is None else cost.iteration_us,
        "fingerprint": fingerprint,
        "same_program_as": earlier.get(fingerprint),
        "program": program.to_json(),
        "collectives": None,
        # The options of the sharded program's own collectives, searched from the start above.
        "search": None if search is None else search.to_json(),
    }
    if program.text is not None:  # the search's record read them already from the chosen program
        found_collectives = (record["search"] or {}).get("chosen", {}).get("collectives")
        record["collectives"] = found_collectives or schedule_options.collective_summary(program.text)
    return record, program, cost


def collective_parts(
    disco: dict,
    xla: CompiledProgram,
    strategies: dict,
    lowered,
    costs: ProgramCosts,
    schedule: bool | list,
    best_update: Ranked | None = None,
    relower: Callable | None = None,
    update_schedule: bool | list = True,
    say: Callable[[str], None] | None = None,
) -> tuple[dict, dict, dict | None, frozenset[int] | None]:
    """disco-jax's entry after the collective options search (`schedule`, see `simulated_row`),
    each part's own gain over XLA's program (XLA's compiled cost over the part's), the search's
    record (None where not searched) and, where disco-jax's program changed to one that shards
    updates or none, the gradients whose updates it shards (None: as ranked). With
    `best_update` (`ranked_plan`'s) and `relower`, the sharded update compiled under the searched
    options, with its own collectives' options searched on top (`combine`, `update_schedule` its
    `dims`), is a candidate too: its gain is `parts["combined"]`, its record
    `schedule_options["combined"]`. disco-jax's program is the cheapest compiled of the ranked
    one, XLA's program under the searched options and the combination."""
    ranked_us = disco["simulated"]["iteration_us"] if disco["simulated"] else None
    xla_us = strategies["JAX_default"]["simulated"]["iteration_us"]
    parts = ranked_parts(xla_us, disco)
    if schedule is False:
        return disco, parts, None, None
    dims = None if schedule is True else schedule
    found = schedule_options.search_options(lowered, costs, dims=dims, default=xla, progress=say)
    parts["collective_options"] = found.gain
    searched = found.to_json()
    best_us, sharded = ranked_us, None
    if found.options and found.chosen.cost is not None and (not best_us or found.chosen.compiled_us < best_us):
        best_us, sharded = found.chosen.compiled_us, frozenset()
        chosen = f"XLA's program under {found.chosen.label}"
        program = found.chosen.program
        what, read = "XLA's program under searched compile options", searched["chosen"]["collectives"]
        disco = _taken(disco, what, chosen, program, found.chosen.cost, 0, read)
    combined = (
        None
        if best_update is None or relower is None
        else combine(best_update, found, relower, costs, update_schedule, say)
    )
    searched["combined"] = None if combined is None else combined[0]
    if combined is not None and combined[2] is not None:
        record, program, cost = combined
        parts["combined"] = xla_us / cost.iteration_us
        if not best_us or cost.iteration_us < best_us:
            sharded = best_update.strategy.sharded
            what = "the sharded update under searched compile options"
            disco = _taken(disco, what, record["label"], program, cost, len(sharded), record["collectives"])
    return disco, parts, searched, sharded


def _taken(
    disco: dict, what: str, chosen: str, program: CompiledProgram, cost, sharded: int, collectives: dict | None = None
) -> dict:
    """disco-jax's row entry with `program` (its compiled `cost`) taken in place of the ranked
    one because `what` compiles cheaper (`collectives`: its summary where already read)."""
    return {
        **disco,
        "simulated": cost.to_json(),
        "description": f"{disco['description']}; {what} cheaper",
        "chosen": chosen,
        "program": program.to_json(),
        "sharded_gradients": sharded,
        "collectives": collectives or schedule_options.collective_summary(program.text),
    }
