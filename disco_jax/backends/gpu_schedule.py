"""XLA:GPU's scheduled module as kernels, and XLA's own decisions mapped onto the graph IR.

The GPU backend captures and rewrites at PRE_SCHEDULER, where XLA:GPU has not fused or combined
anything yet (every op is an entry instruction, one all-reduce per gradient). What XLA itself
makes of that module is read from POST_SCHEDULER of the same compile:

* `scheduled_kernels(graph, text)`: the scheduled entry computation as `ScheduledKernel`s in
  XLA's order: gemm fusions (cuBLAS / Triton `kCustom`) and other custom fusions or calls as
  opaque kernels, kLoop / kInput fusions, each async collective as one kernel spanning its
  start/done pair, and the ops left unfused; each with its flops and bytes and the graph ops it
  computes.
* `with_xla_decisions(graph, text)`: the graph with XLA's fusions (`xla_groups`, `xla_homes`,
  `xla_kernel_names`, `xla_exports`), its all-reduce combining (`xla_buckets`) and its schedule
  (`xla_schedule`) read off the scheduled module. `xla_default(graph)` is then XLA:GPU's plan.

Instructions are mapped back to graph ops by name: XLA keeps an instruction's name when it clones
it into a fusion, adding `.N` (`select_n.6` -> `select_n.6.3`), and names a gemm fusion after its
dot (`gemm_fusion_dot.5`). Instructions a pass created afresh (a gemm epilogue rebuilt by the
Triton rewriter) are mapped by opcode, shape and `op_name` metadata when exactly one graph op
matches. What maps to nothing (bitcasts, broadcasts XLA made) is left out of the groups.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING

from disco_jax import _hlo
from disco_jax._strategy import components
from disco_jax.backends.gpu_buckets import carriers, read_allreduces
from disco_jax.cost.work import KernelWork, Work, instruction_work

if TYPE_CHECKING:
    from disco_jax._graph import Graph

# Computations a fusion instruction calls that are not part of the kernel's code.
_REDUCER_KEYS = ("to_apply",)
_COLLECTIVE_STARTS = {"all-reduce-start", "all-gather-start", "collective-permute-start", "async-start"}


@dataclasses.dataclass(frozen=True)
class ScheduledKernel:
    """One kernel (or async collective) of XLA:GPU's scheduled module.

    kind: 'gemm' (a cuBLAS / Triton gemm fusion), 'custom' (another custom fusion or custom call),
      'loop' / 'input' (kLoop / kInput fusions), 'collective' (an async start/done pair or a
      synchronous collective), or 'op' (an unfused instruction that launches work).
    position / done_position: index in the schedule (of the start and the done for async pairs).
    ops: the graph ops it computes. gradients: for all-reduces, the graph's gradient ids carried.
    work: bytes read and written at the kernel's boundary and the work of its instructions.
    """

    name: str
    kind: str
    position: int
    done_position: int
    ops: frozenset[int]
    gradients: tuple[int, ...]
    work: KernelWork


def _strip_layout(shape: str) -> str:
    return re.sub(r"{[^{}]*}", "", shape)


def _op_name(inst: _hlo.Instruction) -> str | None:
    m = re.search(r'op_name="([^"]*)"', inst.attr("metadata") or "")
    return m.group(1) if m else None


class _OpMapper:
    """Maps instructions of the scheduled module back to graph op ids (see the module docstring)."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.by_name: dict[str, int] = {}
        self.by_signature: dict[tuple, list[int]] = {}
        for op in graph.ops:
            if op.kind in ("fusible", "opaque"):
                self.by_name.setdefault(op.name, op.id)
                key = (op.opcode, _strip_layout(op.inst.shape), _op_name(op.inst))
                self.by_signature.setdefault(key, []).append(op.id)

    def _same(self, o: int, inst: _hlo.Instruction) -> bool:
        op = self.graph.ops[o]
        a, b = _op_name(op.inst), _op_name(inst)
        return op.opcode == inst.opcode and (a is None or b is None or a == b)

    def op(self, inst: _hlo.Instruction, fusion_name: str = "") -> int | None:
        name = inst.name
        while True:
            o = self.by_name.get(name)
            if o is not None and self._same(o, inst):
                return o
            if not re.search(r"\.(\d+|clone)$", name):  # `reduce.69.1.clone.1` -> `reduce.69`
                break
            name = name.rsplit(".", 1)[0]
        if inst.opcode in ("dot", "convolution") and "_fusion_" in fusion_name:
            o = self.by_name.get(fusion_name.split("_fusion_", 1)[1])
            if o is not None and self._same(o, inst):
                return o
        if inst.opcode in ("parameter", "constant", "bitcast", "get-tuple-element", "tuple"):
            return None
        candidates = self.by_signature.get((inst.opcode, _strip_layout(inst.shape), _op_name(inst)), [])
        return candidates[0] if len(candidates) == 1 else None

    def computation(self, comp: _hlo.Computation, outer: list[int | None], fusion_name: str) -> dict[str, int]:
        """Graph op per instruction of a fusion's computation (`outer`: the graph op each of the
        fusion's operands carries). An instruction a pass made afresh whose name and metadata
        are ambiguous is mapped by structure: the one graph op of its opcode that reads the
        graph ops its operands map to."""
        found: dict[str, int] = {}
        params: set[str] = set()
        for inst in comp.instructions:
            if inst.opcode == "parameter":
                k = int(inst.literal)
                params.add(inst.name)
                if k < len(outer) and outer[k] is not None:
                    found[inst.name] = outer[k]
                continue
            o = self.op(inst, fusion_name)
            if o is None and inst.opcode not in ("constant", "bitcast", "tuple", "get-tuple-element"):
                o = self._by_operands(inst, [found.get(n) for n in inst.operands])
            if o is not None:
                found[inst.name] = o
        return {
            n: o
            for n, o in found.items()
            if not any(i.name == n and i.opcode == "parameter" for i in comp.instructions)
        }

    def _by_operands(self, inst: _hlo.Instruction, operands: list[int | None]) -> int | None:
        known = {o for o in operands if o is not None}
        if not known:
            return None
        sources = self.graph.free_sources
        candidates = [
            op.id
            for op in self.graph.ops
            if op.opcode == inst.opcode
            and op.kind in ("fusible", "opaque")
            and known <= {s for v in op.operands for s in sources[v]}
        ]
        return candidates[0] if len(candidates) == 1 else None


def _called(module: _hlo.HloModuleText, inst: _hlo.Instruction) -> list[_hlo.Computation]:
    """Computations whose instructions are part of a fusion's code (nested fusions included)."""
    found, stack = [], [inst]
    while stack:
        i = stack.pop()
        for k, v in i.attrs:
            if k not in ("calls", "called_computations") or k in _REDUCER_KEYS:
                continue
            for name in v.strip("{}").split(","):
                if not name.strip():
                    continue
                comp = module.computation(name.strip().lstrip("%"))
                found.append(comp)
                stack.extend(comp.instructions)
    return found


def _kind(inst: _hlo.Instruction, comps: list[_hlo.Computation]) -> str:
    if inst.opcode == "fusion":
        kind = inst.attr("kind")
        if kind == "kCustom":
            gemm = "gemm" in (inst.attr("backend_config") or "") or any(
                i.opcode in ("dot", "convolution") for c in comps for i in c.instructions
            )
            return "gemm" if gemm else "custom"
        return {"kLoop": "loop", "kInput": "input"}.get(kind or "", "custom")
    if inst.opcode == "custom-call":
        return "custom"
    if inst.opcode in _COLLECTIVE_STARTS or inst.opcode in ("all-reduce", "all-gather", "reduce-scatter"):
        return "collective"
    return "op"


def _work(inst: _hlo.Instruction, comps: list[_hlo.Computation], shapes: dict[str, list]) -> KernelWork:
    inner: list[Work] = []
    for comp in comps or []:
        local = {i.name: i.outputs for i in comp.instructions}
        inner += [instruction_work(i, [local.get(n) for n in i.operands]) for i in comp.instructions]
    if not comps:
        inner.append(instruction_work(inst, [shapes.get(n) for n in inst.operands]))
    read = sum(sum(t.bytes for t in shapes.get(n) or []) for n in inst.operands)
    return KernelWork.of(read, inst.output_bytes, inner)


_FREE_IN_SCHEDULE = frozenset("parameter constant get-tuple-element tuple bitcast after-all".split())


def scheduled_kernels(graph: Graph, text: str) -> list[ScheduledKernel]:
    """XLA:GPU's kernels in schedule order, mapped onto `graph` (see the module docstring).
    `text`: the module at POST_SCHEDULER (`is_scheduled=true`: its entry order is the schedule)."""
    module = _hlo.parse_module(text)
    if "is_scheduled=true" not in module.header:
        raise ValueError("not a scheduled module: read XLA:GPU's decisions at POST_SCHEDULER")
    mapper = _OpMapper(graph)
    entry = module.entry
    shapes = {i.name: i.outputs for i in entry.instructions}
    by_name = entry.by_name()
    carrier = carriers(graph)
    reads: dict[int, list[tuple[int | None, int]]] = {}  # all-reduce kernel -> (gradient, elements) per slot
    starts: dict[str, int] = {}
    kernels: list[ScheduledKernel] = []
    for pos, inst in enumerate(entry.instructions):
        if inst.opcode in _FREE_IN_SCHEDULE:
            continue
        if inst.opcode.endswith("-done"):
            k = starts.pop(inst.operands[0], None)
            if k is not None:
                kernels[k] = dataclasses.replace(kernels[k], done_position=pos)
            continue
        comps = _called(module, inst) if inst.opcode in ("fusion", "custom-call") else []
        if comps:
            outer = [_origin(module, by_name, mapper, n) for n in inst.operands]
            ops = {o for c in comps for o in mapper.computation(c, outer, inst.name).values()}
        else:
            ops = {mapper.op(inst)}
        ops.discard(None)
        kind = _kind(inst, comps)
        if inst.opcode in ("all-reduce", "all-reduce-start"):
            slots = [n for operand in inst.operands for n in _parts(module, by_name, operand)]
            reads[len(kernels)] = [
                (carrier.get(_origin(module, by_name, mapper, n)), by_name[n].outputs[0].elements)  # type: ignore[arg-type]
                for n in slots
            ]
        if inst.opcode.endswith("-start"):
            starts[inst.name] = len(kernels)
        kernels.append(
            ScheduledKernel(inst.name, kind, pos, pos, frozenset(ops), (), _work(inst, comps, shapes))  # type: ignore[arg-type]
        )
    for k, gradients in zip(reads, read_allreduces(graph, list(reads.values()))):
        kernels[k] = dataclasses.replace(kernels[k], gradients=tuple(gradients))
    return kernels


def _parts(module, by_name: dict, name: str) -> list[str]:
    """The entry values XLA concatenated into the flat buffer `name` of a combined all-reduce
    (through bitcasts), in order; [name] when it is no concatenation."""
    inst = by_name.get(name)
    while inst is not None and inst.opcode in ("bitcast", "copy") and inst.operands[0] in by_name:
        inst = by_name[inst.operands[0]]
    if inst is not None and inst.opcode == "concatenate":
        return [p for n in inst.operands for p in _parts(module, by_name, n)]
    if inst is not None and inst.opcode == "fusion":
        comp = module.computation(inst.attr("calls").lstrip("%"))
        root = comp.root
        params = [_param(comp, n) for n in root.operands] if root.opcode == "concatenate" else []
        if params and all(p is not None for p in params):  # the combiner's flat buffer
            return [p for k in params for p in _parts(module, by_name, inst.operands[int(k)])]  # type: ignore[arg-type]
    return [name]


def _origin(module, by_name: dict, mapper: _OpMapper, name: str) -> int | None:
    """The graph op whose value an entry value of the scheduled module carries, looking through
    bitcasts and get-tuple-elements of multi-output fusions."""
    inst = by_name.get(name)
    if inst is None:
        return None
    if inst.opcode in ("bitcast", "copy"):
        return _origin(module, by_name, mapper, inst.operands[0])
    index = None
    if inst.opcode == "get-tuple-element":
        index = int(inst.attr("index"))
        inst = by_name.get(inst.operands[0])
        if inst is None:
            return None
    if inst.opcode != "fusion":
        return mapper.op(inst)
    comp = module.computation(inst.attr("calls").lstrip("%"))
    root = comp.root
    if root.opcode == "tuple" and index is not None:
        root = comp.by_name()[root.operands[index]]
    while root.opcode == "bitcast":
        root = comp.by_name()[root.operands[0]]
    return mapper.op(root, inst.name)


def _param(comp: _hlo.Computation, name: str) -> str | None:
    """The parameter number behind `name` through bitcasts, or None when it is computed."""
    inst = comp.by_name()[name]
    while inst.opcode == "bitcast":
        inst = comp.by_name()[inst.operands[0]]
    return inst.literal if inst.opcode == "parameter" else None


def _bridged(graph: Graph, part: frozenset[int], mapped: set[int]) -> set[int]:
    """Unmapped fusible ops on a path from `part` back to `part` through unmapped fusible ops."""

    def unmapped(o: int) -> bool:
        return o >= 0 and o not in mapped and graph.ops[o].kind == "fusible"

    def reach(step) -> set[int]:
        found: set[int] = set()
        stack = [x for o in part for x in step(o) if unmapped(x)]
        while stack:
            o = stack.pop()
            if o not in found:
                found.add(o)
                stack.extend(x for x in step(o) if unmapped(x))
        return found

    sources = graph.free_sources
    forward = reach(graph.consumers)
    if not forward:
        return set()
    backward = reach(lambda o: [s for v in graph.ops[o].operands for s in sources[v]])
    return forward & backward


def _choose_homes(
    graph: Graph, groups: list[frozenset[int]], names: list[str], positions: list[float], unheld_at: dict[int, float]
) -> dict[int, int]:
    """Each fusible op's home group. An op XLA computes in several fusions (a broadcast of a
    constant; a layer norm recomputed in the next residual's fusion) lives in the first of them
    in XLA's schedule: its readers outside run after that one. Only when a reader outside them
    runs before it (or is unscheduled) does it get a group of one (appended) as its home.
    `unheld_at`: where each op runs when no group holds it (`_unheld_positions`)."""
    holders: dict[int, list[int]] = {}
    for gi, members in enumerate(groups):
        for o in members:
            holders.setdefault(o, []).append(gi)
    # Each held op's first holder in XLA's schedule, and where every op runs (held: at its first).
    firsts = {o: held[0] if len(held) == 1 else min(held, key=positions.__getitem__) for o, held in holders.items()}
    at = unheld_at | {o: positions[first] for o, first in firsts.items()}
    homes: dict[int, int] = {}
    for o, held in holders.items():
        first = firsts[o]
        start = positions[first]
        if any(at[u] < start and all(u not in groups[gi] for gi in held) for u in graph.consumers(o)):
            homes[o] = len(groups)
            groups.append(frozenset([o]))
            names.append(graph.ops[o].name)
            positions.append(float("inf"))
        else:
            homes[o] = first
    return homes


def _unheld_positions(graph: Graph, kernels: list[ScheduledKernel]) -> dict[int, float]:
    """Where each op runs when no group holds it: a non-fusible op at its kernel's place in XLA's
    schedule; a fusible op, an op XLA did not schedule, and the module's output (-1) never."""
    at = dict.fromkeys(range(-1, len(graph.ops)), float("inf"))
    at.update((o, k.position) for k in kernels for o in k.ops if graph.ops[o].kind != "fusible")
    return at


def _read_nodes(graph: Graph, bucket_of: dict[int, int]) -> list[tuple[tuple[int, int | None], ...]]:
    """For each op, the non-free ops it reads (through free ops, in operand order) that are nodes of
    `_group_cycle`'s graph: with the node where it is fixed (an opaque op, a gradient's all-reduce),
    None for a fusible op (its node is its home group)."""
    fixed = {o: -1 - o for o in graph.opaque_ops} | bucket_of
    return [
        tuple(
            (src, fixed.get(src))
            for v in op.operands
            for src in graph.free_sources[v]
            if src in fixed or graph.ops[src].kind == "fusible"
        )
        for op in graph.ops
    ]


def _providers(members: frozenset[int], homes: dict[int, int], reads: tuple[tuple[int, int | None], ...]) -> set[int]:
    """Nodes of `_group_cycle`'s graph that an op (of a kernel with `members`) reads from, given its
    `reads` (`_read_nodes`)."""
    out: set[int] = set()
    for src, node in reads:
        if src not in members:
            out.add(homes[src] if node is None else node)
    return out


def _bucket_nodes(graph: Graph, buckets: list[tuple[int, ...]]) -> dict[int, int]:
    """Reduced-value op -> its all-reduce's node in `_group_cycle`'s graph (-1 - len(ops) - bucket)."""
    return {graph.gradients[g].reduced: -1 - len(graph.ops) - b for b, bucket in enumerate(buckets) for g in bucket}


def _group_cycle(
    graph: Graph,
    groups: list[frozenset[int]],
    homes: dict[int, int],
    buckets: list[tuple[int, ...]],
    reads: list[tuple[tuple[int, int | None], ...]],
) -> list[int] | None:
    """A dependency cycle among groups (by index), opaque ops (op o as -1 - o) and all-reduces
    (bucket b as -1 - len(ops) - b), in order (each node reads from the next, the last from the
    first); None when there is none. `reads`: `_read_nodes` of the graph and `buckets`."""
    deps: dict[int, set[int]] = {}
    for gi, members in enumerate(groups):
        deps[gi] = set().union(*(_providers(members, homes, reads[o]) for o in members)) - {gi}
    for o in graph.opaque_ops:
        deps[-1 - o] = _providers(frozenset([o]), homes, reads[o])
    for b, bucket in enumerate(buckets):
        producers = {graph.gradients[g].producer for g in bucket}
        deps[-1 - len(graph.ops) - b] = {homes[p] if graph.ops[p].kind == "fusible" else -1 - p for p in producers}
    state: dict[int, int] = {}  # 1: on the path, 2: done
    for root in deps:
        if root in state:
            continue
        path, iters = [root], [iter(deps[root])]
        state[root] = 1
        while path:
            nxt = next(iters[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                iters.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                iters.append(iter(deps.get(nxt, ())))
    return None


def with_xla_decisions(graph: Graph, text: str) -> Graph:
    """`graph` with XLA:GPU's fusions, all-reduce buckets and schedule as read from `text`, the
    same compile's POST_SCHEDULER module. Fusible ops XLA fused into one kLoop / kInput fusion
    form one group; those of a gemm or custom fusion one group per connected piece (prologues,
    epilogue); the others are groups of one. A gradient found in no all-reduce keeps an
    all-reduce of its own."""
    kernels = scheduled_kernels(graph, text)
    groups: list[frozenset[int]] = []
    names: list[str] = []
    positions: list[float] = []  # each group's kernel's place in XLA's schedule
    for k in kernels:
        members = frozenset(o for o in k.ops if graph.ops[o].kind == "fusible")
        if not members or k.kind == "collective":
            continue
        # A gemm fusion's fusible ops are its prologue(s) and epilogue: one group each (the
        # dot between them is opaque; one group around it would be a dependency cycle).
        parts = [members] if k.kind in ("loop", "input") else components(graph, sorted(members))
        for part in parts:
            groups.append(part)
            names.append(k.name)
            positions.append(k.position)
    # Ops mapped to no kernel: XLA made most of them bitcasts inside a fusion. One that lies on a
    # path between members of a group (through such ops only) is part of that fusion; left apart,
    # it would read as a kernel the fusion both feeds and waits for.
    mapped = set().union(*groups) if groups else set()
    groups = [part | _bridged(graph, part, mapped) for part in groups]
    seen = set().union(*groups) if groups else set()
    for o in graph.fusible_ops:
        if o not in seen:
            groups.append(frozenset([o]))
            names.append(graph.ops[o].name)
            positions.append(float("inf"))
    unheld_at = _unheld_positions(graph, kernels)
    buckets: list[tuple[int, ...]] = []
    carried: set[int] = set()
    for k in kernels:  # a gradient mapped to two all-reduces (an ambiguous name) counts once
        bucket = tuple(g for g in dict.fromkeys(k.gradients) if g not in carried)
        if bucket:
            buckets.append(bucket)
            carried |= set(bucket)
    buckets += [(g.id,) for g in graph.gradients if g.id not in carried]
    reads = _read_nodes(graph, _bucket_nodes(graph, buckets))
    base = len(groups)
    while True:
        del groups[base:], names[base:], positions[base:]
        homes = _choose_homes(graph, groups, names, positions, unheld_at)
        cycle = _group_cycle(graph, groups, homes, buckets, reads)
        if cycle is None:
            break
        # A cycle means a member was mapped to the wrong fusion or a recomputed op to the wrong
        # home (XLA's own schedule has none): the members of each fusion on it that read from
        # the next kernel on it leave the fusion (an op no other fusion holds becomes a group of one).
        cut = False
        for a, b in zip(cycle, cycle[1:] + cycle[:1]):
            if not 0 <= a < base or len(groups[a]) < 2:
                continue
            readers = {o for o in groups[a] if b in _providers(groups[a], homes, reads[o])}
            if readers and readers != groups[a]:
                groups[a] -= readers
                cut = True
                held = set().union(*(g for gi, g in enumerate(groups[:base]) if gi != a))
                for o in sorted(readers - held):
                    groups.insert(base, frozenset([o]))
                    names.insert(base, graph.ops[o].name)
                    positions.insert(base, float("inf"))
                    base += 1
        if not cut:
            raise ValueError(f"XLA's kernels as read form a dependency cycle the reader cannot undo: {cycle}")
    exports = [sorted(o for o in g if any(u not in g for u in graph.consumers(o))) or [max(g)] for g in groups]
    return dataclasses.replace(
        graph,
        xla_groups=groups,
        xla_homes=homes,
        xla_buckets=buckets,
        xla_kernel_names=names,
        xla_exports=exports,
        xla_schedule=tuple(kernels),
    )
