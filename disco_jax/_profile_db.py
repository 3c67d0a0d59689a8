"""The profile store: what was measured for one device kind, kept as JSON.

`Profile` is everything measured for one device kind and device count (kernel times by kernel
signature, the all-reduce fit and its points; the fit also by the number of processes the devices
belong to, since collectives between processes go over another transport (gloo, NCCL over the
network) than those within one); `ProfileDatabase` keeps profiles as JSON files:
shipped ones in the package data `disco_jax/profiles/<device kind>/profile.json`, and the user's own
in a cache directory (`$DISCO_JAX_PROFILE_DIR` or `~/.cache/disco-jax/profiles`) that takes
precedence. `disco_jax._device_timing` measures; this module only stores and loads.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.resources
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

from disco_jax import _warnings
from disco_jax._files import write_json_atomic
from disco_jax.cost.allreduce import AllReduceCostModel

FORMAT_VERSION = 1
"""Version of both JSON formats written here (`Profile.to_json` and the database files)."""

# Shipped profiles and estimator weights are package data (`disco_jax/profiles/<device kind>/`), so a
# wheel carries them; importlib.resources finds them wherever the package is installed.
SHIPPED_PROFILE_DIR = Path(str(importlib.resources.files("disco_jax") / "profiles"))
DEFAULT_USER_PROFILE_DIR = Path("~/.cache/disco-jax/profiles")
PROFILE_DIR_ENV = "DISCO_JAX_PROFILE_DIR"
PROFILE_FILE_NAME = "profile.json"


class ProfileFileWarning(UserWarning):
    """A profile file on disk could not be used (corrupt JSON, wrong format version)."""


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
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


@dataclasses.dataclass
class Profile:
    """Everything measured on one machine for one device kind and device count.

    `kernel_times_us` maps kernel signatures (opaque strings chosen by the caller; they identify a
    kernel by what it computes, not by its name in one module) to microseconds. `allreduce` is the
    fitted line for `num_devices` devices held by `num_processes` processes (a multi-process job's
    collectives cross processes), `allreduce_points` the (bytes, us) points behind it.
    """

    device_kind: str
    backend: str
    num_devices: int
    num_processes: int = 1
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
        """An empty profile keyed to `devices` (default: all of `jax.devices()`) and the number of
        processes they belong to."""
        devices = list(jax.devices() if devices is None else devices)
        return cls(
            device_kind=devices[0].device_kind,
            backend=devices[0].platform,
            num_devices=len(devices),
            num_processes=process_count(devices),
            **fields,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "device_kind": self.device_kind,
            "backend": self.backend,
            "num_devices": int(self.num_devices),
            "num_processes": int(self.num_processes),
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
            num_processes=int(d.get("num_processes", 1)),  # written before multi-process fits were kept
            allreduce=None if d.get("allreduce") is None else AllReduceCostModel.from_json(d["allreduce"]),
            allreduce_points=[(int(b), float(us)) for b, us in d.get("allreduce_points", [])],
            kernel_times_us={str(k): float(v) for k, v in d.get("kernel_times_us", {}).items()},
            jax_version=str(d.get("jax_version", "")),
            created=str(d.get("created", "")),
        )


def process_count(devices: Sequence[jax.Device]) -> int:
    """How many processes hold `devices`."""
    return len({d.process_index for d in devices})


def allreduce_key(num_devices: int, num_processes: int = 1) -> str:
    """The key of an all-reduce fit in a database file: the device count ('8') for devices of one
    process, as files have always been keyed, and '4 in 2 processes' for devices spread over
    several (another transport: a fit is reused only where it was measured). A disco-jax that
    knows only the first kind of key reads such a file and ignores those entries."""
    if num_processes <= 1:
        return str(int(num_devices))
    return f"{int(num_devices)} in {int(num_processes)} processes"


def _check_format_version(d: Any, what: str) -> None:
    version = d.get("format_version") if isinstance(d, Mapping) else None
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{what} has format_version {version!r}; this disco-jax reads version "
            f"{FORMAT_VERSION} only (re-run profiling to regenerate it)"
        )


class ProfileDatabase:
    """Profiles as JSON files, one per device kind: `<root>/<device kind key>/profile.json`.

    Two roots: the shipped, read-only `profiles/` package data (`SHIPPED_PROFILE_DIR`), and the user cache
    (`user_dir`, else env `DISCO_JAX_PROFILE_DIR`, else `~/.cache/disco-jax/profiles`), where
    `save` writes. A file holds the kernel times of its device kind (they do not depend on how
    many devices run) and one all-reduce fit per device count and process count (they do;
    `allreduce_key`):

        {"format_version": 1, "device_kind": "cpu", "backend": "cpu" | null,
         "kernel_times_us": {signature: us},
         "allreduce": {"8": {"per_byte_us": C, "latency_us": D, "points": [[bytes, us], ...],
                             "jax_version": ..., "created": ...},
                       "4 in 2 processes": {...}},
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

    def load(self, device_kind: str, backend: str, num_devices: int, num_processes: int = 1) -> Profile | None:
        """The profile of `device_kind` (raw or sanitized) for `num_devices` devices held by
        `num_processes` processes, or None.

        Kernel times are the shipped ones updated by the user's; the all-reduce fit is the user's
        for this device and process count if any, else the shipped one, else None. A file recorded
        for another backend is skipped with a warning.
        """
        key = allreduce_key(num_devices, num_processes)
        layers = []
        for path in (self.shipped_path(device_kind), self.user_path(device_kind)):
            data = _read_profile_file(path)
            if data is None:
                continue
            if data.get("backend") not in (None, backend):
                _warnings.warn(
                    f"ignoring profile file {path}: recorded for backend {data['backend']!r}, not {backend!r}",
                    ProfileFileWarning,
                )
                continue
            layers.append(data)
        if not layers:
            return None
        kernel_times: dict[str, float] = {}
        allreduce_entry = None
        for data in layers:  # shipped first, so the user's entries overwrite
            kernel_times.update(data["kernel_times_us"])
            allreduce_entry = data["allreduce"].get(key, allreduce_entry)
        newest = layers[-1]
        return Profile(
            device_kind=newest["device_kind"],
            backend=backend,
            num_devices=int(num_devices),
            num_processes=int(num_processes),
            allreduce=None if allreduce_entry is None else AllReduceCostModel.from_json(allreduce_entry),
            allreduce_points=(
                [] if allreduce_entry is None else [(int(b), float(t)) for b, t in allreduce_entry["points"]]
            ),
            kernel_times_us=kernel_times,
            jax_version=newest.get("jax_version", ""),
            created=newest.get("updated", ""),
        )

    def save(self, profile: Profile) -> Path:
        """Merge `profile` into its device kind's user-cache file and write it atomically.

        Its kernel times are added (replacing equal signatures); its all-reduce fit, if any,
        replaces the one stored for its device and process count. Returns the file's path.
        """
        data = self._user_file_for_update(profile.device_kind)
        data["backend"] = profile.backend
        data["kernel_times_us"].update(_finite_times(profile.kernel_times_us))
        if profile.allreduce is not None:
            data["allreduce"][allreduce_key(profile.num_devices, profile.num_processes)] = {
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
            _warnings.warn(
                f"moved unreadable profile file {path} to {aside} ({err}); writing a new one",
                ProfileFileWarning,
            )
            data = None
        if data is None:
            data = {
                "format_version": FORMAT_VERSION,
                "device_kind": device_kind,
                "backend": None,
                "kernel_times_us": {},
                "allreduce": {},
            }
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
        _warnings.warn(f"ignoring unreadable profile file {path}: {err}", ProfileFileWarning)
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
