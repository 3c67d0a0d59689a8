"""The mesh and per-layer layout of a step, searched on compiled programs (deviceless for a GPU
cluster): every candidate (`operators.OperatorPlan`: a data x model mesh shape and a choice per
layer group) is lowered again (`sharding.mesh_step`), compiled by XLA:GPU for the target, costed by
the compiled-program model (`cost.cost_program`, collectives per replica group:
`eval.clusters.GroupedCollectives`) and its per-device peak read from XLA's memory analysis. The
cheapest candidate within `memory_limit_bytes` is chosen; candidates that compile to the same
program (the same module text) are costed once and named together. The configurations a user
writes by hand (`eval.handwritten.hand_plans`) are candidates too, so the choice is never costlier
than the best of them within the limit by construction (where one of them is cheapest, it is the
choice, and says so: its label starts "by hand" after the mesh).

Search by layer groups, not by layer: the groups are the parameter tree's first keys without their
number (every `Block_i` is one group, a scan's stack one, the embedding another), so a 32-layer
decoder has the same handful of groups as a 2-layer one and the candidates are (mesh shapes) x
(choices per group that reads parameters through dots): at most 4 x 6 x 2 programs (22 for a
decoder on 8 or 32 GPUs of nodes of 8) and 5 by hand, each one compile. Layers of one group
are alike in a decoder, and a per-layer choice inside a scanned stack cannot differ between
iterations anyway; a decoder whose layers differ would need groups split further (not done).

    found = mesh_step.structure(step, args)
    result = search_layouts(step, args, found, cluster, memory_limit_bytes=80e9)
    result.chosen.plan, result.chosen.iteration_us, result.chosen.peak_bytes
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import time
from typing import Any

from disco_jax import backends, cost
from disco_jax.sharding import choice, mesh_step, operators, remat, update
from disco_jax.sharding.mesh_step import dot_groups


@dataclasses.dataclass
class LayoutCandidate:
    """One plan (an `operators.OperatorPlan`, or a configuration written by hand:
    `eval.handwritten.HandPlan`) compiled for the target: its peak (XLA's memory analysis, bytes per device), its
    compiled cost, the program's fingerprint, and the other plans that compiled to the same program."""

    plan: Any
    peak_bytes: int | None = None
    cost: Any = None
    fingerprint: str | None = None
    compile_s: float = 0.0
    same_program: list[str] = dataclasses.field(default_factory=list)
    enacted: Any = None
    program: Any = None  # the compiled program as costed (`cost.CompiledProgram`)
    why_not: str | None = None

    @property
    def iteration_us(self) -> float | None:
        return None if self.cost is None else self.cost.iteration_us

    def to_json(self, found=None) -> dict:
        return {
            "plan": self.plan.label,
            **self.plan.to_json(),
            "iteration_us": self.iteration_us,
            "compute_us": None if self.cost is None else self.cost.compute_us,
            "comm_us": None if self.cost is None else self.cost.comm_us,
            "peak_bytes": self.peak_bytes,
            "compile_s": round(self.compile_s, 1),
            "same_program_as": list(self.same_program),
            "why_not": self.why_not,
            **({"layout": self.enacted.to_json(found)} if found is not None and self.enacted is not None else {}),
        }


@dataclasses.dataclass
class LayoutSearch:
    chosen: LayoutCandidate | None
    candidates: list[LayoutCandidate]
    reason: str
    seconds: float

    def to_json(self, found=None) -> dict:
        return {
            "chosen": None if self.chosen is None else self.chosen.to_json(found),
            "reason": self.reason,
            "seconds": round(self.seconds, 1),
            "candidates": [c.to_json() for c in self.candidates],
        }

    def within(self, memory_limit_bytes: int | None) -> LayoutSearch:
        """The same compiled candidates chosen again under another memory limit (a compile is
        deterministic: nothing is compiled again)."""
        return choose(self.candidates, distinct(self.candidates), memory_limit_bytes, self.seconds)


def distinct(candidates: list[LayoutCandidate]) -> list[LayoutCandidate]:
    """The compiled candidates whose program no earlier candidate compiled to (`same_program`
    names the others on the first): one per distinct program, in the search's order."""
    repeated = {label for c in candidates for label in c.same_program}
    return [c for c in candidates if c.fingerprint is not None and c.plan.label not in repeated]


def candidate_plans(
    found: mesh_step.Structure, devices_per_node: int, hand: bool = True
) -> list[operators.OperatorPlan | Any]:
    """Every mesh shape (`operators.mesh_shapes`) with every choice for the blocks' group and the
    choices that fit it for the other groups read by dots (the embedding: replicated, FSDP, or
    split on the vocabulary, with FSDP where the blocks have it); with `hand`, then the
    configurations a user writes by hand (`eval.handwritten.hand_plans`: data parallel, FSDP, TP
    over a node, data x TP, FSDP x TP), so that the search's choice is never costlier than the
    best of them that fits: they are candidates like any other, compiled and costed the same way."""
    groups = dot_groups(found)
    plans = []
    for data, model in operators.mesh_shapes(len(found.devices), devices_per_node):
        choices = [c for c in operators.CHOICES if (model > 1) == operators.uses_tp(c)]
        if data == 1:
            choices = [c for c in choices if not operators.uses_fsdp(c)] or ["replicated"]
        for block in choices:
            fsdp = operators.uses_fsdp(block)
            for other in {("fsdp_tp" if fsdp else "tp") if model > 1 else block, "fsdp" if fsdp else "replicated"}:
                plans.append(
                    operators.OperatorPlan(data, model, {g: block if i == 0 else other for i, g in enumerate(groups)})
                )
    if hand:
        from disco_jax.eval import handwritten  # lazily: `import disco_jax` does not import eval

        plans += handwritten.hand_plans(len(found.devices), devices_per_node)
    unique = {p.label: p for p in plans}
    return list(unique.values())


# The debug tables XLA prints before the computations (where in Python each op was traced): two
# lowerings of one program from different call sites differ only there and in ops' metadata.
_DEBUG_TABLES = re.compile(r"^(FileNames|FunctionNames|FileLocations|StackFrames)\n(?:.+\n)*", re.M)


def _fingerprint(text: str) -> str:
    """The program's identity: its module text without its name, ops' metadata (op names, source
    lines) and the stack-frame tables, so that the same program lowered by two paths (a
    hand-written configuration and disco-jax's plan) is one program."""
    body = re.sub(r"^HloModule \S+", "HloModule m", text, count=1)
    body = _DEBUG_TABLES.sub("", body)
    body = re.sub(r", metadata=\{[^}]*\}", "", body)
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def lower_plan(step, args, found, plan) -> tuple:
    """(lowered, enacted layout) of the step on `plan`'s mesh with its layout: disco-jax's plan
    by `mesh_step.relower`, a configuration written by hand by `eval.handwritten.relower`."""
    if isinstance(plan, operators.OperatorPlan):
        lowered, _, enacted = mesh_step.relower(step, args, found, plan)
    else:  # a configuration written by hand (`eval.handwritten.HandPlan`)
        from disco_jax.eval import handwritten

        lowered, _, enacted = handwritten.relower(step, args, found, plan)
    return lowered, enacted


def compile_candidate(step, args, found, plan, cluster, costs=None) -> LayoutCandidate:
    """`plan` lowered, compiled for the target and costed (`why_not` where it does not compile)."""
    c = LayoutCandidate(plan)
    start = time.perf_counter()
    try:
        lowered, c.enacted = lower_plan(step, args, found, plan)
        compiled = lowered.compile()
    except Exception as e:  # a plan XLA refuses is a candidate that does not apply
        c.why_not, c.compile_s = f"{type(e).__name__}: {e}"[:300], time.perf_counter() - start
        return c
    c.compile_s = time.perf_counter() - start
    text = compiled.as_text()
    c.fingerprint = _fingerprint(text)
    c.peak_bytes = choice.footprint(update.memory(compiled, {}))
    estimator, collectives, params = costs or (
        cluster.kernel_estimator(),
        cluster.grouped_collectives(),
        cluster.simulator_params(),
    )
    c.program = cost.compiled_program(text, backends.GPU)
    c.cost = cost.cost_program(c.program, estimator, collectives, params)
    return c


def search_layouts(
    step,
    args: tuple,
    found: mesh_step.Structure,
    cluster,
    memory_limit_bytes: int | None = None,
    plans=None,
    say=print,
    after=None,
) -> LayoutSearch:
    """Compile and cost every plan (default `candidate_plans`), choose the cheapest within the limit;
    where none is within it, the cheapest `REMAT_TRIED` distinct programs again with their loops
    rematerialized (`rematerialized`), then choose. `after(search)`, where given, is called with
    the search so far after each plan (a long run keeps its partial result)."""
    start = time.perf_counter()
    plans = plans if plans is not None else candidate_plans(found, cluster.gpus_per_node)
    costs = (cluster.kernel_estimator(), cluster.grouped_collectives(), cluster.simulator_params())
    done: list[LayoutCandidate] = []
    by_program: dict[str, LayoutCandidate] = {}

    def run(plans, total):
        for plan in plans:
            c = compile_candidate(step, args, found, plan, cluster, costs)
            if c.fingerprint is not None and c.fingerprint in by_program:
                by_program[c.fingerprint].same_program.append(plan.label)
            elif c.fingerprint is not None:
                by_program[c.fingerprint] = c
            done.append(c)
            if say is not None:
                us = "-" if c.iteration_us is None else f"{c.iteration_us / 1e3:.2f} ms"
                gb = "-" if c.peak_bytes is None else f"{c.peak_bytes / 1e9:.2f} GB"
                why = " " + c.why_not if c.why_not else ""
                say(f"{plan.label:60s} {us:>10s} {gb:>10s} ({c.compile_s:.0f} s){why}")
            if after is not None and len(done) < total:
                after(choose(done, list(by_program.values()), memory_limit_bytes, time.perf_counter() - start))
        return choose(done, list(by_program.values()), memory_limit_bytes, time.perf_counter() - start)

    result = run(plans, len(plans))
    if result.chosen is None and memory_limit_bytes is not None:
        again = rematerialized(list(by_program.values()))
        if again and say is not None:
            say(f"no plan fits {memory_limit_bytes} bytes per device; {len(again)} plans again, loops rematerialized")
        result = run(again, len(plans) + len(again)) if again else result
    return result


# How many of the cheapest distinct programs are compiled again with their loops rematerialized
# (each with every policy) where no plan fits the memory limit.
REMAT_TRIED = 4


def rematerialized(distinct: list[LayoutCandidate]) -> list[operators.OperatorPlan]:
    """The cheapest `REMAT_TRIED` compiled plans (`operators.OperatorPlan`s without remat) with each
    `sharding.remat` policy: "dots" recomputes least, "full" keeps only each layer's input."""
    costed = [c for c in distinct if isinstance(c.plan, operators.OperatorPlan) and not c.plan.remat and c.cost]
    cheapest = sorted(costed, key=lambda c: c.iteration_us)[:REMAT_TRIED]
    return [dataclasses.replace(c.plan, remat=policy) for c in cheapest for policy in remat.POLICIES]


def choose(done: list[LayoutCandidate], distinct: list[LayoutCandidate], memory_limit_bytes, seconds: float):
    """The search's result: the cheapest of the `distinct` programs within the limit."""
    fits = [c for c in distinct if memory_limit_bytes is None or (c.peak_bytes or 0) <= memory_limit_bytes]
    if not fits:
        smallest = min(distinct, key=lambda c: c.peak_bytes or 0, default=None)
        reason = f"no plan fits {memory_limit_bytes} bytes per device" + (
            f" (smallest: {smallest.plan.label}, {smallest.peak_bytes})" if smallest else ""
        )
        return LayoutSearch(None, done, reason, seconds)
    chosen = min(fits, key=lambda c: c.iteration_us)
    over = len(distinct) - len(fits)
    reason = f"{chosen.plan.label}: the cheapest compiled of {len(distinct)} distinct programs ({len(done)} plans)" + (
        f" within {memory_limit_bytes} bytes per device ({over} over it)" if memory_limit_bytes else ""
    )
    return LayoutSearch(chosen, done, reason, seconds)


def offline_layout(step, args: tuple, cluster, memory_limit_bytes: int | None) -> dict:
    """What `offline.plan_for_target(layouts=True)` records: the search over every candidate plan
    of the step (`candidate_plans`) for `cluster`, as JSON (the chosen mesh and layout first)."""
    found = mesh_step.structure(step, args)
    return search_layouts(step, args, found, cluster, memory_limit_bytes, say=None).to_json(found)
