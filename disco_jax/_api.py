"""`@optimize_distributed`: the decorator and the object it returns.

For each new program (argument signature and static values) the first call prepares an
executable through the pipeline (`disco_jax._pipeline.prepare`): in the search phase it searches,
validates and stores a plan; in the enactment phase it applies the stored plan (or runs XLA's own
executable with one warning when there is none). Later calls of the same program go straight to
the prepared executable.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
from collections.abc import Callable
from typing import Any

import jax

from disco_jax._options import Options, StepReport, search_enabled
from disco_jax._pipeline import prepare
from disco_jax._search import SearchConfig
from disco_jax.sharding.mesh_plan import MeshRun
from disco_jax.sharding.update import Resharding


class _StaticArgs:
    """Which arguments of a jitted function are static (`static_argnums` / `static_argnames`, read
    from the jit object): they are part of the program, not inputs of the executable. `split`
    separates a call into the executable's arguments and the static values, by position and by
    name, whichever way the caller passed them."""

    def __init__(self, fn: Callable):
        info = getattr(fn, "_jit_info", None)
        nums = set(getattr(info, "static_argnums", ()) or ())
        names = set(getattr(info, "static_argnames", ()) or ())
        signature = getattr(info, "fun_signature", None)
        positional = (
            []
            if signature is None
            else [
                p.name
                for p in signature.parameters.values()
                if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
            ]
        )
        self.nums = frozenset(nums | {i for i, n in enumerate(positional) if n in names})
        self.names = frozenset(names | {positional[i] for i in nums if 0 <= i < len(positional)})
        self.any = bool(self.nums or self.names)

    def split(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, tuple]:
        """(executable's positional args, its keyword args, the static values as a hashable key)."""
        if not self.any:
            return args, kwargs, ()
        nums = {i if i >= 0 else i + len(args) for i in self.nums}
        dynamic_args = tuple(a for i, a in enumerate(args) if i not in nums)
        dynamic_kwargs = {k: v for k, v in kwargs.items() if k not in self.names}
        static = (
            tuple((i, args[i]) for i in sorted(nums) if 0 <= i < len(args)),
            tuple(sorted(((k, v) for k, v in kwargs.items() if k in self.names), key=lambda kv: kv[0])),
        )
        return dynamic_args, dynamic_kwargs, static


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """What one program (argument signature and static values) runs: a compiled executable that
    takes the dynamic arguments only, or the user's jitted function (`takes_static`). `steady`:
    what the calls after it run, when this one moves its arguments to other shardings first
    (the sharded weight update's first call)."""

    run: Callable
    static: tuple
    takes_static: bool
    steady: _Prepared | None = None


class OptimizedStep:
    """A jitted step with disco-jax's plan applied. Call it like the original function.

    Calls go first to the executable of the previous call, whose own (C++) argument check is the
    only per-call work: a call it does not fit (other shapes, dtypes, shardings, tree or static
    values) raises there before anything runs, and takes the slow path, which keys programs by
    signature and static values and prepares a new one when needed."""

    def __init__(self, fn: Callable, options: Options, search: bool | None = None):
        if not hasattr(fn, "lower") or not callable(fn):
            raise TypeError(f"optimize_distributed expects a function, got {fn!r}")
        self._fn = fn
        self.options = options
        self.search = search
        self._statics = _StaticArgs(fn)
        self._prepared: dict[Any, _Prepared] = {}
        self._last: _Prepared | None = None
        self.reports: list[StepReport] = []
        functools.update_wrapper(self, fn)

    @property
    def last_report(self) -> StepReport | None:
        return self.reports[-1] if self.reports else None

    def lower(self, *args, **kwargs):
        return self._fn.lower(*args, **kwargs)

    def executable(self, *args, **kwargs) -> Callable:
        """What a call with these arguments runs, prepared (searched or enacted) if it is new: a
        `jax.stages.Compiled` taking the non-static arguments (`.as_text()` shows the plan in the
        compiled module), or the jitted function itself on backends disco-jax leaves alone."""
        return self._lookup(args, kwargs)[0].run

    def __call__(self, *args, **kwargs):
        last = self._last
        if last is not None:
            try:
                if last.takes_static or not self._statics.any:
                    return last.run(*args, **kwargs)
                dynamic_args, dynamic_kwargs, static = self._statics.split(args, kwargs)
                if static == last.static:
                    return last.run(*dynamic_args, **dynamic_kwargs)
            except (TypeError, ValueError):
                pass  # not this program: the executable refused the arguments before running
        prepared, dynamic_args, dynamic_kwargs = self._lookup(args, kwargs)
        self._last = prepared.steady or prepared
        if prepared.takes_static:
            return prepared.run(*args, **kwargs)
        return prepared.run(*dynamic_args, **dynamic_kwargs)

    def _lookup(self, args: tuple, kwargs: dict) -> tuple[_Prepared, tuple, dict]:
        """The slow path: the program of this call by signature and static values, prepared if
        new; with the call's dynamic arguments."""
        dynamic_args, dynamic_kwargs, static = self._statics.split(args, kwargs)
        key = (_signature(dynamic_args, dynamic_kwargs), static)
        prepared = self._prepared.get(key)
        if prepared is None:
            run = self._prepare(args, kwargs, dynamic_args, dynamic_kwargs)
            steady = None
            if isinstance(run, Resharding | MeshRun):  # the program of the arguments as the step returns them
                steady = _Prepared(run.steady, static, takes_static=False)
                self._prepared[(_signature(*run.reshard(dynamic_args, dynamic_kwargs)), static)] = steady
            prepared = self._prepared[key] = _Prepared(run, static, takes_static=run is self._fn, steady=steady)
        return prepared, dynamic_args, dynamic_kwargs

    def _prepare(self, args, kwargs, dynamic_args, dynamic_kwargs) -> Callable:
        search = search_enabled() if self.search is None else self.search  # validate the variable first
        report = StepReport(phase="search" if search else "enact", backend=jax.default_backend())
        self.reports.append(report)
        return prepare(self._fn, args, kwargs, dynamic_args, dynamic_kwargs, self.options, search, report)


def _signature(args, kwargs):
    """Cache key of a call, on the hot path of every training step: the tree structure and each
    array's shape, dtype and sharding (hashable objects; no string formatting)."""
    leaves, tree = jax.tree.flatten((args, kwargs))
    return tree, tuple(
        (leaf.shape, leaf.dtype, _sharding_key(leaf.sharding))
        if isinstance(leaf, jax.Array)
        else (type(leaf), tuple(leaf.shape), str(leaf.dtype))
        if hasattr(leaf, "shape")
        else (type(leaf),)  # Python scalars are traced, their value does not matter
        for leaf in leaves
    )


def _sharding_key(sharding):
    """A sharding as a key: `NamedSharding`s that differ only in trailing unsplit dimensions
    (`P()`, `P(None)`: what a step is given and what it returns) are one key."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec)
        while spec and spec[-1] is None:
            spec = spec[:-1]
        return sharding.mesh, spec, sharding.memory_kind
    return sharding


_SEARCH_PARAMETERS = ("alpha", "beta", "seed", "budget_s", "max_unchanged")


def optimize_distributed(
    fn: Callable | None = None,
    *,
    search: bool | None = None,
    config: SearchConfig | None = None,
    plan_dir: str | os.PathLike | None = None,
    validation_pairs: int = 20,
    measured_candidates: int = 4,
    weight_update: str = "search",
    memory_limit_bytes: int | None = None,
    layout: Any = "search",
    verbose: bool = True,
    **kwargs,
):
    """Optimize a data-parallel training step by joint op fusion and all-reduce fusion.

    Use as `@optimize_distributed` or `@optimize_distributed(search=..., ...)`, above `@jax.jit` or on
    a plain function, which is then jitted with the remaining keyword arguments (`static_argnames=`,
    `donate_argnums=`, ... as `jax.jit` takes them). Static arguments are part of the program: each
    static value is a program of its own, with a plan of its own.

    search: True: the first call of each program searches for a plan, validates it against the
    unmodified step and stores it in `plan_dir` (default `$DISCO_JAX_PLAN_DIR` or
    `~/.cache/disco-jax/plans`); False: the first call applies the stored plan, or runs the
    unmodified step with a warning when there is none; None (default): `ENABLE_SEARCH=1` searches.

    config: the search's parameters (`SearchConfig`); alpha, beta, seed, budget_s, max_unchanged may
    also be given one by one and replace the config's. validation_pairs: interleaved timing pairs
    at the first look of the acceptance test (then twice and four times as many, until the plan is
    faster or slower with 95% confidence; README "Never slower"). measured_candidates: per round of
    the measured search, the best distinct candidates compiled and timed against the unmodified step
    (the fastest goes to validation; 0: the search's best, unmeasured). verbose: progress and the
    summary on stderr (the `disco_jax` logger gets them either way).

    weight_update: "search" (default): the search decides per parameter group between XLA's
    replicated update and the sharded one (README "Sharded weight update"), the sharded one kept
    only when measured faster or needed to fit `memory_limit_bytes` (per device; None: no limit).
    "sharded": `jax.jit` steps keep their optimizer state sharded over the data axis, each device
    updating its slice (one warning and the replicated update where no leaf qualifies, e.g. a
    `shard_map` step). "replicated": every device updates the whole optimizer state.
    layout: "search" (a two-axis plan where no one-axis update fits the limit), "data", or forced:
    "tp", "2x4:fsdp_tp"... (`sharding.mesh_plan`, docs/operator-parallelism.md)."""
    if search not in (None, True, False):
        raise TypeError(f"search must be None, True or False, got {search!r}")
    overrides = {k: kwargs.pop(k) for k in _SEARCH_PARAMETERS if k in kwargs}
    config = dataclasses.replace(config or SearchConfig(), **overrides)  # SearchConfig validates
    options = Options(
        search=config,
        plan_dir=None if plan_dir is None else str(plan_dir),
        validation_pairs=validation_pairs,
        verbose=verbose,
        measured_candidates=measured_candidates,
        weight_update=weight_update,
        memory_limit_bytes=memory_limit_bytes,
        layout=layout,
    )
    jit_kwargs = kwargs

    def wrap(f: Callable) -> OptimizedStep:
        if not callable(f):
            raise TypeError(f"optimize_distributed expects a function, got {f!r}")
        if hasattr(f, "lower"):
            if jit_kwargs:
                raise TypeError(
                    f"optimize_distributed got jax.jit options ({', '.join(sorted(jit_kwargs))}) for a "
                    "function that is jitted already; pass them to its jax.jit"
                )
        else:
            f = jax.jit(f, **jit_kwargs)
        return OptimizedStep(f, options, search)

    return wrap if fn is None else wrap(fn)
