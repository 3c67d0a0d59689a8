"""The `Backend` record and the `Rewriter` protocol (see the package docstring)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

from disco_jax.backends.compiled import KernelSchedule, read_kernels
from disco_jax.sharding import apply

if TYPE_CHECKING:
    from disco_jax._graph import Graph
    from disco_jax._program import Program
    from disco_jax._strategy import Strategy


class Rewriter(Protocol):
    """Turns a strategy of a program (captured for this backend) into the module text the hook
    returns, for one backend and stage."""

    def rewrite(self, program: Program, strategy: Strategy) -> str: ...


@dataclasses.dataclass(frozen=True)
class Backend:
    """One XLA compiler, as disco-jax sees it.

    platform: JAX's platform name (`jax.default_backend()`, the hook's `platforms=`).
    hook_stage: the `jax.extend.xla.PipelineStage` member name where the module is captured and
      rewritten.
    fusible: opcodes the loop emitter generates inside a kLoop fusion.
    no_producer_fusion: fusible opcodes never fused into a consumer as a producer (they would be
      recomputed per output element of the consumer).
    emittable: `(graph, strategy, exports) -> bool`: can the compiler emit every fused group
      (`exports`: per group, the ops it outputs).
    rewriter: writes a strategy into the captured module.
    xla_buckets: how XLA combines the graph's all-reduces by default (gradient ids per all-reduce).
    baseline_options: XLA compile options that enact DisCo's baselines, by baseline name
      (`{}`: XLA's defaults).
    rewrite_options: XLA compile options every compile of a rewritten module gets (XLA:GPU: its
      all-reduce combiner off, so the plan's buckets are the all-reduces that run).
    decisions_stage: where XLA's own fusion and combining decisions are read when the hook stage
      comes before them (XLA:GPU: POST_SCHEDULER); None when the captured module already holds them.
    read_decisions: `(graph, module text at decisions_stage) -> graph` with XLA's fusions, buckets
      and schedule mapped onto the graph's ops (`xla_groups`, `xla_buckets`, ...).
    decisions_options: XLA compile options of the compile XLA's own decisions are read from: passes
      that rewrite the graph in ways the IR cannot express are off there and in every rewritten
      compile (XLA:GPU: all-reduce reassociation, which turns the sum of two reduced gradients into
      one all-reduce of their sum), so that XLA's plan as read and any plan compile alike.
    decorator_ready: whether `@optimize_distributed` searches and enacts plans on this backend's
      devices. False: the backend captures, rewrites and compiles (deviceless too), but its search
      and enact phases have not run on a device of its kind yet, so the decorator runs the
      unmodified step there rather than risk a user's training.
    emits_fusions: whether the rewriter writes fused groups as `fusion` instructions (XLA:CPU) or
      leaves XLA's fusion passes to form them from bare ops between its cuts (XLA:GPU). A kernel
      measured alone is emitted the same way (`gnn_estimator.kernel_module_text`).
    creates_reduce_scatter: whether the compiler turns an all-reduce whose every user is a
      dynamic-slice into a reduce-scatter after the hook (XLA:GPU's ReduceScatterCreator; the
      sharded weight update's gradients); the simulator costs such a gradient's transfer as one.
    packs_buckets: whether the rewriter can pack a bucket's gradients into one flat buffer
      (concatenate, one all-reduce, slice back: `Strategy.packed`), the way PyTorch DDP and Horovod
      pack theirs. XLA:CPU: a variadic all-reduce pays one rendezvous per operand, which packing
      saves; XLA:GPU's combined all-reduce is already one NCCL call over one buffer.
    hook_rules: the proven sharding rules (`sharding.rules` names) the pipeline applies itself to
      every module it compiles on this backend, at the hook after any plan's rewrite
      (`sharding.apply.apply_rules`): those the compiler does not apply (XLA:CPU: the
      reduce-scatter of an all-reduce read as blocks, grouped all-gathers; XLA:GPU, which forms
      reduce-scatters and combines all-gathers itself: the shard read for the own block of a
      gathered parameter).
    read_kernels: the kernels of a compiled executable's module text in schedule order, loop
      bodies and branches in theirs, what `cost.compiled` costs (`backends.compiled.read_kernels`,
      which reads XLA:GPU's and XLA:CPU's).
    profile_options: XLA compile options of an executable the profile phase traces, so that every
      kernel is an event of its own in the trace (XLA:GPU: command buffers off; a command buffer,
      a CUDA graph, is one event and hides its kernels, docs/gpu.md). The same program otherwise:
      the user's executable keeps XLA's defaults and is what is timed.
    """

    platform: str
    hook_stage: str
    fusible: frozenset[str]
    no_producer_fusion: frozenset[str]
    emittable: Callable[[Graph, Strategy, list[list[int]]], bool]
    rewriter: Rewriter
    xla_buckets: Callable[[Graph], list[tuple[int, ...]]]
    baseline_options: Mapping[str, Mapping[str, str]]
    rewrite_options: Mapping[str, str] = dataclasses.field(default_factory=dict)
    decisions_stage: str | None = None
    read_decisions: Callable[[Graph, str], Graph] | None = None
    decisions_options: Mapping[str, str] = dataclasses.field(default_factory=dict)
    decorator_ready: bool = True
    emits_fusions: bool = True
    creates_reduce_scatter: bool = False
    read_kernels: Callable[..., KernelSchedule] = read_kernels
    profile_options: Mapping[str, str] = dataclasses.field(default_factory=dict)
    hook_rules: frozenset[str] = frozenset()
    packs_buckets: bool = False

    @property
    def forms_reduce_scatter(self) -> bool:
        """Whether a sharded update's all-reduce runs as a reduce-scatter on this backend: the
        compiler forms it, or the pipeline applies the rule that does (once proven)."""
        return self.creates_reduce_scatter or apply.REDUCE_SCATTER_RULE in (self.hook_rules & apply.proven())
