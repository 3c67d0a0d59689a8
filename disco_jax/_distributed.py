"""Talking to the other processes of a multi-process JAX job (`jax.distributed`).

disco-jax needs three things from the other processes, all through the key-value store of JAX's
distributed runtime (JSON as bytes; never pickle):

* `agree(key, value)`: every process publishes a value (module fingerprint, machine, versions,
  phase) and checks everyone's against process 0's; any difference raises `PlanMismatchError`
  on every process, naming the processes and fields that differ;
* `broadcast_json(key, value)`: process 0's decision (a strategy, a plan) reaches every process;
* `gather_json(key, value)`: every process sees every process's value (e.g. output comparisons).

Every wait has a timeout (`sync_timeout_s()`: `$DISCO_JAX_SYNC_TIMEOUT_S`, default 300 s) and
fails with `SyncTimeoutError` naming the key and the process waited for, never a hang. Keys must
be unique in the job: `new_scope()` gives each prepared step its own prefix, and since every
process prepares its steps in the same order, the n-th scope names the same step everywhere.

`initialize_from_env()` joins the job described by the variables `disco-jax launch` sets.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

COORDINATOR_ENV = "DISCO_JAX_COORDINATOR"
NUM_PROCESSES_ENV = "DISCO_JAX_NUM_PROCESSES"
PROCESS_ID_ENV = "DISCO_JAX_PROCESS_ID"
SYNC_TIMEOUT_ENV = "DISCO_JAX_SYNC_TIMEOUT_S"
DEFAULT_SYNC_TIMEOUT_S = 300.0

_scopes = itertools.count()


class PlanMismatchError(RuntimeError):
    """The processes of a job do not run the same program, versions, devices or plan."""


class SyncTimeoutError(TimeoutError):
    """A process waited too long for another one's value in the key-value store."""


def initialize_from_env() -> bool:
    """Join the multi-process job described by `$DISCO_JAX_COORDINATOR` (host:port),
    `$DISCO_JAX_NUM_PROCESSES` and `$DISCO_JAX_PROCESS_ID` (set by `disco-jax launch`), with gloo
    CPU collectives. Call it before anything else uses JAX. Returns True when this process is part
    of such a job, False (and does nothing) when the variables are not set."""
    address = os.environ.get(COORDINATOR_ENV)
    if not address:
        return False
    if jax.distributed.is_initialized():
        return True
    try:
        num_processes, process_id = int(os.environ[NUM_PROCESSES_ENV]), int(os.environ[PROCESS_ID_ENV])
    except (KeyError, ValueError) as e:
        raise ValueError(
            f"{COORDINATOR_ENV} is set, so {NUM_PROCESSES_ENV} and {PROCESS_ID_ENV} must be integers: {e}"
        ) from None
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    timeout = max(1, int(sync_timeout_s()))  # joining, and waiting for the others at exit
    jax.distributed.initialize(
        coordinator_address=address,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=timeout,
        shutdown_timeout_seconds=timeout,
    )
    return True


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def sync_timeout_s() -> float:
    value = os.environ.get(SYNC_TIMEOUT_ENV, "").strip()
    if not value:
        return DEFAULT_SYNC_TIMEOUT_S
    try:
        timeout = float(value)
    except ValueError:
        timeout = -1.0
    if not timeout > 0:
        raise ValueError(f"{SYNC_TIMEOUT_ENV} must be a positive number of seconds, got {value!r}")
    return timeout


def new_scope(name: str) -> str:
    """A key prefix unique to this call, the same on every process (calls happen in the same order)."""
    return f"disco_jax/{next(_scopes)}/{name}"


def digest(value: Any) -> str:
    """A short hash of a JSON value (sorted keys), for comparing large values across processes."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def _client():
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(
            "jax.distributed is not initialized; call disco_jax.initialize_from_env() or "
            "jax.distributed.initialize() first"
        )
    return client


def _set(key: str, value: Any) -> None:
    _client().key_value_set_bytes(key, json.dumps(value, sort_keys=True).encode())


def _get(key: str, deadline: float, source: int, timeout_s: float) -> Any:
    remaining_ms = max(1, int((deadline - time.monotonic()) * 1000))
    try:
        data = _client().blocking_key_value_get_bytes(key, remaining_ms)
    except Exception as e:  # the runtime raises its own error type on a deadline or a lost peer
        raise SyncTimeoutError(
            f"disco-jax: process {jax.process_index()} waited {timeout_s:.0f} s for {key!r} from process "
            f"{source} and got nothing ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). "
            "Do all processes run the same program with the same ENABLE_SEARCH? (timeout: "
            f"${SYNC_TIMEOUT_ENV})"
        ) from None
    return json.loads(data)


def broadcast_json(key: str, value: Any, timeout_s: float | None = None) -> Any:
    """Process 0's `value` on every process (the others' `value` is ignored; pass None)."""
    timeout_s = sync_timeout_s() if timeout_s is None else timeout_s
    if jax.process_index() == 0:
        _set(key, value)
        return json.loads(json.dumps(value, sort_keys=True))  # what the others see
    return _get(key, time.monotonic() + timeout_s, 0, timeout_s)


def gather_json(key: str, value: Any, timeout_s: float | None = None) -> list[Any]:
    """Every process's `value`, in process order, on every process."""
    timeout_s = sync_timeout_s() if timeout_s is None else timeout_s
    _set(f"{key}/{jax.process_index()}", value)
    deadline = time.monotonic() + timeout_s
    return [_get(f"{key}/{i}", deadline, i, timeout_s) for i in range(jax.process_count())]


def slowest_pairs(key: str) -> Callable[[list[float], list[float]], list[float]]:
    """A `merge` for `_validate.time_until_decided` and `time_interleaved` in a multi-process job:
    every process's per-pair default and plan times, gathered after each look, and per pair the
    ratio of the job's steps: the plan's time at its slowest process over the default's at its
    slowest (a job's step lasts as long as its slowest process); the same list on every process.

    Not the slowest of the processes' ratios, max(plan / default), which the rows and the
    acceptance rule took before: that is biased above 1 where the processes' times scatter, and an
    A/A run over gloo (`scripts/aa_calibration.py --processes 2`, MLP, 40 comparisons) read 1.074
    for one executable against itself, its acceptance rule deciding "slower" 12 times in 40; the
    job's step read 1.000 with 1 false decision."""
    looks = itertools.count()

    def merge(default_us: list[float], plan_us: list[float]) -> list[float]:
        everyone = gather_json(f"{key}/{next(looks)}", [list(default_us), list(plan_us)])
        default = [max(times) for times in zip(*(d for d, _ in everyone))]
        plan = [max(times) for times in zip(*(p for _, p in everyone))]
        return [p / d for d, p in zip(default, plan)]

    return merge


def agree(key: str, value: dict, timeout_s: float | None = None, what: str = "program") -> list[dict]:
    """Check that every process holds the same `value` (a flat dict). Raises `PlanMismatchError`
    on every process, naming each process and field that differs from process 0, when they do not.
    Returns every process's value."""
    values = gather_json(key, value, timeout_s)
    reference = values[0]
    problems = []
    for i, other in enumerate(values[1:], start=1):
        fields = sorted(set(reference) | set(other))
        diffs = [
            f"{f} {other.get(f)!r} (process 0: {reference.get(f)!r})"
            for f in fields
            if other.get(f) != reference.get(f)
        ]
        if diffs:
            problems.append(f"process {i}: " + ", ".join(diffs))
    if problems:
        raise PlanMismatchError(
            f"disco-jax: the processes do not run the same {what}: "
            + "; ".join(problems)
            + ". Every process must run the same program on the same kind of machine "
            "with the same versions and ENABLE_SEARCH."
        )
    return values


def regions(outputs: Any, like: Any) -> Any:
    """`outputs` cut to the regions `like`'s local shards cover, so that two programs whose outputs
    are sharded differently (a sharded update's state against the replicated update's) compare
    shard by shard: each array spanning other processes' devices becomes the list, one per local
    device in `addressable(like)`'s order, of that region cut from a local shard of `outputs`
    that holds it (identity in a single-process job). `like`: the same program outputs' structure."""
    if not is_multiprocess():
        return outputs

    def cut(x, shape_of):
        if not isinstance(shape_of, jax.Array) or shape_of.is_fully_addressable:
            return addressable(x)
        pieces = []
        for target in shape_of.addressable_shards:
            for source in x.addressable_shards:
                inside = _inside(target.index, source.index, x.shape)
                if inside is not None:
                    pieces.append(np.asarray(source.data)[inside])
                    break
            else:
                raise ValueError(f"no local shard of an output of shape {x.shape} holds the region {target.index}")
        return pieces

    return jax.tree.map(cut, outputs, like)


def _inside(target: tuple, source: tuple, shape: tuple) -> tuple | None:
    """`target`'s region relative to `source`'s (both tuples of slices into an array of `shape`),
    or None where `source` does not hold all of it."""
    relative = []
    for t, s, n in zip(target, source, shape):
        t0, t1, _ = t.indices(n)
        s0, s1, _ = s.indices(n)
        if not (s0 <= t0 and t1 <= s1):
            return None
        relative.append(slice(t0 - s0, t1 - s0))
    return tuple(relative)


def addressable(outputs: Any) -> Any:
    """Outputs as this process can read them: each array spanning other processes' devices is
    replaced by the list of its local shards (identity in a single-process job)."""
    if not is_multiprocess():
        return outputs

    def local(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return [s.data for s in x.addressable_shards]
        return x

    return jax.tree.map(local, outputs)


def local_parts(full: Any, like: Any) -> Any:
    """`full` (host arrays of whole outputs, held by every process) cut as `addressable` cuts
    `like`: each of `like`'s arrays spanning other processes' devices becomes the list of the
    regions of its local shards (identity in a single-process job)."""
    if not is_multiprocess():
        return full

    def cut(x, shape_of):
        if isinstance(shape_of, jax.Array) and not shape_of.is_fully_addressable:
            return [np.asarray(x)[s.index] for s in shape_of.addressable_shards]
        return x

    return jax.tree.map(cut, full, like)
