"""The baselines of DisCo's evaluation (section 6.1), each expressed two ways at once.

A `Baseline` is

* a `Strategy` on the captured program's graph, for the simulator (every platform), and
* how the program's compiler (`Program.backend`: XLA:CPU measured, XLA:GPU compiled deviceless)
  enacts it: XLA compile options (`compiler_options`, from the backend's `baseline_options`),
  or, for the framework-style bucketings XLA has no option for, a rewrite of the strategy into
  the module (`compiler_options is None`: compile with `disco_jax._compile.compile_strategy`).
  The bucketing is what PyTorch DDP and Horovod do; enacting it through our rewriter is enacting
  that policy. `compile_baselines` compiles each one that way (`_compile.Programs`).

The baselines (one function each):

| function | name | op fusion | all-reduce combining |
|---|---|---|---|
| `jax_no_fusion` | JAX_no_fusion | none | none (one per gradient) |
| `jax_op_fusion` | JAX_op_fusion | XLA's | none |
| `jax_allreduce_fusion` | JAX_AllReduce_fusion | none | XLA's |
| `jax_default` | JAX_default | XLA's | XLA's |
| `pytorch_ddp` | PyTorch_DDP | XLA's | 25 MiB buckets in gradient-ready order, first 1 MiB; flat buffers |
| `horovod` | Horovod | XLA's | gradients ready in one 1 ms cycle, flat buffers of up to 128 MiB |

XLA:CPU levers (checked on compiled HLO in tests/test_baselines.py; pass names in
docs/xla-facts.md): the pass `fusion` forms loop fusions (with it disabled, `fusion-wrapper` still
wraps each elementwise op alone in a one-instruction kLoop fusion, which is how XLA:CPU emits code
for it); `cpu-all-reduce-combiner` combines all-reduces (the CPU combiner takes everything it can).
XLA's library-call fusions (`__ynn_fusion` around a dot or convolution) are not op fusion and stay.
XLA:GPU levers (`backends.gpu.BASELINE_OPTIONS`, tests/test_backends_gpu.py, docs/xla-facts.md):
the pipeline `fusion` off (ops emitted one per fusion; gemm fusions keep the elementwise prologues
and epilogues the Triton gemm rewriter gave them), the combine threshold 0 with all-reduce
reassociation off (one all-reduce per gradient).

"XLA's all-reduce combining" is a rule passed as `combine` (a function of the graph giving the
gradient ids of each all-reduce): by default the measured platform's, `backends.CPU.xla_buckets`
(what the captured module shows); on a simulated GPU cluster `xla_gpu_buckets`, XLA:GPU's combiner
of neighbouring all-reduces up to `xla_gpu_all_reduce_combine_threshold_bytes` (30 MiB by
default), where the graph is XLA:CPU's module (XLA:GPU's op fusion is then XLA:CPU's decisions),
or `backends.GPU.xla_buckets`, XLA:GPU's combining as it compiled the step, where the graph is
XLA:GPU's module.

PyTorch DDP and Horovod do not fuse ops (eager PyTorch; Horovod leaves that to the framework). Here
they get XLA's op fusion, so they are the strongest version of their bucketing policy; pass
`fusion="none"` for the eager variant.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from disco_jax import AllReduceCostModel, Graph, Program, Strategy, _strategy, backends, simulate
from disco_jax._compile import CompiledProgram, Programs
from disco_jax.backends import Backend

Combine = Callable[[Graph], Sequence[Sequence[int]]]  # XLA's all-reduce combining: gradient ids per all-reduce

MiB = 1 << 20
XLA_GPU_COMBINE_THRESHOLD_BYTES = 30 * MiB  # xla_gpu_all_reduce_combine_threshold_bytes default
XLA_GPU_COMBINE_THRESHOLD_COUNT = 256  # xla_gpu_collective_combine_threshold_count default
DDP_BUCKET_CAP_BYTES = 25 * MiB  # torch DistributedDataParallel(bucket_cap_mb=25)
DDP_FIRST_BUCKET_BYTES = 1 * MiB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
HOROVOD_FUSION_THRESHOLD_BYTES = 128 * MiB  # HOROVOD_FUSION_THRESHOLD default since v0.21.0
HOROVOD_CYCLE_TIME_US = 1000.0  # HOROVOD_CYCLE_TIME default (1 ms) since v0.21.0

SOURCES = {
    "JAX_no_fusion": "DisCo section 6.1 baseline (1): XLA's op fusion and all-reduce combining off",
    "JAX_op_fusion": "DisCo section 6.1 baseline (2): XLA's all-reduce combining off",
    "JAX_AllReduce_fusion": "DisCo section 6.1 baseline (3): XLA's op fusion off",
    "JAX_default": "DisCo section 6.1 baseline (4); XLA's defaults (GPU combine threshold 30 MiB, "
    "xla_gpu_all_reduce_combine_threshold_bytes)",
    "PyTorch_DDP": "DisCo section 6.1 baseline (5); torch DistributedDataParallel bucket_cap_mb=25 and "
    "_DEFAULT_FIRST_BUCKET_BYTES = 1 MiB; buckets close once they reach the cap "
    "(reducer.cpp compute_bucket_assignment_by_size), in the order gradients become ready "
    "(DDP's reverse parameter order stands for that); each bucket one flat buffer all-reduced as one tensor "
    "(the Reducer copies gradients into, or views them in, its bucket's contiguous tensor), packed here "
    "where the backend packs (Strategy.packed; a scanned step's loop-body all-reduces too, Strategy.packed_loops)",
    "Horovod": "Horovod tensor fusion (docs/tensor-fusion.rst): every cycle, ready tensors of one dtype copied "
    "into the fusion buffer up to HOROVOD_FUSION_THRESHOLD, one allreduce of the buffer, copied back out; "
    "defaults 128 MB and 1 ms (HOROVOD_CYCLE_TIME) since v0.21.0 (changelog, #2468). The cycle is modelled "
    "from the gradients' simulated ready times: those ready in one 1 ms window share buffers; packed here "
    "where the backend packs (Strategy.packed; a scanned step's loop-body all-reduces too, Strategy.packed_loops)",
}


@dataclasses.dataclass(frozen=True)
class Baseline:
    """One baseline on one captured program.

    name: the baseline's name in the report. strategy: its decisions on the program's graph, for
    the simulator. compiler_options: XLA compile options that make the program's compiler
    (`Program.backend`) compile the step this way (``{}``: XLA's defaults; the backend's
    `baseline_options`), or None when it is enacted by rewriting `strategy` into the module.
    description: one line for the report."""

    name: str
    strategy: Strategy
    compiler_options: dict | None
    description: str

    @property
    def enacted_by(self) -> str:
        return "rewrite" if self.compiler_options is None else "compile options"


def compiler_options(name: str, backend: Backend = backends.CPU) -> dict | None:
    """`backend`'s compile options for baseline `name` (None: enacted by rewrite)."""
    options = backend.baseline_options.get(name)
    return None if options is None else dict(options)


# --------------------------------------------------------------------------- bucket builders


def gradient_ready_order(graph: Graph, ready_times_us: Sequence[float] | None = None) -> list[int]:
    """Gradient ids in the order they become ready: by ready time when given, else by the
    program position of their producers (the order the backward pass produces them)."""
    if ready_times_us is not None:
        return sorted(range(len(graph.gradients)), key=lambda g: (ready_times_us[g], graph.gradients[g].producer, g))
    return sorted(range(len(graph.gradients)), key=lambda g: (graph.gradients[g].producer, g))


def _reduced_dependencies(graph: Graph) -> list[int]:
    """Per gradient, a bitmask of the gradients whose all-reduced value its producer depends on
    (forward-pass all-reduces such as batch-norm statistics feed later gradients)."""
    return graph.reduced_dependencies


class _Buckets:
    """Open buckets (one per kind of gradient, `compat`) and closed ones. A gradient that depends
    on the reduced value of a gradient in an open bucket closes that bucket first: buckets then
    close before anything that waits for them joins one, so the buckets can never wait for each
    other in a cycle."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.dependencies = _reduced_dependencies(graph)
        self.open: dict[tuple, list[int]] = {}
        self.bytes: dict[tuple, int] = {}
        self.masks: dict[tuple, int] = {}
        self.closed_count: dict[tuple, int] = {}
        self.done: list[tuple[int, ...]] = []

    def close(self, compat: tuple) -> None:
        if self.open.get(compat):
            self.done.append(tuple(self.open[compat]))
            self.closed_count[compat] = self.closed_count.get(compat, 0) + 1
        self.open[compat], self.bytes[compat], self.masks[compat] = [], 0, 0

    def close_dependencies(self, gid: int) -> None:
        mask = self.dependencies[gid]
        for compat, open_mask in list(self.masks.items()):
            if mask & open_mask:
                self.close(compat)

    def add(self, gid: int) -> None:
        g = self.graph.gradients[gid]
        if g.compat not in self.open:
            self.close(g.compat)
        self.open[g.compat].append(gid)
        self.bytes[g.compat] += g.nbytes
        self.masks[g.compat] |= 1 << gid

    def finish(self) -> list[tuple[int, ...]]:
        for compat in list(self.open):
            self.close(compat)
        return self.done


def fit_buckets(
    graph: Graph, order: Sequence[int], threshold_bytes: int, max_count: int | None = None
) -> list[tuple[int, ...]]:
    """Greedy combining in `order` (gradients after those they depend on): add a gradient to the
    open bucket of its kind (`compat`) while the bucket stays within `threshold_bytes` (and
    `max_count` gradients); a gradient that does not fit closes it. A gradient larger than the
    threshold travels alone. (XLA's combiner and Horovod's fusion buffer.)"""
    buckets = _Buckets(graph)
    for gid in order:
        g = graph.gradients[gid]
        buckets.close_dependencies(gid)
        bucket = buckets.open.get(g.compat)
        if bucket and (
            buckets.bytes[g.compat] + g.nbytes > threshold_bytes or (max_count is not None and len(bucket) >= max_count)
        ):
            buckets.close(g.compat)
        buckets.add(gid)
    return buckets.finish()


def ddp_buckets(
    graph: Graph,
    order: Sequence[int],
    bucket_cap_bytes: int = DDP_BUCKET_CAP_BYTES,
    first_bucket_bytes: int = DDP_FIRST_BUCKET_BYTES,
) -> list[tuple[int, ...]]:
    """PyTorch DDP's assignment: per dtype, fill a bucket in `order` and close it as soon as it
    holds at least its limit; the first bucket's limit is `first_bucket_bytes`, later ones
    `bucket_cap_bytes`."""
    buckets = _Buckets(graph)
    for gid in order:
        g = graph.gradients[gid]
        buckets.close_dependencies(gid)
        buckets.add(gid)
        limit = first_bucket_bytes if buckets.closed_count.get(g.compat, 0) == 0 else bucket_cap_bytes
        if buckets.bytes[g.compat] >= limit:
            buckets.close(g.compat)
    return buckets.finish()


def horovod_buckets(
    graph: Graph,
    threshold_bytes: int = HOROVOD_FUSION_THRESHOLD_BYTES,
    ready_times_us: Sequence[float] | None = None,
    cycle_us: float = HOROVOD_CYCLE_TIME_US,
) -> list[tuple[int, ...]]:
    """Horovod's tensor fusion: the gradients that became ready within one cycle are fused, in
    ready order and per dtype, into buffers of at most `threshold_bytes`. Without ready times
    every gradient counts as ready in one cycle (pure threshold fusion in production order)."""
    order = gradient_ready_order(graph, ready_times_us)
    if ready_times_us is None or cycle_us <= 0:
        return fit_buckets(graph, order, threshold_bytes)
    cycles: dict[int, list[int]] = {}
    for gid in order:
        cycles.setdefault(int(ready_times_us[gid] // cycle_us), []).append(gid)
    buckets: list[tuple[int, ...]] = []
    for c in sorted(cycles):
        buckets.extend(fit_buckets(graph, cycles[c], threshold_bytes))
    return buckets


def xla_gpu_buckets(
    graph: Graph,
    threshold_bytes: int = XLA_GPU_COMBINE_THRESHOLD_BYTES,
    max_count: int = XLA_GPU_COMBINE_THRESHOLD_COUNT,
) -> list[tuple[int, ...]]:
    """XLA:GPU's all-reduce combiner: neighbouring all-reduces (production order) combined up to
    the byte threshold and the op count threshold."""
    return fit_buckets(graph, gradient_ready_order(graph), threshold_bytes, max_count)


def per_gradient(graph: Graph) -> list[tuple[int, ...]]:
    return [(g.id,) for g in graph.gradients]


class _GivenCosts:
    """An `Estimator` from a function of a list of kernels."""

    name = "given"

    def __init__(self, kernel_time_us: Callable[[list], list]):
        self.kernel_time_us = kernel_time_us

    def estimate(self, graph, kernels):
        return self.kernel_time_us(list(kernels))


def gradient_ready_times(program: Program, strategy: Strategy, kernel_time_us: Callable[[list], list]) -> list[float]:
    """When each gradient is ready when `strategy`'s kernels run on the simulator's compute stream
    and communication costs nothing. `kernel_time_us(kernels)` costs a list of kernels
    (frozensets of op ids). Raises ValueError for an invalid strategy."""
    per_gradient_buckets = _strategy.with_buckets(strategy, per_gradient(program.graph), "ready-times")
    step = simulate(program, per_gradient_buckets, _GivenCosts(kernel_time_us), AllReduceCostModel(0.0, 0.0))
    if step is None:
        raise ValueError("strategy has no valid kernel graph")
    return step.allreduce_ready_us  # one bucket per gradient, in gradient order


# --------------------------------------------------------------------------- the baselines


def _fusion_groups(graph: Graph, fusion: str) -> Strategy:
    if fusion == "xla":
        return _strategy.xla_default(graph)
    if fusion == "none":
        return _strategy.unfused(graph)
    raise ValueError(f"fusion must be 'xla' or 'none', got {fusion!r}")


def _combining(combine: Combine) -> str:
    return getattr(combine, "__name__", type(combine).__name__)


def jax_no_fusion(program: Program) -> Baseline:
    """Neither op fusion nor all-reduce combining."""
    graph = program.graph
    s = _strategy.with_buckets(_strategy.unfused(graph), per_gradient(graph), "JAX_no_fusion")
    return Baseline(
        "JAX_no_fusion",
        s,
        compiler_options("JAX_no_fusion", program.backend),
        "no op fusion, one all-reduce per gradient",
    )


def jax_op_fusion(program: Program) -> Baseline:
    """XLA's op fusion, no all-reduce combining."""
    graph = program.graph
    s = _strategy.with_buckets(_strategy.xla_default(graph), per_gradient(graph), "JAX_op_fusion")
    return Baseline(
        "JAX_op_fusion",
        s,
        compiler_options("JAX_op_fusion", program.backend),
        "XLA's op fusion, one all-reduce per gradient",
    )


def jax_allreduce_fusion(program: Program, combine: Combine = backends.CPU.xla_buckets) -> Baseline:
    """XLA's all-reduce combining (`combine`), no op fusion."""
    graph = program.graph
    s = _strategy.with_buckets(_strategy.unfused(graph), combine(graph), "JAX_AllReduce_fusion")
    return Baseline(
        "JAX_AllReduce_fusion",
        s,
        compiler_options("JAX_AllReduce_fusion", program.backend),
        f"no op fusion, XLA's all-reduce combining ({_combining(combine)})",
    )


def jax_default(program: Program, combine: Combine = backends.CPU.xla_buckets) -> Baseline:
    """XLA's op fusion and all-reduce combining (`combine`)."""
    graph = program.graph
    s = _strategy.with_buckets(_strategy.xla_default(graph), combine(graph), "JAX_default")
    return Baseline(
        "JAX_default",
        s,
        compiler_options("JAX_default", program.backend),
        f"XLA's op fusion and all-reduce combining ({_combining(combine)})",
    )


def pytorch_ddp(
    program: Program,
    *,
    bucket_cap_bytes: int = DDP_BUCKET_CAP_BYTES,
    first_bucket_bytes: int = DDP_FIRST_BUCKET_BYTES,
    fusion: str = "xla",
    ready_times_us: Sequence[float] | None = None,
) -> Baseline:
    """PyTorch DDP's gradient buckets (enacted by rewrite)."""
    graph = program.graph
    order = gradient_ready_order(graph, ready_times_us)
    s = _strategy.with_buckets(
        _fusion_groups(graph, fusion), ddp_buckets(graph, order, bucket_cap_bytes, first_bucket_bytes), "PyTorch_DDP"
    )
    s = _packed(program, s)
    return Baseline(
        "PyTorch_DDP",
        s,
        compiler_options("PyTorch_DDP", program.backend),
        f"{'XLA op fusion' if fusion == 'xla' else 'no op fusion'}, DDP buckets "
        f"(cap {bucket_cap_bytes / MiB:g} MiB, first {first_bucket_bytes / MiB:g} MiB){_packing(s)}",
    )


def _packed(program: Program, s: Strategy) -> Strategy:
    """A framework's buckets as it runs them: each one flat buffer, where the backend packs
    (XLA:CPU; XLA:GPU's combined all-reduce is one flat NCCL call already); a scanned step's
    per-layer all-reduce in its loop body too (`Strategy.packed_loops`), the bucket a framework
    would fill with that layer's gradients, so that disco-jax is not credited with packing the
    frameworks do."""
    packs = bool(getattr(program.backend, "packs_buckets", False))
    return dataclasses.replace(s, packed=packs, packed_loops=packs and bool(program.graph.loop_allreduces))


def _packing(s: Strategy) -> str:
    loops = ", the loop bodies' all-reduces too" if s.packed_loops else ""
    return (", packed into flat buffers" + loops) if s.packed else ""


def horovod(
    program: Program,
    *,
    threshold_bytes: int = HOROVOD_FUSION_THRESHOLD_BYTES,
    cycle_us: float = HOROVOD_CYCLE_TIME_US,
    ready_times_us: Sequence[float] | None = None,
    fusion: str = "xla",
) -> Baseline:
    """Horovod's threshold tensor fusion per cycle (enacted by rewrite)."""
    graph = program.graph
    s = _strategy.with_buckets(
        _fusion_groups(graph, fusion), horovod_buckets(graph, threshold_bytes, ready_times_us, cycle_us), "Horovod"
    )
    s = _packed(program, s)
    cycle = f", cycle {cycle_us / 1000:g} ms" if ready_times_us is not None else ""
    return Baseline(
        "Horovod",
        s,
        compiler_options("Horovod", program.backend),
        f"{'XLA op fusion' if fusion == 'xla' else 'no op fusion'}, fusion threshold "
        f"{threshold_bytes / MiB:g} MiB{cycle}{_packing(s)}",
    )


def compile_baselines(programs: Programs, candidates: Sequence[Baseline]) -> dict[str, CompiledProgram]:
    """Each baseline of `candidates` compiled as the program's backend enacts it, by its name: XLA's
    program under its compile options (JAX_default: XLA's own), or its strategy rewritten into the
    module; a baseline that cannot be enacted comes back marked so, with the reason
    (`_compile.compile_program`). `programs`: the step's programs (`_compile.Programs`)."""
    return {b.name: programs.compile(b.name, b.strategy, b.compiler_options) for b in candidates}


BASELINES: dict[str, Callable[..., Baseline]] = {
    "JAX_no_fusion": jax_no_fusion,
    "JAX_op_fusion": jax_op_fusion,
    "JAX_AllReduce_fusion": jax_allreduce_fusion,
    "JAX_default": jax_default,
    "PyTorch_DDP": pytorch_ddp,
    "Horovod": horovod,
}


def all_baselines(
    program: Program,
    *,
    combine: Combine = backends.CPU.xla_buckets,
    kernel_time_us: Callable[[list], list] | None = None,
    **thresholds,
) -> list[Baseline]:
    """Every baseline on `program`, with `combine` as XLA's all-reduce combining (default: the
    measured platform's; `xla_gpu_buckets` for a simulated GPU cluster). With `kernel_time_us`
    (the platform's kernel cost), DDP and Horovod order gradients by when they become ready in
    XLA's plan, and Horovod fuses per cycle; without it, by program position and in one cycle.
    `thresholds`: bucket_cap_bytes / first_bucket_bytes (DDP), threshold_bytes / cycle_us (Horovod)."""
    graph, ready = program.graph, None
    if kernel_time_us is not None:
        ready = gradient_ready_times(
            program,
            _strategy.with_buckets(_strategy.xla_default(graph), per_gradient(graph), "ready-times"),
            kernel_time_us,
        )
    ddp_args = {k: thresholds[k] for k in ("bucket_cap_bytes", "first_bucket_bytes") if k in thresholds}
    hvd_args = {k: thresholds[k] for k in ("threshold_bytes", "cycle_us") if k in thresholds}
    return [
        jax_no_fusion(program),
        jax_op_fusion(program),
        jax_allreduce_fusion(program, combine),
        jax_default(program, combine),
        pytorch_ddp(program, ready_times_us=ready, **ddp_args),
        horovod(program, ready_times_us=ready, **hvd_args),
    ]
