"""Compile a fused kernel alone and measure its time on the current backend.

Data flow: (graph, kernel) -> `_kernels.kernel_module_text` -> compiled through the XLA pass hook
(`disco_jax._capture.compile_with_hook`): a dummy function with the kernel's input and output
shapes is lowered, and at the hook its module is replaced by the kernel module (the header line,
with the entry computation layout, is copied from the dummy so the executable's signature matches)
-> `time_kernels` runs many compiled kernels under `jax.profiler.trace` and reads each kernel's
thunk time per execution from the trace (as `disco_jax._device_timing.measure_kernel_times` does for
whole steps): median over the executions of a round, minimum over rounds.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from disco_jax import _capture, _device_timing, _hlo
from disco_jax._program import Program
from gnn_estimator import _kernels

_NUMPY_DTYPES = {
    "pred": np.bool_,
    "s8": np.int8,
    "s16": np.int16,
    "s32": np.int32,
    "u8": np.uint8,
    "u16": np.uint16,
    "u32": np.uint32,
    "f16": np.float16,
    "bf16": jnp.bfloat16,
    "f32": np.float32,
}
if jax.config.jax_enable_x64:
    _NUMPY_DTYPES.update({"s64": np.int64, "u64": np.uint64, "f64": np.float64})

_fresh = itertools.count()


def numpy_dtype(hlo_dtype: str):
    """The numpy dtype of an HLO element type; KeyError for types jax cannot hold here."""
    return _NUMPY_DTYPES[hlo_dtype]


def random_array(spec, rng: np.random.Generator) -> jax.Array:
    """Inputs that keep every elementwise op finite: floats in [0.5, 1.5), integers in [1, 4).

    Drawn on the device from a seed taken from `rng` (deterministic for a given `rng`): a GPU kernel
    can read hundreds of megabytes, which NumPy would take seconds to draw and copy over."""
    dtype = numpy_dtype(spec.dtype)
    return _draw(int(rng.integers(2**31)), tuple(spec.dims), spec.dtype, dtype)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _draw(seed, dims, hlo_dtype, dtype):
    key = jax.random.key(seed)
    if hlo_dtype == "pred":
        return jax.random.bernoulli(key, 0.5, dims)
    if hlo_dtype.startswith(("s", "u")):
        return jax.random.randint(key, dims, 1, 4, jnp.int32).astype(dtype)
    return jax.random.uniform(key, dims, jnp.float32, 0.5, 1.5).astype(dtype)


@dataclasses.dataclass
class CompiledKernel:
    """One kernel compiled alone: call `compiled(*args)`; its time is that of `instructions` (the
    compiled module's kernels: one on XLA:CPU, as many as XLA:GPU's fusion made of the bare ops)
    in module `module_name` of the trace."""

    compiled: object
    args: tuple
    module_name: str
    instructions: tuple[str, ...]


def compile_kernel(program: Program, kernel: frozenset[int], rng: np.random.Generator) -> CompiledKernel:
    """Compile `kernel` (a measurable set of fusible op ids of `program`'s graph, see
    `_kernels.measurable`) alone, as `program`'s compiler emits it."""
    # A dummy with the kernel's entry signature; its name makes the module name unique in traces.
    text_probe, params, exports = _kernels.kernel_module_text(program, kernel, "HloModule probe")
    in_specs, out_specs = _kernels.kernel_boundary_specs(program.graph, params, exports)
    outputs = [(tuple(s.dims), numpy_dtype(s.dtype)) for s in out_specs]

    def dummy(*args):
        results = tuple(jnp.zeros(shape, dtype) for shape, dtype in outputs)
        return results if len(results) > 1 else results[0]

    dummy.__name__ = dummy.__qualname__ = f"disco_kernel_{next(_fresh)}"
    args = tuple(random_array(s, rng) for s in in_specs)
    lowered = jax.jit(dummy, keep_unused=True).lower(*args)
    module_name = _capture.module_name(lowered)

    def replace(text: str) -> str:
        header = text.splitlines()[0]
        return _kernels.kernel_module_text(program, kernel, header)[0]

    compiled = _capture.compile_with_hook(lowered, replace, cache_tag=f"{module_name}-{text_probe}")
    return CompiledKernel(compiled, args, module_name, _compiled_kernels(compiled.as_text()))


def _compiled_kernels(compiled_text: str) -> tuple[str, ...]:
    """The names the kernels have in the compiled module, which the trace reports: XLA:CPU (jaxlib
    0.12) wraps a lone op in a one-op fusion named after the op (`wrapped_tanh`), so it is not
    always `KERNEL_INSTRUCTION`. The entry computation holds the kernels and free ops."""
    kernels = tuple(
        i.name
        for i in _hlo.parse_module(compiled_text).entry.instructions
        if i.opcode not in ("parameter", "constant", "tuple", "get-tuple-element", "bitcast")
    )
    if not kernels:
        raise ValueError("no kernel in the compiled kernel module")
    return kernels


@dataclasses.dataclass(frozen=True)
class KernelTiming:
    """A kernel's measured time: `time_us` is the smallest of the per-round medians (rounds are
    seconds apart, so a round slowed by other processes on the machine does not decide it);
    `round_us` are the per-round medians; `runs` the executions seen in all rounds."""

    time_us: float
    round_us: tuple[float, ...]
    runs: int

    @property
    def repeat_error(self) -> float:
        """|a - b| / min(a, b) for a, b the minima over the first and the second half of the rounds:
        how far two independent measurements of this kernel disagree (the label noise)."""
        half = len(self.round_us) // 2
        if half == 0:
            return 0.0
        a, b = min(self.round_us[:half]), min(self.round_us[half:])
        return abs(a - b) / max(min(a, b), 1e-9)


def _wall_us(kernel: CompiledKernel, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        jax.block_until_ready(kernel.compiled(*kernel.args))
    return (time.perf_counter() - start) * 1e6 / calls


def time_kernels(
    kernels: Sequence[CompiledKernel],
    *,
    rounds: int = 4,
    extra_rounds: int = 4,
    noisy: float = 0.1,
    target_us: float = 5_000.0,
    min_runs: int = 10,
    max_runs: int = 40,
) -> list[KernelTiming | None]:
    """Time compiled kernels: `rounds` rounds, each a profiler trace in which every kernel runs
    back to back (inputs stay warm, as inside a step) about `target_us` of wall time, between
    `min_runs` and `max_runs` executions. Kernels whose `repeat_error` then exceeds `noisy` get
    `extra_rounds` more. A kernel's time per execution is the union of its instruction's thunk
    events in the trace. None for a kernel the trace never showed."""
    runs = []
    for k in kernels:
        wall = _wall_us(k, 3)  # warm-up, and the wall time that sizes the runs
        runs.append(int(min(max_runs, max(min_runs, target_us / max(wall, 1.0)))))
    per_round: list[list[float]] = [[] for _ in kernels]
    total_runs = [0] * len(kernels)

    def measure(indices: list[int], count: int) -> None:
        for _ in range(count):
            times = _traced_times([kernels[i] for i in indices], [runs[i] for i in indices])
            for i, t in zip(indices, times):
                if t:
                    per_round[i].append(float(np.median(t)))
                    total_runs[i] += len(t)

    measure(list(range(len(kernels))), rounds)
    timings = [KernelTiming(min(r), tuple(r), n) if r else None for r, n in zip(per_round, total_runs)]
    again = [i for i, t in enumerate(timings) if t is not None and t.repeat_error > noisy]
    if again and extra_rounds:
        measure(again, extra_rounds)
    return [KernelTiming(min(r), tuple(r), n) if r else None for r, n in zip(per_round, total_runs)]


def _traced_times(kernels: Sequence[CompiledKernel], runs: Sequence[int], skip: int = 2) -> list[list[float]]:
    """Microseconds per execution of each kernel, from one profiler trace; each kernel's first
    `skip` executions warm it up again (caches, allocator) and are not counted."""
    with tempfile.TemporaryDirectory(prefix="disco-gnn-trace-") as trace_dir:
        with jax.profiler.trace(trace_dir):
            for k, n in zip(kernels, runs):
                for _ in range(n + skip):
                    jax.block_until_ready(k.compiled(*k.args))
        traces = [jax.profiler.ProfileData.from_file(str(p)) for p in sorted(Path(trace_dir).rglob("*.xplane.pb"))]
    executions: list[list[tuple[float, float]]] = []
    for k in kernels:
        events = [e for e in _device_timing.module_op_events(traces, k.module_name) if e.op in k.instructions]
        if events and all(e.run is not None for e in events):  # XLA:CPU: one run_id per execution
            by_run: dict[object, list[tuple[float, float]]] = {}
            for e in events:
                by_run.setdefault((e.device, e.run), []).append((e.start_ns, e.end_ns))
            executions.append([(min(s for s, _ in spans), _union_ns(spans) / 1e3) for spans in by_run.values()])
            continue
        # GPU kernel events carry no run_id: each is one launch, so the i-th launch of every
        # kernel of the module belongs to the i-th execution.
        by_op: dict[str, list[tuple[float, float]]] = {}
        for e in events:
            by_op.setdefault(e.op, []).append((e.start_ns, e.end_ns))
        launches = [sorted(spans) for spans in by_op.values()]
        count = min((len(s) for s in launches), default=0)
        executions.append([(launches[0][i][0], sum(s[i][1] - s[i][0] for s in launches) / 1e3) for i in range(count)])
    return [[us for _, us in sorted(e)[skip:]] for e in executions]


def _union_ns(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -np.inf
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total
