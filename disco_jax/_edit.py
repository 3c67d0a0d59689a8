"""One search move's change to a strategy, applied and normalized locally (incremental evaluation).

A move copies its parent's groups, homes and *group index* (per op, the groups that hold it) into a
`StrategyEdit`, changes a few groups through it, and asks it to `normalize`: only what the change
touched is re-examined, never every group of the strategy:

* groups whose members or homed ops changed are pruned (`prune`: members nothing they export
  needs are dropped);
* a group is *dead* when no consumer reads a value from it (every consumer of every op it homes
  computes that op itself); removing one re-homes its ops and may kill others, so the dead check
  runs over a worklist: the touched groups and the homes of the producers of every member of a
  changed group (only their exports can have changed);
* the exports of those groups are what the program's compiler must be able to emit
  (`Backend.emittable`): an edit it cannot emit is refused there, so moves do not produce such
  candidates.

A removed group's slot is taken by the last group (swap-remove), so only the ops of two groups are
re-indexed. `group_index(groups, num_ops)` builds the index from scratch (what the property test
compares the maintained one with).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from disco_jax._graph import Graph
    from disco_jax._program import Program


def group_index(groups: Sequence[frozenset[int]], num_ops: int) -> tuple[tuple[int, ...], ...]:
    """Per op id, the indexes (ascending) of the groups that hold it."""
    index: list[list[int]] = [[] for _ in range(num_ops)]
    for gi, g in enumerate(groups):
        for o in g:
            index[o].append(gi)
    return tuple(tuple(x) for x in index)


def prune(graph: Graph, group: frozenset[int], homed: Iterable[int]) -> frozenset[int]:
    """Keep the ops a group exports (homed) and those they need inside the group."""
    keep, stack = set(), list(homed)
    while stack:
        o = stack.pop()
        if o in keep:
            continue
        keep.add(o)
        stack.extend(v for v in graph.ops[o].operands if v in group)
    return frozenset(keep) if len(keep) != len(group) else group


class StrategyEdit:
    """Groups, homes and the group index of a strategy of `program` being changed, copied from the parent."""

    def __init__(
        self, program: Program, groups: Sequence[frozenset[int]], homes: Sequence[int], index: Sequence[tuple]
    ):
        self.program, self.graph = program, program.graph
        self.groups = list(groups)
        self.homes = list(homes)
        self.index = list(index)
        self.touched: set[int] = set()  # groups whose members or homed ops changed
        self.changed_ops: set[int] = set()  # members of changed groups (before and after)
        self.rehomed: set[int] = set()  # ops given another home

    def set_group(self, gi: int, members: frozenset[int]) -> None:
        old = self.groups[gi]
        for o in old - members:
            self.index[o] = tuple(x for x in self.index[o] if x != gi)
        for o in members - old:
            self.index[o] = tuple(sorted((*self.index[o], gi)))
        # Whether a producer's value is read from its home depends on every group its consumers
        # are in, so every member of a changed group counts as changed.
        self.changed_ops |= old | members
        self.groups[gi] = members
        self.touched.add(gi)

    def add_group(self, members: frozenset[int]) -> int:
        self.groups.append(frozenset())
        gi = len(self.groups) - 1
        self.set_group(gi, members)
        return gi

    def rehome(self, o: int, gi: int) -> None:
        self.touched.add(self.homes[o])
        self.homes[o] = gi
        self.rehomed.add(o)
        self.touched.add(gi)

    def remove_group(self, gi: int, renamed: list[set[int]] = ()) -> None:
        """Drop an empty group (its ops re-homed first); the last group takes its slot, and the
        sets in `renamed` (and `touched`) follow the rename."""
        self.set_group(gi, frozenset())
        last = len(self.groups) - 1
        if last != gi:
            moved = self.groups[last]
            self.groups[gi] = moved
            for o in moved:
                self.index[o] = tuple(sorted(gi if x == last else x for x in self.index[o]))
                self.changed_ops.add(o)
                if self.homes[o] == last:
                    self.homes[o] = gi
        self.groups.pop()
        self.touched.discard(gi)
        for ids in (self.touched, *renamed):
            if last in ids:
                ids.discard(last)
                ids.add(gi)
            ids.discard(len(self.groups))
        if last != gi:
            self.touched.add(gi)

    def homed(self, gi: int) -> list[int]:
        return [o for o in self.groups[gi] if self.homes[o] == gi]

    def exports(self, gi: int) -> list[int]:
        """The ops group `gi` hands to kernels that do not compute them themselves
        (`_strategy.group_exports` for one group)."""
        graph, groups, index, ops, homes = self.graph, self.groups, self.index, self.graph.ops, self.homes
        out = []
        for o in sorted(o for o in groups[gi] if homes[o] == gi):
            exported = False
            for u in graph.consumers(o):
                if u < 0 or ops[u].kind != "fusible":
                    exported = True
                    break
                for x in index[u]:  # loops, not all(): the moves' hottest code; gi holds o
                    if x != gi and o not in groups[x]:
                        exported = True
                        break
                if exported:
                    break
            if exported:
                out.append(o)
        return out

    def reaches(self, start: int, target: int, buckets: Sequence[Sequence[int]], limit: int = 4096) -> bool:
        """Whether group `target` depends on group `start` through some other kernel (a group,
        an opaque op or an all-reduce): merging the two while the merged kernel hands out
        `start`'s values would close a cycle.

        Two walks over kernels meet in the middle: forward from `start` along the values it
        hands out, backward from `target` along the values it reads, each step extending the
        smaller frontier, until a kernel lies on both (a path) or one walk runs out (none).
        Values produced after `target`'s last op are not followed forward, nor ops before
        `start`'s first value backward: no path of ops leaves that range, though one through a
        kernel holding ops far apart (XLA:GPU's clones) can. Nor are more than `limit` kernels
        visited. So a cycle found is certain, and one missed is left to `kernel_dag`'s full check."""
        homed = [o for o in self.groups[start] if self.homes[o] == start]
        if not homed:
            return False
        first, last = min(homed), max(self.groups[target])
        bucket_of = {gid: bi for bi, b in enumerate(buckets) for gid in b}
        origin, goal = ("group", start), ("group", target)
        ahead, behind = {origin}, {goal}  # reached from start; reaching target
        forward, backward = [origin], [goal]
        walks = {  # frontier, its side's kernels, the other side's, next kernels, own end, other end
            True: (forward, ahead, behind, lambda n: self._successors(n, last, buckets, bucket_of), origin, goal),
            False: (backward, behind, ahead, lambda n: self._predecessors(n, first, buckets, bucket_of), goal, origin),
        }
        while forward and backward:
            frontier, mine, theirs, step, home, end = walks[len(forward) <= len(backward)]
            node = frontier.pop()
            for x in step(node):
                if x in mine:
                    continue
                if x == end:
                    if node != home:
                        return True
                    continue  # the direct edge, which the merge absorbs
                if x in theirs:
                    return True
                mine.add(x)
                frontier.append(x)
            if len(ahead) + len(behind) >= limit:
                return False
        return False

    def _successors(self, node: tuple[str, int], last: int, buckets, bucket_of: dict[int, int]):
        """The kernels reading a value `node` hands out, produced at or before op `last`."""
        graph, ops, groups, index = self.graph, self.graph.ops, self.groups, self.index
        kind, k = node
        if kind == "group":
            values = [o for o in groups[k] if self.homes[o] == k]
        elif kind == "opaque":
            values = [k]
        else:
            values = [graph.gradients[gid].reduced for gid in buckets[k]]
        for v in values:
            if v > last:
                continue
            for u in graph.consumers(v):
                if u < 0:
                    continue
                op = ops[u]
                if op.kind == "fusible":
                    for x in index[u]:
                        if v not in groups[x]:  # a group holding v computes it itself
                            yield ("group", x)
                elif op.kind == "reduced":
                    yield ("bucket", bucket_of[op.gradient])
                else:
                    yield ("opaque", u)

    def _predecessors(self, node: tuple[str, int], first: int, buckets, bucket_of: dict[int, int]):
        """The kernels handing `node` a value it reads in an op after op `first`."""
        graph, ops, homes, sources = self.graph, self.graph.ops, self.homes, self.graph.free_sources
        kind, k = node
        own: frozenset[int] | tuple = ()
        if kind == "group":
            computed = own = self.groups[k]
        elif kind == "opaque":
            computed = (k,)
        else:
            computed = [graph.gradients[gid].reduced for gid in buckets[k]]
        for u in computed:
            if u <= first:
                continue
            for v in ops[u].operands:
                for src in sources[v]:
                    if src in own:
                        continue
                    op = ops[src]
                    if op.kind == "fusible":
                        yield ("group", homes[src])
                    elif op.kind == "reduced":
                        yield ("bucket", bucket_of[op.gradient])
                    else:
                        yield ("opaque", src)

    def normalize(self) -> bool:
        """Prune the touched groups, remove the groups that became dead, and check that the
        compiler can emit every group whose exports may have changed; False when it cannot."""
        graph = self.graph
        for gi in sorted(self.touched):
            g = self.groups[gi]
            pruned = prune(graph, g, self.homed(gi))
            if pruned is not g:
                self.set_group(gi, pruned)
        checked: set[int] = set()
        sources = graph.free_sources
        while True:
            checked |= self.touched
            for u in self.changed_ops:
                for v in graph.ops[u].operands:
                    for src in sources[v]:
                        if graph.ops[src].kind == "fusible":
                            checked.add(self.homes[src])
            self.changed_ops.clear()
            dead = next((gi for gi in sorted(checked) if gi < len(self.groups) and self._dead(gi)), None)
            if dead is None:
                break
            for o in self.homed(dead):
                self.rehome(o, next(x for x in self.index[o] if x != dead))
            self.remove_group(dead, [checked])
        checked = {gi for gi in checked if gi < len(self.groups)}
        exports = [self.exports(gi) for gi in sorted(checked)]
        return self.program.backend.emittable(graph, None, exports)

    def _dead(self, gi: int) -> bool:
        """No consumer reads from the group, and each op it homes is held by another group."""
        if any(len(self.index[o]) < 2 for o in self.homed(gi)):
            return False
        return not self.exports(gi)
