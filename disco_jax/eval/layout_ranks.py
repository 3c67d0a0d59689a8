"""How the graph simulator ranks the layout search's candidates against the compiled cost (issue
44): may it prune candidates before they are compiled? Only where its ranking agrees.

The layout search (`layout_search.search_layouts`) compiles every candidate plan deviceless for a
GPU cluster and costs it with the compiled-program model. Here each distinct program of a search
(candidates that compiled to the same program are one point, `LayoutCandidate.same_program`) is
lowered again (`layout_search.lower_plan`), captured at the GPU backend's hook stage
(`_compile.capture_program`, as the decorator and offline plans capture a step; an operator plan
gathers no parameter again, so no re-gather rule applies) and simulated with XLA's default
strategy for its graph (`_strategy.xla_default`) on the cluster's graph cost model as offline
plans use it (`offline.program_costs`: its kernel estimator, its all-reduce model, no simulator
params): the figure an offline plan records as `simulated.iteration_us`. Then Spearman's rho and
Kendall's tau-b (`eval.ranks`) between those and the compiled `iteration_us`, over the programs
the graph simulator could simulate; the others say why (`RankPoint.why_not`) and are counted.

    search = layout_search.search_layouts(step, args, found, cluster)
    ranks = layout_ranks(step, args, found, search.candidates, cluster)
    ranks.spearman, ranks.kendall, [(p.label, p.compiled_us, p.graph_us) for p in ranks.points]
"""

from __future__ import annotations

import dataclasses
import time

from disco_jax import _strategy, backends, layout_search, offline
from disco_jax._compile import capture_program
from disco_jax.cost import simulate
from disco_jax.eval.ranks import kendall_tau, spearman


@dataclasses.dataclass
class RankPoint:
    """One distinct compiled program of a search: its first plan's label, the plans that compiled
    to it too, its compiled cost and its graph-simulated step time (None, with `why_not`, where
    the graph simulator cannot simulate it)."""

    label: str
    same_program: list[str]
    compiled_us: float
    graph_us: float | None = None
    why_not: str | None = None
    capture_s: float = 0.0

    def to_json(self) -> dict:
        return {
            "plan": self.label,
            "same_program_as": list(self.same_program),
            "compiled_us": self.compiled_us,
            "graph_us": self.graph_us,
            "why_not": self.why_not,
            "capture_s": round(self.capture_s, 1),
        }


@dataclasses.dataclass
class LayoutRanks:
    """The points of a search (one per distinct compiled program, in the search's order), the
    rank correlations over those the graph simulator simulated, and how many plans did not
    compile (no point: they have no compiled cost)."""

    points: list[RankPoint]
    spearman: float | None
    kendall: float | None
    not_compiled: int

    @property
    def simulated(self) -> list[RankPoint]:
        return [p for p in self.points if p.graph_us is not None]

    @property
    def left_out(self) -> list[RankPoint]:
        """The distinct programs the graph simulator could not simulate (out of the correlation)."""
        return [p for p in self.points if p.graph_us is None]

    def graph_rank_of_compiled_best(self) -> int | None:
        """Where the compiled model's cheapest simulated program stands in the graph simulator's
        order (1: it is the graph simulator's cheapest too): how many candidates a search pruned by
        the graph simulator would have to keep to keep the compiled choice."""
        points = self.simulated
        if not points:
            return None
        best = min(points, key=lambda p: p.compiled_us)
        return 1 + sum(1 for p in points if p.graph_us < best.graph_us)

    def to_json(self) -> dict:
        return {
            "spearman": self.spearman,
            "kendall_tau_b": self.kendall,
            "programs": len(self.points),
            "simulated": len(self.simulated),
            "left_out": len(self.left_out),
            "not_compiled": self.not_compiled,
            "graph_rank_of_compiled_best": self.graph_rank_of_compiled_best(),
            "points": [p.to_json() for p in self.points],
        }


def graph_simulated_us(lowered, costs) -> float | None:
    """The graph simulator's step time of `lowered` for a GPU target: its program captured at the
    GPU backend's hook stage, XLA's default strategy of its graph simulated on `costs`
    (`offline.program_costs`); None where that strategy is not a valid one."""
    program, _ = capture_program(lowered, backends.GPU)
    simulated = simulate(program, _strategy.xla_default(program.graph), costs.estimator, costs.allreduce)
    return None if simulated is None else simulated.iteration_us


def layout_ranks(step, args, found, candidates, cluster, say=print) -> LayoutRanks:
    """The graph simulator's step time of each distinct compiled program among `candidates`
    (`layout_search.LayoutCandidate`s of one search of `step` on `cluster`) against its compiled
    cost, and their rank correlations. `say`, where given, is called with a line per program."""
    costs = offline.program_costs(cluster)
    points = []
    for c in layout_search.distinct(candidates):
        point = RankPoint(c.plan.label, list(c.same_program), c.iteration_us)
        start = time.perf_counter()
        try:
            lowered, _ = layout_search.lower_plan(step, args, found, c.plan)
            point.graph_us = graph_simulated_us(lowered, costs)
            if point.graph_us is None:
                point.why_not = "XLA's default strategy, read onto the graph, is not a valid strategy"
        except Exception as e:  # the graph simulator's limits are what this measures: say which
            point.why_not = f"{type(e).__name__}: {e}"[:300]
        point.capture_s = time.perf_counter() - start
        points.append(point)
        if say is not None:
            graph = "-" if point.graph_us is None else f"{point.graph_us / 1e3:.2f} ms"
            why = f" {point.why_not}" if point.why_not else ""
            say(f"{point.label:60s} compiled {point.compiled_us / 1e3:8.2f} ms  graph {graph:>10s}{why}")
    simulated = [p for p in points if p.graph_us is not None]
    compiled, graph = [p.compiled_us for p in simulated], [p.graph_us for p in simulated]
    not_compiled = sum(1 for c in candidates if c.cost is None)
    return LayoutRanks(points, spearman(compiled, graph), kendall_tau(compiled, graph), not_compiled)
