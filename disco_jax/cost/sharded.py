"""The sharded weight update as the simulator costs it, on the replicated step's graph.

Sharding a gradient's update (Xu et al. 2020; ZeRO stage 1; `disco_jax.sharding.update` enacts
it by lowering the step again) changes three things in a data-parallel step, and a strategy's
`Strategy.sharded` gradients are simulated with exactly these:

* the gradient's all-reduce becomes a reduce-scatter where the platform forms one
  (`reduce_scatters`: a simulated GPU cluster's NCCL, or `Backend.forms_reduce_scatter`: XLA:GPU
  forms it, and on XLA:CPU the pipeline applies the proven rule that does, `sharding.apply`);
* its update (the gradient's `UpdateRegions.ops`) runs on 1/N of each tensor: a compute kernel
  whose ops all belong to sharded updates costs 1/N of its estimate;
* the updated parameter is all-gathered: one all-gather per sharded bucket, of the bucket's
  bytes, once the kernels holding its gradients' new values have run.

A gradient's *update region*: the ops reached from its all-reduced value through ops with as many
elements as the gradient (an elementwise optimizer: Adam's moments and the parameter's new value),
and reached from no other gradient. Its *state*: the entry parameters of that size that only its
region reads (Adam's `mu` and `nu`; the parameter itself also feeds the forward pass), whose bytes
a sharded update divides by N on every device.
"""

from __future__ import annotations

import dataclasses
import math
import re

from disco_jax._graph import Graph, per_graph
from disco_jax._program import Program, per_program
from disco_jax.sharding import apply


@dataclasses.dataclass(frozen=True)
class UpdateRegions:
    """Per gradient of one graph: its update's ops, the ones the module outputs, its state's
    entry parameters (op ids) and their bytes; per op, the gradient whose update holds it (-1)."""

    ops: tuple[frozenset[int], ...]
    outputs: tuple[tuple[int, ...], ...]
    state: tuple[tuple[int, ...], ...]
    state_bytes: tuple[int, ...]
    region_of: tuple[int, ...]
    num_shards: int

    dims: tuple[tuple[int, ...], ...] = ()  # per gradient, its dimensions

    @property
    def shardable(self) -> frozenset[int]:
        """The gradients whose update can be sharded: it outputs a new value, keeps state, and
        has a dimension the devices divide (as `sharding.leaves.split_dimension` asks)."""
        n = self.num_shards
        if n < 2:
            return frozenset()
        return frozenset(
            g
            for g, (out, st, dims) in enumerate(zip(self.outputs, self.state, self.dims))
            if out and st and any(d >= n and d % n == 0 for d in dims)
        )

    def saved_bytes(self, sharded) -> int:
        """Per-device state bytes a sharded update of `sharded` (gradient ids) saves."""
        return sum(self.state_bytes[g] for g in sharded) * (self.num_shards - 1) // self.num_shards


def group_size(replica_groups: str | None) -> int | None:
    """Devices per group of a collective's `replica_groups` (as `_hlo.replica_groups_key`
    prints it: `mesh[8] {0}`; or `{{0,1,..}}`; or the iota form `[1,8]<=[8]`); None if unknown."""
    text = (replica_groups or "").strip()
    m = re.fullmatch(r"mesh\[([\d,\s]*)\]\s*\{([\d,\s]*)\}", text)
    if m:
        sizes = [int(s) for s in m.group(1).split(",") if s.strip()]
        axes = [int(a) for a in m.group(2).split(",") if a.strip()]
        return math.prod(sizes[a] for a in axes) if axes and all(a < len(sizes) for a in axes) else None
    m = re.match(r"\{\{([\d,\s]*)\}", text)
    if m:
        return len([d for d in m.group(1).split(",") if d.strip()]) or None
    m = re.match(r"\[\s*\d+\s*,\s*(\d+)\s*\]", text)
    return int(m.group(1)) if m else None


def update_regions(graph: Graph, num_shards: int | None = None) -> UpdateRegions:
    """The update regions of `graph`'s gradients; `num_shards`: the data-parallel degree (default:
    the devices of the first gradient's all-reduce group)."""
    if num_shards is None:
        num_shards = group_size(graph.gradients[0].compat[2]) if graph.gradients else None
    ops, n = graph.ops, len(graph.ops)
    elements = [op.inst.outputs[0].elements if len(op.inst.outputs) == 1 else -1 for op in ops]
    reached: list[int] = [-1] * n  # gradient id, or -2 where several gradients reach the op
    regions: list[set[int]] = []
    for grad in graph.gradients:
        size, seen, stack = elements[grad.producer], set(), [grad.reduced]
        while stack:
            o = stack.pop()
            for u in graph.users[o]:
                if u not in seen and elements[u] == size and ops[u].kind in ("fusible", "free"):
                    seen.add(u)
                    stack.append(u)
        # The ops of that size read only by the update (Adam's `b1 * mu`): the update's too.
        stack = list(seen)
        while stack:
            for x in ops[stack.pop()].operands:
                if (
                    x not in seen
                    and elements[x] == size
                    and ops[x].kind == "fusible"
                    and all(u >= 0 and u in seen for u in graph.consumers(x))
                ):
                    seen.add(x)
                    stack.append(x)
        for o in seen:
            reached[o] = grad.id if reached[o] in (-1, grad.id) else -2
        regions.append(seen)
    region_of = [r if r >= 0 and ops[o].kind == "fusible" else -1 for o, r in enumerate(reached)]
    owned = [frozenset(o for o in seen if region_of[o] == g) for g, seen in enumerate(regions)]
    outputs = tuple(tuple(sorted(o for o in region if -1 in graph.consumers(o))) for region in owned)
    state = []
    for g, region in enumerate(owned):
        size = elements[graph.gradients[g].producer]
        params = {
            src
            for o in region
            for operand in ops[o].operands
            for src in _parameters(graph, operand)
            if elements[src] == size
        }
        state.append(tuple(sorted(p for p in params if all(u >= 0 and region_of[u] == g for u in graph.consumers(p)))))
    return UpdateRegions(
        tuple(owned),
        outputs,
        tuple(state),
        tuple(sum(ops[p].output_bytes for p in st) for st in state),
        tuple(region_of),
        num_shards or 1,
        tuple(ops[g.producer].inst.outputs[0].dims for g in graph.gradients),
    )


def _parameters(graph: Graph, o: int) -> list[int]:
    """The entry parameters whose value op `o` is (through free ops such as bitcasts)."""
    stack, out = [o], []
    while stack:
        x = stack.pop()
        op = graph.ops[x]
        if op.opcode == "parameter":
            out.append(x)
        elif op.kind == "free":
            stack.extend(op.operands)
    return out


regions_of = per_graph(update_regions)


def reduce_scatters(program: Program, allreduce) -> bool:
    """Whether a sharded bucket's all-reduce becomes a reduce-scatter: the communication model's
    `forms_reduce_scatter` where it models a platform of its own (a simulated GPU cluster, whose
    rows may cost XLA:CPU's module), else the backend that compiles `program`."""
    own = getattr(allreduce, "forms_reduce_scatter", None)
    return program.backend.forms_reduce_scatter if own is None else bool(own)


@per_program
def scattered_gradients(program: Program) -> frozenset[int]:
    """The gradients of `program` (one that already slices them: the sharded update lowered)
    whose all-reduce runs as a reduce-scatter: where the compiler forms them
    (`Backend.creates_reduce_scatter`), those whose every user is a dynamic-slice; where the
    pipeline applies the rule (`Backend.hook_rules`), those it matches (`sharding.apply.scatterable`)."""
    graph, backend = program.graph, program.backend
    if backend.creates_reduce_scatter:
        return frozenset(
            g.id
            for g in graph.gradients
            if graph.consumers(g.reduced)
            and all(u >= 0 and graph.ops[u].opcode == "dynamic-slice" for u in graph.consumers(g.reduced))
        )
    if not backend.forms_reduce_scatter:
        return frozenset()
    matched = apply.scatterable(graph.module)
    return frozenset(g.id for g in graph.gradients if g.result_name in matched)


@per_program
def grouped_gathers(program: Program) -> frozenset[int]:
    """The all-gathers of `program` the hook groups with an earlier one under XLA's plan
    (`Program.rules_applied`, `grouped_all_gather`): one all-gather pays the group's latency, these
    only their bytes. Taken from XLA's plan for every strategy (a plan with other buckets may
    group them otherwise)."""
    graph, out = program.graph, set()
    for a in program.rules_applied:
        if a["rule"] == apply.GROUPED_ALL_GATHER_RULE:
            out.update(graph.entry_values[name] for name in a["at"][1:] if name in graph.entry_values)
    return frozenset(out)
