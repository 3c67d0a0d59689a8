"""The output check every plan goes through: its outputs against a float64 re-run of the step.

A plan for a training step computes what the step computes, but not bit for bit: fusion changes
how XLA generates elementwise code, a reduce-scatter sums in another order than an all-reduce.
Optimizers such as Adam divide by running moments, so on their first step ulp-level differences
of near-zero gradients become learning-rate-sized updates (DESIGN.md point 17): no ulp tolerance
tells a correct plan from a wrong one there. What does is a reference that knows which program is
closer to the exact result:

    Float64Run(fn, args, kwargs)      one per call: the user's function (`jax.jit(...).__wrapped__`)
         │                            run once on the host CPU with its floating inputs promoted to
         │                            float64 (`jax.enable_x64`), or the reason it cannot run
         └── OutputCheck              one per program (`Captured.output_check`): XLA's outputs of
                .compare(outputs,     that program, the float64 outputs, and (for the fallback) the
                   rerun=...)         step's outputs on inputs nudged by one ulp; `.moved()`: the
                   │                  same check from the state after `STATE_STEPS` unmodified steps
                   └── Comparison     the verdict, which check decided, per-leaf deviations, and
                                      from which state (`state_steps`)

`compare` judges a candidate (a fusion plan, or another program of the same call such as the
sharded weight update) with `_validate.compare_to_float64` where the float64 run exists: per
output leaf, the candidate may deviate from the float64 result by at most `FACTOR` times XLA's
own program's deviation plus a floor. Where it does not (the function is not a `jax.jit`
function, computes in a narrower float type even from float64 inputs, cannot be traced or run on
the host in float64, or is too large to re-run there), the ulp tolerance of
`_validate.compare_outputs` decides, and the `Comparison` records why. A candidate that only
regroups all-reduces must still be bitwise XLA's (every element is reduced in the same order).

Every caller compares through this: the pipeline's validation (`_search_phase.validate`), the measured
search's candidates (`_tuning_devices.device_measure`), the sharded update's check
(`sharding.update.check_outputs`) and the benchmark's measured rows (`eval.measured`). The float64
run happens at most once per call, the first time a candidate is not bitwise-checked (and once
more for the moved state). Each passes `rerun`, its candidate on other argument values
(`_compile.Runner.on`), so that a candidate that passes on the call's inputs, where a fresh
optimizer state is zero and hides how the plan carries state, is judged again from a moved one.

Multi-process jobs: the inputs are gathered to every process (`process_allgather`), each process
runs the float64 step on its own CPU device and compares the regions of its own output shards;
whether the float64 run worked is agreed by all (one failure makes every process fall back, with
that process's reason), and the verdicts are merged (`Comparison.merge`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jax_core

from disco_jax import _distributed, _validate, backends

# The float64 step runs on the host's CPU; above this many floating-point operations (XLA's cost
# analysis of the float64 program) it would take minutes there, and the ulp tolerance decides.
MAX_FLOAT64_FLOPS = 2e11


class Float64Run:
    """The outputs of one call of the user's jitted function, run on the host in float64: every
    floating input promoted, the function traced again under `jax.enable_x64`. `outputs()` runs it
    the first time it is asked (in a multi-process job every process must ask at the same point)
    and returns host arrays of the full (global) outputs, or None with `reason` saying why not."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.reason: str | None = None
        self._outputs: Any = None
        self._done = False

    def outputs(self) -> Any | None:
        if not self._done:
            self._done = True
            self._outputs, self.reason = self._run()
            if _distributed.is_multiprocess():  # every process falls back if one cannot run it
                reasons = _distributed.gather_json(_distributed.new_scope("float64-run"), self.reason)
                failed = [(i, r) for i, r in enumerate(reasons) if r is not None]
                if failed:
                    self._outputs, self.reason = None, f"process {failed[0][0]}: {failed[0][1]}"
        return self._outputs

    def on(self, dynamic_args: tuple, dynamic_kwargs: dict) -> Float64Run:
        """The float64 run of the same function on other values of the call's dynamic arguments
        (static ones, by the jit's `static_argnums`/`static_argnames`, stay as called)."""
        info = getattr(self.fn, "_jit_info", None)
        if info is None:
            return Float64Run(self.fn, dynamic_args, dynamic_kwargs)
        n = len(self.args)
        static = {i % n for i in info.static_argnums} if n else set()
        values = iter(dynamic_args)
        args = tuple(a if i in static else next(values) for i, a in enumerate(self.args))
        kwargs = {k: v if k in info.static_argnames else dynamic_kwargs[k] for k, v in self.kwargs.items()}
        return Float64Run(self.fn, args, kwargs)

    def _run(self) -> tuple[Any | None, str | None]:
        fn = self.fn
        info = getattr(fn, "_jit_info", None)
        if info is None or not hasattr(fn, "__wrapped__"):
            return None, "the step is not a jax.jit function"
        jitted = jax.jit(fn.__wrapped__, static_argnums=info.static_argnums, static_argnames=info.static_argnames)
        try:
            with jax.enable_x64(True), jax.default_device(_host_cpu()):
                # Traced from shapes first: nothing is copied for a step that cannot run.
                shape_args, shape_kwargs = jax.tree.map(_promoted_shape, (self.args, self.kwargs))
                traced = jitted.trace(*shape_args, **shape_kwargs)
                narrow = narrow_float(traced.jaxpr.jaxpr)
                if narrow is not None:
                    return None, f"it computes in {narrow} even from float64 inputs"
                flops = (traced.lower().cost_analysis() or {}).get("flops", 0.0)
                if flops > MAX_FLOAT64_FLOPS:
                    return None, f"its float64 run needs {flops:.3g} flops, over {MAX_FLOAT64_FLOPS:.0e} on the host"
                args, kwargs = jax.tree.map(_promoted, (self.args, self.kwargs))
                return jax.tree.map(np.asarray, jitted(*args, **kwargs)), None
        except Exception as e:  # no host CPU backend, shard_map collectives across processes, custom calls, ...
            return None, f"it does not run in float64 on the host: {_message(e)}"


def _message(e: Exception) -> str:
    first = str(e).strip().splitlines()
    return f"{type(e).__name__}: {first[0][:200] if first else ''}"


def _host_cpu():
    return jax.local_devices(backend=backends.CPU.platform)[0]


def _host(x: jax.Array) -> np.ndarray:
    if x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _float64(dtype) -> Any:
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return np.dtype(np.complex128)
    return np.dtype(np.float64) if jnp.issubdtype(dtype, jnp.floating) else dtype


def _promoted_shape(x: Any) -> Any:
    """An input's shape and promoted dtype, as `_promoted` will give it (no sharding)."""
    if isinstance(x, jax.Array | np.ndarray):
        return jax.ShapeDtypeStruct(x.shape, _float64(x.dtype))
    return x


def _promoted(x: Any) -> Any:
    """An input as the float64 run takes it: floating arrays as float64 host arrays, other arrays
    on the host, key arrays rebuilt on the host CPU from their data, anything else as it is."""
    if not isinstance(x, jax.Array | np.ndarray):
        return x
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):  # PRNG keys
        data = _host(jax.random.key_data(x))
        return jax.device_put(jax.random.wrap_key_data(data, impl=jax.random.key_impl(x)), _host_cpu())
    host = _host(x) if isinstance(x, jax.Array) else x
    return host.astype(_float64(host.dtype))


def _float_bits(var) -> int:
    dtype = getattr(getattr(var, "aval", None), "dtype", None)
    return jnp.finfo(dtype).bits if dtype is not None and jnp.issubdtype(dtype, jnp.inexact) else 0


def narrow_float(jaxpr) -> str | None:
    """Where a float64 trace rounds to a narrower float type (a hard-coded float32 cast of a value
    computed from the inputs, a reduced-precision op): 'float32 (convert_element_type)', or None.
    Narrow floats made from integers or booleans (masks, one-hot labels) lose nothing and pass.
    Walks nested jaxprs."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "reduce_precision":
            return f"reduced precision ({eqn.primitive.name})"
        inner = list(jax_core.jaxprs_in_params(eqn.params))
        if inner:  # a call, a loop, a custom derivative: its body says where
            found = next((f for f in map(narrow_float, inner) if f is not None), None)
            if found is not None:
                return found
            continue
        widest = max(map(_float_bits, eqn.invars), default=0)
        for var in eqn.outvars:
            if 0 < _float_bits(var) < widest:
                return f"{var.aval.dtype} ({eqn.primitive.name})"
    return None


# The state a candidate is also judged from: the state carried out of this many unmodified steps
# (two: a fresh optimizer state is zero, so a step from it cannot show how a plan treats the
# state it carries; from a moved state, an error there shows; docs/output-check.md).
STATE_STEPS = 2


class OutputCheck:
    """How candidates for one program are judged against it, on the call's inputs and again on
    the inputs of a later step. `run_on(args, kwargs)`: XLA's executable of the program on given
    values of the call's dynamic arguments `args`/`kwargs`; `exact`: the call's `Float64Run` (None:
    the ulp tolerance always decides). XLA's outputs, the nudged run (the fallback's sensitivity)
    and the moved state are each made at most once, when first needed.

    The moved state (`moved`): XLA's executable run `state_steps` times from the call's inputs,
    the outputs that carry an argument's state (`carried_state`) fed back as that argument each
    time; it is judged like the call's own inputs, with its own float64 run."""

    def __init__(
        self,
        run_on: Callable[[tuple, dict], Any],
        args: tuple,
        kwargs: dict,
        exact: Float64Run | None,
        state_steps: int = STATE_STEPS,
    ):
        self.run_on, self.args, self.kwargs, self.exact = run_on, args, kwargs, exact
        self.state_steps = state_steps
        self._default: Any = None
        self._nudged: Any = None
        self._moved: OutputCheck | None = None
        self._moved_reason: str | None = None

    @classmethod
    def for_call(cls, fn: Callable, args: tuple, kwargs: dict | None = None) -> OutputCheck:
        """The check of a jitted function's call as made (every argument dynamic): its own
        outputs are the default."""
        kwargs = kwargs or {}
        return cls(lambda a, k: fn(*a, **k), args, kwargs, Float64Run(fn, args, kwargs))

    def default(self) -> Any:
        """XLA's outputs of the program (run the first time they are asked for)."""
        if self._default is None:
            self._default = jax.block_until_ready(self.run_on(self.args, self.kwargs))
        return self._default

    def moved(self) -> OutputCheck | None:
        """The check of the same program from the state after `state_steps` unmodified steps
        (same batch, state fed back), or None with `moved_reason` saying why there is none."""
        if self._moved is None and self._moved_reason is None:
            carried = carried_state(self.args, self.default())
            if self.state_steps < 1:
                self._moved_reason = "not asked for"
            elif not carried:
                self._moved_reason = "no output carries an argument's state to the next step"
            else:
                args, outputs = self.args, self.default()
                for step in range(self.state_steps):
                    if step:
                        outputs = jax.block_until_ready(self.run_on(args, self.kwargs))
                    args = fed_back(args, outputs, carried)
                exact = None if self.exact is None else self.exact.on(args, self.kwargs)
                moved = OutputCheck(self.run_on, args, self.kwargs, exact, state_steps=0)
                if _finite((self.args, self.default())) and not _finite((args, moved.default())):
                    # An output shaped like an argument need not be its state: fed back, it can
                    # overflow, and infinities judge nothing (inf <= inf passes any candidate).
                    self._moved_reason = f"the step from the state after {self.state_steps} unmodified steps overflows"
                else:
                    self._moved = moved
        return self._moved

    @property
    def moved_reason(self) -> str | None:
        return self._moved_reason

    def compare(
        self,
        outputs: Any,
        *,
        bitwise: bool = False,
        merge_key: str | None = None,
        rerun: Callable[[tuple, dict], Any] | None = None,
    ) -> _validate.Comparison:
        """`outputs` (a candidate's on the call's inputs, global arrays, sharded as its program
        shards them) against this program's: bitwise, or against the float64 run, or within the
        ulp tolerance when there is none. `rerun(args, kwargs)`: the candidate on other values of
        the arguments (`Runner.on`); given, a candidate that passes is judged again from the moved
        state (`moved`), and that verdict is returned (`state_steps` says so; a candidate must
        pass both). This process compares the regions of its own shards of `outputs`; `merge_key`
        (a multi-process job's unique key): every process's verdict merged under it."""
        first = self._compare_once(outputs, bitwise, merge_key)
        if rerun is None:
            first.state_reason = "the candidate was not run again"
            return first
        if not first.within_tolerance:
            return first
        moved = self.moved()
        if moved is None:
            first.state_reason = self.moved_reason
            return first
        later = moved._compare_once(rerun(moved.args, moved.kwargs), bitwise, merge_key and f"{merge_key}/moved")
        later.state_steps = self.state_steps
        return later

    def _compare_once(self, outputs: Any, bitwise: bool, merge_key: str | None) -> _validate.Comparison:
        default = _distributed.regions(self.default(), outputs)
        local = _distributed.addressable(outputs)
        if bitwise:
            comparison = _validate.compare_outputs(default, local, bitwise=True)
        else:
            exact = None if self.exact is None else self.exact.outputs()
            reason = "no float64 run of the step" if self.exact is None else self.exact.reason
            if exact is not None:
                reason = shape_mismatch(exact, self.default())
            if reason is None:
                comparison = _validate.compare_to_float64(_distributed.local_parts(exact, outputs), default, local)
            else:
                if self._nudged is None:
                    nudged_args, nudged_kwargs = _validate.nudge((self.args, self.kwargs))
                    self._nudged = jax.block_until_ready(self.run_on(nudged_args, nudged_kwargs))
                floor = _validate.sensitivity(default, _distributed.regions(self._nudged, outputs))
                comparison = _validate.compare_outputs(default, local, bitwise=False, floor=floor)
                comparison.fallback_reason = reason
        if merge_key is None or not _distributed.is_multiprocess():
            return comparison
        return _validate.Comparison.merge(_distributed.gather_json(merge_key, dataclasses.asdict(comparison)))


def _finite(tree: Any) -> bool:
    """Every floating leaf of `tree` holds only finite values: one reduction over the global
    arrays, so every process of a job reads the same answer."""
    leaves = [x for x in jax.tree.leaves(tree) if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)]
    return bool(_all_finite(leaves)) if leaves else True


@jax.jit
def _all_finite(leaves: list) -> jax.Array:  # one jitted function: compiled once per set of shapes
    return jnp.stack([jnp.isfinite(x).all() for x in leaves]).all()


def _signature(tree: Any) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(np.shape(x)), str(getattr(x, "dtype", type(x)))) for x in leaves)


def _parts(outputs: Any) -> tuple:
    return tuple(outputs) if isinstance(outputs, tuple | list) else (outputs,)


def carried_state(args: tuple, outputs: Any) -> dict[int, int]:
    """Argument index -> index of the output (of a tuple of outputs; 0 for a lone output) that
    carries its state to the next step: the first output not yet taken with the argument's
    pytree structure, shapes and dtypes (`(params, opt_state, x, y) -> (params, opt_state, loss)`:
    {0: 0, 1: 1}; a Flax `TrainState` in, `(state, metrics)` out: {0: 0}). A lone scalar
    argument (a learning rate, a step number) is not taken for state: it would match a loss."""
    taken: set[int] = set()
    carried = {}
    parts = [_signature(o) for o in _parts(outputs)]
    for j, arg in enumerate(args):
        leaves = jax.tree.leaves(arg)
        if not leaves or (len(leaves) == 1 and np.ndim(leaves[0]) == 0 and arg is leaves[0]):
            continue
        signature = _signature(arg)
        found = next((i for i, s in enumerate(parts) if i not in taken and s == signature), None)
        if found is not None:
            carried[j] = found
            taken.add(found)
    return carried


def fed_back(args: tuple, outputs: Any, carried: dict[int, int]) -> tuple:
    """The arguments of the next step: each carried argument replaced by its output, in the
    argument's own sharding (a program may return its state laid out otherwise)."""
    parts = _parts(outputs)

    return tuple(jax.tree.map(placed_like, parts[carried[j]], a) if j in carried else a for j, a in enumerate(args))


def placed_like(value: Any, own: Any) -> Any:
    """`value` in the sharding of `own` (the argument it stands for), where both are arrays."""
    if isinstance(value, jax.Array) and isinstance(own, jax.Array) and value.sharding != own.sharding:
        return jax.device_put(value, own.sharding)
    return value


def shape_mismatch(exact: Any, default: Any) -> str | None:
    """Why the float64 outputs cannot stand for the program's (another structure, another shape,
    a floating output that is not 64-bit), or None."""
    exact_leaves, exact_tree = jax.tree.flatten(exact)
    default_leaves, default_tree = jax.tree.flatten(default)
    if exact_tree != default_tree:
        return "its float64 run returns another output structure"
    for i, (x, d) in enumerate(zip(exact_leaves, default_leaves)):
        if tuple(np.shape(x)) != tuple(d.shape):
            return f"its float64 run returns output {i} with shape {np.shape(x)}, not {d.shape}"
        if jnp.issubdtype(d.dtype, jnp.inexact) and np.asarray(x).dtype not in (np.float64, np.complex128):
            return f"its float64 run returns output {i} in {np.asarray(x).dtype}"
    return None
