"""What an op computes and moves: the one work counter of disco-jax.

Every count of an op's flops, elements, transcendentals and bytes is made here, and everything
that needs one reads it from here: `work_per_op(graph)` and `flops_per_op(graph)` (cached per
graph), the analytical estimator's kernel features, the GPU roofline of `disco_jax.eval.clusters`,
and the GNN's node features and analytical baseline (`gnn_estimator`).

* `Work`: one op's work. For an op a loop fusion computes (`loop_work`): its output elements (a
  reduce: its reduced input elements), with transcendental ops counted apart. For an opaque op
  (`instruction_work`, summed over the computation of a custom fusion: XLA:CPU wraps dots and
  convolutions in `__ynn_fusion`s): elementwise, reduce and transcendental elements and dot and
  convolution flops of its instructions.
* `KernelWork`: a kernel's bytes read and written (`kernel_io_bytes`) and the sum of its ops' work;
  `KernelWork.features()` is the analytical estimator's feature vector.

This module reads HLO instructions (`disco_jax._hlo`) and the graph IR, which imports nothing of it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import numpy as np

from disco_jax import _hlo
from disco_jax._graph import Graph, per_graph
from disco_jax._hlo import ELEMENTWISE

TRANSCENDENTAL = frozenset(
    "exp exponential exponential-minus-one log log-plus-one logistic tanh sin cos tan erf power "
    "rsqrt sqrt cbrt atan2".split()
)
HALF_FLOATS = frozenset({"bf16", "f16"})
"""16-bit float types: a dot or convolution of them runs at the tensor cores' 16-bit rate."""
TRANSCENDENTAL_FLOPS = 8.0
"""Flop-equivalents per element of a transcendental op (exp, log, tanh... cost several FMAs)."""

ANALYTICAL_FEATURES: tuple[str, ...] = ("launch", "bytes", "elementwise", "transcendental", "dot_flops")
"""Names of the entries of `KernelWork.features()`."""


@dataclasses.dataclass(frozen=True)
class Work:
    """One op's work.

    flops: floating-point work: one per element of an elementwise op, `TRANSCENDENTAL_FLOPS` per
      element of a transcendental one, one per reduced input element, 2 x multiply-adds of dots
      and convolutions (data movement such as broadcast or transpose: none).
    elementwise: elements of non-transcendental work: for an op a loop fusion computes, every
      output element (a reduce: every reduced input element), data movement included; inside an
      opaque op, those of its elementwise and reduce instructions.
    transcendental: elements of transcendental ops.
    dot: flops of dots and convolutions.
    bytes: bytes of the op's output.
    dot_16bit: the part of `dot` whose operands are 16-bit floats (bfloat16, float16): tensor
      cores run it at their 16-bit rate, twice the TF32 one on an H100.
    conv: the part of `dot` that convolutions compute (cuDNN's kernels, whose achieved rate
      differs from the gemm libraries').
    """

    flops: float = 0.0
    elementwise: float = 0.0
    transcendental: float = 0.0
    dot: float = 0.0
    bytes: int = 0
    dot_16bit: float = 0.0
    conv: float = 0.0

    def __add__(self, other: Work) -> Work:
        return Work(
            self.flops + other.flops,
            self.elementwise + other.elementwise,
            self.transcendental + other.transcendental,
            self.dot + other.dot,
            self.bytes + other.bytes,
            self.dot_16bit + other.dot_16bit,
            self.conv + other.conv,
        )


def loop_work(opcode: str, out_elements: float, reduced_elements: float = 0.0, out_bytes: int = 0) -> Work:
    """Work of an op a loop fusion computes, from its opcode, output elements and (a reduce) the
    elements of the inputs it reduces. Also what a stored kernel description (`gnn_estimator`)
    is counted with."""
    out = float(out_elements)
    if opcode in TRANSCENDENTAL:
        return Work(flops=TRANSCENDENTAL_FLOPS * out, transcendental=out, bytes=out_bytes)
    if opcode == "reduce":
        reduced = float(reduced_elements)
        return Work(flops=reduced, elementwise=reduced, bytes=out_bytes)
    return Work(flops=out if opcode in ELEMENTWISE else 0.0, elementwise=out, bytes=out_bytes)


def _reduced_elements(operands: Sequence[list[_hlo.TensorSpec] | None]) -> float:
    """Elements of the inputs of a reduce or reduce-window: the first half of its operands (the
    second half are the init values)."""
    return float(sum(specs[0].elements for specs in operands[: len(operands) // 2] if specs))


def _contracted(inst: _hlo.Instruction, lhs: _hlo.TensorSpec) -> int:
    """The product of the lhs's contracting dimensions: a dot's `lhs_contracting_dims`, or those
    of a library gemm call's backend config (cuBLAS: `"lhs_contracting_dimensions":["1"]`)."""
    dims = (inst.attr("lhs_contracting_dims", "{}") or "{}").strip("{}")
    if inst.opcode == "custom-call":
        found = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', inst.attr("backend_config") or "")
        dims = found.group(1).replace('"', "") if found else ""
    k = 1
    for d in dims.split(","):
        if d.strip():
            k *= lhs.dims[int(d)]
    return k


def _matrix_op(inst: _hlo.Instruction) -> str | None:
    """'convolution', 'dot' or 'attention' for an instruction that is one: itself, or a library
    call that carries one's attributes (a cuDNN convolution: `window` and `dim_labels`; cuDNN's
    fused attention: an `fmha` target; a cuBLAS gemm: dot dimension numbers in its backend
    config); None otherwise."""
    if inst.opcode in ("dot", "convolution"):
        return inst.opcode
    if inst.opcode != "custom-call":
        return None
    if inst.attr("dim_labels") is not None:
        return "convolution"
    if "fmha" in (inst.attr("custom_call_target") or ""):
        return "attention"
    return "dot" if '"lhs_contracting_dimensions"' in (inst.attr("backend_config") or "") else None


def _conv_flops(inst: _hlo.Instruction, lhs: _hlo.TensorSpec | None, rhs: _hlo.TensorSpec | None) -> float:
    """2 x the forward convolution's output elements x (kernel elements / output features), the
    kernel's output feature dimension read from `dim_labels` (its kernel part, 'o'). A cuDNN
    backward call carries the forward convolution's attributes with its tensors in other places
    (XLA's `CudnnConvKind`): backward-input takes (output gradient, kernel) and makes the input
    gradient; backward-filter takes (input, output gradient) and makes the kernel gradient. Each
    costs what the forward convolution costs."""
    target = (inst.attr("custom_call_target") or "").strip('"')
    output = inst.outputs[0] if inst.outputs else None
    if target.endswith("convBackwardFilter"):
        forward_output, kernel = rhs, output
    elif target.endswith("convBackwardInput"):
        forward_output, kernel = lhs, rhs
    else:
        forward_output, kernel = output, rhs
    if forward_output is None or kernel is None or not kernel.dims:
        return 0.0
    m = re.match(r"[^_]*_([^-]*)->", inst.attr("dim_labels", "") or "")
    if m and "o" in m.group(1) and len(m.group(1)) == len(kernel.dims):
        out_features = kernel.dims[m.group(1).index("o")]
    else:
        out_features = kernel.dims[-1]
    return 2.0 * forward_output.elements * kernel.elements / max(1, out_features)


_FMHA_SHAPE = re.compile(r'"intermediate_tensor_shape":\{"dimensions":\["(\d+)","(\d+)","(\d+)","(\d+)"\]')


def _attention_flops(inst: _hlo.Instruction, query: _hlo.TensorSpec | None) -> float:
    """cuDNN's fused attention (`__cudnn$fmhaSoftmax*`): 2 x batch x heads x queries x keys x
    head width per matrix product, of which the forward call computes 2 (scores, then their
    product with the values) and the backward 5 (the scores again, and the gradients of the
    values, the probabilities, the queries and the keys); a causal mask skips half. The
    (batch, heads, queries, keys) shape is the call's `intermediate_tensor_shape`."""
    config = inst.attr("backend_config") or ""
    found = _FMHA_SHAPE.search(config)
    if found is None or query is None or not query.dims:
        return 0.0
    b, h, q, k = (int(x) for x in found.groups())
    per_product = 2.0 * b * h * q * k * query.dims[-1]
    products = 5 if "Backward" in (inst.attr("custom_call_target") or "") else 2
    causal = '"mask_type":"CAUSAL"' in config
    return products * per_product / (2 if causal else 1)


def instruction_work(inst: _hlo.Instruction, operands: Sequence[list[_hlo.TensorSpec] | None]) -> Work:
    """Work of one instruction of an opaque op (the op itself, or an instruction of a custom
    fusion's computation); `operands` are the output specs of its operands (None where unknown)."""
    first = operands[0][0] if operands and operands[0] else None
    second = operands[1][0] if len(operands) > 1 and operands[1] else None
    matrix = _matrix_op(inst)
    if matrix is not None:
        if matrix == "convolution":
            flops = _conv_flops(inst, first, second)
        elif matrix == "attention":
            flops = _attention_flops(inst, first)
        else:
            flops = 0.0 if first is None else 2.0 * inst.outputs[0].elements * _contracted(inst, first)
        narrow = first is not None and second is not None and {first.dtype, second.dtype} <= HALF_FLOATS
        conv = flops if matrix == "convolution" else 0.0
        return Work(flops=flops, dot=flops, dot_16bit=flops if narrow else 0.0, conv=conv)
    elements = float(sum(t.elements for t in inst.outputs))
    if inst.opcode in TRANSCENDENTAL:
        return Work(flops=TRANSCENDENTAL_FLOPS * elements, transcendental=elements)
    if inst.opcode in ELEMENTWISE:
        return Work(flops=elements, elementwise=elements)
    if inst.opcode in ("reduce", "reduce-window"):
        reduced = _reduced_elements(operands)
        return Work(flops=reduced, elementwise=reduced)
    return Work()


def op_work(graph: Graph, o: int) -> Work:
    """Work of op `o` of `graph` (read it through the graph's cache, `work_per_op(graph)[o]`)."""
    op = graph.ops[o]
    operands = [graph.ops[v].inst.outputs for v in op.operands]
    if op.kind != "opaque":
        reduced = _reduced_elements(operands) if op.opcode == "reduce" else 0.0
        return loop_work(op.opcode, sum(t.elements for t in op.inst.outputs), reduced, op.output_bytes)
    if op.opcode != "fusion":
        return dataclasses.replace(instruction_work(op.inst, operands), bytes=op.output_bytes)
    try:
        comp = graph.module.computation((op.inst.attr("calls") or "").lstrip("%"))
    except KeyError:
        return Work(bytes=op.output_bytes)
    shapes = {i.name: i.outputs for i in comp.instructions}
    total = Work()
    for inst in comp.instructions:
        total += instruction_work(inst, [shapes.get(name) for name in inst.operands])
    return dataclasses.replace(total, bytes=op.output_bytes)


@per_graph
def work_per_op(graph: Graph) -> list[Work]:
    """Per op of `graph`: its flops, elements, transcendentals and bytes (`op_work`), computed once per graph."""
    return [op_work(graph, op.id) for op in graph.ops]


@per_graph
def flops_per_op(graph: Graph) -> list[float]:
    """Per op of `graph`: its floating-point work (`Work.flops`), computed once per graph."""
    return [w.flops for w in work_per_op(graph)]


# --------------------------------------------------------------------------- kernels


def _region_read(graph: Graph, members: frozenset[int], value: int) -> int | None:
    """Bytes a kernel reads of `value` when it only slices it: every use inside the kernel (through
    bitcasts) is the sliced operand of a `dynamic-slice` (the slice's bytes) or the buffer of a
    `dynamic-update-slice` (written in place, not read); None when some use reads it whole."""
    total = 0
    for u in graph.users[value]:
        if u not in members:
            continue
        op = graph.ops[u]
        if op.opcode == "bitcast":
            inner = _region_read(graph, members, u)
            if inner is None:
                return None
            total += inner
        elif op.opcode == "dynamic-slice" and op.operands[0] == value and value not in op.operands[1:]:
            total += op.output_bytes
        elif op.opcode == "dynamic-update-slice" and op.operands[0] == value and value not in op.operands[1:]:
            pass
        else:
            return None
    return total


def _written_bytes(graph: Graph, members: frozenset[int], export: int) -> int:
    """Bytes a kernel writes of one of its outputs: a `dynamic-update-slice` of a buffer read from
    outside the kernel (through bitcasts) is emitted in place and writes its update only."""
    op = graph.ops[export]
    while op.opcode == "bitcast" and op.operands and op.operands[0] in members:
        op = graph.ops[op.operands[0]]
    if op.opcode == "dynamic-update-slice":
        buffer = op.operands[0]
        while buffer in members and graph.ops[buffer].opcode == "bitcast":
            buffer = graph.ops[buffer].operands[0]
        if buffer not in members:
            return graph.ops[op.operands[1]].output_bytes
    return graph.ops[export].output_bytes


def kernel_io_bytes(graph: Graph, members: frozenset[int], exports: Sequence[int] | None = None) -> tuple[int, int]:
    """Bytes read from outside the kernel and bytes written by it (exports default: ops used
    outside the kernel, else its last op). Small constants (64 bytes or less) are not read: a
    fusion holds its own copy. A value the kernel only slices counts the slices' bytes, and a
    dynamic-update-slice in place (a loop body stacking its layer's activations into a
    `(layers, ...)` buffer) its update's: neither reads nor writes the whole buffer
    (`_region_read`, `_written_bytes`)."""
    inputs, exports = _kernel_io(graph, members, exports)
    read = sum(_read_bytes(graph, members, v) for v in inputs)
    return read, sum(_written_bytes(graph, members, o) for o in exports)


def _read_bytes(graph: Graph, members: frozenset[int], value: int) -> int:
    region = _region_read(graph, members, value)
    return graph.ops[value].output_bytes if region is None else region


def kernel_half_bytes(graph: Graph, members: frozenset[int]) -> int:
    """Of `kernel_io_bytes`' total, the bytes of 16-bit float values (bfloat16, float16): what the
    kernel would move in addition were they 32-bit (a dtype-true cost scales by it). A value moved
    in part (a slice, an in-place update) counts its 16-bit share of what is moved."""
    inputs, exports = _kernel_io(graph, members, None)

    def half(o: int, moved: int) -> int:
        whole = graph.ops[o].output_bytes
        share = sum(t.bytes for t in graph.ops[o].inst.outputs if t.dtype in HALF_FLOATS)
        return share if moved >= whole or not whole else share * moved // whole

    return sum(half(v, _read_bytes(graph, members, v)) for v in inputs) + sum(
        half(o, _written_bytes(graph, members, o)) for o in exports
    )


def _kernel_io(graph: Graph, members: frozenset[int], exports: Sequence[int] | None) -> tuple[list[int], list[int]]:
    inputs = {v for o in members for v in graph.ops[o].operands if v not in members}
    read = [v for v in inputs if graph.ops[v].opcode != "constant" or graph.ops[v].output_bytes > 64]
    if exports is None:
        exports = [o for o in members if any(u not in members for u in graph.users[o])] or [max(members)]
    return read, list(exports)


@dataclasses.dataclass(frozen=True)
class KernelWork:
    """What one kernel moves and computes: bytes read and written, and its ops' work summed."""

    read_bytes: float
    written_bytes: float
    elementwise: float
    transcendental: float
    dot: float
    dot_16bit: float = 0.0  # of `dot`, the flops of 16-bit float operands (`Work.dot_16bit`)
    conv: float = 0.0  # of `dot`, the flops of convolutions (`Work.conv`)

    @classmethod
    def of(cls, read_bytes: float, written_bytes: float, ops: Sequence[Work]) -> KernelWork:
        total = sum(ops, Work())
        return cls(
            float(read_bytes),
            float(written_bytes),
            total.elementwise,
            total.transcendental,
            total.dot,
            total.dot_16bit,
            total.conv,
        )

    @property
    def bytes(self) -> float:
        return self.read_bytes + self.written_bytes

    def features(self) -> np.ndarray:
        """The analytical feature vector [1, bytes moved, elementwise, transcendental, dot flops]
        (`ANALYTICAL_FEATURES`)."""
        return np.array([1.0, self.bytes, self.elementwise, self.transcendental, self.dot])


def kernel_work(graph: Graph, members: frozenset[int]) -> KernelWork:
    """A kernel's bytes moved (`kernel_io_bytes`, default exports) and its ops' work."""
    read, written = kernel_io_bytes(graph, members)
    work = work_per_op(graph)
    return KernelWork.of(read, written, [work[o] for o in members])
