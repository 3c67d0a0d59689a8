"""Profiler (DisCo section 4.2): what kernels and all-reduces cost on the real devices.

Two measurements feed the simulator, and one store keeps them:

- `measure_kernel_times` runs a compiled step under `jax.profiler.trace`, reads the XSpace
  (`*.xplane.pb`) back with `jax.profiler.ProfileData`, and returns the mean time of every HLO
  instruction of the step's module, keyed by instruction name (the names in `compiled.as_text()`).
- `measure_allreduce_cost` times float32 all-reduces of several sizes on a mesh and fits DisCo's
  line T(bytes) = C * bytes + D (`AllReduceCostModel`).
- `Profile` is everything measured for one device kind and device count; `ProfileDatabase` keeps
  profiles as JSON files: shipped ones in the package data `disco_jax/profiles/<device kind>/profile.json`, and the
  user's own in a cache directory that takes precedence.

Data flow: compiled step -> trace -> {instruction name: us} -> (the caller turns names into kernel
signatures) -> Profile.kernel_times_us -> ProfileDatabase.save -> JSON on disk -> ProfileDatabase.load
-> estimator / simulator.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.resources
import json
import math
import os
import re
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from disco_jax._files import write_json_atomic

FORMAT_VERSION = 1
"""Version of both JSON formats written here (`Profile.to_json` and the database files)."""

# Shipped profiles and estimator weights are package data (`disco_jax/profiles/<device kind>/`), so a
# wheel carries them; importlib.resources finds them wherever the package is installed.
SHIPPED_PROFILE_DIR = Path(str(importlib.resources.files("disco_jax") / "profiles"))
DEFAULT_USER_PROFILE_DIR = Path("~/.cache/disco-jax/profiles")
PROFILE_DIR_ENV = "DISCO_JAX_PROFILE_DIR"
PROFILE_FILE_NAME = "profile.json"

# 8 sizes, log-spaced from 4 KiB to 16 MiB (rounded to KiB): the range gradient buckets live in.
DEFAULT_ALLREDUCE_SIZES: tuple[int, ...] = (4096, 13312, 44032, 144384, 475136, 1558528, 5112832, 16777216)


class ProfileFileWarning(UserWarning):
    """A profile file on disk could not be used (corrupt JSON, wrong format version)."""


# ----------------------------------------------------------------------------------------------
# All-reduce cost model


@dataclasses.dataclass(frozen=True)
class AllReduceCostModel:
    """T(bytes) = per_byte_us * bytes + latency_us (DisCo's T = C*x + D), in microseconds.

    `bytes` is the size of the all-reduced tensor on one device (the bytes of the all-reduce's
    HLO shape), not the total over devices.
    """

    per_byte_us: float
    latency_us: float

    def time_us(self, nbytes: int | float) -> float:
        return self.per_byte_us * float(nbytes) + self.latency_us

    def to_json(self) -> dict[str, float]:
        return {"per_byte_us": float(self.per_byte_us), "latency_us": float(self.latency_us)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> AllReduceCostModel:
        return cls(per_byte_us=float(d["per_byte_us"]), latency_us=float(d["latency_us"]))


def fit_allreduce_cost(points: Sequence[tuple[int, float]]) -> AllReduceCostModel:
    """Least-squares line through (bytes, microseconds) points, both coefficients >= 0.

    Residuals are relative (each point weighted by 1/time): sizes span four orders of magnitude,
    and an unweighted fit lets the largest size decide everything and leaves the latency D, which
    is what makes tensor fusion pay off, as noise. A negative coefficient is clipped to zero and
    the other one refitted alone.
    """
    if not points:
        raise ValueError("fit_allreduce_cost needs at least one (bytes, us) point")
    x = np.array([float(b) for b, _ in points])
    t = np.array([float(us) for _, us in points])
    w = 1.0 / np.maximum(t, max(float(t.max()) * 1e-6, 1e-9))
    if len(set(x.tolist())) < 2:
        return AllReduceCostModel(per_byte_us=0.0, latency_us=max(0.0, float(np.average(t, weights=w**2))))
    design = np.stack([x, np.ones_like(x)], axis=1) * w[:, None]
    (per_byte, latency), *_ = np.linalg.lstsq(design, t * w, rcond=None)
    if per_byte < 0:
        per_byte, latency = 0.0, float(np.average(t, weights=w**2))
    if latency < 0:
        latency = 0.0
        per_byte = float(np.sum(w**2 * x * t) / np.sum(w**2 * x * x))
    return AllReduceCostModel(per_byte_us=max(0.0, float(per_byte)), latency_us=max(0.0, float(latency)))


def measure_allreduce_cost(
    mesh: jax.sharding.Mesh,
    *,
    sizes_bytes: Sequence[int] = DEFAULT_ALLREDUCE_SIZES,
    repeats: int = 5,
    warmup: int = 2,
    chain: int = 4,
) -> tuple[AllReduceCostModel, list[tuple[int, float]]]:
    """Time float32 all-reduces (psum over every axis of `mesh`) and fit `AllReduceCostModel`.

    For each size, two programs are compiled: one that all-reduces a per-device buffer of that size
    `chain` times in a row, and a baseline that is the same program without the all-reduces. Both
    are timed by wall clock (block_until_ready), interleaved, `repeats` times after `warmup` calls;
    the all-reduce time is (median(chained) - median(baseline)) / chain. Why not the profiler
    trace: on CPU, tracing slows large collectives 2-4x; and why the baseline: it cancels the
    dispatch and output handling that a single jitted psum would put into the latency D.

    Sizes are rounded down to whole float32 elements per device. Returns the fit and the raw
    (bytes per device, microseconds) points. Every process of a multi-process mesh must call this
    with the same arguments (the programs are collectives); each gets its own (similar) fit.
    """
    if repeats < 1 or chain < 1:
        raise ValueError(f"repeats and chain must be >= 1, got repeats={repeats}, chain={chain}")
    points: list[tuple[int, float]] = []
    for nbytes in sizes_bytes:
        elements = max(1, int(nbytes) // 4)
        chained = _AllReduceChain(mesh, elements, links=chain)
        baseline = _AllReduceChain(mesh, elements, links=0)
        for _ in range(warmup):
            baseline.call_us()
            chained.call_us()
        baseline_us, chained_us = [], []
        for _ in range(repeats):  # interleaved, so drift in machine load hits both alike
            baseline_us.append(baseline.call_us())
            chained_us.append(chained.call_us())
        per_allreduce = (statistics.median(chained_us) - statistics.median(baseline_us)) / chain
        points.append((4 * elements, max(0.0, per_allreduce)))
    return fit_allreduce_cost(points), points


class _AllReduceChain:
    """A compiled program: `links` dependent psums of a float32[elements] buffer on every device.

    Each link is psum, then overwrite element 0 with a device-varying value. The overwrite keeps
    XLA from proving the next psum's input replicated (it would turn that psum into a multiply)
    and costs O(1). The buffer is donated and fed back, so calls reuse memory as a step would.
    """

    def __init__(self, mesh: jax.sharding.Mesh, elements: int, links: int):
        axes = tuple(mesh.axis_names)
        spec = PartitionSpec(axes)

        def allreduce_chain(x):
            seed = jnp.minimum(x[:1], 0.0)
            for _ in range(links):
                x = lax.psum(x, axes)
                x = lax.dynamic_update_slice(x, seed, (0,))
            return x

        allreduce_chain.__name__ = f"disco_allreduce_chain_{links}x{4 * elements}b"
        program = jax.shard_map(allreduce_chain, mesh=mesh, in_specs=spec, out_specs=spec)
        sharding = NamedSharding(mesh, spec)
        self.buffer = jax.make_array_from_callback(
            (mesh.size * elements,), sharding, lambda index: np.zeros((elements,), np.float32))
        self.compiled = jax.jit(program, donate_argnums=0).lower(self.buffer).compile()

    def call_us(self) -> float:
        start = time.perf_counter()
        self.buffer = self.compiled(self.buffer)
        self.buffer.block_until_ready()
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
class _OpEvent:
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
    (device, run) executions seen; where events carry no run_id, by devices seen times `steps`.
    """
    events = _module_op_events(traces, module_name)
    if not events:
        return {}
    busy_ns: dict[tuple[Any, int | None, str], float] = {}
    intervals: dict[tuple[Any, int | None, str], list[tuple[float, float]]] = {}
    for e in events:
        intervals.setdefault((e.device, e.run, e.op), []).append((e.start_ns, e.end_ns))
    for key, spans in intervals.items():
        busy_ns[key] = _union_length(spans)
    if all(e.run is not None for e in events):
        executions = len({(e.device, e.run) for e in events})
    else:
        executions = len({e.device for e in events}) * steps
    totals: dict[str, float] = {}
    for (_, _, op), ns in busy_ns.items():
        totals[op] = totals.get(op, 0.0) + ns
    return {op: ns / 1e3 / executions for op, ns in sorted(totals.items())}


def _module_op_events(traces: Iterable[Any], module_name: str) -> list[_OpEvent]:
    device_events: list[_OpEvent] = []
    host_events: list[_OpEvent] = []
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
                    found = _OpEvent(device, None if run is None else int(run), str(stats["hlo_op"]),
                                     start, start + float(event.duration_ns))
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


# ----------------------------------------------------------------------------------------------
# Profiles and their store


def sanitize_device_kind(device_kind: str) -> str:
    """A device kind as a directory name: lower case, runs of other characters become '-'.

    'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3', 'cpu' -> 'cpu'. Idempotent.
    """
    key = re.sub(r"[^a-z0-9]+", "-", device_kind.lower()).strip("-")
    if not key:
        raise ValueError(f"device kind {device_kind!r} has no letters or digits")
    return key


def device_kind_key(device: jax.Device) -> str:
    """Sanitized `device.device_kind`, the directory name of its profiles."""
    return sanitize_device_kind(device.device_kind)


def _utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


@dataclasses.dataclass
class Profile:
    """Everything measured on one machine for one device kind and device count.

    `kernel_times_us` maps kernel signatures (opaque strings chosen by the caller; they identify a
    kernel by what it computes, not by its name in one module) to microseconds. `allreduce` is the
    fitted line for `num_devices` devices, `allreduce_points` the (bytes, us) points behind it.
    """

    device_kind: str
    backend: str
    num_devices: int
    allreduce: AllReduceCostModel | None = None
    allreduce_points: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    kernel_times_us: dict[str, float] = dataclasses.field(default_factory=dict)
    jax_version: str = jax.__version__
    created: str = dataclasses.field(default_factory=_utc_now)

    @property
    def device_kind_key(self) -> str:
        return sanitize_device_kind(self.device_kind)

    @classmethod
    def for_devices(cls, devices: Sequence[jax.Device] | None = None, **fields: Any) -> Profile:
        """An empty profile keyed to `devices` (default: all of `jax.devices()`)."""
        devices = list(jax.devices() if devices is None else devices)
        return cls(device_kind=devices[0].device_kind, backend=devices[0].platform,
                   num_devices=len(devices), **fields)

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "device_kind": self.device_kind,
            "backend": self.backend,
            "num_devices": int(self.num_devices),
            "allreduce": None if self.allreduce is None else self.allreduce.to_json(),
            "allreduce_points": [[int(b), float(us)] for b, us in self.allreduce_points],
            "kernel_times_us": {str(k): float(v) for k, v in sorted(self.kernel_times_us.items())},
            "jax_version": self.jax_version,
            "created": self.created,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Profile:
        _check_format_version(d, "profile")
        return cls(
            device_kind=str(d["device_kind"]),
            backend=str(d["backend"]),
            num_devices=int(d["num_devices"]),
            allreduce=None if d.get("allreduce") is None else AllReduceCostModel.from_json(d["allreduce"]),
            allreduce_points=[(int(b), float(us)) for b, us in d.get("allreduce_points", [])],
            kernel_times_us={str(k): float(v) for k, v in d.get("kernel_times_us", {}).items()},
            jax_version=str(d.get("jax_version", "")),
            created=str(d.get("created", "")),
        )


def _check_format_version(d: Any, what: str) -> None:
    version = d.get("format_version") if isinstance(d, Mapping) else None
    if version != FORMAT_VERSION:
        raise ValueError(f"{what} has format_version {version!r}; this disco-jax reads version "
                         f"{FORMAT_VERSION} only (re-run profiling to regenerate it)")


class ProfileDatabase:
    """Profiles as JSON files, one per device kind: `<root>/<device kind key>/profile.json`.

    Two roots: the shipped, read-only `profiles/` package data (`SHIPPED_PROFILE_DIR`), and the user cache
    (`user_dir`, else env `DISCO_JAX_PROFILE_DIR`, else `~/.cache/disco-jax/profiles`), where
    `save` writes. A file holds the kernel times of its device kind (they do not depend on how
    many devices run) and one all-reduce fit per device count (they do):

        {"format_version": 1, "device_kind": "cpu", "backend": "cpu" | null,
         "kernel_times_us": {signature: us},
         "allreduce": {"8": {"per_byte_us": C, "latency_us": D, "points": [[bytes, us], ...],
                             "jax_version": ..., "created": ...}},
         "jax_version": ..., "updated": ...}

    `load` layers the user file over the shipped one entry by entry: a kernel time or an
    all-reduce fit from the user cache wins over the shipped one. A file that is not valid JSON
    of this format gives a `ProfileFileWarning` and is treated as absent; `save` moves such a file
    aside (`profile.json.corrupt`) before writing. Writes are atomic (temp file + os.replace) but
    not locked: let one process (process 0) write, as with JAX's compilation cache.
    """

    def __init__(self, user_dir: str | os.PathLike | None = None, shipped_dir: str | os.PathLike | None = None):
        if user_dir is None:
            user_dir = os.environ.get(PROFILE_DIR_ENV) or DEFAULT_USER_PROFILE_DIR
        self.user_dir = Path(user_dir).expanduser()
        self.shipped_dir = Path(shipped_dir).expanduser() if shipped_dir is not None else SHIPPED_PROFILE_DIR

    def user_path(self, device_kind: str) -> Path:
        return self.user_dir / sanitize_device_kind(device_kind) / PROFILE_FILE_NAME

    def shipped_path(self, device_kind: str) -> Path:
        return self.shipped_dir / sanitize_device_kind(device_kind) / PROFILE_FILE_NAME

    def load(self, device_kind: str, backend: str, num_devices: int) -> Profile | None:
        """The profile of `device_kind` (raw or sanitized) for `num_devices` devices, or None.

        Kernel times are the shipped ones updated by the user's; the all-reduce fit is the user's
        for this device count if any, else the shipped one, else None. A file recorded for another
        backend is skipped with a warning.
        """
        layers = []
        for path in (self.shipped_path(device_kind), self.user_path(device_kind)):
            data = _read_profile_file(path)
            if data is None:
                continue
            if data.get("backend") not in (None, backend):
                warnings.warn(f"ignoring profile file {path}: recorded for backend {data['backend']!r}, "
                              f"not {backend!r}", ProfileFileWarning, stacklevel=2)
                continue
            layers.append(data)
        if not layers:
            return None
        kernel_times: dict[str, float] = {}
        allreduce_entry = None
        for data in layers:  # shipped first, so the user's entries overwrite
            kernel_times.update(data["kernel_times_us"])
            allreduce_entry = data["allreduce"].get(str(int(num_devices)), allreduce_entry)
        newest = layers[-1]
        return Profile(
            device_kind=newest["device_kind"],
            backend=backend,
            num_devices=int(num_devices),
            allreduce=None if allreduce_entry is None else AllReduceCostModel.from_json(allreduce_entry),
            allreduce_points=[] if allreduce_entry is None else [(int(b), float(t)) for b, t in allreduce_entry["points"]],
            kernel_times_us=kernel_times,
            jax_version=newest.get("jax_version", ""),
            created=newest.get("updated", ""),
        )

    def save(self, profile: Profile) -> Path:
        """Merge `profile` into its device kind's user-cache file and write it atomically.

        Its kernel times are added (replacing equal signatures); its all-reduce fit, if any,
        replaces the one stored for its device count. Returns the file's path.
        """
        data = self._user_file_for_update(profile.device_kind)
        data["backend"] = profile.backend
        data["kernel_times_us"].update(_finite_times(profile.kernel_times_us))
        if profile.allreduce is not None:
            data["allreduce"][str(int(profile.num_devices))] = {
                **profile.allreduce.to_json(),
                "points": [[int(b), float(us)] for b, us in profile.allreduce_points],
                "jax_version": profile.jax_version,
                "created": profile.created,
            }
        return self._write(profile.device_kind, data)

    def merge_kernel_times(self, device_kind: str, times: Mapping[str, float], *, backend: str | None = None) -> Path:
        """Add or update kernel times (signature -> us) of `device_kind` in the user cache."""
        data = self._user_file_for_update(device_kind)
        if backend is not None:
            data["backend"] = backend
        data["kernel_times_us"].update(_finite_times(times))
        return self._write(device_kind, data)

    def _user_file_for_update(self, device_kind: str) -> dict[str, Any]:
        path = self.user_path(device_kind)
        try:
            data = _parse_profile_file(path)
        except _UnreadableProfileFile as err:
            aside = path.with_name(path.name + ".corrupt")
            os.replace(path, aside)
            warnings.warn(f"moved unreadable profile file {path} to {aside} ({err}); writing a new one",
                          ProfileFileWarning, stacklevel=4)
            data = None
        if data is None:
            data = {"format_version": FORMAT_VERSION, "device_kind": device_kind, "backend": None,
                    "kernel_times_us": {}, "allreduce": {}}
        return data

    def _write(self, device_kind: str, data: dict[str, Any]) -> Path:
        data["jax_version"] = jax.__version__
        data["updated"] = _utc_now()
        path = self.user_path(device_kind)
        write_json_atomic(path, data)
        return path


def _finite_times(times: Mapping[str, float]) -> dict[str, float]:
    out = {}
    for signature, us in times.items():
        us = float(us)
        if not math.isfinite(us) or us < 0:
            raise ValueError(f"kernel time for {signature!r} must be finite and >= 0, got {us}")
        out[str(signature)] = us
    return out


def _read_profile_file(path: Path) -> dict[str, Any] | None:
    """A database file's contents, or None if absent or unusable (with a warning)."""
    try:
        return _parse_profile_file(path)
    except _UnreadableProfileFile as err:
        warnings.warn(f"ignoring unreadable profile file {path}: {err}", ProfileFileWarning, stacklevel=3)
        return None


class _UnreadableProfileFile(Exception):
    pass


def _parse_profile_file(path: Path) -> dict[str, Any] | None:
    """A database file's validated contents; None if absent; `_UnreadableProfileFile` if unusable."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        _check_format_version(data, "file")
        if not isinstance(data.get("kernel_times_us"), dict) or not isinstance(data.get("allreduce"), dict):
            raise ValueError("missing 'kernel_times_us' or 'allreduce' mapping")
        data["kernel_times_us"] = {str(k): float(v) for k, v in data["kernel_times_us"].items()}
        for entry in data["allreduce"].values():
            AllReduceCostModel.from_json(entry)
            [(int(b), float(t)) for b, t in entry["points"]]
        data.setdefault("device_kind", path.parent.name)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        raise _UnreadableProfileFile(str(err)) from err
    return data
