"""Building blocks for writing a strategy back into a post-fusion module (XLA:CPU's hook stage).

`disco_jax.backends.cpu.CpuRewriter` emits the entry computation anew, kernel by kernel in the
strategy's topological order, with the `Emitter` here:

* an opaque op keeps its instruction (operands renamed);
* a group of one op is that op, unfused;
* a group equal to one of XLA's fusions reuses XLA's fused computation;
* any other group becomes a new kLoop fusion; ops it shares with other groups are cloned into
  it (duplicate fusion); several exported values make it a multi-output fusion;
* each bucket becomes one all-reduce (variadic for several gradients), emitted right after its
  last gradient's producer, with the reduction and replica groups of the original.

Other computations are kept verbatim. `fused_computation` is shared with the GNN's standalone
kernel measurements, so both see the same code.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from disco_jax import _hlo
from disco_jax._graph import Graph
from disco_jax._strategy import Strategy

# Constants up to this size are cloned into each fusion that reads them (as XLA does).
CLONE_CONSTANT_BYTES = 64


def strip_layout(shape: str) -> str:
    return re.sub(r"\{[^{}]*\}", "", shape)


@dataclasses.dataclass
class Emitter:
    """The new entry computation under construction: instructions, new fused computations, and
    the entry name that holds each op's value."""

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


def kernel_inputs(
    graph: Graph, members: frozenset[int], suffix: str, param_name: Callable[[int], str]
) -> tuple[dict[int, str], list[int], list[_hlo.Instruction]]:
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
            if src.opcode == "constant" and src.kind == "free" and src.output_bytes <= CLONE_CONSTANT_BYTES:
                inner[v] = f"{src.name}.{suffix}"
                constants.append(dataclasses.replace(src.inst, name=inner[v], is_root=False, attrs=[]))
            else:
                inner[v] = param_name(len(params))
                params.append(v)
    return inner, params, constants


def member_instructions(
    graph: Graph, members: frozenset[int], inner: dict[int, str], suffix: str
) -> list[_hlo.Instruction]:
    """`members`' instructions in op order, renamed `{name}.{suffix}` (recorded in `inner`, which
    already names their outside inputs) and reading each other by those names."""
    out = []
    for o in sorted(members):
        op = graph.ops[o]
        inner[o] = f"{op.name}.{suffix}"
        attrs = [(k, v) for k, v in op.inst.attrs if k not in ("metadata", "control-predecessors")]
        out.append(
            dataclasses.replace(
                op.inst, name=inner[o], operands=[inner[v] for v in op.operands], attrs=attrs, is_root=False
            )
        )
    return out


def fused_computation(
    graph: Graph, members: frozenset[int], exports: list[int], name: str, suffix: str
) -> tuple[_hlo.Computation, list[int], str]:
    """The fused computation of a kLoop fusion of `members` that outputs `exports` (a tuple, i.e.
    a multi-output fusion, when there are several). Small constants are cloned inside; every other
    value from outside becomes a parameter. Inner names get `.{suffix}`.

    Returns (computation, op ids feeding its parameters in order, result shape text). Used by
    the rewrite and by the GNN's kernel measurements, so both see the same code."""
    inner, params, body = kernel_inputs(graph, members, suffix, lambda i: f"param_{i}.{suffix}")
    param_insts = [
        _hlo.Instruction(inner[v], graph.ops[v].inst.shape, "parameter", [], str(i), []) for i, v in enumerate(params)
    ]
    body += member_instructions(graph, members, inner, suffix)
    if len(exports) == 1:
        root_shape = graph.ops[exports[0]].inst.shape
        body = [dataclasses.replace(i, is_root=True) if i.name == inner[exports[0]] else i for i in body]
    else:
        root_shape = "(" + ", ".join(graph.ops[o].inst.shape for o in exports) + ")"
        body.append(
            _hlo.Instruction(
                f"tuple.{suffix}", root_shape, "tuple", [inner[o] for o in exports], None, [], is_root=True
            )
        )
    # With layouts: jaxlib 0.11.2 leaves a signature's shapes unlaid otherwise, and XLA:GPU's
    # fusion passes then abort the process ("Check failed: has_layout()").
    header_params = ", ".join(f"{inner[v]}: {graph.ops[v].inst.shape}" for v in params)
    header = f"%{name} ({header_params}) -> {root_shape} {{"
    return _hlo.Computation(name, header, param_insts + body), params, root_shape
