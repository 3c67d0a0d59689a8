"""Ranking a step's candidate programs by the compiled-program model.

The graph simulator proposes (the search's best distinct candidates); XLA compiles each, and the
compiled-program model (`cost.compiled`) costs what it compiled. `rank_by_compiled_cost` is the
one ranking every caller uses: the simulated rows (`eval.rows`), offline plans (`offline`) and
the measured search on a GPU (`CompiledRanking`, through `_tuning`). XLA's own program is always
among the ranked, so a plan ranks first only when its compiled cost beats XLA's.

A candidate the GPU rewriter would compile is not compiled where it cannot win
(`rewrite_floor_us`): the rewriter compiles with XLA's all-reduce reassociation off, so it
all-reduces every gradient the graph holds, and where XLA's reassociation sums many of them before
one all-reduce (an unrolled RNN's per-time-step weight gradients) that traffic alone can cost more
than XLA's whole program (docs/collectives.md, "Why rewritten GPU candidates lost").
"""

from __future__ import annotations

import dataclasses
from typing import Any

from disco_jax._compile import Captured, CompiledProgram, compile_program
from disco_jax._graph import Graph
from disco_jax._strategy import Strategy
from disco_jax.backends import Backend
from disco_jax.cost.compiled import CompiledCost, compiled_cost

RANKED_CANDIDATES = 4  # the search's best distinct candidates compiled and ranked by compiled cost
XLA_PROGRAM = "XLA's program"  # the label of XLA's own program among ranked candidates


@dataclasses.dataclass(frozen=True)
class Ranked:
    """One candidate of `rank_by_compiled_cost`: its label, strategy (None for XLA's own
    program), the graph simulator's figure for it (what proposed it), its compiled program, and
    that program's cost by the compiled-program model (None where it was not enacted)."""

    label: str
    strategy: Strategy | None
    graph_us: float | None
    program: CompiledProgram
    cost: CompiledCost | None

    @property
    def compiled_us(self) -> float | None:
        return None if self.cost is None else self.cost.iteration_us

    def to_json(self) -> dict:
        return {
            "label": self.label,
            "graph_simulated_us": self.graph_us,
            "compiled_us": self.compiled_us,
            "program": self.program.to_json(),
            "compiled_cost": None if self.cost is None else self.cost.to_json(),
        }


class ProgramCosts:
    """Compiled programs costed by the compiled-program model (`cost.compiled_cost` with one
    estimator, collective model and simulator params), each distinct program once: a row's
    baselines and candidates often compile to the same program, XLA's own among them. None for a
    program that was not enacted."""

    def __init__(self, backend: Backend, estimator: Any, allreduce: Any, params: Any = None):
        self.backend, self.estimator, self.allreduce, self.params = backend, estimator, allreduce, params
        self._by_text: dict[str, CompiledCost] = {}

    def __call__(self, program: CompiledProgram) -> CompiledCost | None:
        if not program.enacted:
            return None
        text = program.text
        if text not in self._by_text:
            self._by_text[text] = compiled_cost(text, self.backend, self.estimator, self.allreduce, self.params)
        return self._by_text[text]


def rewrite_floor_us(graph: Graph, strategy: Strategy, costed: ProgramCosts) -> float | None:
    """No program the GPU rewriter compiles for `strategy` (of `graph`) costs less than this, by the
    compiled-program model: the rewriter all-reduces every gradient of the graph (reassociation
    off, `backends.gpu.REWRITE_OPTIONS`; XLA must keep the plan's all-reduces or the plan is not
    enacted), the model runs collectives one after another on one stream, and its collective
    costs are subadditive (latency plus bytes over bandwidth, or the lowest of such lines: one
    collective of all the bytes costs no more than any split of them), so the step takes at least
    one all-reduce of all their bytes. None for a strategy that shards updates (compiled by
    relowering, with XLA's own options) or with no gradients."""
    if strategy.sharded:
        return None
    total = sum(g.nbytes for g in graph.gradients)
    if not total:
        return None
    return float(costed.allreduce.time_us(total))


def rank_by_compiled_cost(
    default: CompiledProgram,
    candidates: list[tuple[Strategy, float | None]],
    compile: Any,
    costed: ProgramCosts,
    *,
    default_graph_us: float | None = None,
    floor_us: Any = None,
) -> list[Ranked]:
    """XLA's own program (`default`, compiled) and each candidate (a strategy with the graph
    simulator's figure; `compile(label, strategy)` -> `CompiledProgram`) costed by the
    compiled-program model (`costed`: its estimator, collectives and simulator params; a caller's
    `ProgramCosts` does not cost a program it costed already again), cheapest first; candidates
    that were not enacted come last. XLA's program is always among them, so a plan ranks first
    only when its compiled cost beats XLA's. Candidates are the search's best distinct ones
    (`SearchResult.top`); one equal to XLA's program compiles to it and ties with it (the stable
    sort keeps XLA's first). `floor_us(strategy)`: a lower bound on the candidate's compiled cost
    (`rewrite_floor_us` for one the GPU rewriter enacts; None: none known); a candidate whose
    floor is not below XLA's compiled cost is not compiled (it is ranked as not enacted, with the
    floor as the reason)."""

    ranked = [Ranked(XLA_PROGRAM, None, default_graph_us, default, costed(default))]
    xla_us = ranked[0].compiled_us
    for i, (strategy, graph_us) in enumerate(candidates):
        label = f"candidate {i + 1} ({strategy.origin})"
        floor = None if floor_us is None else floor_us(strategy)
        if floor is not None and xla_us is not None and floor >= xla_us:
            reason = (
                f"not compiled: cannot win, at least {floor:.1f} us (the rewriter all-reduces every gradient, "
                f"reassociation off) against XLA's whole program's {xla_us:.1f} us"
            )
            ranked.append(
                Ranked(
                    label, strategy, graph_us, CompiledProgram(label, "rewrite", {}, "not enacted", reason=reason), None
                )
            )
            continue
        program = compile(label, strategy)
        ranked.append(Ranked(program.name, strategy, graph_us, program, costed(program)))
    return sorted(ranked, key=lambda r: (r.compiled_us is None, r.compiled_us or 0.0))


class CompiledRanking:
    """The measured search's ranking of a round's candidates (`_tuning.MeasuredSearch.pick`):
    called with (strategy, simulated us) pairs, it compiles each through the rewriter, ranks
    them with XLA's own program (`step.default_compiled`) by the compiled-program model with the
    step's cost model (`rank_by_compiled_cost`), and returns those whose compiled program costs
    less than XLA's, cheapest first. `rounds`: every ranking, as recorded in the plan."""

    def __init__(self, step: Captured, cost_model: Any):
        self.step, self.cost_model, self.rounds = step, cost_model, []
        self.xla = CompiledProgram(XLA_PROGRAM, "compile options", {}, "compiled", step.default_compiled)

    @classmethod
    def of(cls, step: Captured, cost_model: Any) -> CompiledRanking | None:
        """A ranking where the step's graph is read before XLA's own fusion
        (`Backend.decisions_stage`: XLA:GPU), whose groups are then not the kernels XLA compiles;
        None elsewhere (XLA:CPU: the graph's groups are the executable's kernels)."""
        return cls(step, cost_model) if step.backend.decisions_stage is not None else None

    def __call__(self, candidates: list[tuple[Strategy, float]]) -> list[tuple[Strategy, float]]:
        step, model = self.step, self.cost_model
        ranked = rank_by_compiled_cost(
            self.xla,
            candidates,
            lambda label, s: compile_program(step.lowered, step.program, label, s, None),
            costs := ProgramCosts(step.backend, model.estimator, model.allreduce, model.params),
            floor_us=lambda s: rewrite_floor_us(step.graph, s, costs),
        )
        self.rounds.append([r.to_json() for r in ranked])
        xla_us = self.xla_us = next(r.compiled_us for r in ranked if r.strategy is None)
        return [
            (r.strategy, r.graph_us) for r in ranked if r.strategy is not None and (r.compiled_us or xla_us) < xla_us
        ]
