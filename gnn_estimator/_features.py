"""Kernel descriptions and the feature encoding of the GNN (DisCo section 4.3.1).

Data flow: (graph, kernel, op times) -> `describe_kernel` -> a JSON-able description (what the
dataset stores: it does not depend on the feature encoding, so a new encoding re-reads old data)
-> `featurize` -> `KernelFeatures` (node matrix, edge lists, kernel-level vector; numpy) -> the
model (`_model.GraphBatch`). `kernel_features(graph, kernel, op_times_us)` does both steps.

A description is ``{"nodes": [...], "exports": [...]}`` with one node per op of the kernel in op-id
(program) order: ``op`` (opcode), ``dtype``, ``shape``, ``operands`` (an int for another node of the
kernel, else ``[dtype, shape, cloned, input]`` for a value read from outside: ``cloned`` for small
constants copied into the fusion, ``input`` numbers the kernel's distinct outside values), ``dims``
(the `dimensions` attribute of reduce, broadcast, transpose, concatenate, reverse), ``flops`` (its
`cost.work.flops_per_op`) and ``time_us`` (the op's own profiled time, or null).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from disco_jax import _hlo
from disco_jax._graph import Graph
from disco_jax._rewrite import CLONE_CONSTANT_BYTES
from disco_jax.cost.work import TRANSCENDENTAL, TRANSCENDENTAL_FLOPS, flops_per_op
from gnn_estimator import _kernels

FEATURE_VERSION = 1
"""Bumped whenever `featurize` changes: weights trained on another version are refused."""

OPCODE_VOCABULARY: tuple[str, ...] = tuple(
    """
abs add and atan2 bitcast bitcast-convert broadcast cbrt ceil clamp compare concatenate convert copy
cos divide erf exp exponential-minus-one floor iota is-finite log log-plus-one logistic maximum
minimum multiply negate not or pad power reduce reduce-precision remainder reshape reverse
round-nearest-afz round-nearest-even rsqrt select shift-left shift-right-arithmetic
shift-right-logical sign sin slice sqrt subtract tan tanh transpose xor
""".split()
)
"""Opcodes with a one-hot slot; any other opcode shares the final "other" slot."""

_OPCODE_INDEX = {op: i for i, op in enumerate(OPCODE_VOCABULARY)}
_DTYPE_GROUPS = ("f32", "half", "int", "pred", "wide")  # wide: 64-bit and complex

NODE_FEATURES: tuple[str, ...] = (
    *(f"opcode={op}" for op in OPCODE_VOCABULARY),
    "opcode=other",
    "log_out_elements",
    "log_out_bytes",
    "log_in_elements",
    "log_in_bytes",
    "log_external_read_bytes",
    "exported",
    "log_export_bytes",
    "log_flops",
    "rank",
    *(f"dtype={g}" for g in _DTYPE_GROUPS),
    "transcendental",
    "minor_dim_moves",
    "log_reduction_ratio",
    "num_operands",
    "log_internal_users",
    "log_own_time_us",
    "own_time_known",
    "log_evaluations",
    "log_recompute_ratio",
    "log_minor_dim",
    "log_operand_minor_dim",
)
"""One row per op. log_* are log1p of the quantity; bytes/elements of the op's output and of all
its operands; external_read: operands from outside the kernel (cloned constants excluded);
export_bytes: bytes written when the op is exported; minor_dim_moves: a transpose, reduce or
broadcast that changes the minor-most (contiguous) dimension; reduction_ratio: input over output
elements; log_own_time_us: log of the op's own profiled time (not log1p: the same scale as the
predicted log time), 0 with own_time_known = 0 where unknown;
evaluations: how many elements of the op the fused loop computes (a value read through a
broadcast or a reduce is recomputed for every element that reads it, see `_evaluations`), and
recompute_ratio: evaluations over output elements; minor_dim: size of the output's minor-most
(contiguous, vectorized) dimension, operand_minor_dim: the same for its first operand."""

KERNEL_FEATURES: tuple[str, ...] = (
    "log_read_bytes",
    "log_written_bytes",
    "log_num_ops",
    "log_total_flops",
    "log_max_elements",
    "num_exports",
    "log_sum_own_time_us",
    "fraction_own_time_known",
    "log_num_inputs",
    "log_evaluated_elements",
    "log_evaluated_work",
)
"""One row per kernel: bytes read from outside (each input once) and written, number of ops,
total flops, largest op output, exported values, log of the sum of the known own times (0 when
none is known) and the fraction
of ops with a known time, number of distinct inputs, total evaluated elements, and evaluated
work (evaluations weighted `TRANSCENDENTAL_FLOPS` = 8 for transcendental ops, as `cost.work.flops_per_op` is)."""


_COLUMN = {name: i for i, name in enumerate(NODE_FEATURES)}


def _dims_attr(inst: _hlo.Instruction) -> list[int] | None:
    text = inst.attr("dimensions")
    if text is None:
        return None
    return [int(d) for d in text.strip("{}").split(",") if d.strip()]


def describe_kernel(graph: Graph, kernel: frozenset[int], op_times_us: Mapping[int, float] | None = None) -> dict:
    """The JSON-able description of `kernel` (fusible op ids of `graph`), exports by the default
    rule of `_kernels.default_exports`; `op_times_us` gives known own times by op id."""
    order = sorted(kernel)
    position = {o: i for i, o in enumerate(order)}
    flops = flops_per_op(graph)
    inputs: dict[int, int] = {}
    nodes = []
    for o in order:
        op = graph.ops[o]
        spec = op.inst.outputs[0]
        operands: list[Any] = []
        for v in op.operands:
            if v in position:
                operands.append(position[v])
            else:
                src = graph.ops[v]
                specs = src.inst.outputs
                s = specs[0] if specs else _hlo.TensorSpec("token", ())
                cloned = src.opcode == "constant" and src.kind == "free" and src.output_bytes <= CLONE_CONSTANT_BYTES
                operands.append([s.dtype, list(s.dims), cloned, inputs.setdefault(v, len(inputs))])
        time_us = None if op_times_us is None else op_times_us.get(o)
        nodes.append(
            {
                "op": op.opcode,
                "dtype": spec.dtype,
                "shape": list(spec.dims),
                "operands": operands,
                "dims": _dims_attr(op.inst),
                "flops": float(flops[o]),
                "time_us": None if time_us is None else float(time_us),
            }
        )
    exports = [position[o] for o in _kernels.default_exports(graph, kernel)]
    return {"nodes": nodes, "exports": exports}


@dataclasses.dataclass(frozen=True)
class KernelFeatures:
    """The GNN's input for one kernel: `nodes` [n, len(NODE_FEATURES)], directed edges
    `senders` -> `receivers` (data flow inside the kernel, both directions, plus a self loop per
    op), `kernel` [len(KERNEL_FEATURES)]."""

    nodes: np.ndarray
    senders: np.ndarray
    receivers: np.ndarray
    kernel: np.ndarray

    @property
    def num_nodes(self) -> int:
        return int(self.nodes.shape[0])

    @property
    def num_edges(self) -> int:
        return int(self.senders.shape[0])


def _elements(shape) -> int:
    return math.prod(shape) if shape else 1


def _bytes(dtype: str, shape) -> int:
    return _elements(shape) * _hlo.DTYPE_BYTES.get(dtype, 4)


def _dtype_group(dtype: str) -> str:
    if dtype == "f32":
        return "f32"
    if dtype in ("f16", "bf16") or dtype.startswith("f8"):
        return "half"
    if dtype == "pred":
        return "pred"
    if dtype in ("f64", "s64", "u64", "c64", "c128"):
        return "wide"
    return "int"


def _minor_dim_moves(node: dict, operand_shapes: list[list[int]]) -> bool:
    op, dims, rank = node["op"], node["dims"], len(node["shape"])
    if op == "transpose" and dims:
        return dims[-1] != len(dims) - 1
    if op == "reduce" and dims is not None and operand_shapes:
        return (len(operand_shapes[0]) - 1) in dims
    if op == "broadcast" and dims is not None:
        return rank > 0 and (not dims or dims[-1] != rank - 1)
    return False


def _log_time(us: float) -> float:
    """log of a time in microseconds, floored at 10 ns (the target of the network is log us)."""
    return math.log(max(float(us), 1e-2))


class _Op(NamedTuple):
    """What a node's features need of its op, whatever the kernel: its own columns (`_op_row`),
    opcode, output elements and bytes, flops, and the weight of one evaluation."""

    row: np.ndarray
    opcode: str
    out_elements: int
    out_bytes: int
    flops: float
    weight: float


def _evaluations(ops: Sequence[_Op], internal: Sequence[Sequence[int]], exports: set[int]) -> list[float]:
    """Elements of each op a kLoop fusion evaluates: an exported op (or one nobody in the kernel
    reads) once per output element; an op read by others as often as its readers need it, which
    for a reader through a reduce (or a concatenate/pad piece) is scaled by the reader's input
    over output elements. Readers at the same index share one evaluation, so the maximum over
    readers is taken. Ops are in program order: readers come after what they read; `internal`:
    per op, the positions of its operands inside the kernel."""
    evaluations = [0.0] * len(ops)
    read = [False] * len(ops)
    for i in range(len(ops) - 1, -1, -1):
        own = float(ops[i].out_elements)
        if i in exports or not read[i]:
            evaluations[i] = max(evaluations[i], own)
        spread = ops[i].opcode in ("reduce", "concatenate", "pad")
        for ref in internal[i]:
            factor = ops[ref].out_elements / max(own, 1.0) if spread else 1.0
            evaluations[ref] = max(evaluations[ref], evaluations[i] * factor)
            read[ref] = True
    return evaluations


def _op_row(node: Mapping[str, Any], operands: Sequence[tuple[str, Sequence[int]]]) -> np.ndarray:
    """The columns of a node's row that depend on its op alone, not on the kernel around it nor
    on its own time: opcode, sizes, dtype, layout. `operands`: (dtype, shape) of each."""
    col = _COLUMN
    r = np.zeros(len(NODE_FEATURES), np.float32)
    shape = node["shape"]
    out_elements = _elements(shape)
    operand_shapes = [s for _, s in operands]
    r[_OPCODE_INDEX.get(node["op"], len(OPCODE_VOCABULARY))] = 1.0
    r[col["log_out_elements"]] = math.log1p(out_elements)
    r[col["log_out_bytes"]] = math.log1p(_bytes(node["dtype"], shape))
    r[col["log_in_elements"]] = math.log1p(sum(_elements(s) for s in operand_shapes))
    r[col["log_in_bytes"]] = math.log1p(sum(_bytes(d, s) for d, s in operands))
    r[col["log_flops"]] = math.log1p(node["flops"])
    r[col["rank"]] = len(shape)
    r[col[f"dtype={_dtype_group(node['dtype'])}"]] = 1.0
    r[col["transcendental"]] = float(node["op"] in TRANSCENDENTAL)
    r[col["minor_dim_moves"]] = float(_minor_dim_moves(node, operand_shapes))
    if node["op"] == "reduce" and operand_shapes:
        r[col["log_reduction_ratio"]] = math.log1p(_elements(operand_shapes[0]) / max(out_elements, 1))
    r[col["num_operands"]] = len(operands)
    r[col["log_minor_dim"]] = math.log1p(shape[-1] if shape else 1)
    if operand_shapes:
        r[col["log_operand_minor_dim"]] = math.log1p(operand_shapes[0][-1] if operand_shapes[0] else 1)
    return r


def _encode(
    ops: Sequence[_Op],
    internal: Sequence[Sequence[int]],
    external: Sequence[Sequence[tuple[Any, int, bool]]],
    exports: set[int],
    times: Sequence[float | None],
) -> KernelFeatures:
    """The kernel's features from its ops in program order: `internal`, per op, the positions of
    its operands inside the kernel; `external`, per op, (input, bytes, cloned) of each operand
    read from outside (`input` names the value); `exports`, positions; `times`, own times or
    None. Both `featurize` and `KernelFeaturizer` come here."""
    n = len(ops)
    rows = np.stack([op.row for op in ops])
    col = _COLUMN
    users = [0] * n
    senders: list[int] = []
    receivers: list[int] = []
    for i, refs in enumerate(internal):
        for ref in refs:
            users[ref] += 1
            senders += [ref, i]
            receivers += [i, ref]
    senders += range(n)
    receivers += range(n)
    evaluations = _evaluations(ops, internal, exports)
    read_inputs: dict[Any, int] = {}
    known_times = []
    written = max_elements = 0
    total_flops = evaluated_work = 0.0
    for i, op in enumerate(ops):
        external_bytes = 0
        for value, nbytes, cloned in external[i]:
            if not cloned:
                external_bytes += nbytes
                read_inputs[value] = nbytes
        r = rows[i]
        r[col["log_external_read_bytes"]] = math.log1p(external_bytes)
        if i in exports:
            r[col["exported"]] = 1.0
            r[col["log_export_bytes"]] = math.log1p(op.out_bytes)
            written += op.out_bytes
        r[col["log_internal_users"]] = math.log1p(users[i])
        if times[i] is not None:
            r[col["log_own_time_us"]] = _log_time(times[i])
            r[col["own_time_known"]] = 1.0
            known_times.append(times[i])
        r[col["log_evaluations"]] = math.log1p(evaluations[i])
        r[col["log_recompute_ratio"]] = math.log1p(evaluations[i] / max(op.out_elements, 1))
        evaluated_work += evaluations[i] * op.weight
        total_flops += op.flops
        max_elements = max(max_elements, op.out_elements)
    kernel = np.array(
        [
            math.log1p(sum(read_inputs.values())),
            math.log1p(written),
            math.log1p(n),
            math.log1p(total_flops),
            math.log1p(max_elements),
            len(exports),
            _log_time(sum(known_times)) if known_times else 0.0,
            len(known_times) / max(n, 1),
            math.log1p(len(read_inputs)),
            math.log1p(sum(evaluations)),
            math.log1p(evaluated_work),
        ],
        np.float32,
    )
    return KernelFeatures(rows, np.array(senders, np.int32), np.array(receivers, np.int32), kernel)


def _node_op(node: Mapping[str, Any], operands: Sequence[tuple[str, Sequence[int]]]) -> _Op:
    """A node's `_Op`; `operands`: (dtype, shape) of each."""
    weight = TRANSCENDENTAL_FLOPS if node["op"] in TRANSCENDENTAL else 1.0
    out_bytes = _bytes(node["dtype"], node["shape"])
    row = _op_row(node, operands)
    return _Op(row, node["op"], _elements(node["shape"]), out_bytes, node["flops"], weight)


def featurize(description: Mapping[str, Any]) -> KernelFeatures:
    """Encode a description into `KernelFeatures` (deterministic: equal descriptions give equal
    arrays)."""
    nodes = description["nodes"]
    ops, internal, external = [], [], []
    for node in nodes:
        specs, inside, outside = [], [], []
        for ref in node["operands"]:
            if isinstance(ref, int):
                specs.append((nodes[ref]["dtype"], nodes[ref]["shape"]))
                inside.append(ref)
            else:
                dtype, shape, cloned, input_id = ref
                specs.append((dtype, shape))
                outside.append((input_id, _bytes(dtype, shape), cloned))
        ops.append(_node_op(node, specs))
        internal.append(inside)
        external.append(outside)
    times = [node.get("time_us") for node in nodes]
    return _encode(ops, internal, external, set(description["exports"]), times)


def kernel_features(
    graph: Graph, kernel: frozenset[int], op_times_us: Mapping[int, float] | None = None
) -> KernelFeatures:
    """`featurize(describe_kernel(graph, kernel, op_times_us))`: the GNN input for one kernel."""
    return featurize(describe_kernel(graph, kernel, op_times_us))


class KernelFeaturizer:
    """`kernel_features` for the many kernels of one graph a search asks about: each op's `_Op`
    and operands are worked out once, and a kernel costs only what depends on which ops it holds.
    Equal, to the bit, to `kernel_features` (tests/test_gnn_estimator.py). It keeps no reference
    to the graph: pass the same graph to every call."""

    def __init__(self) -> None:
        self._ops: dict[int, tuple[_Op, list[tuple[int, int, bool]]]] = {}

    def _op(self, graph: Graph, o: int) -> tuple[_Op, list[tuple[int, int, bool]]]:
        """Op `o`'s `_Op`, and its operands as (value, bytes, cloned)."""
        found = self._ops.get(o)
        if found is None:
            op = graph.ops[o]
            spec = op.inst.outputs[0]
            specs, operands = [], []
            for v in op.operands:
                src = graph.ops[v]
                s = src.inst.outputs[0] if src.inst.outputs else _hlo.TensorSpec("token", ())
                cloned = src.opcode == "constant" and src.kind == "free" and src.output_bytes <= CLONE_CONSTANT_BYTES
                specs.append((s.dtype, list(s.dims)))
                operands.append((v, _bytes(s.dtype, list(s.dims)), cloned))
            node = {
                "op": op.opcode,
                "dtype": spec.dtype,
                "shape": list(spec.dims),
                "dims": _dims_attr(op.inst),
                "flops": float(flops_per_op(graph)[o]),
            }
            found = self._ops[o] = (_node_op(node, specs), operands)
        return found

    def features(
        self,
        graph: Graph,
        kernel: frozenset[int],
        op_times_us: Mapping[int, float] | None = None,
        exports: Sequence[int] | None = None,
    ) -> KernelFeatures:
        """`kernel_features(graph, kernel, op_times_us)`. `exports`: the positions (in op order)
        of `_kernels.default_exports`, when the caller has them (the estimator's cache key)."""
        order = sorted(kernel)
        position = {o: i for i, o in enumerate(order)}
        entries = [self._op(graph, o) for o in order]
        internal = [[position[v] for v, _, _ in operands if v in position] for _, operands in entries]
        external = [[e for e in operands if e[0] not in position] for _, operands in entries]
        if exports is None:
            exports = [position[o] for o in _kernels.default_exports(graph, kernel)]
        times = [None] * len(order)
        if op_times_us:
            times = [None if op_times_us.get(o) is None else float(op_times_us[o]) for o in order]
        return _encode([op for op, _ in entries], internal, external, set(exports), times)


def without_times(description: Mapping[str, Any]) -> dict:
    """The description with every own time unknown (what the core has for ops inside fusions)."""
    return {**description, "nodes": [{**node, "time_us": None} for node in description["nodes"]]}
