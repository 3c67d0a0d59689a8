"""The joint search over fusion, buckets and which gradients' updates to shard (`search_sharding`),
run on the replicated step's graph for `weight_update="search"` (`choice.choose`): the search's
`shard_update` move over the gradients whose state is a layout's leaves (`gradient_leaves`), each
strategy costed as `cost.sharded` models it (reduce-scatter, 1/N update, all-gather) and, under a
memory limit, valid only where its estimated footprint fits (`_WithinLimit`). Its pick is one of
the choice's program candidates."""

from __future__ import annotations

from disco_jax import _search, _strategy
from disco_jax._compile import Captured
from disco_jax.cost.sharded import UpdateRegions, regions_of
from disco_jax.sharding import update


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
    cost = model.evaluator(step.program)
    if (
        limit is not None
        and replicated_bytes is not None
        and regions.saved_bytes(shardable) >= replicated_bytes - limit
    ):
        cost = _WithinLimit(cost, regions, replicated_bytes, limit)
    result = _search.backtracking_search(
        step.program, cost, config, moves=_strategy.with_sharding(shardable), starts=starts
    )
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
