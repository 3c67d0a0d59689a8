"""Plans: the search's decisions for one program on one machine, stored as JSON.

A plan is keyed like JAX's compilation cache: module fingerprint, backend, device kind and
count. It records the jax/jaxlib versions it was made with; a plan whose fingerprint, machine or
versions differ is never applied (`Plan.mismatches` says why). Files are written atomically (temp
file + rename) into the plan directory: the `plan_dir` argument, else `$DISCO_JAX_PLAN_DIR`, else
`~/.cache/disco-jax/plans`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import jax
import jaxlib

from disco_jax import _distributed, _warnings
from disco_jax._files import write_json_atomic

PLAN_FORMAT_VERSION = 1
PLAN_DIR_ENV = "DISCO_JAX_PLAN_DIR"


class PlanWarning(UserWarning):
    """A stored plan was not applied (missing, corrupt, stale or foreign)."""


@dataclasses.dataclass
class MachineKey:
    """What a plan must match besides the program: where and with what it runs."""

    backend: str
    device_kind: str
    num_devices: int
    num_processes: int = 1
    jax_version: str = jax.__version__
    jaxlib_version: str = jaxlib.__version__

    @classmethod
    def current(cls, devices=None) -> MachineKey:
        devices = list(devices) if devices is not None else jax.devices()
        from disco_jax._profile_db import device_kind_key

        return cls(jax.default_backend(), device_kind_key(devices[0]), len(devices), jax.process_count())


@dataclasses.dataclass
class Plan:
    fingerprint: str
    module_name: str
    machine: MachineKey
    use_default: bool  # True: XLA's own plan was kept (search found nothing better, or validation)
    strategy: dict | None  # Strategy.to_json(); None when use_default
    reason: str  # why this plan (or the default) was chosen
    simulated: dict = dataclasses.field(default_factory=dict)  # {'default': {...}, 'plan': {...}}
    measured: dict = dataclasses.field(default_factory=dict)  # validation: times, errors, tolerance
    search: dict = dataclasses.field(default_factory=dict)  # search statistics and options
    # The weight update the plan was made for: mode, data axis, the sharding of each optimizer-state
    # leaf it shards, per-device memory (`disco_jax.sharding.update`); {} in plans made before it.
    weight_update: dict = dataclasses.field(default_factory=dict)
    # The sharding rules applied at the hook to the program the plan runs (`sharding.apply`): per
    # application its rule, the instructions it matched and the one it made; [] in older plans.
    rules_applied: list = dataclasses.field(default_factory=list)
    # XLA compile options the plan's program is compiled with, by name (`disco_jax.schedule_options`:
    # combine thresholds, the latency-hiding scheduler...); with no strategy, the plan is XLA's own
    # program under them. {} in plans that keep XLA's options.
    compile_options: dict = dataclasses.field(default_factory=dict)
    # A two-axis plan (mesh and per-layer layout, `sharding.mesh_plan`) decided for this program:
    # "mode" "mesh" (enacted) or "data" (an offline layout measured and not applied), the plan
    # (`mesh_step.Enacted.to_json`), why, whether memory forced it, what was measured; {} otherwise.
    layout: dict = dataclasses.field(default_factory=dict)
    created: float = dataclasses.field(default_factory=time.time)
    format_version: int = PLAN_FORMAT_VERSION

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> Plan:
        if not isinstance(data, dict):
            raise ValueError("plan file does not hold a JSON object")
        version = data.get("format_version")
        if version != PLAN_FORMAT_VERSION:
            raise ValueError(f"plan format version {version!r}, this disco-jax reads {PLAN_FORMAT_VERSION}")
        try:
            fields = dict(data)
            fields["machine"] = MachineKey(**fields["machine"])
            return cls(**fields)
        except (KeyError, TypeError) as e:
            raise ValueError(f"plan file is malformed: {e}") from None

    def mismatches(self, fingerprint: str, machine: MachineKey) -> list[str]:
        """Reasons this plan must not be applied to a module with `fingerprint` on `machine`."""
        problems = []
        if self.fingerprint != fingerprint:
            problems.append(f"module fingerprint {self.fingerprint} != {fingerprint} (the program changed)")
        for field in dataclasses.fields(MachineKey):
            mine, theirs = getattr(self.machine, field.name), getattr(machine, field.name)
            if mine != theirs:
                problems.append(f"{field.name} {mine!r} != {theirs!r}")
        return problems

    @property
    def file_name(self) -> str:
        return plan_file_name(self.fingerprint, self.machine)


def plan_file_name(fingerprint: str, machine: MachineKey) -> str:
    # The module does not tell how its devices are spread over processes: the file name does.
    processes = f"-p{machine.num_processes}" if machine.num_processes > 1 else ""
    return f"{fingerprint}-{machine.backend}-{machine.device_kind}-{machine.num_devices}{processes}.json"


def resolve_plan_dir(plan_dir: str | os.PathLike | None = None) -> Path:
    if plan_dir is not None:
        return Path(plan_dir).expanduser()
    if os.environ.get(PLAN_DIR_ENV):
        return Path(os.environ[PLAN_DIR_ENV]).expanduser()
    return Path("~/.cache/disco-jax/plans").expanduser()


def save_plan(plan: Plan, plan_dir: str | os.PathLike | None = None) -> Path:
    """Store a plan; raises OSError (with the path) if the directory cannot be written."""
    path = resolve_plan_dir(plan_dir) / plan.file_name
    try:
        write_json_atomic(path, plan.to_json())
    except OSError as e:
        raise OSError(f"cannot write plan to {path}: {e.strerror or e}") from e
    return path


def read_plan_file(path: str | os.PathLike) -> Plan:
    """Read one plan file; ValueError for anything that is not a valid plan."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    return Plan.from_json(data)


def find_plan(
    fingerprint: str, machine: MachineKey, plan_dir: str | os.PathLike | None = None
) -> tuple[Plan | None, Path]:
    """The stored plan for this program and machine, or None (with a PlanWarning when a file
    exists but cannot be used: corrupt, other format, stale versions or a foreign program)."""
    path = resolve_plan_dir(plan_dir) / plan_file_name(fingerprint, machine)
    if not path.exists():
        return None, path
    try:
        plan = read_plan_file(path)
    except (OSError, ValueError) as e:
        _warnings.warn(f"disco-jax: ignoring plan {path}: {e}; running the unmodified step", PlanWarning)
        return None, path
    problems = plan.mismatches(fingerprint, machine)
    if problems:
        _warnings.warn(
            f"disco-jax: plan {path} does not match this run ({'; '.join(problems)}); "
            "running the unmodified step. Run with ENABLE_SEARCH=1 to make a new plan.",
            PlanWarning,
        )
        return None, path
    return plan, path


def shared_plan(scope: str, plan: Plan | None) -> Plan | None:
    """Multi-process enactment: process 0's plan (or None) on every process. A process whose own
    plan directory holds a different plan for this program makes every process fail."""
    decisions = None if plan is None else {k: v for k, v in (plan.strategy or {}).items() if k != "origin"}
    mine = (
        None
        if plan is None
        else _distributed.digest([plan.fingerprint, plan.use_default, decisions, plan.compile_options])
    )
    digests = _distributed.gather_json(f"{scope}/plan-digest", mine)
    differing = [i for i, d in enumerate(digests) if d is not None and d != digests[0]]
    if differing:
        raise _distributed.PlanMismatchError(
            f"disco-jax: process(es) {differing} hold a different plan for this program than process 0 "
            f"(plan digests {digests}); give every process the same plan directory, or remove the stale plans"
        )
    shared = _distributed.broadcast_json(f"{scope}/plan", None if plan is None else plan.to_json())
    return None if shared is None else Plan.from_json(shared)
