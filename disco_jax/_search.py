"""Backtracking search over joint fusion strategies (DisCo Algorithm 1).

A priority queue holds candidate strategies by simulated cost. Each step dequeues the cheapest,
applies every move a random number of times in 0..beta, and keeps the result as the best if it
is cheaper, re-enqueueing it when its cost is within alpha of the best. The search ends when the
queue is empty, the best has not changed for `max_unchanged` candidates, or the time budget is
spent. Candidates already seen are not simulated twice. `SearchConfig.mode` adds what FlexFlow's
search does where Algorithm 1 stalls (its queue empties quickly with alpha = 1.05): restarts from
the cheapest candidates kept, or a Metropolis (MCMC) walk.

`SearchResult.top(k)` keeps the cheapest distinct candidates the search costed (`KEEP` of them), so
the measured search (`disco_jax._tuning`) can time the best few for real without simulating them
again, and a later round can start from a measured candidate (`starts=`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import heapq
import itertools
import math
import random
import time
from collections.abc import Callable, Collection, Mapping

from disco_jax._program import Program
from disco_jax._strategy import MOVES, Move, Strategy, start_candidates

MODES = ("backtracking", "restarts", "mcmc")
KEEP = 64  # distinct candidates a SearchResult keeps for `top`, cheapest first


@dataclasses.dataclass(frozen=True)
class SearchConfig:
    """alpha: keep exploring candidates within alpha x best cost (>= 1). beta: each move is
    applied Random(0, beta) times per step. max_unchanged: stop after this many candidates
    without a new best (the paper's 1000). budget_s: wall-clock limit. max_queue: memory bound.
    mode: Algorithm 1, with restarts, or an MCMC walk (below); temperature: the walk's."""

    alpha: float = 1.05
    beta: int = 10
    max_unchanged: int = 1000
    budget_s: float = 60.0
    seed: int = 0
    max_queue: int = 4096
    # 'backtracking': Algorithm 1. 'restarts': when its queue empties before the other stops,
    # refill it with the cheapest candidates kept. 'mcmc': FlexFlow's Metropolis walk: one current
    # strategy, a candidate replaces it when cheaper, or with probability exp(-(c/current - 1)/temperature).
    mode: str = "backtracking"
    temperature: float = 0.01

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be positive, got {self.temperature}")
        if self.alpha < 1.0:
            raise ValueError(f"alpha must be >= 1, got {self.alpha}")
        if self.beta < 1:
            raise ValueError(f"beta must be a positive integer, got {self.beta}")
        if self.budget_s <= 0:
            raise ValueError(f"budget_s must be positive, got {self.budget_s}")


@dataclasses.dataclass
class SearchResult:
    best: Strategy
    best_cost: float
    start_costs: dict[str, float]  # cost of each start candidate by origin
    evaluated: int  # candidates simulated
    invalid: int  # candidates rejected as invalid (cycles)
    duplicates: int  # candidates already seen
    improvements: int
    seconds: float
    stop_reason: str
    restarts: int = 0  # times the queue was refilled (mode 'restarts')
    # The cheapest distinct valid candidates costed (starts included), as (cost, strategy), cheapest first.
    candidates: list[tuple[float, Strategy]] = dataclasses.field(default_factory=list, repr=False)

    @property
    def candidates_per_second(self) -> float:
        return self.evaluated / self.seconds if self.seconds > 0 else 0.0

    def top(self, k: int, exclude: Collection = ()) -> list[tuple[Strategy, float]]:
        """The `k` cheapest distinct candidates (by `Strategy.key()`) the search costed, with their
        costs, cheapest first, leaving out those whose key is in `exclude`. Nothing is simulated:
        the costs are those the search computed (at most `KEEP` candidates are kept)."""
        out: list[tuple[Strategy, float]] = []
        taken = set(exclude)
        for c, s in self.candidates:
            if len(out) >= k:
                break
            key = s.key()
            if key not in taken:
                taken.add(key)
                out.append((s, c))
        return out

    def stats(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("best", "candidates")}
        d["candidates_per_second"] = round(self.candidates_per_second, 1)
        return d


@contextlib.contextmanager
def _fewer_collections():
    """CPython's cyclic collector, tuned for a search: it allocates millions of small containers
    that die young by reference counting or live on in its queue, and forms no reference cycles
    (tests/test_search.py), yet the collector traverses the young ones every 700 net allocations:
    1.0-1.4 s of a 10 s search of transformer:tiny or resnet50:paper. For the search the young
    generation is collected every 100,000 net allocations (0.01-0.17 s), restored after. Nothing
    is frozen (`gc.freeze`): CPython 3.12 starts with objects frozen, and `gc.unfreeze` would thaw
    those and any a host program froze before forking."""
    threshold = gc.get_threshold()
    gc.set_threshold(max(threshold[0], 100_000), *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)


def backtracking_search(
    program: Program,
    cost: Callable[[Strategy], float | None],
    config: SearchConfig = SearchConfig(),
    *,
    moves: Mapping[str, Move] = MOVES,
    starts: list[Strategy] | None = None,
    progress: Callable[[float, int, float], None] | None = None,
) -> SearchResult:
    """Search `program`'s strategies from `starts` (default: XLA's plan, the unfused graph and
    their variants; a later round of the measured search starts from its best measured candidate).

    `cost(strategy)` returns the simulated iteration time, or None for an invalid strategy; a
    `cost.many(strategies, parent=)` (`cost.SimulatedCost`), when there is one, costs the
    candidates of one step together, from the state of the strategy their moves started from.
    `progress(best_cost, evaluated, elapsed_s)` is called after every step."""
    with _fewer_collections():
        return _search(program, cost, config, moves, starts, progress)


def _search(
    program: Program,
    cost: Callable[[Strategy], float | None],
    config: SearchConfig,
    moves: Mapping[str, Move],
    starts: list[Strategy] | None,
    progress: Callable[[float, int, float], None] | None,
) -> SearchResult:
    rng = random.Random(config.seed)
    started = time.perf_counter()
    evaluate_many = getattr(cost, "many", None) or (lambda strategies, parent: [cost(s) for s in strategies])
    tie = itertools.count()
    seen: set = set()
    queue: list = []
    kept: list = []  # the KEEP cheapest candidates as (-cost, -n, strategy): the dearest on top
    start_costs: dict[str, float] = {}
    best, best_cost = None, float("inf")

    def keep(c: float, s: Strategy) -> None:
        entry = (-c, -next(tie), s)
        if len(kept) < KEEP:
            heapq.heappush(kept, entry)
        elif entry > kept[0]:
            heapq.heapreplace(kept, entry)

    if starts is None:
        starts = start_candidates(program.graph, getattr(program.backend, "packs_buckets", False))
    for s in starts:
        key = s.key()
        new = key not in seen
        c = cost(s)
        seen.add(key)
        if c is None:
            continue
        start_costs[s.origin] = c
        if new:
            keep(c, s)
        heapq.heappush(queue, (c, next(tie), s))
        if c < best_cost:
            best, best_cost = s, c
    if best is None:
        raise ValueError("no valid start strategy for this module")
    evaluated, invalid, duplicates, improvements, unchanged, restarts = len(start_costs), 0, 0, 0, 0, 0
    stop = "queue empty"
    if config.mode == "mcmc":
        queue = [min(queue)]  # the walk starts from the cheapest start
    while True:
        if not queue:
            if config.mode != "restarts" or not kept:
                break
            restarts += 1
            queue = [(-negative, next(tie), s) for negative, _, s in kept]
            heapq.heapify(queue)
        if unchanged >= config.max_unchanged:
            stop = f"best unchanged for {config.max_unchanged} candidates"
            break
        if time.perf_counter() - started > config.budget_s:
            stop = f"time budget of {config.budget_s:g} s spent"
            break
        current_cost, _, current = heapq.heappop(queue)
        walk_to = None
        step: list[Strategy] = []  # this step's new candidates, evaluated together
        root = dataclasses.replace(current, rehomed=frozenset())  # the moves record what they re-home
        for move in moves.values():
            candidate = root
            for _ in range(rng.randint(0, config.beta)):
                nxt = move(program, candidate, rng)
                if nxt is not None:
                    candidate = nxt
            if candidate is root:
                continue
            key = candidate.key()
            if key in seen:
                duplicates += 1
                unchanged += 1
                continue
            seen.add(key)
            step.append(candidate)
        for candidate, c in zip(step, evaluate_many(step, parent=current) if step else []):
            evaluated += 1
            if c is None:
                invalid += 1
                continue
            candidate = dataclasses.replace(candidate, origin=f"search({candidate.origin.split('(')[-1].rstrip(')')})")
            keep(c, candidate)
            if c < best_cost:
                best, best_cost = candidate, c
                improvements += 1
                unchanged = 0
            else:
                unchanged += 1
            if config.mode == "mcmc":
                if walk_to is None and (
                    c < current_cost or rng.random() < math.exp(-(c / current_cost - 1) / config.temperature)
                ):
                    walk_to = (c, next(tie), candidate)
            elif c <= config.alpha * best_cost:
                heapq.heappush(queue, (c, next(tie), candidate))
        if config.mode == "mcmc":
            queue = [walk_to or (current_cost, next(tie), current)]
        if len(queue) > config.max_queue:
            queue = heapq.nsmallest(config.max_queue // 2, queue)
            heapq.heapify(queue)
        if progress is not None:
            progress(best_cost, evaluated, time.perf_counter() - started)
    return SearchResult(
        best,
        best_cost,
        start_costs,
        evaluated,
        invalid,
        duplicates,
        improvements,
        time.perf_counter() - started,
        stop,
        restarts,
        [(-negative, s) for negative, _, s in sorted(kept, reverse=True)],
    )
