"""The records the decorator's pipeline is driven by and reports into: `Options` (how a decorated
step searches and validates), `StepReport` (what happened when one program was prepared), and
the phase chosen by ``ENABLE_SEARCH``."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from disco_jax import _search
from disco_jax.sharding import mesh_plan, update

ENABLE_SEARCH_ENV = "ENABLE_SEARCH"


def search_enabled() -> bool:
    """The default phase, from ENABLE_SEARCH: '1' search, '0' or unset enact; anything else is an error."""
    value = os.environ.get(ENABLE_SEARCH_ENV, "").strip()
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    raise ValueError(f"{ENABLE_SEARCH_ENV} must be 0 or 1, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Options:
    """How a decorated step searches and validates. `search`: the search's parameters;
    `plan_dir`: where plans are stored (None: `$DISCO_JAX_PLAN_DIR` or the user cache);
    `validation_pairs`: interleaved timing pairs when validating a plan; `verbose`: print to stderr;
    `measured_candidates`: distinct candidates per round the measured search (`_tuning`) compiles
    and times against XLA's plan before one goes to validation (0: validate the search's best);
    `weight_update`: 'sharded' keeps the optimizer state sharded over the data axis
    (`disco_jax.sharding.update`), 'replicated' is XLA's data-parallel update, 'search' chooses
    per parameter group (`disco_jax.sharding.choice`) within `memory_limit_bytes` per device;
    `layout`: two-axis plans (`disco_jax.sharding.mesh_plan`): 'search' considers them where no
    one-axis weight update fits `memory_limit_bytes` and enacts stored ones, 'data' never, a
    forced plan ('tp', 'DxM:CHOICE', an `OperatorPlan`) always."""

    search: _search.SearchConfig = _search.SearchConfig()
    plan_dir: str | None = None
    validation_pairs: int = 20
    verbose: bool = True
    measured_candidates: int = 4
    weight_update: str = "search"
    memory_limit_bytes: int | None = None
    layout: Any = "search"

    def __post_init__(self):
        update.check_weight_update(self.weight_update)
        mesh_plan.check_layout(self.layout)
        limit = self.memory_limit_bytes
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0):
            raise ValueError(f"memory_limit_bytes must be a positive integer or None, got {limit!r}")
        if not isinstance(self.measured_candidates, int) or self.measured_candidates < 0:
            raise ValueError(f"measured_candidates must be a non-negative integer, got {self.measured_candidates!r}")

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        if not isinstance(self.layout, str):
            data["layout"] = self.layout.to_json()
        return data


@dataclasses.dataclass
class StepReport:
    """What happened when one program of a decorated step was prepared (`OptimizedStep.reports`).

    phase: 'search' or 'enact'. applied: whether the program runs a disco-jax plan; reason: why
    (or why not). default_counts / plan_counts: `compiled_stats` of XLA's executable and the
    plan's. simulated / measured / search: the plan's records (see `Plan`)."""

    phase: str
    backend: str
    search_ran: bool = False
    applied: bool = False
    reason: str | None = None
    fingerprint: str | None = None
    module: str | None = None
    graph: dict | None = None
    default_counts: dict | None = None
    plan_counts: dict | None = None
    compile_status: str | None = None
    plan: dict | None = None
    plan_path: str | None = None
    simulated: dict | None = None
    measured: dict | None = None
    search: dict | None = None
    process_index: int | None = None
    plan_from_process: int | None = None
    weight_update: dict | None = None  # mode, sharded leaves, per-device memory (`sharding.update`)
    rules_applied: list | None = None  # sharding rules applied at the hook to the executable that runs
    layout: dict | None = None  # the two-axis plan enacted or measured (`sharding.mesh_plan.record`)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)
