"""A strategy's kernel graph in slots, derived from an ancestor's by what the moves changed.

`KernelState` is what the simulator runs: one *slot* per kernel (a fusion group, an opaque op, an
all-reduce bucket or, for a bucket whose update is sharded, its all-gather) with its dependencies,
users, tie-break rank and estimated time, plus, per op, the slot whose output holds its value
(`provider`). Kernels are identified across strategies by a *key*: a group's member set, an opaque
op's singleton set, a bucket's gradient ids complemented (``~gid``, negative, so a bucket's key
never equals a group's), tagged ``("scatter", ids)`` when its update is sharded
(`Strategy.sharded`), and ``("gather", ids)`` for that bucket's all-gather of the updated
parameters (`cost.sharded`).

`build(graph, strategy)` makes a state from scratch. `derive(graph, parent, child)` makes the
child's from the parent's (FlexFlow's delta idea applied to the kernel graph): the parent's lists
are copied; a kernel whose key the child no longer has either hands its slot to the new kernel
that took over most of its values (a grown or cut group, a merged or split bucket) or is removed;
and only the kernels that read a value whose slot changed get their dependencies recomputed
(candidates: the members of changed groups, the ops the moves re-homed, `Strategy.rehomed`, and
the gradients of changed buckets). The unchanged part of the graph is never touched. New compute
kernels have no estimate until `estimate_missing` asks the estimators for all of them at once.

`events.run` simulates a state.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from disco_jax.cost.allreduce import collective_ops
from disco_jax.cost.sharded import UpdateRegions, regions_of

if TYPE_CHECKING:
    from disco_jax._graph import Graph
    from disco_jax._strategy import Strategy
    from disco_jax.cost.estimators import Estimator

GROUP, OPAQUE, BUCKET = "group", "opaque", "bucket"  # the values of `_strategy`'s kernel kinds
GATHER = "gather"  # a sharded bucket's all-gather of the updated parameters
_NONE: frozenset[int] = frozenset()
_HASH_SPAN = 1 << 20


@functools.lru_cache(maxsize=1 << 14)
def _ids(bucket: tuple[int, ...]) -> frozenset[int]:
    return frozenset(~g for g in bucket)


def bucket_key(bucket: tuple[int, ...], sharded: frozenset[int] = _NONE, packed: bool = False):
    """A bucket's kernel key: its gradients complemented, tagged when their update is sharded
    ('scatter') or when they are packed into one flat buffer ('packed': `Strategy.packed`, a
    bucket of several replicated gradients)."""
    if bucket[0] in sharded:
        return ("scatter", _ids(bucket))
    return ("packed", _ids(bucket)) if packed and len(bucket) > 1 else _ids(bucket)


def is_packed(key) -> bool:
    return isinstance(key, tuple) and key[0] == "packed"


def is_scatter(key) -> bool:
    return isinstance(key, tuple) and key[0] == "scatter"


def _anchor(graph: Graph, members: frozenset[int], kind: str, regions: UpdateRegions | None) -> float:
    """Where a kernel stands in the program: a group's or opaque op's last op, an all-reduce
    just after its last gradient's producer, an all-gather after the update's last output."""
    if kind == BUCKET:
        return max(graph.gradients[g].producer for g in members) + 0.5
    if kind == GATHER:
        return max(o for g in members for o in (*regions.outputs[g], graph.gradients[g].reduced)) + 0.5
    return graph.kernel_reads(members)[0]


def _rank(anchor: float, key) -> float:
    """Program position first, a hash of the key within it (below the next position's half)."""
    return anchor + (hash(key) % _HASH_SPAN) / (_HASH_SPAN * 2.5)


@dataclasses.dataclass
class KernelState:
    """One strategy's kernels by slot (parallel lists), the per-op and per-gradient slot maps,
    and the key sets. A state is never changed once simulated: `derive` changes a copy."""

    keys: list  # per slot: the kernel's key, None for a free slot
    members: list[frozenset[int]]  # ops of a group or opaque kernel, gradient ids of a bucket
    kinds: list[str]
    deps: list[frozenset[int]]
    users: list[set[int]]  # shared with the parent until `_users` copies one (`owned`)
    rank: list[float]
    comm: list[bool]  # runs on the communication channel (buckets and opaque collectives)
    estimate: list[float | None]  # compute kernels: the estimator's time (None: not asked yet)
    provider: list[int]  # per op: the slot whose output holds its value (-1: none)
    bucket_of: list[int]  # per gradient: its bucket's slot
    slot_of: dict
    group_keys: set
    bucket_keys: set
    free: list[int]
    sharded: frozenset[int] = _NONE  # the strategy's sharded gradients
    regions: UpdateRegions | None = None  # the graph's update regions, where `sharded` is not empty
    gather_keys: set = dataclasses.field(default_factory=set)
    owned: set[int] = dataclasses.field(default_factory=set)  # slots whose users set is this state's own
    packed_loops: bool = False  # the strategy's loop bodies' all-reduces packed (`Strategy.packed_loops`)

    def copy(self) -> KernelState:
        return KernelState(
            self.keys.copy(),
            self.members.copy(),
            self.kinds.copy(),
            self.deps.copy(),
            self.users.copy(),
            self.rank.copy(),
            self.comm.copy(),
            self.estimate.copy(),
            self.provider.copy(),
            self.bucket_of.copy(),
            self.slot_of.copy(),
            self.group_keys.copy(),
            self.bucket_keys.copy(),
            self.free.copy(),
            self.sharded,
            self.regions,
            self.gather_keys.copy(),
            packed_loops=self.packed_loops,
        )

    def _users(self, k: int) -> set[int]:
        """Slot k's users, to change: copied first if the set is shared (a kernel read by
        thousands would otherwise be copied at every edit)."""
        if k not in self.owned:
            self.users[k] = set(self.users[k])
            self.owned.add(k)
        return self.users[k]

    def alive(self) -> list[int]:
        return [k for k, key in enumerate(self.keys) if key is not None]

    def bucket_slots(self, strategy: Strategy) -> list[int]:
        """The slots of the strategy's buckets, in its order."""
        return [self.slot_of[bucket_key(b, strategy.sharded, strategy.packed)] for b in strategy.buckets]

    # ----------------------------------------------------------------- edits

    def _add(self, graph: Graph, key, members: frozenset[int], kind: str) -> int:
        anchor = _anchor(graph, members, kind, self.regions)
        comm = kind in (BUCKET, GATHER) or (kind == OPAQUE and next(iter(members)) in collective_ops(graph))
        entry = (key, members, kind, _NONE, set(), _rank(anchor, key), comm, None if not comm else 0.0)
        if self.free:
            k = self.free.pop()
            for column, value in zip(self._columns(), entry):
                column[k] = value
        else:
            k = len(self.keys)
            for column, value in zip(self._columns(), entry):
                column.append(value)
        self.slot_of[key] = k
        self.owned.add(k)
        return k

    def _rekey(self, graph: Graph, k: int, key, members: frozenset[int]) -> None:
        """Slot k holds another kernel of the same kind now (its dependencies to recompute)."""
        del self.slot_of[self.keys[k]]
        self.slot_of[key] = k
        self.keys[k], self.members[k] = key, members
        self.rank[k] = _rank(_anchor(graph, members, self.kinds[k], self.regions), key)
        if not self.comm[k]:
            self.estimate[k] = None

    def _columns(self) -> tuple[list, ...]:
        return (self.keys, self.members, self.kinds, self.deps, self.users, self.rank, self.comm, self.estimate)

    def _remove(self, k: int) -> list[int]:
        """Free slot `k`; returns its users (their dependencies must be recomputed)."""
        gone = frozenset([k])
        for p in self.deps[k]:
            self._users(p).discard(k)
        users = list(self.users[k])
        for u in users:  # the slot may be reused: no edge may point at it
            self.deps[u] -= gone
        del self.slot_of[self.keys[k]]
        self.keys[k] = self.estimate[k] = None
        self.deps[k] = _NONE
        self.users[k] = set()
        self.owned.add(k)
        self.free.append(k)
        return users

    def _set_deps(self, graph: Graph, k: int) -> None:
        provider = self.provider
        if self.kinds[k] == BUCKET:
            sources, gradients = graph.free_sources, graph.gradients
            new = {provider[src] for gid in self.members[k] for src in sources[gradients[gid].producer]}
        elif self.kinds[k] == GATHER:
            outputs, gradients = self.regions.outputs, graph.gradients
            new = {provider[o] for gid in self.members[k] for o in (*outputs[gid], gradients[gid].reduced)}
        else:
            new = {provider[src] for src in graph.kernel_reads(self.members[k])[1]}
        new.discard(k)
        new.discard(-1)
        old = self.deps[k]
        for p in old.difference(new):
            self._users(p).discard(k)
        for p in new.difference(old):
            self._users(p).add(k)
        self.deps[k] = frozenset(new)


def _empty(graph: Graph) -> KernelState:
    return KernelState(
        [], [], [], [], [], [], [], [], [-1] * len(graph.ops), [-1] * len(graph.gradients), {}, set(), set(), []
    )


def group_keys(strategy: Strategy) -> list:
    """Per group, its kernel key: its member set; for a member set several groups share
    (XLA:GPU clones small fusions), the member set and the ops that group homes, and for clones
    that home nothing (interchangeable: same members, no users) also their ordinal."""
    groups = strategy.groups
    count = collections.Counter(groups)
    if len(count) == len(groups):
        return list(groups)
    homes, keys = strategy.homes, list(groups)
    for i, g in enumerate(groups):
        if count[g] > 1:
            if len(g) == 1:  # most clones: one op, homed in one of them
                keys[i] = (g, g if homes[next(iter(g))] == i else _NONE)
            else:
                keys[i] = (g, frozenset(o for o in g if homes[o] == i))
    repeats = collections.Counter(keys)
    if len(repeats) != len(keys):
        seen: dict = {}
        for i, key in enumerate(keys):
            if repeats[key] > 1:
                seen[key] = n = seen.get(key, -1) + 1
                keys[i] = (*key, n)
    return keys


def build(graph: Graph, strategy: Strategy) -> KernelState:
    """The kernel state of `strategy` from scratch (no check that the backend can emit it)."""
    st = _empty(graph)
    st.packed_loops = strategy.packed_loops
    if strategy.sharded:
        st.sharded, st.regions = strategy.sharded, regions_of(graph)
    group_slots = []
    for g, key in zip(strategy.groups, group_keys(strategy)):
        group_slots.append(st._add(graph, key, g, GROUP))
        st.group_keys.add(key)
    for o, kernel in zip(graph.opaque_ops, graph.opaque_kernels):
        st.provider[o] = st._add(graph, kernel, kernel, OPAQUE)
    for b in strategy.buckets:
        key = bucket_key(b, strategy.sharded, strategy.packed)
        k = st._add(graph, key, frozenset(b), BUCKET)
        st.bucket_keys.add(key)
        for gid in b:
            st.bucket_of[gid] = k
            st.provider[graph.gradients[gid].reduced] = k
    for o in graph.fusible_ops:
        st.provider[o] = group_slots[strategy.homes[o]]
    _gathers(graph, st, strategy)
    for k in range(len(st.keys)):
        st._set_deps(graph, k)
    return st


def _gathers(graph: Graph, st: KernelState, strategy: Strategy) -> list[int]:
    """Add and remove all-gather slots to match the strategy's sharded buckets; returns the
    slots of them all (their dependencies still to set)."""
    wanted = {("gather", _ids(b)): b for b in strategy.buckets if b[0] in strategy.sharded}
    for key in st.gather_keys - wanted.keys():
        st._remove(st.slot_of[key])
    for key in wanted.keys() - st.gather_keys:
        st._add(graph, key, frozenset(wanted[key]), GATHER)
    st.gather_keys = set(wanted)
    return [st.slot_of[key] for key in wanted]


def derive(graph: Graph, parent: KernelState, child: Strategy) -> KernelState:
    """The kernel state of `child` from the state of the strategy its moves started from
    (`child.rehomed`: the ops they re-homed; None when unknown: built from scratch).

    A new group (or bucket) takes the slot of a gone one that provided most of the values it
    provides now (`_heir`): a group that grew or was cut, or a bucket that was merged or split,
    keeps its slot, so the consumers of the values it still provides keep their edges. Gone
    kernels without an heir are removed, new ones without a predecessor added."""
    if child.rehomed is None:
        return build(graph, child)
    groups = child.groups
    keys = group_keys(child)
    position = {key: i for i, key in enumerate(keys)}
    st = parent.copy()
    st.packed_loops = child.packed_loops
    if child.sharded:
        st.regions = st.regions or regions_of(graph)
    st.sharded = child.sharded
    ops, slot_of, provider, homes, gradients = graph.ops, st.slot_of, st.provider, child.homes, graph.gradients
    changed = set(child.rehomed)  # fusible ops whose provider may have changed
    dirty: set[int] = set()  # kernels whose dependencies are recomputed
    moved = []  # values whose provider changed: their consumers are dirty

    gone = {slot_of[key]: key for key in st.group_keys.difference(position)}
    born = []
    for key in position.keys() - st.group_keys:
        i = position[key]
        g = groups[i]
        k = _heir(gone, (provider[o] for o in g if homes[o] == i))
        if k is None:
            born.append(key)
            continue
        changed.update(st.members[k])
        st.group_keys.discard(gone.pop(k))
        st._rekey(graph, k, key, g)
        st.group_keys.add(key)
        changed.update(g)
        dirty.add(k)
    bucket_keys = [bucket_key(b, child.sharded, child.packed) for b in child.buckets]
    gone_buckets = {slot_of[key]: key for key in st.bucket_keys - set(bucket_keys)}
    new_buckets = []  # (slot or None, key, bucket)
    for key, b in zip(bucket_keys, child.buckets):
        if key not in st.bucket_keys:
            k = _heir(gone_buckets, (st.bucket_of[g] for g in b))
            if k is not None:
                st.bucket_keys.discard(gone_buckets.pop(k))
            new_buckets.append((k, key, b))

    removed: set[int] = set()  # freed slots: a value they provided moved, even if the slot is reused
    for k in [*gone, *gone_buckets]:
        if st.kinds[k] == GROUP:
            changed.update(st.members[k])
        dirty.update(st._remove(k))
        removed.add(k)
    st.group_keys.difference_update(gone.values())
    st.bucket_keys.difference_update(gone_buckets.values())
    for key in born:
        g = groups[position[key]]
        dirty.add(st._add(graph, key, g, GROUP))
        st.group_keys.add(key)
        changed.update(g)
    for k, key, b in new_buckets:
        if k is None:
            k = st._add(graph, key, frozenset(b), BUCKET)
        else:
            st._rekey(graph, k, key, frozenset(b))
        st.bucket_keys.add(key)
        dirty.add(k)
        for gid in b:
            st.bucket_of[gid] = k
            r = gradients[gid].reduced
            if provider[r] != k or k in removed:
                provider[r] = k
                moved.append(r)
    for o in changed:
        if ops[o].kind == "fusible":
            k = slot_of[keys[homes[o]]]
            if k != provider[o] or k in removed:
                provider[o] = k
                moved.append(o)
    index = child.group_index() if moved else ()
    for o in moved:
        for u in graph.consumers(o):
            if u < 0:
                continue
            if ops[u].kind == "fusible":
                dirty.update(slot_of[keys[x]] for x in index[u])
            else:  # an opaque op or an all-reduce result: its own kernel
                dirty.add(provider[u])
    if st.gather_keys or child.sharded:  # a few kernels: their dependencies are always recomputed
        dirty.update(_gathers(graph, st, child))
    for k in dirty:
        if st.keys[k] is not None:
            st._set_deps(graph, k)
    return st


def _heir(gone: dict[int, object], providers) -> int | None:
    """The gone slot that provided most of `providers` (slots, one per value), if any."""
    votes: dict[int, int] = {}
    for p in providers:
        if p in gone:
            votes[p] = votes.get(p, 0) + 1
    return max(votes, key=votes.__getitem__) if votes else None


def estimate_missing(graph: Graph, states: Sequence[KernelState], estimator: Estimator) -> None:
    """Fill every compute kernel without an estimate, asking the estimator once for all of them."""
    wanted: dict[frozenset[int], list[tuple[KernelState, int]]] = {}
    for st in states:
        for k, e in enumerate(st.estimate):
            if e is None and st.keys[k] is not None:
                wanted.setdefault(st.members[k], []).append((st, k))
    if not wanted:
        return
    kernels = list(wanted)
    for kernel, t in zip(kernels, estimator.estimate(graph, kernels)):
        for st, k in wanted[kernel]:
            st.estimate[k] = float(t or 0.0)
