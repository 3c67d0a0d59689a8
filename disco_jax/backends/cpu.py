"""XLA:CPU: the backend disco-jax measures, searches and enacts on.

Facts this file encodes (docs/xla-facts.md): the pass hook's PRE_SCHEDULER stage on CPU sees
the module after fusion and after the all-reduce combiner, so the captured module already holds
XLA's own op fusion and all-reduce combining (`xla_buckets` reads them off the graph); its
elemental emitter fuses the ops in `FUSIBLE` into kLoop fusions; a multi-output loop fusion is one
loop over the first output's shape; and the passes `fusion` and `cpu-all-reduce-combiner` can be
disabled by name to enact DisCo's baselines.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

from disco_jax import _hlo
from disco_jax._edit import prune
from disco_jax._graph import Graph
from disco_jax._hlo import ELEMENTWISE
from disco_jax._program import Program
from disco_jax._rewrite import Emitter, fused_computation
from disco_jax._strategy import BUCKET, GROUP, OPAQUE, Strategy, group_exports, kernel_dag
from disco_jax.backends.base import Backend
from disco_jax.sharding import apply

# Ops XLA:CPU's elemental emitter generates inside a kLoop fusion.
FUSIBLE = ELEMENTWISE | frozenset(
    "broadcast reshape transpose copy slice concatenate pad reduce iota reverse bitcast".split()
)
# A producer whose consumer is fused with it is recomputed per output element of the consumer:
# XLA never fuses these as producers, and neither does the search.
NO_PRODUCER_FUSION = frozenset({"reduce", "concatenate", "pad", "iota"})


def emittable(graph: Graph, strategy: Strategy, exports: list[list[int]]) -> bool:
    """XLA:CPU emits a multi-output loop fusion as one loop over the first output's shape: all
    outputs of a fused group must have the same shape (else the compiler crashes)."""
    return all(len(outs) < 2 or len({graph.ops[o].inst.shape for o in outs}) == 1 for outs in exports)


def xla_buckets(graph: Graph) -> list[tuple[int, ...]]:
    """The captured module is after XLA:CPU's combiner (it combines everything it can)."""
    return [tuple(b) for b in graph.xla_buckets]


def _disable(*passes: str) -> dict[str, str]:
    return {"xla_disable_hlo_passes": ",".join(passes)}


class CpuRewriter:
    """Writes a strategy into XLA:CPU's module at PRE_SCHEDULER (after fusion and the all-reduce
    combiner): the entry computation is emitted anew, kernel by kernel (see `disco_jax._rewrite`)."""

    def rewrite(self, program: Program, strategy: Strategy) -> str:
        dag = kernel_dag(program, strategy)
        if dag is None:
            raise ValueError("strategy has a dependency cycle; it cannot be rewritten")
        graph = program.graph
        module = graph.module
        em = Emitter(graph, strategy)
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
            body.append(
                _hlo.Instruction(
                    root.name, root.shape, "tuple", [em.names[o] for o in graph.outputs], None, [], is_root=True
                )
            )
        else:
            # The output goes last (free ops are emitted as soon as their inputs exist).
            name = em.names[graph.outputs[0]]
            at = max(i for i, inst in enumerate(body) if inst.name == name)
            body.append(dataclasses.replace(body.pop(at), is_root=True))
        entry = dataclasses.replace(module.entry, instructions=body)
        # The loop bodies are the capture's own, their all-reduces packed where the plan says so.
        kept = pack_loop_allreduces(module, graph.loop_allreduces) if strategy.packed_loops else module.computations
        comps = [c for c in kept if not c.is_entry] + em.computations + [entry]
        return _hlo.HloModuleText(module.header, module.preamble, comps).to_text()

    def _emit_group(self, em: Emitter, gi: int, exports: list[int], xla_by_members) -> None:
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
                    em.emit(
                        _hlo.Instruction(
                            name, graph.ops[o].inst.shape, "get-tuple-element", [inst.name], None, [("index", str(i))]
                        )
                    )
                    em.names[o] = name
            return
        self._emit_new_fusion(em, members, exports)

    def _emit_new_fusion(self, em: Emitter, members: frozenset[int], exports: list[int]) -> None:
        graph = em.graph
        members = prune(graph, members, exports)  # XLA rejects fused ops without users
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
        em.emit(
            _hlo.Instruction(
                name,
                root_shape,
                "fusion",
                em.operand_names(params),
                None,
                [("kind", "kLoop"), ("calls", f"%{comp.name}")],
            )
        )
        if len(exports) == 1:
            em.names[exports[0]] = name
        else:
            for i, o in enumerate(exports):
                out = f"{name}.out{i}"
                em.emit(
                    _hlo.Instruction(
                        out, graph.ops[o].inst.shape, "get-tuple-element", [name], None, [("index", str(i))]
                    )
                )
                em.names[o] = out

    def _emit_bucket(self, em: Emitter, gradient_ids: list[int]) -> None:
        graph = em.graph
        grads = [graph.gradients[g] for g in gradient_ids]
        template = graph.allreduce_templates[grads[0].compat]
        em.channel += 1
        attrs = [
            (k, v) for k, v in template.attrs if k not in ("metadata", "control-predecessors", "frontend_attributes")
        ]
        attrs = [(k, str(em.channel) if k == "channel_id" else v) for k, v in attrs]
        operands = [em.names[g.producer] for g in grads]
        shapes = [graph.ops[g.producer].inst.shape for g in grads]
        if len(grads) > 1 and em.strategy.packed:
            self._emit_packed_bucket(em, grads, operands, shapes, attrs)
            return
        if len(grads) == 1:
            em.emit(_hlo.Instruction(grads[0].result_name, shapes[0], "all-reduce", operands, None, attrs))
            em.names[grads[0].reduced] = grads[0].result_name
            return
        name = f"disco_all-reduce.{em.channel}"
        em.emit(_hlo.Instruction(name, "(" + ", ".join(shapes) + ")", "all-reduce", operands, None, attrs))
        for i, g in enumerate(grads):
            em.emit(_hlo.Instruction(g.result_name, shapes[i], "get-tuple-element", [name], None, [("index", str(i))]))
            em.names[g.reduced] = g.result_name

    def _emit_packed_bucket(self, em: Emitter, grads, operands: list[str], shapes: list[str], attrs) -> None:
        """The bucket as DDP and Horovod run theirs (`packed_allreduce`)."""
        body, pieces = packed_allreduce(str(em.channel), operands, shapes, attrs)
        for inst in body:
            em.emit(inst)
        for g, shape, piece in zip(grads, shapes, pieces):
            em.emit(_hlo.Instruction(g.result_name, shape, "reshape", [piece], None, []))
            em.names[g.reduced] = g.result_name


def packed_allreduce(
    tag: str, operands: list[str], shapes: list[str], attrs
) -> tuple[list[_hlo.Instruction], list[str]]:
    """One all-reduce of several tensors of one element type as DDP and Horovod run theirs: every
    operand flattened into one buffer (`reshape` to 1-D, `concatenate`), one all-reduce of it,
    each operand's part sliced back out. Each element is still summed over the devices on its
    own, so the result is the variadic all-reduce's bit for bit. Returns the instructions and,
    per operand, the name of its flat reduced part (to be reshaped back to `shapes`)."""
    dtype = re.match(r"(\w+)\[", shapes[0]).group(1)
    sizes = [math.prod(int(d) for d in re.findall(r"\d+", _dims(s))) for s in shapes]
    total = sum(sizes)
    out, flat = [], []
    for i, (operand, size) in enumerate(zip(operands, sizes)):
        flat.append(f"disco_pack.{tag}.in{i}")
        out.append(_hlo.Instruction(flat[-1], f"{dtype}[{size}]{{0}}", "reshape", [operand], None, []))
    buffer, reduced = f"disco_pack.{tag}", f"disco_all-reduce.{tag}"
    out.append(_hlo.Instruction(buffer, f"{dtype}[{total}]{{0}}", "concatenate", flat, None, [("dimensions", "{0}")]))
    out.append(_hlo.Instruction(reduced, f"{dtype}[{total}]{{0}}", "all-reduce", [buffer], None, attrs))
    pieces, start = [], 0
    for i, size in enumerate(sizes):
        pieces.append(f"disco_unpack.{tag}.out{i}")
        bounds = f"{{[{start}:{start + size}]}}"
        out.append(_hlo.Instruction(pieces[-1], f"{dtype}[{size}]{{0}}", "slice", [reduced], None, [("slice", bounds)]))
        start += size
    return out, pieces


def pack_loop_allreduces(module: _hlo.HloModuleText, allreduces: Sequence[tuple[str, str]]) -> list[_hlo.Computation]:
    """The module's computations with each of `allreduces` (body computation, all-reduce names:
    `Graph.loop_allreduces`) packed into one flat buffer (`packed_allreduce`) where it stands in
    its loop body, so that it runs packed once per iteration. The variadic all-reduce's name now
    holds the tuple of the reduced parts, so its users in the body read them unchanged."""
    wanted: dict[str, set[str]] = {}
    for comp, name in allreduces:
        wanted.setdefault(comp, set()).add(name)
    out = []
    for comp in module.computations:
        if comp.name not in wanted:
            out.append(comp)
            continue
        body = []
        for inst in comp.instructions:
            if inst.name not in wanted[comp.name]:
                body.append(inst)
                continue
            shapes = _tuple_elements(inst.shape)
            attrs = [(k, v) for k, v in inst.attrs if k not in ("metadata", "frontend_attributes")]
            packed, pieces = packed_allreduce(inst.name.replace("all-reduce", "loop"), inst.operands, shapes, attrs)
            body.extend(packed)
            parts = []
            for i, (piece, shape) in enumerate(zip(pieces, shapes)):
                parts.append(f"disco_unpacked.{inst.name}.{i}")
                body.append(_hlo.Instruction(parts[-1], shape, "reshape", [piece], None, []))
            body.append(_hlo.Instruction(inst.name, inst.shape, "tuple", parts, None, [], is_root=inst.is_root))
        out.append(dataclasses.replace(comp, instructions=body))
    return out


def _tuple_elements(shape: str) -> list[str]:
    """The element shapes of a tuple shape's text, layouts kept (`(f32[2]{0}, /*index=1*/...)`)."""
    inner = re.sub(r"/\*.*?\*/", "", shape).strip()[1:-1]
    return [e.strip() for e in _hlo.split_top_level(inner)]


def _dims(shape: str) -> str:
    """The dimensions of an array shape's text (`f32[16,32]{1,0}` -> `16,32`)."""
    return re.match(r"\w+\[([^\]]*)\]", shape).group(1)


CPU = Backend(
    platform="cpu",
    hook_stage="PRE_SCHEDULER",
    fusible=FUSIBLE,
    no_producer_fusion=NO_PRODUCER_FUSION,
    emittable=emittable,
    rewriter=CpuRewriter(),
    xla_buckets=xla_buckets,
    baseline_options={
        "JAX_no_fusion": _disable("fusion", "cpu-all-reduce-combiner"),
        "JAX_op_fusion": _disable("cpu-all-reduce-combiner"),
        "JAX_AllReduce_fusion": _disable("fusion"),
        "JAX_default": {},
    },
    hook_rules=frozenset(apply.RULES),  # XLA:CPU has no reduce-scatter creator, no all-gather combiner
    packs_buckets=True,
)
