"""Measured search: the search proposes, the devices decide.

A search that trusts its model finds the model's errors (the winner's curse). As TVM's Ansor and
XLA's autotuner do, the best few distinct candidates of the search are compiled through the
rewriter and timed for real against XLA's plan, and what was measured flows back into the model
before the search goes on:

    search ── top k ── compile, time against XLA's plan (interleaved pairs), trace kernels ──┐
      ↑                                                                                       │
      └─ measured kernels into the table; simulator recalibrated over every measured ─────────┘
         configuration; measured candidates cost what was measured; the next round
         starts from the best measured candidate

On XLA:GPU only candidates that compile below XLA's program are timed (`_ranking.CompiledRanking`).
The loop ends when its budget (`TuningConfig`), its rounds or new candidates run out; where the
search offered packing, its cheapest packing candidate is measured before the loop ends whatever
the budget. The candidate measured fastest goes to validation (the acceptance rule,
`_search_phase.validate`); when no candidate measured faster than XLA's plan, XLA's plan is kept
with that evidence.

Multi-process jobs: timing and tracing run the step (collectives), so every process measures the
same candidates in the same order. Process 0 alone searches and picks; it broadcasts each
candidate before it is measured (None ends the loop), and a pair's ratio is that of the job's
steps, each at its slowest process (`_distributed.slowest_pairs`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from disco_jax import _distributed, _profile_phase, _search, _validate, cost
from disco_jax._console import Ui
from disco_jax._program import Program
from disco_jax._ranking import CompiledRanking
from disco_jax._strategy import Strategy, kernel_dag, xla_default


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """candidates: distinct candidates timed per round (k). pairs: interleaved timing pairs per
    candidate. max_rounds: rounds of search and measurement (the first round's search is the
    search phase's own). budget_s: wall-clock limit of the loop; None: `budget_share` of the
    search's `budget_s`. The first candidate is measured whatever the budget, and so is the
    search's cheapest packing candidate where it offered packing (`MeasuredSearch.packing_candidate`).
    research_share: the search budget of each later round, as a share of the search's (at most half
    the time left). kernel_steps: traced steps per candidate for its kernel times."""

    candidates: int = 4
    pairs: int = 8
    max_rounds: int = 3
    budget_s: float | None = None
    budget_share: float = 0.5
    research_share: float = 0.25
    kernel_steps: int = 3

    def loop_budget_s(self, search: _search.SearchConfig) -> float:
        return self.budget_s if self.budget_s is not None else self.budget_share * search.budget_s


@dataclasses.dataclass
class Measurement:
    """One candidate on the devices: its interleaved timing against XLA's plan, its kernels' times
    by their ops (the kernels the simulator costs), the all-reduces XLA kept (None: unknown), its
    outputs against the step's (`Captured.output_check`; None: not checked), and whether XLA kept
    the collectives the hook returned (`_compile.keeps_plan`; None: the all-reduces decide)."""

    timing: _validate.Timing
    kernel_times: dict[frozenset[int], float] = dataclasses.field(default_factory=dict)
    allreduces: int | None = None
    outputs: _validate.Comparison | None = None
    kept: bool | None = None


Measure = Callable[[Strategy], Measurement]


@dataclasses.dataclass
class Record:
    """A measured candidate: its round, what the model predicted when it was picked (time and
    ratio to XLA's plan, both simulated), and what was measured (None: it failed, see `error`)."""

    round: int
    strategy: Strategy
    predicted_us: float
    predicted_ratio: float
    measurement: Measurement | None
    error: str | None = None
    kernels_added: int = 0

    @property
    def wrong(self) -> bool:
        """Measured, and its outputs failed the output check."""
        m = self.measurement
        return m is not None and m.outputs is not None and not m.outputs.within_tolerance

    @property
    def ineligible(self) -> str | None:
        """Why the candidate cannot be chosen, None where it can: measured, its outputs right, and
        XLA kept the planned collectives (else another program ran)."""
        m, buckets = self.measurement, len(self.strategy.buckets)
        if m is None or self.wrong:
            return f"failed ({self.error})" if m is None else "outputs outside the output check"
        kept = m.kept if m.kept is not None else m.allreduces in (None, buckets)
        return None if kept else "XLA compiled other collectives than the plan's"

    @property
    def eligible(self) -> bool:
        return self.ineligible is None

    @property
    def measured_ratio(self) -> float:
        return self.measurement.timing.ratio if self.measurement is not None else math.inf

    def to_json(self) -> dict:
        t = None if self.measurement is None else self.measurement.timing
        out = {
            "round": self.round,
            "origin": self.strategy.origin,
            "predicted_us": self.predicted_us,
            "predicted_ratio": self.predicted_ratio,
            "measured_us": None if t is None else t.plan_us,
            "measured_ratio": None if t is None else t.ratio,
            "ratio_iqr": None if t is None else [t.ratio_low, t.ratio_high],
            "ratio_ci95": None if t is None else list(t.ratio_ci95),
            "verdict": None if t is None else t.verdict,
            "packed": self.strategy.packed,
            "pairs": 0 if t is None else t.pairs,
            "default_us": None if t is None else t.default_us,
            "allreduces": {
                "planned": len(self.strategy.buckets),
                "compiled": None if self.measurement is None else self.measurement.allreduces,
            },
            "kernels_added": self.kernels_added,
        }
        outputs = None if self.measurement is None else self.measurement.outputs
        if outputs is not None:
            out["outputs"] = {"check": outputs.check, "within_tolerance": outputs.within_tolerance}
        if self.ineligible is not None:
            out["ineligible"] = self.ineligible
        return out


@dataclasses.dataclass
class Tuned:
    """The loop's outcome. best: the candidate measured fastest when it measured faster than XLA's
    plan, else XLA's plan; reason and evidence: why XLA's plan is kept (the fastest candidate's
    timing), None / {} when a candidate goes to validation or nothing could be measured."""

    best: Strategy
    records: list[Record]
    recalibration: dict | None
    rounds: list[dict]
    stop_reason: str
    seconds: dict[str, float]  # total, and measuring / learning / searching
    rankings: list[dict] = dataclasses.field(default_factory=list)  # per round, by compiled cost
    reason: str | None = None
    evidence: dict = dataclasses.field(default_factory=dict)
    kernel_times_us: dict[str, float] = dataclasses.field(default_factory=dict)  # measured, by signature

    def to_json(self) -> dict:
        """The plan's `search` entries: every measured candidate (`picked`: the one sent to
        validation), the last recalibration, the loop."""
        picked = self.best.key() if self.reason is None else None  # the candidate sent to validation
        return {
            "measured_candidates": [
                {**r.to_json(), "picked": r.measurement is not None and r.strategy.key() == picked}
                for r in self.records
            ],
            "recalibration": self.recalibration,
            "tuning": {"rounds": self.rounds, "stop_reason": self.stop_reason, "seconds": self.seconds},
            **({"compiled_ranking": self.rankings} if self.rankings else {}),
        }


def measured_table(cost_model: cost.CostModel) -> cost.TableEstimator:
    """The measured table of the cost model's estimator chain (put first when there is none)."""
    for estimator in cost_model.estimator.estimators:
        if isinstance(estimator, cost.TableEstimator):
            return estimator
    table = cost.TableEstimator({})
    cost_model.estimator = cost.chain(table, *cost_model.estimator.estimators)
    return table


def recalibrate(
    program: Program, cost_model: cost.CostModel, points: Sequence[tuple[Strategy, float, str]]
) -> cost.Calibrated | None:
    """Fit the simulator's parameters (`disco_jax.cost.calibrate`) to every measured configuration
    given as (strategy, measured us, label), distinct by key: the ones the calibrate phase fits
    (`_profile_phase.CALIBRATED`; the step's fixed cost stays as measured, else it would absorb
    everything the configurations share and leave no compute). Sets `cost_model.params` when the
    fit reproduces the points better than the parameters it started from (a noisy point can make
    the least-squares optimum a degenerate one). Returns what `calibrate` fitted, None with fewer
    than two configurations."""
    unique: dict = {}
    for s, us, label in points:
        if us > 0 and kernel_dag(program, s) is not None:
            unique.setdefault(s.key(), (s, cost.kernel_state(program, s), float(us), label))
    if len(unique) < 2:
        return None
    strategies, states, measured, labels = zip(*unique.values())

    def simulate_at(params: cost.SimulatorParams) -> list[float]:
        return [
            cost.simulate(program, s, cost_model.estimator, cost_model.allreduce, params, state=st).iteration_us
            for s, st in zip(strategies, states)
        ]

    free = _profile_phase.calibrated_free(len(measured))
    fitted = cost.calibrate(simulate_at, measured, free=free, start=cost_model.params, labels=labels)
    before = [abs(s - m) / m for s, m in zip(simulate_at(cost_model.params), measured)]
    if float(np.sum(np.square(before))) >= sum(p.error**2 for p in fitted.points):
        cost_model.params = fitted.params
    return fitted


def packs(s: Strategy) -> bool:
    """`s` packs all-reduce buckets into flat buffers (its buckets, or its loop bodies')."""
    return s.packed or s.packed_loops


class MeasuredSearch:
    """Process 0's side of the loop: which candidate to time next (`next`), what was measured
    (`record`), what the model learns from it (`learn`), and the outcome (`finish`).

    `first` is the search phase's own search (round 0); `points`, configurations measured before
    the loop (strategy, measured ratio to XLA's plan, label); `rank`, a `_ranking.CompiledRanking`."""

    def __init__(
        self,
        program: Program,
        cost_model: cost.CostModel,
        first: _search.SearchResult,
        search: _search.SearchConfig,
        tuning: TuningConfig,
        points: Sequence[tuple[Strategy, float, str]] = (),
        ui: Ui | None = None,
        rank: CompiledRanking | None = None,
    ):
        self.program, self.cost_model, self.search, self.tuning = program, cost_model, search, tuning
        self.points, self.ui, self.rank = list(points), ui or Ui(False), rank
        self.default = xla_default(program.graph)
        self.started = time.perf_counter()
        self.budget_s = tuning.loop_budget_s(search)
        self.records: list[Record] = []
        self.measured: dict = {}  # key -> Record
        self.fresh: list[Record] = []  # measured since the model last learned
        self.rounds: list[dict] = []
        self.round = 0
        self.recalibration: dict | None = None
        self.stop_reason: str | None = None
        self.pending: tuple | None = None
        self.seconds = {"measuring": 0.0, "learning": 0.0, "searching": 0.0}
        self.kernel_times_us: dict[str, float] = {}  # what the loop added to the measured table
        self.default_us = self.simulate(self.default)
        self.queue = self.pick(first)
        self.owed = self.packing_candidate(first)

    def simulate(self, s: Strategy) -> float | None:
        r = self.cost_model.simulate(self.program, s)
        return None if r is None else r.iteration_us

    def cost(self, s: Strategy) -> float | None:
        """A strategy's cost for the search: what it measured (its ratio to XLA's plan, in simulated
        units), for a candidate measured already; None for one that failed or computed other
        outputs; else simulated."""
        r = self.measured.get(s.key())
        if r is not None and (r.measurement is None or r.wrong):
            return None
        if r is not None and r.eligible:
            return r.measured_ratio * self.default_us
        return self.simulate(s)

    def pick(self, result: _search.SearchResult) -> list[tuple[Strategy, float, float]]:
        """The next round's candidates: the search's cheapest distinct ones (its best first), never
        XLA's plan nor one measured already; with predicted time and ratio to XLA's plan."""
        exclude = set(self.measured) | {self.default.key()}
        top = result.top(self.tuning.candidates, exclude)
        return [(s, c, c / self.default_us) for s, c in (self.rank(top) if self.rank and top else top)]

    def packing_candidate(self, result: _search.SearchResult) -> tuple[Strategy, float, float] | None:
        """The search's cheapest packing candidate (buckets packed into flat buffers, `packs`), owed
        a measurement whatever the budget where the search offered packing (a backend that packs,
        XLA:CPU). Ordered by predicted time alone, a packing candidate the simulator costs near XLA's
        plan came after the budget on the gloo Transformer row and three cpu-2dev rows (issue 46),
        yet packing is what the frameworks the rows compare against do. The packed start is rebuilt where the search's
        `KEEP` cheapest crowded it out. None where packing was not offered."""
        exclude = set(self.measured) | {self.default.key()}
        for c, s in result.candidates:
            if packs(s) and s.key() not in exclude:
                return s, c, c / self.default_us
        for field, origin in (("packed", "xla+packed-allreduce"), ("packed_loops", "xla+packed-loop-allreduce")):
            if origin in result.start_costs:
                c = result.start_costs[origin]
                return dataclasses.replace(self.default, origin=origin, **{field: True}), c, c / self.default_us
        return None

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def next(self) -> Strategy | None:
        """The candidate to measure next, or None when the loop is over."""
        while self.stop_reason is None:
            if self.queue and (not self.records or self.elapsed() < self.budget_s):
                self.pending = self.queue.pop(0)
                return self.pending[0]
            if self.fresh:
                self.learn()
            owed, self.owed = self.owed, None  # the packing candidate, where none packed was measured
            if (
                owed is not None
                and owed[0].key() not in self.measured
                and not any(packs(r.strategy) for r in self.records)
            ):
                self.pending = owed
                return owed[0]
            if not self.records:
                self.stop_reason = "no candidate besides XLA's plan"
            elif self.elapsed() >= self.budget_s:
                self.stop_reason = f"time budget of {self.budget_s:g} s spent"
            elif self.round + 1 >= self.tuning.max_rounds:
                self.stop_reason = f"{self.tuning.max_rounds} rounds"
            else:
                self.research()
                if not self.queue:
                    self.stop_reason = "no new candidate"
        return None

    def record(self, measurement: Measurement | None, error: str | None = None, seconds: float = 0.0) -> Record:
        """What measuring the pending candidate gave (in `seconds`)."""
        self.seconds["measuring"] += seconds
        s, predicted_us, predicted_ratio = self.pending
        r = Record(self.round, s, predicted_us, predicted_ratio, measurement, error)
        self.records.append(r)
        self.measured[s.key()] = r
        self.fresh.append(r)
        if measurement is None:
            self.ui.say(f"candidate {len(self.records)} ({s.origin}) could not be measured: {error}")
        else:
            t = measurement.timing
            self.ui.say(
                f"candidate {len(self.records)} (round {self.round}, {s.origin}): simulated "
                f"{predicted_ratio:.3f}x, measured {t.ratio:.3f}x [{t.ratio_low:.3f}-{t.ratio_high:.3f}] "
                f"over {t.pairs} pairs"
            )
        return r

    def learn(self) -> None:
        """Measured kernel times into the table (kernels it lacks), and the simulator recalibrated
        over every configuration measured: XLA's plan, those measured before the loop, and each
        candidate at its measured ratio times XLA's median measured step."""
        started = time.perf_counter()
        graph, table = self.program.graph, measured_table(self.cost_model)
        for r in self.fresh:
            for members, t in (r.measurement.kernel_times if r.measurement is not None else {}).items():
                signature = graph.kernel_signature(members)
                if signature not in table.times_us:
                    table.times_us[signature] = self.kernel_times_us[signature] = float(t)
                    r.kernels_added += 1
        self.fresh = []
        self.cost_model.estimator = cost.chain(*self.cost_model.estimator.estimators)  # forget cached estimates
        measured = [r for r in self.records if r.eligible]
        if measured:
            reference = float(np.median([r.measurement.timing.default_us for r in measured]))
            points = [(self.default, reference, "xla")] + [
                (s, ratio * reference, label) for s, ratio, label in self.points
            ]
            points += [(r.strategy, r.measured_ratio * reference, r.strategy.origin) for r in measured]
            try:
                fitted = recalibrate(self.program, self.cost_model, points)
            except ValueError as e:  # keep the parameters the search ran with
                self.recalibration = {"error": str(e)}
            else:
                if fitted is not None:
                    self.recalibration = {**fitted.to_json(), "applied": self.cost_model.params == fitted.params}
        self.default_us = self.simulate(self.default)
        self.seconds["learning"] += time.perf_counter() - started
        added = sum(r.kernels_added for r in self.records)
        fit = self.recalibration or {}
        self.ui.say(
            f"model updated from {len(self.records)} measured candidates: {added} kernel times added"
            + (f"; simulator recalibrated, misfit {fit['misfit']:.1%}" if "misfit" in fit else "")
        )

    def research(self) -> None:
        """A new round of the search, from the best measured candidate and XLA's plan, costed by
        the updated model (measured candidates at their measured cost)."""
        self.round += 1
        measured = [r for r in self.records if r.eligible]
        starts = [min(measured, key=lambda r: r.measured_ratio).strategy] if measured else []
        starts.append(self.default)
        left = self.budget_s - self.elapsed()
        budget = max(0.05, min(self.tuning.research_share * self.search.budget_s, left / 2))
        config = dataclasses.replace(self.search, budget_s=budget, seed=self.search.seed + self.round)
        result = _search.backtracking_search(self.program, self.cost, config, starts=starts)
        self.queue = self.pick(result)
        self.seconds["searching"] += result.seconds
        self.rounds.append(
            {
                "round": self.round,
                "start": starts[0].origin,
                "evaluated": result.evaluated,
                "seconds": result.seconds,
                "best_ratio": result.best_cost / self.default_us,
                "candidates": len(self.queue),
            }
        )

    def finish(self) -> Tuned:
        if self.fresh:
            self.learn()
        stop = self.stop_reason or "ended"
        measured = [r for r in self.records if r.eligible]
        fastest = min(measured, key=lambda r: r.measured_ratio, default=None)
        seconds, ranked = {"total": self.elapsed(), **self.seconds}, self.rank.rounds if self.rank else []
        tuned = Tuned(self.default, self.records, self.recalibration, self.rounds, stop, seconds, ranked)
        tuned.kernel_times_us = dict(self.kernel_times_us)
        if fastest is not None and fastest.measured_ratio < 1.0:
            tuned.best = fastest.strategy
        elif fastest is not None:
            t = fastest.measurement.timing
            tuned.reason = (
                f"no measured candidate was faster than XLA's plan: the fastest of {len(self.records)}, "
                f"{fastest.strategy.origin}, measured {t.ratio:.3f}x the default step time over {t.pairs} pairs "
                f"(simulated {fastest.predicted_ratio:.3f}x)"
            )
            tuned.evidence = {**t.to_json(), "candidate": fastest.strategy.origin, "source": "measured candidates"}
        elif self.records:
            why = "; ".join(sorted({r.ineligible for r in self.records}))
            tuned.reason = f"none of the {len(self.records)} candidates could be measured: {why}"
        return tuned


def measured_search(
    program: Program,
    cost_model: cost.CostModel,
    first: _search.SearchResult | None,
    search: _search.SearchConfig,
    tuning: TuningConfig,
    measure: Measure,
    *,
    scope: str | None = None,
    points: Sequence[tuple[Strategy, float, str]] = (),
    ui: Ui | None = None,
    rank: CompiledRanking | None = None,
) -> Tuned | None:
    """Run the loop with `measure` (`device_measure` on the devices; tests pass their own).
    Process 0 is the one given `first` (its search phase's search): it picks, learns and gets the
    `Tuned`; in a multi-process job (`scope`) the others measure what it broadcasts and get None."""
    loop = MeasuredSearch(program, cost_model, first, search, tuning, points, ui, rank) if first is not None else None
    graph = program.graph
    timeout_s = _distributed.sync_timeout_s() + tuning.loop_budget_s(search) + search.budget_s
    for index in itertools.count():
        strategy = loop.next() if loop is not None else None
        if scope is not None:
            data = None if strategy is None else strategy.to_json(graph)
            data = _distributed.broadcast_json(f"{scope}/tuning/{index}", data, timeout_s=timeout_s)
            strategy = None if data is None else Strategy.from_json(graph, data)
        if strategy is None:
            break
        started = time.perf_counter()
        try:
            measurement, error = measure(strategy), None
        except Exception as e:  # a candidate XLA cannot compile or run is recorded, not fatal
            measurement, error = None, f"{type(e).__name__}: {e}"
        if loop is not None:
            loop.record(measurement, error, time.perf_counter() - started)
    return loop.finish() if loop is not None else None
