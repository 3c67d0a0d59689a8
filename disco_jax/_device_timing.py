"""Device timing, the profiler (DisCo section 4.2): what kernels and all-reduces cost on the real devices.

Two measurements feed the simulator:

- `measure_kernel_times` runs a compiled step under `jax.profiler.trace`, reads the XSpace
  (`*.xplane.pb`) back with `jax.profiler.ProfileData`, and returns the mean time of every HLO
  instruction of the step's module, keyed by instruction name (the names in `compiled.as_text()`).
- `measure_allreduce_cost` times float32 all-reduces of several sizes on a mesh, several times
  each, and fits DisCo's line T(bytes) = C * bytes + D robustly (`disco_jax.cost.AllReduceCostModel`,
  `fit_allreduce_samples`), with how far the fit moves over the repetitions.
- `disco_jax._profile_db` keeps what was measured (`Profile`, `ProfileDatabase`).

Data flow: compiled step -> trace -> {instruction name: us} -> (the caller turns names into kernel
signatures) -> Profile.kernel_times_us -> ProfileDatabase.save -> JSON on disk -> ProfileDatabase.load
-> estimator / simulator.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from disco_jax.cost.allreduce import AllReduceCostModel, fit_allreduce_samples

# 13 sizes, log-spaced by factors of 2 from 4 KiB to 16 MiB: the range gradient buckets live in.
DEFAULT_ALLREDUCE_SIZES: tuple[int, ...] = tuple(4096 << i for i in range(13))


# ----------------------------------------------------------------------------------------------
# All-reduce cost (the model and its fit live in disco_jax.cost.allreduce)


def measure_allreduce_cost(
    mesh: jax.sharding.Mesh,
    *,
    sizes_bytes: Sequence[int] = DEFAULT_ALLREDUCE_SIZES,
    repeats: int = 9,
    warmup: int = 2,
    chain: int = 4,
    rounds: int = 3,
    tensors: int = 8,
) -> tuple[AllReduceCostModel, list[tuple[int, float]]]:
    """Time float32 all-reduces (psum over every axis of `mesh`) and fit `AllReduceCostModel`.

    For each size, two programs are compiled: one that all-reduces a per-device buffer of that size
    `chain` times in a row (up to 8 times more below 1 MiB, `_links`), and a baseline that is the
    same program without the all-reduces. Both are timed by wall clock (block_until_ready) in
    interleaved pairs after `warmup` calls, and each pair gives one sample (chained - baseline) /
    all-reduces. Why not the profiler trace: on CPU,
    tracing slows large collectives 2-4x; and why the baseline: it cancels the dispatch and
    output handling that a single jitted psum would put into the latency D. The `repeats` pairs
    of a size are taken in `rounds` passes over all sizes (so a burst of load on a shared machine
    hits a few samples of every size, not every sample of one), and the fit is to each size's
    median sample (`fit_allreduce_samples`: robust line, with its spread in the model's JSON).

    With `tensors` > 1, one more pair of programs all-reduces `tensors` buffers of the smallest
    size in one variadic all-reduce: what it costs beyond the line for their total bytes, per
    tensor after the first, is the model's `per_tensor_us` (XLA:CPU all-reduces the operands of
    a variadic all-reduce one at a time, so combining saves it no latency).

    Sizes are rounded down to whole float32 elements per device. Returns the fit and the
    (bytes per device, median microseconds) point of each size. Every process of a multi-process
    mesh must call this with the same arguments (the programs are collectives); each gets its own
    (similar) fit.
    """
    if repeats < 1 or chain < 1 or rounds < 1 or tensors < 1:
        raise ValueError(
            f"repeats, chain, rounds and tensors must be >= 1, got {repeats}, {chain}, {rounds}, {tensors}"
        )
    programs = []
    smallest = max(1, int(min(sizes_bytes)) // 4)
    shapes = [(max(1, int(b) // 4), 1) for b in sizes_bytes] + ([(smallest, tensors)] if tensors > 1 else [])
    for elements, count in shapes:
        chained = _AllReduceChain(mesh, elements, links=_links(chain, 4 * elements), tensors=count)
        baseline = _AllReduceChain(mesh, elements, links=0, tensors=count)
        for _ in range(warmup):
            baseline.call_us()
            chained.call_us()
        programs.append(((4 * elements, count), chained, baseline))
    samples = _chain_samples(programs, repeats, rounds)
    model = fit_allreduce_samples({b: v for (b, count), v in samples.items() if count == 1})
    if tensors > 1:
        variadic = samples[(4 * smallest, tensors)]
        extra = statistics.median(variadic) - model.time_us(4 * smallest * tensors)
        spread = {**model.spread, "variadic": {"tensors": tensors, "bytes_each": 4 * smallest, "samples_us": variadic}}
        model = dataclasses.replace(model, per_tensor_us=max(0.0, extra / (tensors - 1)), spread=spread)
    points = [(b, max(0.0, statistics.median(v))) for (b, count), v in sorted(samples.items()) if count == 1]
    return model, points


def measure_scatter_gather_cost(
    mesh: jax.sharding.Mesh,
    *,
    sizes_bytes: Sequence[int] = DEFAULT_ALLREDUCE_SIZES[::2],
    repeats: int = 6,
    warmup: int = 2,
    chain: int = 2,
    rounds: int = 3,
) -> tuple[tuple[float, float], list[tuple[int, float]]]:
    """The line (per_byte_us, latency_us) of one reduce-scatter or all-gather of a float32 tensor
    of each size (bytes: the whole tensor, the reduce-scatter's input and the all-gather's
    output), for `AllReduceCostModel.scatter_gather`: measured as `measure_allreduce_cost`
    measures all-reduces, on chains of reduce-scatter + all-gather pairs (each pair's time split
    evenly: a ring sends the same bytes in both), and the (bytes, median us) of each size.
    Sizes are rounded down to whole float32 elements a multiple of the device count."""
    if repeats < 1 or chain < 1 or rounds < 1:
        raise ValueError(f"repeats, chain and rounds must be >= 1, got {repeats}, {chain}, {rounds}")
    programs = []
    for b in sizes_bytes:
        elements = max(1, int(b) // 4 // mesh.size) * mesh.size
        links = _links(chain, 4 * elements)
        chained = _AllReduceChain(mesh, elements, links=links, collective="scatter-gather")
        baseline = _AllReduceChain(mesh, elements, links=0, collective="scatter-gather")
        for _ in range(warmup):
            baseline.call_us()
            chained.call_us()
        programs.append(((4 * elements, 1), chained, baseline))
    samples = _chain_samples(programs, repeats, rounds)
    model = fit_allreduce_samples({b: [t / 2 for t in v] for (b, _), v in samples.items()})
    points = [(b, max(0.0, statistics.median(v) / 2)) for (b, _), v in sorted(samples.items())]
    return (model.per_byte_us, model.latency_us), points


def _chain_samples(programs: list, repeats: int, rounds: int) -> dict[tuple[int, int], list[float]]:
    """Per program key, `repeats` samples of (chained - baseline) / links: interleaved pairs,
    alternating which goes first, in `rounds` passes over all programs."""
    samples: dict[tuple[int, int], list[float]] = {key: [] for key, _, _ in programs}
    per_round = [repeats // rounds + (1 if r < repeats % rounds else 0) for r in range(rounds)]
    for n in per_round:
        for key, chained, baseline in programs:
            for i in range(n):
                if i % 2:
                    c, b = chained.call_us(), baseline.call_us()
                else:
                    b, c = baseline.call_us(), chained.call_us()
                samples[key].append((c - b) / chained.links)
    return samples


def _links(chain: int, nbytes: int) -> int:
    """All-reduces per call for a size: `chain`, times up to 8 for sizes below 1 MiB, so that a
    small all-reduce's time stands out of the call's own jitter (over gloo, about a millisecond)."""
    return chain * max(1, min(8, (1 << 20) // max(1, nbytes)))


class _AllReduceChain:
    """A compiled program: `links` dependent psums of `tensors` float32[elements] buffers on every
    device (XLA combines the psums of one link into one variadic all-reduce); with
    `collective="scatter-gather"`, a reduce-scatter then an all-gather per link.

    Each link is psum, then overwrite element 0 with a device-varying value. The overwrite keeps
    XLA from proving the next psum's input replicated (it would turn that psum into a multiply)
    and costs O(1). The buffers are donated and fed back, so calls reuse memory as a step would.
    """

    def __init__(self, mesh: jax.sharding.Mesh, elements: int, links: int, tensors: int = 1, collective="all-reduce"):
        axes = tuple(mesh.axis_names)
        spec = PartitionSpec(axes)
        self.links = links

        def reduce(x):
            if collective == "all-reduce":
                return lax.psum(x, axes)
            return lax.all_gather(lax.psum_scatter(x, axes, tiled=True), axes, tiled=True)

        def allreduce_chain(xs):
            seed = jnp.minimum(xs[0][:1], 0.0)
            for _ in range(links):
                xs = tuple(reduce(x) for x in xs)
                xs = tuple(lax.dynamic_update_slice(x, seed, (0,)) for x in xs)
            return xs

        allreduce_chain.__name__ = f"disco_{collective.replace('-', '')}_chain_{links}x{tensors}x{4 * elements}b"
        program = jax.shard_map(allreduce_chain, mesh=mesh, in_specs=spec, out_specs=spec)
        sharding = NamedSharding(mesh, spec)
        self.buffer = tuple(
            jax.make_array_from_callback(
                (mesh.size * elements,), sharding, lambda index: np.zeros((elements,), np.float32)
            )
            for _ in range(tensors)
        )
        self.compiled = jax.jit(program, donate_argnums=0).lower(self.buffer).compile()

    def call_us(self) -> float:
        start = time.perf_counter()
        self.buffer = self.compiled(self.buffer)
        jax.block_until_ready(self.buffer)
        return (time.perf_counter() - start) * 1e6


# ----------------------------------------------------------------------------------------------
# Kernel times from a profiler trace


def measure_kernel_times(
    compiled: jax.stages.Compiled,
    args: tuple,
    *,
    steps: int = 5,
    warmup: int = 2,
    module_name: str | None = None,
) -> dict[str, float]:
    """Mean time per step of each HLO instruction of a compiled executable, in microseconds.

    Runs `compiled(*args)` `warmup` times untraced, then `steps` times under `jax.profiler.trace`
    into a temporary directory (blocking after each call so steps do not overlap), parses the
    XSpace and returns {instruction name: mean microseconds per step} for the instructions of the
    HLO module `module_name` (default: the compiled module's own name, from the `HloModule NAME`
    line of `compiled.as_text()`). Averages over devices and steps; an instruction run several
    times per step (a while body) is summed within the step. Only instructions that appeared in
    the trace are returned.

    What the numbers mean: an event spans an instruction's thunk on one device. A collective's
    time includes waiting for the other devices to arrive (and on CPU the profiler itself slows
    large collectives), so use `measure_allreduce_cost` for communication; a control-flow
    instruction (while, conditional, call) covers its body, whose instructions are also reported.
    `args` must not be donated to `compiled` (it is called several times with them), and no other
    profiler trace may be active.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if module_name is None:
        module_name = hlo_module_name(compiled.as_text())
    for _ in range(warmup):
        jax.block_until_ready(compiled(*args))
    with tempfile.TemporaryDirectory(prefix="disco-jax-trace-") as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(steps):
                jax.block_until_ready(compiled(*args))
        traces = [jax.profiler.ProfileData.from_file(str(p)) for p in sorted(Path(trace_dir).rglob("*.xplane.pb"))]
    if not traces:
        raise RuntimeError(f"jax.profiler.trace wrote no *.xplane.pb under {trace_dir}")
    return kernel_times_from_trace(traces, module_name, steps=steps)


def hlo_module_name(hlo_text: str) -> str:
    """NAME from the first line `HloModule NAME, ...` of an HLO module's text."""
    match = re.match(r"\s*HloModule\s+([^\s,]+)", hlo_text)
    if match is None:
        raise ValueError("HLO text does not start with 'HloModule NAME'")
    return match.group(1)


@dataclasses.dataclass(frozen=True)
class OpEvent:
    """One traced event of an HLO instruction (`module_op_events`)."""

    device: Any  # device_ordinal stat, or the device plane's name where there is none (GPU)
    run: int | None  # run_id stat: one execution of the module; None where the trace has none
    op: str
    start_ns: float
    end_ns: float


def kernel_times_from_trace(traces: Iterable[Any], module_name: str, *, steps: int) -> dict[str, float]:
    """{hlo instruction name: mean microseconds per step} for `module_name` in parsed traces.

    `traces` are `jax.profiler.ProfileData` (one per *.xplane.pb). The events used are those with
    stats `hlo_module == module_name` and `hlo_op`; device planes (`/device:...`, GPU) are preferred
    over host planes when they have any, since a host event there would be a launch, not the kernel.
    Events of one instruction on one device in one run are merged as time intervals, so an event
    nested in another of the same instruction (thread-pool work, or a kernel under its op on
    another line) is counted once. Each instruction's total is divided by the number of
    (device, run) executions seen (those that ran at least half as many of the module's ops as
    the largest did); where events carry no run_id, by devices seen times `steps`.
    """
    events = module_op_events(traces, module_name)
    if not events:
        return {}
    busy_ns: dict[tuple[Any, int | None, str], float] = {}
    intervals: dict[tuple[Any, int | None, str], list[tuple[float, float]]] = {}
    for e in events:
        intervals.setdefault((e.device, e.run, e.op), []).append((e.start_ns, e.end_ns))
    for key, spans in intervals.items():
        busy_ns[key] = _union_length(spans)
    if all(e.run is not None for e in events):
        # An execution is a (device, run) that ran a good part of the module's ops: on a GPU a
        # few events (memsets) can carry a run id of their own, and counting it as one more
        # execution of every op made the H200 records' per-kernel times of steps with memsets
        # 25% short (data/gpu/2026-11-28: the paper MLP 9.6 against 13.5 ms a call).
        ops_of_run: dict[tuple[Any, int | None], set[str]] = {}
        for e in events:
            ops_of_run.setdefault((e.device, e.run), set()).add(e.op)
        most = max(len(ops) for ops in ops_of_run.values())
        executions = sum(1 for ops in ops_of_run.values() if len(ops) >= most / 2)
    else:
        executions = len({e.device for e in events}) * steps
    totals: dict[str, float] = {}
    for (_, _, op), ns in busy_ns.items():
        totals[op] = totals.get(op, 0.0) + ns
    return {op: ns / 1e3 / executions for op, ns in sorted(totals.items())}


def module_op_events(traces: Iterable[Any], module_name: str) -> list[OpEvent]:
    """The events of `module_name`'s instructions in parsed traces: those on device planes
    (`/device:...`, GPU kernels) where there are any, else the host's (XLA:CPU thunks)."""
    device_events: list[OpEvent] = []
    host_events: list[OpEvent] = []
    for trace in traces:
        for plane in trace.planes:
            on_device = plane.name.startswith("/device:")
            for line in plane.lines:
                for event in line.events:
                    stats = dict(event.stats)
                    if stats.get("hlo_module") != module_name or "hlo_op" not in stats:
                        continue
                    device = stats.get("device_ordinal", plane.name)
                    run = stats.get("run_id")
                    start = float(event.start_ns)
                    found = OpEvent(
                        device,
                        None if run is None else int(run),
                        str(stats["hlo_op"]),
                        start,
                        start + float(event.duration_ns),
                    )
                    (device_events if on_device else host_events).append(found)
    return device_events or host_events


def _union_length(spans: list[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping [start, end) intervals."""
    total = 0.0
    current_start, current_end = None, None
    for start, end in sorted(spans):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total
