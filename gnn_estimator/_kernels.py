"""Fused kernels of a graph: which values they export, random sampling, standalone HLO modules.

A kernel is a frozenset of fusible op ids of one `Graph` (as in `disco_jax._strategy`). This module
holds the pure functions the estimator's data pipeline needs (those that depend on the compiler, what
it fuses and how its rewriter emits a kernel, take the `disco_jax.Program`):

* `default_exports`: the ops a kernel hands to the rest of the program (the same rule as
  `disco_jax.cost.kernel_io_bytes`: ops read outside the kernel, else its last op);
* `random_kernel`: DisCo's sampling (section 5.2): pick an op, fuse it with one of its
  predecessors, repeat a random number of times;
* `is_convex`: a kernel no outside op sits between two of its members (any other set would put
  a cycle in the strategy's kernel graph, so the search never forms it);
* `kernel_module_text`: a tiny HLO module whose entry computation takes one parameter per kernel
  input and runs the kernel as one kLoop fusion, emitted as `disco_jax.backends.cpu.CpuRewriter` emits
  a new fusion (same constant cloning, same multi-output form; one op stays a bare instruction).
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Sequence

from disco_jax import _hlo
from disco_jax._graph import Graph
from disco_jax._program import Program
from disco_jax._rewrite import fused_computation, kernel_inputs, member_instructions


def default_exports(graph: Graph, kernel: frozenset[int]) -> list[int]:
    """Ops of `kernel` whose value is used outside it (or that are the module output), in op-id
    order; the last op when there is none."""
    outputs = _module_outputs(graph)
    out = [o for o in sorted(kernel) if o in outputs or any(u not in kernel for u in graph.users[o])]
    return out or [max(kernel)]


def _module_outputs(graph: Graph) -> frozenset[int]:
    """Op ids whose values are the module's output."""
    outputs = getattr(graph, "output_set", None)
    if outputs is None:
        root = getattr(graph, "root", None)
        outputs = frozenset() if root is None else frozenset([root])
    return outputs


def external_inputs(graph: Graph, kernel: frozenset[int]) -> list[int]:
    """Op ids outside the kernel whose values it reads, in op-id order."""
    return sorted({v for o in kernel for v in graph.ops[o].operands if v not in kernel})


def is_convex(graph: Graph, kernel: frozenset[int]) -> bool:
    """True when no path leaves the kernel and comes back into it.

    Op ids follow the entry's program order, so a path from an outside user back into the kernel
    only visits ids below the kernel's last member."""
    last = max(kernel)
    frontier = [u for o in kernel for u in graph.users[o] if u not in kernel and u < last]
    seen: set[int] = set()
    while frontier:
        u = frontier.pop()
        if u in seen:
            continue
        seen.add(u)
        for w in graph.users[u]:
            if w in kernel:
                return False
            if w < last:
                frontier.append(w)
    return True


def _can_feed(program: Program, producer: int) -> bool:
    op = program.graph.ops[producer]
    return op.kind == "fusible" and op.opcode not in program.backend.no_producer_fusion


def random_kernel(program: Program, rng: random.Random, length: int, start: int | None = None) -> frozenset[int]:
    """DisCo's sample: start from a random fusible op, then `length - 1` times fuse the kernel
    with one random fusible producer of its members (never a reduce, concatenate, pad or iota,
    which a consumer would recompute per element). Stops early when no producer is left; the
    result may be smaller than `length` and is not necessarily convex (check `is_convex`)."""
    graph = program.graph
    fusible = graph.fusible_ops
    if not fusible:
        raise ValueError("graph has no fusible ops")
    members = {rng.choice(fusible) if start is None else start}
    for _ in range(length - 1):
        producers = sorted(
            {v for o in members for v in graph.ops[o].operands if v not in members and _can_feed(program, v)}
        )
        if not producers:
            break
        members.add(rng.choice(producers))
    return frozenset(members)


def has_default_layouts(shape: str) -> bool:
    """True when every array layout in an HLO shape text is the major-to-minor default."""
    for spec_text in re.finditer(r"[a-z][a-z0-9]*\[([^\]]*)\](\{[^}]*\})?", shape):
        dims = [d for d in spec_text.group(1).split(",") if d.strip()]
        layout = spec_text.group(2)
        if layout is None:
            continue
        minor_to_major = [int(x) for x in layout.strip("{}").split(":")[0].split(",") if x.strip()]
        if minor_to_major and minor_to_major != list(range(len(dims) - 1, -1, -1)):
            return False
    return True


def measurable(graph: Graph, kernel: frozenset[int]) -> bool:
    """Whether `kernel_module_text` can stand the kernel alone: fusible members with one array
    output each, exported values of one shape (a multi-output loop fusion runs one loop), and
    default layouts at its boundary (jit's entry parameters and results have them)."""
    if not kernel or any(graph.ops[o].kind != "fusible" for o in kernel):
        return False
    for o in kernel:
        if len(graph.ops[o].inst.outputs) != 1:
            return False
    exports = default_exports(graph, kernel)
    if len({tuple(graph.ops[o].inst.outputs[0].dims) for o in exports}) > 1:
        return False  # a multi-output loop fusion needs one loop shape (XLA:CPU crashes otherwise)
    boundary = external_inputs(graph, kernel) + exports
    for v in boundary:
        shape = graph.ops[v].inst.shape
        if shape.startswith("(") or not has_default_layouts(shape) or graph.ops[v].inst.outputs[0].dtype == "token":
            return False
    return True


def kernel_module_text(program: Program, kernel: frozenset[int], header: str) -> tuple[str, list[int], list[int]]:
    """A standalone HLO module running `kernel` the way the core's rewrite emits it.

    One op is emitted bare (XLA compiles it as its own kernel); several ops become one kLoop fusion
    (a multi-output fusion when several values are exported), or, on a backend whose rewriter
    leaves fusion to XLA (`Backend.emits_fusions` False: XLA:GPU), bare ops that XLA fuses. The
    kernel's parameters are its inputs, small constants cloned inside. `header` is the `HloModule
    ...` first line of a module with the matching entry signature (the caller lowers a dummy
    function with these parameter and result shapes; see `_measure`). Returns (module text, op ids
    of the entry parameters in order, exported op ids in result order). The kernel instruction
    (the fusion, the lone op, or the tuple of bare ops) is named `KERNEL_INSTRUCTION`.
    """
    graph = program.graph
    exports = default_exports(graph, kernel)
    inner, params, constants = kernel_inputs(graph, kernel, "k", lambda i: f"arg.{i}")
    entry_params = [
        _hlo.Instruction(f"arg.{i}", graph.ops[v].inst.shape, "parameter", [], str(i), []) for i, v in enumerate(params)
    ]
    computations: list[_hlo.Computation] = []
    if len(exports) == 1:
        result_shape = graph.ops[exports[0]].inst.shape
    else:
        result_shape = "(" + ", ".join(graph.ops[o].inst.shape for o in exports) + ")"
    if len(kernel) == 1:
        (o,) = kernel
        op = graph.ops[o]
        entry_body = constants + [
            dataclasses.replace(
                op.inst,
                name=KERNEL_INSTRUCTION,
                operands=[inner[v] for v in op.operands],
                attrs=[(k, v) for k, v in op.inst.attrs if k not in ("metadata", "control-predecessors")],
                is_root=True,
            )
        ]
    elif not program.backend.emits_fusions:
        # XLA:GPU forms the fusions itself (its rewriter only cuts): the kernel is the ops bare,
        # and what XLA's fusion passes make of them is what it costs.
        entry_body = constants + member_instructions(graph, kernel, inner, "k")
        if len(exports) == 1:
            entry_body = [dataclasses.replace(i, is_root=i.name == inner[exports[0]]) for i in entry_body]
        else:
            entry_body.append(
                _hlo.Instruction(KERNEL_INSTRUCTION, result_shape, "tuple", [inner[o] for o in exports], None, [], True)
            )
    else:
        computation, fused_inputs, _ = fused_computation(graph, kernel, exports, "kernel_computation", "k")
        assert fused_inputs == params, "kernel inputs and fused computation parameters disagree"
        computations.append(computation)
        entry_body = [
            _hlo.Instruction(
                KERNEL_INSTRUCTION,
                result_shape,
                "fusion",
                [f"arg.{i}" for i in range(len(params))],
                None,
                [("kind", "kLoop"), ("calls", "%kernel_computation")],
                is_root=True,
            )
        ]
    signature = ", ".join(f"arg.{i}: {graph.ops[v].inst.shape}" for i, v in enumerate(params))
    entry = _hlo.Computation(
        "main", f"ENTRY %main ({signature}) -> {result_shape} {{", entry_params + entry_body, is_entry=True
    )
    module = _hlo.HloModuleText(header, "", _called_computations(graph, kernel) + computations + [entry])
    return module.to_text(), params, exports


def _called_computations(graph: Graph, kernel: frozenset[int]) -> list[_hlo.Computation]:
    """The computations the kernel's ops call (reducers), with theirs, callees first."""
    ordered: list[_hlo.Computation] = []
    seen: set[str] = set()

    def visit(name: str) -> None:
        if name in seen:
            return
        seen.add(name)
        comp = graph.module.computation(name)
        for inst in comp.instructions:
            for callee in inst.called_computations:
                visit(callee)
        # Metadata would name stack frames of the step's module, which this module lacks.
        ordered.append(
            dataclasses.replace(
                comp,
                is_entry=False,
                instructions=[
                    dataclasses.replace(i, attrs=[(k, v) for k, v in i.attrs if k != "metadata"])
                    for i in comp.instructions
                ],
            )
        )

    for o in sorted(kernel):
        for name in graph.ops[o].inst.called_computations:
            visit(name)
    return ordered


KERNEL_INSTRUCTION = "kernel"


def kernel_boundary_specs(graph: Graph, params: Sequence[int], exports: Sequence[int]):
    """(input TensorSpecs, output TensorSpecs) of a standalone kernel module."""
    return ([graph.ops[v].inst.outputs[0] for v in params], [graph.ops[o].inst.outputs[0] for o in exports])
