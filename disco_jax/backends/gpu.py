"""XLA:GPU (CUDA): capture, XLA's own decisions, and a rewriter at PRE_SCHEDULER.

Facts this file encodes (docs/xla-facts.md, checked deviceless for 8 H100s with jax 0.12.0.1):

* The pass hook's PRE_SCHEDULER stage on XLA:GPU is before fusion and before the all-reduce
  combiner: every op is an entry instruction and every gradient has an all-reduce of its own.
  The module returned there is what XLA:GPU compiles. POST_SCHEDULER of the same compile holds
  XLA's fusions, its combined all-reduces and its schedule; `gpu_schedule` reads them onto the
  graph (`decisions_stage`, `read_decisions`).
* Buckets: a variadic all-reduce given at PRE_SCHEDULER stays one collective (XLA flattens its
  operands into one buffer); with `xla_gpu_all_reduce_combine_threshold_bytes=0` the combiner
  leaves every all-reduce as given. So the rewriter writes one all-reduce per bucket and every
  rewritten compile turns the combiner off (`rewrite_options`).
* Fusion boundaries: an `opt-barrier` between two ops at PRE_SCHEDULER keeps them in different
  fusions, and no barrier is left in the compiled module. The rewriter puts one on every edge
  between fusible ops that the plan puts in different groups. It cannot make XLA:GPU form a
  fusion XLA would not form: XLA's fusion passes decide (see `GpuRewriter`).
"""

from __future__ import annotations

import dataclasses
import heapq

from disco_jax import _hlo
from disco_jax._graph import Graph
from disco_jax._hlo import ELEMENTWISE
from disco_jax._program import Program
from disco_jax._strategy import Strategy, is_valid
from disco_jax.backends.base import Backend
from disco_jax.backends.gpu_schedule import with_xla_decisions
from disco_jax.sharding import apply

# Ops XLA:GPU's loop and reduction emitters generate inside kLoop / kInput fusions. A gather is
# one of them (XLA:GPU fuses an embedding lookup with its index arithmetic and its consumers; as an
# opaque op, a fusion around it would read as a dependency cycle), so is an in-place
# dynamic-update-slice.
FUSIBLE = ELEMENTWISE | frozenset(
    "broadcast reshape transpose copy slice concatenate pad reduce iota reverse bitcast dynamic-slice gather "
    "dynamic-update-slice".split()
)
# A reduce's result is needed whole before a consumer can use it: XLA:GPU fuses it with a consumer
# only as a multi-output sibling, never as a producer; so does the search.
NO_PRODUCER_FUSION = frozenset({"reduce"})
# All-reduce reassociation (all-reduce(a) + all-reduce(b) -> all-reduce(a + b), which XLA:GPU runs
# after the hook) moves a sum of reduced gradients before the all-reduce: the graph cannot express
# that, so XLA's decisions are read, and plans compiled, without it (tiny RNNLM: XLA's default
# program has 40 all-reduces for 52 gradients; read with reassociation, its fusions made
# dependency cycles on the graph).
DECISIONS_OPTIONS = {"xla_disable_hlo_passes": "all-reduce-reassociate"}
# And XLA's all-reduce combiner off: the plan's buckets are the all-reduces that run.
REWRITE_OPTIONS = {**DECISIONS_OPTIONS, "xla_gpu_all_reduce_combine_threshold_bytes": "0"}
# Executables the profiler traces: no command buffers. With XLA's default (on), a run of kernels
# becomes one CUDA graph, traced as one `command_buffer_N` event: on one H100 (jax 0.11.2) 6 of 8
# tiny zoo steps showed a single event, the others 106-143 of 190-202 kernels; off, every kernel
# (docs/gpu.md, "Command buffers and the trace").
PROFILE_OPTIONS = {"xla_gpu_enable_command_buffer": ""}
# DisCo's compile-option baselines on XLA:GPU (docs/xla-facts.md, "XLA:GPU baselines"). No op
# fusion: the pipeline named `fusion` off (`priority-fusion`, then `multi_output_fusion`) and the
# Triton softmax rewriter, which fuses reductions and their elementwise neighbours before it; every
# op is then emitted alone (`fusion-wrapper` still wraps it in a one-op fusion), and dots keep the
# elementwise prologues and epilogues the Triton gemm rewriter fused into their gemm fusions (with
# Triton gemms off, cuBLAS takes the bias add as its epilogue instead). No all-reduce combining:
# the combiner off and all-reduce reassociation off (it would sum reduced gradients before one
# all-reduce), so one all-reduce per gradient. XLA's combining and JAX_default are XLA:GPU's
# defaults, reassociation included. PyTorch DDP and Horovod are enacted by the rewriter (not listed).
NO_FUSION_PASSES = "fusion,triton-softmax-rewriter"
BASELINE_OPTIONS = {
    "JAX_no_fusion": {**REWRITE_OPTIONS, "xla_disable_hlo_passes": f"{NO_FUSION_PASSES},all-reduce-reassociate"},
    "JAX_op_fusion": dict(REWRITE_OPTIONS),
    "JAX_AllReduce_fusion": {"xla_disable_hlo_passes": NO_FUSION_PASSES},
    "JAX_default": {},
}


def collective_options(
    latency_hiding_scheduler: bool | None = None, combine_threshold_bytes: int | None = None
) -> dict[str, bool | str]:
    """XLA:GPU compile options for one step's collectives (None: XLA's default).

    latency_hiding_scheduler: with it, each all-reduce stays an async start/done pair that XLA
      overlaps with compute; without it (XLA's default) XLA:GPU makes them synchronous.
    combine_threshold_bytes: how many bytes XLA's combiner packs into one all-reduce (default
      30 MiB). A rewritten plan decides its buckets itself (`REWRITE_OPTIONS` turn the combiner
      off), so this is for compiling the unmodified step.
    """
    options: dict[str, bool | str] = {}
    if latency_hiding_scheduler is not None:
        options["xla_gpu_enable_latency_hiding_scheduler"] = bool(latency_hiding_scheduler)  # "true" is refused
    if combine_threshold_bytes is not None:
        if not isinstance(combine_threshold_bytes, int) or combine_threshold_bytes < 0:
            raise ValueError(f"combine_threshold_bytes must be a non-negative int, got {combine_threshold_bytes!r}")
        options["xla_gpu_all_reduce_combine_threshold_bytes"] = str(combine_threshold_bytes)
    return options


def emittable(graph: Graph, strategy: Strategy, exports: list[list[int]]) -> bool:
    """The GPU rewriter emits no fusion itself (it only cuts edges), so any grouping compiles."""
    return True


def xla_buckets(graph: Graph) -> list[tuple[int, ...]]:
    """XLA:GPU's combining as read from the scheduled module (`gpu_schedule.with_xla_decisions`);
    one all-reduce per gradient when the graph was built from the PRE_SCHEDULER module alone."""
    return [tuple(b) for b in graph.xla_buckets]


class GpuRewriter:
    """Writes a strategy into XLA:GPU's module at PRE_SCHEDULER (before fusion and combining).

    The module is edited in place, not re-emitted: XLA:GPU still runs its own fusion after us.
    * Buckets: the gradients' all-reduces are replaced by one all-reduce per bucket (variadic
      for several gradients, with the reduction and replica groups of the original), read
      through get-tuple-elements named as the results they replace.
    * Fusion: where a fusible op reads a fusible op's value and no group of the plan holds
      both, the value passes through `tuple` -> `opt-barrier` -> `get-tuple-element`: XLA:GPU cannot fuse across it,
      and removes it after fusion.
    Not imposed (XLA:GPU decides): edges XLA left unfused between two kernels the plan keeps as
    XLA formed them, that a group is fused at all (XLA may leave it apart), whether
    an op next to a dot joins the gemm fusion as its prologue or epilogue (edges between opaque
    and fusible ops are never cut: the strategy's groups hold fusible ops only), a duplicate's
    recomputation, and the order of the kernels (its scheduler runs after us).
    """

    def rewrite(self, program: Program, strategy: Strategy) -> str:
        graph = program.graph
        if not is_valid(program, strategy):
            raise ValueError("strategy is not valid for this graph (homes, buckets or a dependency cycle)")
        module = _hlo.parse_module(graph.module.to_text())  # a copy to edit
        entry = module.entry
        body = _cut_fusions(graph, strategy, list(entry.instructions))
        body = _regroup_allreduces(graph, strategy, body)
        entry.instructions[:] = _topological(body)
        return module.to_text()


def _cut_fusions(graph: Graph, s: Strategy, body: list[_hlo.Instruction]) -> list[_hlo.Instruction]:
    """Barriers on the edges between fusible ops that the plan puts in different groups."""
    groups_of: dict[int, list[int]] = {}
    for gi, g in enumerate(s.groups):
        for o in g:
            groups_of.setdefault(o, []).append(gi)
    shapes = {i.name: i.shape for i in body}

    # Where the plan keeps XLA's kernels on both sides of an edge XLA left unfused, the edge is left
    # to XLA (it leaves it unfused again), so XLA's own plan compiles to XLA's own program even where
    # the reading of its fusions is imperfect. Every other edge the plan separates is cut: XLA's
    # fusion decisions are not local (an op whose fusion the plan opens may join another one).
    # Without XLA's decisions (a graph read at the hook stage alone) every separated edge is cut.
    xla_holders = graph.xla_holders if graph.xla_schedule else {}

    def kept(o: int) -> bool:
        return {s.groups[gi] for gi in groups_of.get(o, [])} == {graph.xla_groups[x] for x in xla_holders.get(o, ())}

    def separated(v: int, u: int) -> bool:
        if graph.xla_schedule and kept(v) and kept(u) and not xla_holders[v] & xla_holders[u]:
            return False
        # A barrier cuts the edge for every copy of u, so it goes only where no group holds both.
        return all(v not in s.groups[gi] for gi in groups_of.get(u, []))

    cut: dict[str, str] = {}  # value name -> name of its barrier's output
    out: list[_hlo.Instruction] = []
    for inst in body:
        u = graph.entry_values.get(inst.name)
        if u is not None and graph.ops[u].kind == "fusible" and graph.ops[u].name == inst.name:
            operands = list(inst.operands)
            for i, name in enumerate(operands):
                v = graph.entry_values.get(name)
                if v is None:
                    continue
                sources = [x for x in graph.free_sources[v] if graph.ops[x].kind == "fusible"]
                if any(separated(x, u) for x in sources):
                    if name not in cut:
                        cut[name] = _barrier(out, name, shapes[name])
                    operands[i] = cut[name]
            inst = dataclasses.replace(inst, operands=operands)
        out.append(inst)
    return out


def _barrier(out: list[_hlo.Instruction], name: str, shape: str) -> str:
    """Append `tuple(name)` -> `opt-barrier` -> `get-tuple-element`; returns the last one's name."""
    if shape.startswith("("):
        raise ValueError(f"cannot cut the tuple-shaped value {name}")
    t, b, g = f"{name}.disco_cut_tuple", f"{name}.disco_cut_barrier", f"{name}.disco_cut"
    out.append(_hlo.Instruction(t, f"({shape})", "tuple", [name], None, []))
    out.append(_hlo.Instruction(b, f"({shape})", "opt-barrier", [t], None, []))
    out.append(_hlo.Instruction(g, shape, "get-tuple-element", [b], None, [("index", "0")]))
    return g


def _regroup_allreduces(graph: Graph, s: Strategy, body: list[_hlo.Instruction]) -> list[_hlo.Instruction]:
    """The gradients' all-reduces (and the get-tuple-elements of variadic ones) out, one
    all-reduce per bucket in."""
    sources = {g.source for g in graph.gradients}
    body = [
        i
        for i in body
        if i.name not in sources and not (i.opcode == "get-tuple-element" and i.operands and i.operands[0] in sources)
    ]
    tuples = sources - {g.result_name for g in graph.gradients}  # variadic all-reduces' own names
    left = [i.name for i in body if any(o in tuples for o in i.operands)]
    if left:
        raise ValueError(f"{left} read a gradient all-reduce's tuple directly; the rewriter cannot regroup it")
    defined = {i.name for i in body}
    channel = max((int(i.attr("channel_id")) for i in body if i.attr("channel_id") is not None), default=0)
    channel = max(
        [channel] + [int(graph.allreduce_templates[c].attr("channel_id") or 0) for c in graph.allreduce_templates]
    )
    for bucket in s.buckets:
        grads = [graph.gradients[g] for g in sorted(bucket, key=lambda g: graph.gradients[g].producer)]
        operands = [graph.ops[g.producer].name for g in grads]
        missing = [n for n in operands if n not in defined]
        if missing:
            raise ValueError(f"gradient producers {missing} are not entry instructions of the captured module")
        template = graph.allreduce_templates[grads[0].compat]
        channel += 1
        attrs = [
            (k, str(channel) if k == "channel_id" else v)
            for k, v in template.attrs
            if k not in ("metadata", "control-predecessors")
        ]
        shapes = [graph.ops[g.producer].inst.shape for g in grads]
        if len(grads) == 1:
            body.append(_hlo.Instruction(grads[0].result_name, shapes[0], "all-reduce", operands, None, attrs))
            continue
        name = f"disco_all-reduce.{channel}"
        body.append(_hlo.Instruction(name, "(" + ", ".join(shapes) + ")", "all-reduce", operands, None, attrs))
        for i, g in enumerate(grads):
            body.append(
                _hlo.Instruction(g.result_name, shapes[i], "get-tuple-element", [name], None, [("index", str(i))])
            )
    return body


def _topological(body: list[_hlo.Instruction]) -> list[_hlo.Instruction]:
    """Instructions in an order where each follows its operands and control predecessors,
    keeping the given order where free to; the ROOT goes last."""
    index = {i.name: k for k, i in enumerate(body)}
    deps: list[set[int]] = []
    for inst in body:
        names = list(inst.operands)
        preds = inst.attr("control-predecessors")
        if preds:
            names += [p.strip().lstrip("%") for p in preds.strip("{}").split(",") if p.strip()]
        unknown = [n for n in names if n not in index]
        if unknown:
            raise ValueError(f"{inst.name} reads {unknown}, which the rewritten module does not define")
        deps.append({index[n] for n in names})
    users: list[list[int]] = [[] for _ in body]
    for k, d in enumerate(deps):
        for p in d:
            users[p].append(k)
    indegree = [len(d) for d in deps]
    ready = [k for k in range(len(body)) if indegree[k] == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        k = heapq.heappop(ready)
        order.append(k)
        for u in users[k]:
            indegree[u] -= 1
            if indegree[u] == 0:
                heapq.heappush(ready, u)
    if len(order) != len(body):
        raise ValueError("the rewritten entry computation has a cycle")
    out = [body[k] for k in order]
    roots = [i for i in out if i.is_root]
    return [i for i in out if not i.is_root] + roots


GPU = Backend(
    platform="cuda",
    hook_stage="PRE_SCHEDULER",
    fusible=FUSIBLE,
    no_producer_fusion=NO_PRODUCER_FUSION,
    emittable=emittable,
    rewriter=GpuRewriter(),
    xla_buckets=xla_buckets,
    baseline_options=BASELINE_OPTIONS,
    rewrite_options=REWRITE_OPTIONS,
    decisions_stage="POST_SCHEDULER",
    read_decisions=with_xla_decisions,
    decisions_options=DECISIONS_OPTIONS,
    # Searched, validated and enacted on one H100 (jax 0.11.2, docs/gpu.md): eight zoo steps, outputs
    # equal, a plan applied only where measured faster. Several GPUs: only deviceless so far.
    decorator_ready=True,
    emits_fusions=False,
    creates_reduce_scatter=True,
    profile_options=PROFILE_OPTIONS,
    # XLA:GPU forms reduce-scatters and combines all-gathers itself, but keeps the sharded update's
    # slices of a gathered parameter (parameters sharded too): reading the shard instead lets the
    # gathered value die after its last dot (GPT-3 6.7B, 2 layers, 8 H100s deviceless: peak 7.48 ->
    # 5.60 GB per device, docs/sharded-update.md).
    hook_rules=frozenset({apply.OWN_BLOCK_OF_ALL_GATHER_RULE}),
)
