"""A joint fusion strategy and the search moves that change it.

A `Strategy` says, over one `Graph` (op and gradient ids; its structural functions take the graph):

* `groups`: fusion groups of fusible ops. A group of two or more ops becomes one loop fusion; a
  group of one op is that op unfused. Groups may overlap: an op in several groups is recomputed in
  each (DisCo's *duplicate* fusion).
* `homes[op]`: the group whose kernel hands the op's value to consumers outside the groups that
  compute it themselves. When a consumer group is fused with a producer that has other users, the
  producer's home either stays (duplicate fusion: the producer kernel still runs for the others) or
  moves into the merged group (non-duplicate: a multi-output fusion, the value is ready only when
  the whole fused kernel ends).
* `buckets`: which gradients each all-reduce carries; issued once its last gradient is ready.
* `sharded`: the gradients whose weight update is sharded over the data-parallel devices
  (reduce-scatter, update of one Nth, all-gather; `cost.sharded`). A bucket's gradients are all
  sharded or none. The rewrite does not enact it: the program is lowered again with the state
  sharded (`sharding.choice`), and only the simulator reads it on the replicated graph.

The moves, and whatever asks whether the compiler can emit a strategy (`emittable`, `kernel_dag`,
`is_valid`), take the `_program.Program`: the graph with the compiler it was captured for.
`kernel_dag` turns a strategy into kernels (groups, opaque ops, all-reduce buckets) with their
dependencies in a topological order, or None for a cycle; the rewrite emits in that order. The
simulator keeps its own kernel graph (`cost.kernels.KernelState`), which the search derives from a
candidate's parent instead of building it again.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from disco_jax._edit import StrategyEdit, group_index

if TYPE_CHECKING:
    from disco_jax._graph import Graph
    from disco_jax._program import Program

GROUP, OPAQUE, BUCKET = "group", "opaque", "bucket"


@dataclasses.dataclass(frozen=True)
class Strategy:
    groups: tuple[frozenset[int], ...]
    homes: tuple[int, ...]  # per op id: index into groups, or -1 for ops that are not fusible
    buckets: tuple[tuple[int, ...], ...]
    origin: str = ""
    sharded: frozenset[int] = frozenset()
    # Per op, the groups holding it (`_edit.group_index`): the moves hand it from parent to child
    # updated, and refuse any change the backend cannot emit, so a strategy that has one is
    # emittable when its first ancestor was (`kernel_dag` checks only those without); None: built
    # when a move first needs it.
    index: tuple[tuple[int, ...], ...] | None = dataclasses.field(default=None, compare=False, repr=False)
    # The ops whose home the moves changed since the strategy they started from (the search
    # starts each step's moves from an empty set): with the group and bucket changes, what
    # `cost.kernels.derive` rebuilds of that strategy's kernel graph. None: unknown.
    rehomed: frozenset[int] | None = dataclasses.field(default=None, compare=False, repr=False)
    # Every bucket of several gradients packed into one flat buffer (concatenated, one all-reduce,
    # split), as PyTorch DDP and Horovod run theirs; else one variadic all-reduce. Where the
    # backend packs (`Backend.packs_buckets`); a sharded bucket's reduce-scatter is never packed.
    packed: bool = False
    # The all-reduces in the step's loop bodies (a scanned step's per-layer gradients) packed the same
    # way, one flat buffer per all-reduce and iteration: the plan's one decision inside an opaque loop.
    packed_loops: bool = False

    def group_index(self) -> tuple[tuple[int, ...], ...]:
        return self.index if self.index is not None else group_index(self.groups, len(self.homes))

    # `key()`, computed once (the search asks for it at every turn)
    _key: list = dataclasses.field(default_factory=list, init=False, compare=False, repr=False)

    def key(self) -> tuple:
        """Identity of the decisions (group order and origin do not matter)."""
        if not self._key:
            self._key.append((self.fusion_key(), frozenset(self.buckets), self.sharded, self.packed, self.packed_loops))
        return self._key[0]

    def fusion_key(self) -> tuple:
        """Identity of the op-fusion decisions alone: two strategies with equal fusion keys
        compute every value with the same kernels (only their all-reduces may differ): the set
        of groups, and per op the members of its home group (None for ops no group holds)."""
        by_index = [*self.groups, None]  # a home of -1 reads None
        return frozenset(self.groups), tuple(map(by_index.__getitem__, self.homes))

    @property
    def fused_groups(self) -> list[frozenset[int]]:
        return [g for g in self.groups if len(g) > 1]

    def to_json(self, graph: Graph) -> dict:
        """Decisions by op and gradient names, so a plan is readable and checkable."""
        names = [op.name for op in graph.ops]
        return {
            "groups": [
                {"ops": sorted(names[o] for o in g), "exports": sorted(names[o] for o in g if self.homes[o] == i)}
                for i, g in enumerate(self.groups)
                if len(g) > 1
            ],
            "buckets": [[graph.gradients[gid].result_name for gid in b] for b in self.buckets],
            "sharded": sorted(graph.gradients[gid].result_name for gid in self.sharded),
            "packed": self.packed,
            "packed_loops": self.packed_loops,
            "origin": self.origin,
        }

    @classmethod
    def from_json(cls, graph: Graph, data: dict) -> Strategy:
        """Rebuild from `to_json` on the same graph; raises ValueError if a name is unknown."""
        by_name = {op.name: op.id for op in graph.ops}
        by_result = {g.result_name: g.id for g in graph.gradients}
        try:
            fused = [
                (frozenset(by_name[n] for n in grp["ops"]), [by_name[n] for n in grp["exports"]])
                for grp in data["groups"]
            ]
            buckets = tuple(tuple(by_result[n] for n in b) for b in data["buckets"])
            sharded = frozenset(by_result[n] for n in data.get("sharded", ()))
        except KeyError as e:
            raise ValueError(f"plan names {e} which is not in this module") from None
        homes = [-1] * len(graph.ops)
        groups: list[frozenset[int]] = []
        for members, exports in fused:
            for o in exports:
                homes[o] = len(groups)
            groups.append(members)
        for o in graph.fusible_ops:
            if homes[o] < 0:
                homes[o] = len(groups)
                groups.append(frozenset([o]))
        packing = {"packed": bool(data.get("packed")), "packed_loops": bool(data.get("packed_loops"))}
        return cls(tuple(groups), tuple(homes), buckets, data.get("origin", "plan"), sharded, **packing)


def xla_default(graph: Graph) -> Strategy:
    """What XLA did: its fusions and its all-reduce combining."""
    homes = [-1] * len(graph.ops)
    for o, g in graph.xla_homes.items():
        homes[o] = g
    return Strategy(tuple(graph.xla_groups), tuple(homes), tuple(graph.xla_buckets), "xla")


def regroups_only(graph: Graph, s: Strategy) -> bool:
    """`s` has XLA's fusions and differs at most in its all-reduce buckets: every element is then
    reduced in the same order, so its outputs must be bitwise XLA's."""
    return s.fusion_key() == xla_default(graph).fusion_key()


def unfused(graph: Graph) -> Strategy:
    """No op fusion, one all-reduce per gradient."""
    fusible = graph.fusible_ops
    homes = [-1] * len(graph.ops)
    for i, o in enumerate(fusible):
        homes[o] = i
    return Strategy(
        tuple(frozenset([o]) for o in fusible), tuple(homes), tuple((g.id,) for g in graph.gradients), "unfused"
    )


def with_buckets(strategy: Strategy, buckets: Sequence[Sequence[int]], origin: str) -> Strategy:
    return dataclasses.replace(strategy, buckets=tuple(tuple(b) for b in buckets), origin=origin)


def start_candidates(graph: Graph, packs: bool = False) -> list[Strategy]:
    """The search's first queue: XLA's plan, the unfused graph and their bucket variants; where
    the backend packs buckets (`packs`), XLA's plan with its buckets packed into flat buffers."""
    xla, bare = xla_default(graph), unfused(graph)
    per_gradient = [(g.id,) for g in graph.gradients]
    starts = [
        xla,
        bare,
        with_buckets(xla, per_gradient, "xla-fusion+per-gradient-allreduce"),
        with_buckets(bare, graph.xla_buckets, "unfused+xla-allreduce"),
    ]
    if packs and any(len(b) > 1 for b in xla.buckets):
        starts.append(dataclasses.replace(xla, packed=True, origin="xla+packed-allreduce"))
    if packs and graph.loop_allreduces:
        starts.append(dataclasses.replace(xla, packed_loops=True, origin="xla+packed-loop-allreduce"))
    return starts


# --------------------------------------------------------------------------- kernels


@dataclasses.dataclass
class KernelDag:
    """Kernels of a strategy in a topological order, with dependencies by kernel index."""

    kinds: list[str]
    members: list[frozenset[int]]  # ops of a group / the opaque op / gradient ids of a bucket
    deps: list[tuple[int, ...]]
    order: list[int]  # topological order, following the original program where free to choose
    group_index: list[int]  # for GROUP kernels: index into strategy.groups, else -1
    users: list[list[int]] | None = None  # per kernel, the kernels that depend on it (ascending)


def group_exports(graph: Graph, s: Strategy) -> list[list[int]]:
    """Per group, the ops it hands to kernels that do not compute them themselves."""
    groups_of: dict[int, list[int]] = {}
    for gi, g in enumerate(s.groups):
        for o in g:
            groups_of.setdefault(o, []).append(gi)
    exports: list[list[int]] = [[] for _ in s.groups]
    for o in graph.fusible_ops:
        home = s.homes[o]
        for u in graph.consumers(o):
            if u < 0 or graph.ops[u].kind != "fusible" or any(o not in s.groups[x] for x in groups_of.get(u, [])):
                exports[home].append(o)
                break
    return exports


def emittable(program: Program, s: Strategy, exports: list[list[int]] | None = None) -> bool:
    """Can the program's compiler emit every fused group of `s` (`Backend.emittable`)."""
    graph = program.graph
    return program.backend.emittable(graph, s, exports if exports is not None else group_exports(graph, s))


def kernel_dag(program: Program, s: Strategy) -> KernelDag | None:
    """Kernels and their dependencies; None when the strategy is invalid: a dependency cycle,
    or a fused group XLA cannot emit (`emittable`)."""
    if s.index is None and not emittable(program, s):
        return None
    graph = program.graph
    sources, reads, gradients = graph.free_sources, graph.kernel_reads, graph.gradients
    num_groups, opaque = len(s.groups), graph.opaque_ops
    bucket_sets = [frozenset(b) for b in s.buckets]
    kinds = [GROUP] * num_groups + [OPAQUE] * len(opaque) + [BUCKET] * len(bucket_sets)
    members = [*s.groups, *graph.opaque_kernels, *bucket_sets]
    group_index = [*range(num_groups), *[-1] * (len(opaque) + len(bucket_sets))]
    anchor: list[float] = [reads(g)[0] for g in s.groups]
    anchor += opaque
    anchor += [max(gradients[gid].producer for gid in b) + 0.5 for b in s.buckets]
    # provider[o]: the kernel whose output holds op o's value (fusible ops: their home group).
    provider = list(s.homes)
    for i, o in enumerate(opaque, num_groups):
        provider[o] = i
    for k, b in enumerate(s.buckets, num_groups + len(opaque)):
        for gid in b:
            provider[gradients[gid].reduced] = k
    deps: list[tuple[int, ...]] = []
    users: list[list[int]] = [[] for _ in kinds]
    for k, m in enumerate(members):
        if k < num_groups + len(opaque):
            d = {provider[src] for src in reads(m)[1]}
        else:
            d = {provider[src] for gid in m for src in sources[gradients[gid].producer]}
        d.discard(k)
        deps.append(tuple(d))
        for p in d:
            users[p].append(k)
    # Kahn's algorithm, earliest original position first.
    indegree = [len(d) for d in deps]
    heap = [(anchor[k], k) for k in range(len(kinds)) if indegree[k] == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        _, k = heapq.heappop(heap)
        order.append(k)
        for u in users[k]:
            indegree[u] -= 1
            if indegree[u] == 0:
                heapq.heappush(heap, (anchor[u], u))
    if len(order) != len(kinds):
        return None
    return KernelDag(kinds, members, deps, order, group_index, users)


# --------------------------------------------------------------------------- moves


def normalize(program: Program, s: Strategy) -> Strategy | None:
    """`s` normalized from scratch, as a move leaves its result: every group pruned, groups no
    consumer reads from dropped (`StrategyEdit.normalize` with every group touched). None if the
    compiler cannot emit the result."""
    edit = StrategyEdit(program, s.groups, s.homes, group_index(s.groups, len(s.homes)))
    edit.touched.update(range(len(s.groups)))
    return _finish(s, edit)


def _finish(s: Strategy, edit: StrategyEdit) -> Strategy | None:
    if not edit.normalize():
        return None  # the compiler could not emit a group the move changed
    rehomed = None if s.rehomed is None else s.rehomed | edit.rehomed
    index = tuple(edit.index)
    kept = (s.buckets, s.origin, s.sharded, index, rehomed, s.packed, s.packed_loops)
    return Strategy(tuple(edit.groups), tuple(edit.homes), *kept)


def fuse_producer(program: Program, s: Strategy, rng: random.Random, duplicate: bool) -> Strategy | None:
    """DisCo moves (i)/(ii): fuse a random group with the home group of one of its producers."""
    graph = program.graph
    gi = rng.randrange(len(s.groups))
    group = s.groups[gi]
    no_producer = program.backend.no_producer_fusion
    producers = sorted(
        {
            s.homes[v]
            for u in group
            for v in graph.ops[u].operands
            if graph.ops[v].kind == "fusible" and v not in group and graph.ops[v].opcode not in no_producer
        }
    )
    if not producers:
        return None
    pi = rng.choice(producers)
    producer = s.groups[pi]
    if any(graph.ops[o].opcode in no_producer and any(u in group for u in graph.users[o]) for o in producer):
        return None
    if not fusible_together(program, group | producer):
        return None
    edit = StrategyEdit(program, s.groups, s.homes, s.group_index())
    if not duplicate and edit.reaches(pi, gi, s.buckets):
        return None  # the merged kernel would feed a kernel it waits for: a cycle
    edit.set_group(gi, group | producer)
    if not duplicate:
        # Non-duplicate: the merged kernel exports the producer's values (a multi-output fusion).
        # Duplicate: the producer kernel stays for its other consumers (dropped when it has none).
        for o in producer:
            if edit.homes[o] == pi:
                edit.rehome(o, gi)
        edit.remove_group(pi)
    return _finish(s, edit)


def fusible_together(program: Program, members: frozenset[int]) -> bool:
    """Can the compiler be made to fuse `members` into one kernel? A rewriter that emits fusions
    (XLA:CPU) emits any group. XLA:GPU's own fusion passes form the kernels and the rewriter only
    cuts edges (`Backend.emits_fusions`), so there a group must lie inside one of XLA's fusions: a
    plan fusing more is costed as fused but compiles apart, and the search would chase it."""
    if program.backend.emits_fusions:
        return True
    holders, common = program.graph.xla_holders, None
    for o in members:
        common = holders.get(o, frozenset()) if common is None else common & holders.get(o, frozenset())
        if not common:
            return False
    return True


def split_group(program: Program, s: Strategy, rng: random.Random) -> Strategy | None:
    """Undo fusion: cut a random fused group in two at a random point of its op order."""
    graph = program.graph
    fused = [gi for gi, g in enumerate(s.groups) if len(g) > 1]
    if not fused:
        return None
    gi = rng.choice(fused)
    ordered = sorted(s.groups[gi])
    cut = rng.randrange(1, len(ordered))
    parts = components(graph, ordered[:cut]) + components(graph, ordered[cut:])
    edit = StrategyEdit(program, s.groups, s.homes, s.group_index())
    edit.set_group(gi, parts[0])
    for part in parts[1:]:
        pi = edit.add_group(part)
        for o in part:
            if edit.homes[o] == gi:
                edit.rehome(o, pi)
    return _finish(s, edit)


def components(graph: Graph, members: Sequence[int]) -> list[frozenset[int]]:
    """Weakly connected pieces of a set of ops (a fusion must be connected), in the order of
    their first member in `members`."""
    mset, seen, parts = set(members), set(), []
    for start in members:
        if start in seen:
            continue
        stack, part = [start], set()
        while stack:
            o = stack.pop()
            if o in seen:
                continue
            seen.add(o)
            part.add(o)
            stack.extend(x for x in graph.ops[o].operands if x in mset)
            stack.extend(x for x in graph.users[o] if x in mset)
        parts.append(frozenset(part))
    return parts


def _bucket_order(graph: Graph, s: Strategy) -> list[int]:
    """Bucket indexes by their last gradient's producer (the order their all-reduces can start)."""
    producer, buckets = [g.producer for g in graph.gradients].__getitem__, s.buckets
    return sorted(range(len(buckets)), key=lambda b: max(map(producer, buckets[b])))


def merge_buckets(program: Program, s: Strategy, rng: random.Random) -> Strategy | None:
    """DisCo move (iii): combine a random all-reduce with a neighbour in gradient order."""
    graph = program.graph
    if len(s.buckets) < 2:
        return None
    order = _bucket_order(graph, s)
    pos = rng.randrange(len(order))
    other = pos + rng.choice((-1, 1))
    if not 0 <= other < len(order):
        other = pos - 1 if pos > 0 else pos + 1
    a, b = order[pos], order[other]
    if graph.gradients[s.buckets[a][0]].compat != graph.gradients[s.buckets[b][0]].compat:
        return None
    if (s.buckets[a][0] in s.sharded) != (s.buckets[b][0] in s.sharded):
        return None  # one collective cannot both reduce and reduce-scatter
    merged = tuple(sorted(s.buckets[a] + s.buckets[b], key=lambda g: graph.gradients[g].producer))
    # An all-reduce cannot carry a value computed from another of its own results (batch-norm
    # statistics reduced in the forward pass feed later gradients): that would be a cycle.
    carried = sum(1 << g for g in merged)
    depends = graph.reduced_dependencies
    if any(depends[g] & carried for g in merged):
        return None
    buckets = [bk for i, bk in enumerate(s.buckets) if i not in (a, b)] + [merged]
    return dataclasses.replace(s, buckets=tuple(buckets))


def split_bucket(program: Program, s: Strategy, rng: random.Random) -> Strategy | None:
    """Inverse of merge: cut a random all-reduce in two along gradient production order."""
    graph = program.graph
    multi = [i for i, b in enumerate(s.buckets) if len(b) > 1]
    if not multi:
        return None
    i = rng.choice(multi)
    ordered = sorted(s.buckets[i], key=lambda g: graph.gradients[g].producer)
    cut = rng.randrange(1, len(ordered))
    buckets = [b for j, b in enumerate(s.buckets) if j != i] + [tuple(ordered[:cut]), tuple(ordered[cut:])]
    return dataclasses.replace(s, buckets=tuple(buckets))


def pack_buckets(program: Program, s: Strategy, rng: random.Random, loops: bool = False) -> Strategy | None:
    """Pack every bucket of several gradients into one flat buffer, or unpack them again (a
    bucketing move: the rendezvous per operand of a variadic all-reduce against two copies of
    the bucket); `loops`: the all-reduces of several tensors in the step's loop bodies instead
    (`Graph.loop_allreduces`). Only where the backend packs (`Backend.packs_buckets`)."""
    packable = program.graph.loop_allreduces if loops else any(len(b) > 1 and b[0] not in s.sharded for b in s.buckets)
    if not getattr(program.backend, "packs_buckets", False) or not packable:
        return None
    field = "packed_loops" if loops else "packed"
    return dataclasses.replace(s, **{field: not getattr(s, field)})


def shard_update(program: Program, s: Strategy, rng: random.Random, shardable: frozenset[int]) -> Strategy | None:
    """Shard the weight update of a random bucket's gradients, or make a sharded one replicated
    again (the bucket's gradients must all be in `shardable`: `cost.sharded.UpdateRegions`)."""
    choices = [b for b in s.buckets if all(g in shardable for g in b)]
    if not choices:
        return None
    b = rng.choice(choices)
    sharded = s.sharded.difference(b) if b[0] in s.sharded else s.sharded.union(b)
    return dataclasses.replace(s, sharded=sharded)


def sharding_all(s: Strategy, shardable: frozenset[int]) -> Strategy:
    """`s` with every `shardable` gradient's update sharded, each bucket split in its sharded and
    its replicated gradients (a start for the search's `shard_update` move)."""
    parts = [tuple(g for g in b if (g in shardable) == flag) for b in s.buckets for flag in (True, False)]
    origin = f"{s.origin}+sharded-update"
    return dataclasses.replace(s, buckets=tuple(p for p in parts if p), sharded=frozenset(shardable), origin=origin)


def with_sharding(shardable: frozenset[int], moves: dict | None = None) -> dict:
    """The search's moves plus `shard_update` over `shardable` gradients."""
    return {**(MOVES if moves is None else moves), "shard_update": lambda p, s, r: shard_update(p, s, r, shardable)}


def split(program: Program, s: Strategy, rng: random.Random) -> Strategy | None:
    """The split move: open up a fusion or an all-reduce that XLA (or the search) formed."""
    first, second = (split_group, split_bucket) if rng.random() < 0.5 else (split_bucket, split_group)
    return first(program, s, rng) or second(program, s, rng)


Move = Callable[["Program", Strategy, random.Random], "Strategy | None"]

MOVES: dict[str, Move] = {
    "fuse": lambda p, s, r: fuse_producer(p, s, r, duplicate=False),
    "fuse_duplicate": lambda p, s, r: fuse_producer(p, s, r, duplicate=True),
    "merge_allreduce": merge_buckets,
    "split": split,
    "pack_allreduce": pack_buckets,
    "pack_loop_allreduce": functools.partial(pack_buckets, loops=True),
}


def is_valid(program: Program, s: Strategy) -> bool:
    """Every fusible op has a home group holding it, groups hold fusible ops only, every gradient
    is in exactly one bucket of compatible gradients, the compiler can emit its fused groups and
    the kernel graph has no cycle."""
    graph = program.graph
    for o in graph.fusible_ops:
        h = s.homes[o]
        if not 0 <= h < len(s.groups) or o not in s.groups[h]:
            return False
    if any(graph.ops[o].kind != "fusible" for g in s.groups for o in g):
        return False
    seen = sorted(g for b in s.buckets for g in b)
    if seen != list(range(len(graph.gradients))):
        return False
    if any(len({graph.gradients[g].compat for g in b}) != 1 for b in s.buckets):
        return False
    if any(len({g in s.sharded for g in b}) != 1 for b in s.buckets):
        return False
    # kernel_dag checks emittable itself where the strategy has no kernel index
    return (s.index is None or emittable(program, s)) and kernel_dag(program, s) is not None
