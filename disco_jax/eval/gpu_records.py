"""The records `scripts/gpu_programs.py` writes on a GPU, read on any machine (issue 47).

A record is one JSON line per compiled program: its module text (stored compressed as ``text_z``
since 2026-11-28), its wall time per call (median, p10, p90), its traced kernels, and where the
recorder traced one call per trace, every host and device event of those calls (``calls_z``).
`load` reads the files; the rest classifies rows and reads what a fit needs from them: the
module as the compiled-program model reads it (`program_of`), each kernel's traced device time
(`traced_kernel_us`), the host's time issuing each kernel (`host_events`). `eval.gpu_fit` fits
the model to them.
"""

from __future__ import annotations

import base64
import functools
import gzip
import json
import zlib
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path

from disco_jax import backends, cost

STEP_MODES = ("steps", "decoder")
STEP_PROGRAMS = ("default", "plan")
TRIVIAL_PROGRAMS = ("args_only", "args_outputs")


def unpack(packed: str):
    """A value `scripts/gpu_programs.py` stored as base64 of zlib-compressed JSON."""
    return json.loads(zlib.decompress(base64.b64decode(packed)))


def load(paths: Iterable[str | Path]) -> list[dict]:
    """The rows of recorded JSON-lines files (gzipped or not), each with its file's name under
    ``file`` and its module text under ``text`` (stored compressed as ``text_z`` since 2026-11-28)."""
    rows = []
    for p in map(str, paths):
        opener = gzip.open if p.endswith(".gz") else open
        with opener(p, "rt") as f:
            for line in f:
                if not line.strip():
                    continue
                row = {**json.loads(line), "file": Path(p).name}
                if "text_z" in row:
                    row["text"] = unpack(row.pop("text_z"))
                rows.append(row)
    return rows


def setting(row: Mapping) -> str:
    """XLA's command-buffer setting a row was recorded under: "on" (XLA's default) or "off"."""
    return "off" if row.get("command_buffers") == "off" else "on"


def family(row: Mapping) -> str:
    """The model a row belongs to, for leaving it out: the zoo model, or "decoder" for the
    decoders of `gpu_programs.py decoder` (one family, every size and dtype)."""
    return "decoder" if row.get("mode") == "decoder" else str(row.get("model"))


def config(row: Mapping) -> str:
    return "decoder" if row.get("mode") == "decoder" else str(row.get("config"))


def is_step(row: Mapping) -> bool:
    """A recorded training step (XLA's program or a plan) with its wall time and module text."""
    return (
        row.get("mode") in STEP_MODES
        and row.get("program") in STEP_PROGRAMS
        and "wall_median_us" in row
        and "text" in row
        and not row.get("error")
    )


def is_trivial(row: Mapping) -> bool:
    return row.get("program") in TRIVIAL_PROGRAMS and "wall_median_us" in row and "text" in row


@functools.lru_cache(maxsize=256)
def program_of(text: str) -> cost.CompiledProgram:
    """A recorded executable read for costing, once (its graph is most of the fitting's time)."""
    return cost.compiled_program(text, backends.GPU)


def host_kind(k) -> str:
    """The kind the host lane issues a kernel as (`cost.host.HostLane.issue`): a compute kernel's
    kind, "collective" for any collective."""
    return "collective" if k.is_collective else k.kind


def kernel_counts(program: cost.CompiledProgram) -> dict[str, int]:
    """Kernel runs per call by `host_kind` (a loop body's kernels once per iteration)."""
    counts: dict[str, int] = defaultdict(int)
    for k in program.kernels:
        counts[host_kind(k)] += k.repeat
    return dict(counts)


def traced_kernel_us(row: Mapping) -> dict[str, float]:
    """Per instruction, its kernels' device time per call: from the calls traced one per trace
    (the device's stream events of each instruction, summed per call, averaged over the calls)
    where recorded, else the recorder's summary (`_device_timing.kernel_times_from_trace`)."""
    if "calls_z" not in row:
        return dict(row.get("trace", {}).get("kernel_us", {}))
    return _timeline_kernel_us(row["calls_z"])


@functools.lru_cache(maxsize=64)
def _timeline_kernel_us(packed: str) -> dict[str, float]:
    calls = unpack(packed)
    total: dict[str, float] = defaultdict(float)
    for call in calls:
        names = call["names"]
        for plane, line, _, _, duration, op in call["events"]:
            if op and names[plane].startswith("/device:") and "Stream" in names[line]:
                total[op] += duration / 1e3
    return {op: t / len(calls) for op, t in total.items()}


def host_events(row: Mapping) -> dict[str, list[float]]:
    """Per `host_kind`, the host's traced time (us) issuing each kernel, from the calls recorded
    one per trace (the first call left out); empty for rows recorded without host events."""
    if "calls_z" not in row:
        return {}
    program = program_of(row["text"])
    kind = {k.name: host_kind(k) for k in program.kernels}
    out: dict[str, list[float]] = defaultdict(list)
    for call in unpack(row["calls_z"])[1:]:
        names = call["names"]
        for plane, _, name, _, duration, _ in call["events"]:
            label = names[name]
            if names[plane].startswith("/host:") and label in kind:
                out[kind[label]].append(duration / 1e3)
    return dict(out)


def is_host_bound(row: Mapping) -> bool:
    """A call whose time is the host's: a tiny step (0.03-0.5 ms of kernels in 0.3-6 ms calls),
    a trivial program (the step's buffers, at most one kernel), a lone tiny kernel
    (`gpu_programs.py launch`, chain of 1)."""
    if is_step(row):
        return config(row) == "tiny"
    if row.get("mode") == "launch":
        return row.get("length") == 1 and "wall_median_us" in row and "text" in row
    return is_trivial(row)


__all__ = [
    "config",
    "family",
    "host_events",
    "host_kind",
    "is_host_bound",
    "is_step",
    "is_trivial",
    "kernel_counts",
    "load",
    "program_of",
    "setting",
    "traced_kernel_us",
    "unpack",
]
