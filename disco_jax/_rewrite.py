"""Strategy -> HLO module text, for the CPU hook stage (post-fusion, pre-schedule).

The entry computation is emitted anew, kernel by kernel in the strategy's topological order:

* an opaque op keeps its instruction (operands renamed);
* a group of one op is that op, unfused;
* a group equal to one of XLA's fusions reuses XLA's fused computation;
* any other group becomes a new kLoop fusion; ops it shares with other groups are cloned into
  it (duplicate fusion); several exported values make it a multi-output fusion;
* each bucket becomes one all-reduce (variadic for several gradients), emitted right after its
  last gradient's producer, with the reduction and replica groups of the original.

Other computations are kept verbatim. A backend whose hook sees pre-fusion HLO (GPU) needs a
different `Rewriter` (fusion by barriers and combiner settings); the search does not change.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Protocol

from disco_jax import _hlo
from disco_jax._graph import Graph
from disco_jax._strategy import BUCKET, GROUP, OPAQUE, Strategy, _prune, group_exports, kernel_dag

# Constants up to this size are cloned into each fusion that reads them (as XLA does).
_CLONE_CONSTANT_BYTES = 64


class Rewriter(Protocol):
    """Turns a strategy into the module text the hook returns, for one backend and stage."""

    def rewrite(self, graph: Graph, strategy: Strategy) -> str: ...


def _strip_layout(shape: str) -> str:
    return re.sub(r"\{[^{}]*\}", "", shape)


@dataclasses.dataclass
class _Emitter:
    graph: Graph
    strategy: Strategy
    entry: list[_hlo.Instruction] = dataclasses.field(default_factory=list)
    computations: list[_hlo.Computation] = dataclasses.field(default_factory=list)
    names: dict[int, str] = dataclasses.field(default_factory=dict)  # op id -> entry value name
    emitted_free: set[int] = dataclasses.field(default_factory=set)
    counter: int = 0
    channel: int = 0

    def operand_names(self, op_ids) -> list[str]:
        return [self.names[o] for o in op_ids]

    def emit(self, inst: _hlo.Instruction) -> None:
        self.entry.append(inst)

    def renamed(self, inst: _hlo.Instruction, operands: list[str], name: str | None = None) -> _hlo.Instruction:
        attrs = list(inst.attrs)
        preds = inst.attr("control-predecessors")
        if preds is not None:
            kept = []
            for p in preds.strip("{}").split(","):
                p = p.strip().lstrip("%")
                op = self.graph.entry_values.get(p)
                if op is not None and op in self.names:
                    kept.append("%" + self.names[op])
            attrs = [(k, v) for k, v in attrs if k != "control-predecessors"]
            if kept:
                attrs.append(("control-predecessors", "{" + ", ".join(kept) + "}"))
        return dataclasses.replace(inst, name=name or inst.name, operands=operands, attrs=attrs)

    def flush_free(self) -> None:
        """Emit free ops (get-tuple-element, tuple, bitcast, constants) whose inputs now exist."""
        progress = True
        while progress:
            progress = False
            for op in self.graph.ops:
                if op.kind != "free" or op.id in self.emitted_free or op.opcode == "parameter":
                    continue
                if all(o in self.names for o in op.operands):
                    self.emitted_free.add(op.id)
                    self.emit(self.renamed(op.inst, self.operand_names(op.operands)))
                    self.names[op.id] = op.name
                    progress = True


def kernel_inputs(graph: Graph, members: frozenset[int], suffix: str,
                  param_name: Callable[[int], str]) -> tuple[dict[int, str], list[int], list[_hlo.Instruction]]:
    """What a kernel of `members` reads from outside it: small constants are cloned inside (as
    XLA does), every other value becomes a parameter. Returns (name inside the kernel by op id,
    parameter op ids in order, the cloned constant instructions)."""
    inner: dict[int, str] = {}
    params: list[int] = []
    constants: list[_hlo.Instruction] = []
    for o in sorted(members):
        for v in graph.ops[o].operands:
            if v in members or v in inner:
                continue
            src = graph.ops[v]
            if src.opcode == "constant" and src.kind == "free" and src.output_bytes <= _CLONE_CONSTANT_BYTES:
                inner[v] = f"{src.name}.{suffix}"
                constants.append(dataclasses.replace(src.inst, name=inner[v], is_root=False, attrs=[]))
            else:
                inner[v] = param_name(len(params))
                params.append(v)
    return inner, params, constants


def fused_computation(graph: Graph, members: frozenset[int], exports: list[int], name: str,
                      suffix: str) -> tuple[_hlo.Computation, list[int], str]:
    """The fused computation of a kLoop fusion of `members` that outputs `exports` (a tuple, i.e.
    a multi-output fusion, when there are several). Small constants are cloned inside; every other
    value from outside becomes a parameter. Inner names get `.{suffix}`.

    Returns (computation, op ids feeding its parameters in order, result shape text). Used by
    the rewrite and by the GNN's kernel measurements, so both see the same code."""
    inner, params, body = kernel_inputs(graph, members, suffix, lambda i: f"param_{i}.{suffix}")
    param_insts = [_hlo.Instruction(inner[v], graph.ops[v].inst.shape, "parameter", [], str(i), [])
                   for i, v in enumerate(params)]
    for o in sorted(members):
        op = graph.ops[o]
        inner[o] = f"{op.name}.{suffix}"
        attrs = [(k, v) for k, v in op.inst.attrs if k not in ("metadata", "control-predecessors")]
        body.append(dataclasses.replace(op.inst, name=inner[o], operands=[inner[v] for v in op.operands],
                                        attrs=attrs, is_root=False))
    if len(exports) == 1:
        root_shape = graph.ops[exports[0]].inst.shape
        body = [dataclasses.replace(i, is_root=True) if i.name == inner[exports[0]] else i for i in body]
    else:
        root_shape = "(" + ", ".join(graph.ops[o].inst.shape for o in exports) + ")"
        body.append(_hlo.Instruction(f"tuple.{suffix}", root_shape, "tuple", [inner[o] for o in exports],
                                     None, [], is_root=True))
    header_params = ", ".join(f"{inner[v]}: {_strip_layout(graph.ops[v].inst.shape)}" for v in params)
    header = f"%{name} ({header_params}) -> {_strip_layout(root_shape)} {{"
    return _hlo.Computation(name, header, param_insts + body), params, root_shape


class CpuRewriter:
    """Rewriter for XLA:CPU's PRE_SCHEDULER hook stage (DESIGN.md points 2-3)."""

    def rewrite(self, graph: Graph, strategy: Strategy) -> str:
        dag = kernel_dag(graph, strategy)
        if dag is None:
            raise ValueError("strategy has a dependency cycle; it cannot be rewritten")
        module = graph.module
        em = _Emitter(graph, strategy)
        channels = [int(c) for c in re.findall(r"channel_id=(\d+)", module.to_text(drop_metadata=True))]
        em.channel = max(channels, default=0)
        exports = group_exports(graph, strategy)
        xla_by_members = {}
        for i, members in enumerate(graph.xla_groups):
            inst = module.entry.by_name().get(graph.xla_kernel_names[i])
            if inst is not None and inst.opcode == "fusion":
                xla_by_members[members] = (inst, graph.xla_exports[i])
        for op in graph.ops:
            if op.opcode == "parameter" and op.kind == "free":
                em.emit(op.inst)
                em.names[op.id] = op.name
                em.emitted_free.add(op.id)
        em.flush_free()
        for k in dag.order:
            kind = dag.kinds[k]
            if kind == OPAQUE:
                (o,) = dag.members[k]
                op = graph.ops[o]
                em.emit(em.renamed(op.inst, em.operand_names(op.operands)))
                em.names[o] = op.name
            elif kind == GROUP:
                gi = dag.group_index[k]
                self._emit_group(em, gi, exports[gi], xla_by_members)
            elif kind == BUCKET:
                self._emit_bucket(em, sorted(dag.members[k], key=lambda g: graph.gradients[g].producer))
            em.flush_free()
        missing = [graph.ops[o].name for o in graph.outputs if o not in em.names]
        if missing:
            raise ValueError(f"rewrite could not place the module output {missing}")
        body = [dataclasses.replace(i, is_root=False) if i.is_root else i for i in em.entry]
        root = module.entry.root
        if len(graph.outputs) > 1:  # ROOT was a multi-output fusion: rebuild its tuple
            body.append(_hlo.Instruction(root.name, root.shape, "tuple",
                                         [em.names[o] for o in graph.outputs], None, [], is_root=True))
        else:
            # The output goes last (free ops are emitted as soon as their inputs exist).
            name = em.names[graph.outputs[0]]
            at = max(i for i, inst in enumerate(body) if inst.name == name)
            body.append(dataclasses.replace(body.pop(at), is_root=True))
        entry = dataclasses.replace(module.entry, instructions=body)
        comps = [c for c in module.computations if not c.is_entry] + em.computations + [entry]
        return _hlo.HloModuleText(module.header, module.preamble, comps).to_text()

    def _emit_group(self, em: _Emitter, gi: int, exports: list[int], xla_by_members) -> None:
        graph, s = em.graph, em.strategy
        members = s.groups[gi]
        if not exports:
            return
        # XLA's own kernel where the group is unchanged, including the one-op fusions XLA wraps
        # around lone ops (a bare op is generated differently: not bitwise equal).
        original = xla_by_members.get(members)
        if original is not None and set(exports) <= set(original[1]):
            inst, outputs = original
            em.emit(em.renamed(inst, [em.names[graph.entry_values[n]] for n in inst.operands]))
            if len(outputs) == 1 and not inst.shape.startswith("("):
                em.names[outputs[0]] = inst.name
            else:
                for i, o in enumerate(outputs):
                    name = f"{inst.name}.out{i}"
                    em.emit(_hlo.Instruction(name, graph.ops[o].inst.shape, "get-tuple-element",
                                             [inst.name], None, [("index", str(i))]))
                    em.names[o] = name
            return
        self._emit_new_fusion(em, members, exports)

    def _emit_new_fusion(self, em: _Emitter, members: frozenset[int], exports: list[int]) -> None:
        graph = em.graph
        members = _prune(graph, members, exports)  # XLA rejects fused ops without users
        if len(members) == 1:
            (o,) = members
            op = graph.ops[o]
            em.emit(em.renamed(op.inst, em.operand_names(op.operands), name=op.name))
            em.names[o] = op.name
            return
        em.counter += 1
        n = em.counter
        comp, params, root_shape = fused_computation(graph, members, exports, f"disco_fused_computation.{n}", f"d{n}")
        em.computations.append(comp)
        name = f"disco_fusion.{n}"
        em.emit(_hlo.Instruction(name, root_shape, "fusion", em.operand_names(params), None,
                                 [("kind", "kLoop"), ("calls", f"%{comp.name}")]))
        if len(exports) == 1:
            em.names[exports[0]] = name
        else:
            for i, o in enumerate(exports):
                out = f"{name}.out{i}"
                em.emit(_hlo.Instruction(out, graph.ops[o].inst.shape, "get-tuple-element", [name], None,
                                         [("index", str(i))]))
                em.names[o] = out

    def _emit_bucket(self, em: _Emitter, gradient_ids: list[int]) -> None:
        graph = em.graph
        grads = [graph.gradients[g] for g in gradient_ids]
        template = graph.allreduce_templates[grads[0].compat]
        em.channel += 1
        attrs = [(k, v) for k, v in template.attrs
                 if k not in ("metadata", "control-predecessors", "frontend_attributes")]
        attrs = [(k, str(em.channel) if k == "channel_id" else v) for k, v in attrs]
        operands = [em.names[g.producer] for g in grads]
        shapes = [graph.ops[g.producer].inst.shape for g in grads]
        if len(grads) == 1:
            em.emit(_hlo.Instruction(grads[0].result_name, shapes[0], "all-reduce", operands, None, attrs))
            em.names[grads[0].reduced] = grads[0].result_name
            return
        name = f"disco_all-reduce.{em.channel}"
        em.emit(_hlo.Instruction(name, "(" + ", ".join(shapes) + ")", "all-reduce", operands, None, attrs))
        for i, g in enumerate(grads):
            em.emit(_hlo.Instruction(g.result_name, shapes[i], "get-tuple-element", [name], None,
                                     [("index", str(i))]))
            em.names[g.reduced] = g.result_name


def rewriter_for(backend: str) -> Rewriter:
    """The rewriter for a JAX backend name; only the CPU hook stage is implemented."""
    if backend == "cpu":
        return CpuRewriter()
    raise NotImplementedError(
        f"disco-jax rewrites HLO at XLA:CPU's hook stage only; backend {backend!r} is not supported yet "
        "(GPU's PRE_SCHEDULER stage is before fusion; see DESIGN.md point 2)")
