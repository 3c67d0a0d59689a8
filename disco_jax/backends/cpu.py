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
        comps = [c for c in module.computations if not c.is_entry] + em.computations + [entry]
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
        """The bucket as DDP and Horovod run theirs: every gradient flattened into one buffer
        (`reshape` to 1-D, `concatenate`), one all-reduce of it, each gradient sliced back out
        and reshaped. Each element is still summed over the devices on its own, so the result is
        the variadic all-reduce's bit for bit."""
        dtype = re.match(r"(\w+)\[", shapes[0]).group(1)
        sizes = [math.prod(int(d) for d in re.findall(r"\d+", dims)) for dims in (_dims(s) for s in shapes)]
        total, n = sum(sizes), em.channel
        flat = []
        for i, (operand, size) in enumerate(zip(operands, sizes)):
            flat.append(f"disco_pack.{n}.in{i}")
            em.emit(_hlo.Instruction(flat[-1], f"{dtype}[{size}]{{0}}", "reshape", [operand], None, []))
        buffer = f"disco_pack.{n}"
        em.emit(_hlo.Instruction(buffer, f"{dtype}[{total}]{{0}}", "concatenate", flat, None, [("dimensions", "{0}")]))
        reduced = f"disco_all-reduce.{n}"
        em.emit(_hlo.Instruction(reduced, f"{dtype}[{total}]{{0}}", "all-reduce", [buffer], None, attrs))
        start = 0
        for i, (g, size) in enumerate(zip(grads, sizes)):
            piece, bounds = f"disco_unpack.{n}.out{i}", f"{{[{start}:{start + size}]}}"
            em.emit(_hlo.Instruction(piece, f"{dtype}[{size}]{{0}}", "slice", [reduced], None, [("slice", bounds)]))
            em.emit(_hlo.Instruction(g.result_name, shapes[i], "reshape", [piece], None, []))
            em.names[g.reduced] = g.result_name
            start += size


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
