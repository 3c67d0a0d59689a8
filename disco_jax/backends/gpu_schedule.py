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


def with_xla_decisions(graph: Graph, text: str) -> Graph:
    """`graph` with XLA:GPU's fusions, all-reduce buckets and schedule as read from `text`, the
    same compile's POST_SCHEDULER module. Fusible ops XLA fused into one kLoop / kInput fusion
    form one group; those of a gemm or custom fusion one group per connected piece (prologues,
    epilogue); the others are groups of one. A gradient found in no all-reduce keeps an
    all-reduce of its own."""
    kernels = scheduled_kernels(graph, text)
    groups, names, exports = [], [], []
    seen: set[int] = set()
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
            outside = [o for o in part if any(u not in part for u in graph.consumers(o))]
            exports.append(sorted(outside) or [max(part)])
            seen |= part
    for o in graph.fusible_ops:
        if o not in seen:
            groups.append(frozenset([o]))
            names.append(graph.ops[o].name)
            exports.append([o])
    # An op XLA recomputes in several fusions (a broadcast of a constant) has no kernel of its
    # own; where an op outside those fusions reads it, it gets a group of one as its home, so that
    # no fusion appears to feed an op it (through others) depends on.
    holders: dict[int, list[int]] = {}
    for gi, members in enumerate(groups):
        for o in members:
            holders.setdefault(o, []).append(gi)
    homes: dict[int, int] = {}
    for o, held in holders.items():
        outside = [u for u in graph.consumers(o) if u < 0 or all(u not in groups[gi] for gi in held)]
        if len(held) > 1 and outside:
            homes[o] = len(groups)
            groups.append(frozenset([o]))
            names.append(graph.ops[o].name)
            exports.append([o])
        else:
            homes[o] = next((gi for gi in held if o in exports[gi]), held[0])
    buckets: list[tuple[int, ...]] = []
    carried: set[int] = set()
    for k in kernels:  # a gradient mapped to two all-reduces (an ambiguous name) counts once
        bucket = tuple(g for g in dict.fromkeys(k.gradients) if g not in carried)
        if bucket:
            buckets.append(bucket)
            carried |= set(bucket)
    buckets += [(g.id,) for g in graph.gradients if g.id not in carried]
    return dataclasses.replace(
        graph,
        xla_groups=groups,
        xla_homes=homes,
        xla_buckets=buckets,
        xla_kernel_names=names,
        xla_exports=exports,
        xla_schedule=tuple(kernels),
    )
