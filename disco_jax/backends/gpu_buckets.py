"""Which gradients each of XLA:GPU's combined all-reduces carries.

XLA's combiner flattens the operands of a combined all-reduce into one buffer (a `concatenate`
fusion of bitcasts), all-reduces it and slices it back. `gpu_schedule` traces each piece of that
buffer (a slot) back to a graph op by name; what this file adds:

* `carriers(graph)`: graph op -> the gradient its value is. Besides a gradient's producer, the op
  under the producer's layout-only chain (`reshape(dot)`): XLA makes such reshapes bitcasts, and
  the slot then reads the dot itself.
* `read_allreduces(graph, reads)`: the gradients of every all-reduce, with the slots tracing
  found no gradient for resolved by elimination. Seen deviceless for 8 H100s (tiny Transformer,
  Adam): slices of a dot that XLA's dot merger widened (`slice.51.1` of a merged dot for the
  pre-scheduler `slice.6`: a fresh name, and the same opcode, shape and metadata as its sibling
  slices), and a scatter XLA rebuilt. A slot takes the first gradient not read elsewhere with its
  element count that lies between the gradients read around it: XLA keeps the gradients' order
  inside a combined all-reduce.
* Reassociation: where two gradients' all-reduce results are only added (`add(all-reduce(a),
  all-reduce(b))`, the embedding's gradient from two uses), XLA's `all-reduce-reassociate` sums
  them first and all-reduces the sum: one slot carries both, and they share its bucket.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from disco_jax._graph import Graph

_LAYOUT_ONLY = frozenset({"reshape", "bitcast", "copy", "transpose"})


def carriers(graph: Graph) -> dict[int, int]:
    """Graph op -> the gradient id its value is (the producer, or the op under its layout chain)."""
    found = {g.producer: g.id for g in graph.gradients}
    under: dict[int, list[int]] = {}
    for g in graph.gradients:
        o = g.producer
        while graph.ops[o].opcode in _LAYOUT_ONLY and len(graph.ops[o].operands) == 1:
            o = graph.ops[o].operands[0]
            under.setdefault(o, []).append(g.id)
    for o, gs in under.items():
        if len(gs) == 1 and o not in found:
            found[o] = gs[0]
    return found


def summed_units(graph: Graph) -> dict[int, tuple[int, ...]]:
    """Gradient id -> the gradients XLA reassociates it with (itself alone when none): those whose
    all-reduce results feed only an `add` of all-reduce results."""
    summed: dict[int, frozenset[int]] = {}
    for op in graph.ops:
        if op.kind == "reduced" and op.gradient is not None:
            summed[op.id] = frozenset([op.gradient])
        elif op.opcode == "add":
            parts = [s for v in op.operands for s in graph.free_sources[v]]
            if len(parts) > 1 and all(p in summed and graph.consumers(p) == (op.id,) for p in parts):
                summed[op.id] = frozenset().union(*(summed[p] for p in parts))
    unit = {g.id: (g.id,) for g in graph.gradients}
    for members in sorted(summed.values(), key=len):
        for g in members:
            unit[g] = tuple(sorted(members))
    return unit


def read_allreduces(graph: Graph, reads: list[list[tuple[int | None, int]]]) -> list[list[int]]:
    """The gradients each all-reduce carries; `reads`: per all-reduce, for each slot of its flat
    buffer, the gradient traced to it (None: not found) and its element count."""
    unit = summed_units(graph)
    elements = [graph.ops[g.producer].inst.outputs[0].elements for g in graph.gradients]
    read = {g for slots in reads for g, _ in slots if g is not None}
    taken = {m for g in read for m in unit[g]}
    left = sorted({unit[g.id] for g in graph.gradients if g.id not in taken})
    out: list[list[int]] = []
    for slots in reads:
        gradients: list[int] = []
        for k, (g, n) in enumerate(slots):
            if g is None:
                low = max(gradients, default=-1)
                high = min((h for h, _ in slots[k + 1 :] if h is not None), default=len(elements))
                fits = [u for u in left if elements[u[0]] == n and low < u[0] and u[-1] < high]
                if not fits:
                    continue
                left.remove(fits[0])
                gradients += fits[0]
            else:
                gradients += [m for m in unit[g] if m == g or m not in read]
        out.append(list(dict.fromkeys(gradients)))
    return out
