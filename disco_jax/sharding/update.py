"""The sharded weight update (Xu et al. 2020, "Automatic Cross-Replica Sharding of Weight Update in
Data-Parallel Training"; ZeRO stage 1, and with `Layout.parameters` the parameters too, ZeRO-3) for
`jax.jit` + `NamedSharding` data-parallel steps.

In a data-parallel step every device holds the whole optimizer state and repeats the whole
update. Here the optimizer state is kept sharded over the data axis between steps: each device
updates its own slice of each state tensor and the new parameters are all-gathered. Nothing is
rewritten by hand: the user's function is lowered again with input and output shardings that
keep that state sharded (`P("data")` on one dimension) and everything else as the unmodified step
has it, and XLA's SPMD partitioner emits the collectives.

Which input leaves are such state is read from the step's jaxpr (`choose_layout`): a leaf that is
replicated over the data axis, splits evenly over it (on a dimension the axis size divides, or
over several: `leaves.spec_for`), is used by elementwise
operations only (transitively, through nested jits and custom derivatives), and whose
elementwise descendants include an output of its shape and dtype that depends elementwise on
such leaves only (its updated value). Adam's `mu`/`nu` and SGD's momentum qualify; parameters do
not (they feed the forward pass's dots), nor scalar step counters (nothing to split), nor
anything inside a `shard_map` (its collectives are written in the function: the update there is
whatever the function computes).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any

import jax
from jax.sharding import NamedSharding

from disco_jax import _validate, _warnings
from disco_jax._compile import Captured, capture
from disco_jax.sharding import apply, params, prefetch, remat, rules
from disco_jax.sharding.layouts import Layout, put
from disco_jax.sharding.leaves import (  # noqa: F401  (the layout's reading of the jaxpr, re-exported)
    choose_layout,
    elementwise_origins,
    factor_axes,
    factored_mesh,
    leaf_groups,
    spec_for,
    stacked_leaves,
)

# The proven rules (`disco-jax rules`) a sharded update rests on; the plan cites them.
JUSTIFYING_RULES = ("sharded_optimizer_state", "sharded_weight_update")
# ... and those a step with its parameters sharded too rests on (`sharding.params`).
PARAMETER_RULES = ("all_gather_before_use", "sharded_parameter_gradient")


def cited_rules(layout: Layout) -> dict[str, str]:
    """The rules `layout`'s sharding rests on, by name, as the plan cites them (raises
    `rules.RuleNotProven` where one is not proven here)."""
    names = JUSTIFYING_RULES + (PARAMETER_RULES if layout.gathered else ())
    names += (prefetch.RULE,) if layout.prefetch and layout.gathered else ()
    return {name: str(rules.require(name)) for name in names}


WEIGHT_UPDATES = ("search", "sharded", "replicated")

SHARD_MAP_REASON = (
    "the step is a shard_map step: its collectives are written in the function, so disco-jax cannot "
    "shard its parameters or optimizer state; to save memory, shard inside the function "
    "(jax.lax.psum_scatter the gradients, update the local slice, jax.lax.all_gather the parameters) "
    "or write the step with jax.jit and NamedSharding inputs"
)


def check_weight_update(value: Any) -> str:
    if value not in WEIGHT_UPDATES:
        raise ValueError(f"weight_update must be one of {', '.join(map(repr, WEIGHT_UPDATES))}, got {value!r}")
    return value


# ------------------------------------------------------------------------------------ enactment


def data_axis(shardings: list) -> tuple[Any, str] | None:
    """(mesh, axis name) the batch is split over: the first axis of the first `NamedSharding`
    that is not replicated."""
    for sharding in shardings:
        if isinstance(sharding, NamedSharding) and not sharding.is_fully_replicated:
            for entry in sharding.spec:
                if isinstance(entry, str):
                    return sharding.mesh, entry
    return None


def find_layout(
    fn,
    args: tuple,
    kwargs: dict,
    dynamic_args: tuple,
    dynamic_kwargs: dict,
    input_shardings: list,
    split=False,
    whole_layers=False,
    largest=False,
) -> tuple[Layout | None, str]:
    """The sharded-update layout of one call of the jitted `fn`, or (None, why not).
    `input_shardings`: per dynamic leaf, its sharding in the unmodified step's executable; `split`:
    leaves with no dimension the data axis divides are split over several where their size allows
    (`leaves.factored_mesh`; a last resort under a memory limit: the partitioner may replicate what
    such a leaf's gradient meets, so the step can get slower and its temporaries larger).
    Stacked `(layers, ...)` leaves (`leaves.stacked_leaves`) are split after their layer axis;
    with `whole_layers` on it as any other leaf (each device holds whole layers), and only for a
    step that has such leaves (None otherwise). `largest`: each leaf split on its largest
    divisible dimension rather than its first (`leaves.split_dimension`; FSDP as users write it)."""
    if getattr(fn, "_jit_info", None) is None or not hasattr(fn, "__wrapped__"):
        return None, "the step is not a jax.jit function"
    traced = fn.trace(*args, **kwargs)
    jaxpr = getattr(traced.jaxpr, "jaxpr", traced.jaxpr)
    if any(eqn.primitive.name == "shard_map" for eqn in jaxpr.eqns):
        return None, SHARD_MAP_REASON
    with_paths, _ = jax.tree_util.tree_flatten_with_path((dynamic_args, dynamic_kwargs))
    if not len(with_paths) == len(jaxpr.invars) == len(input_shardings):
        return None, "the step's inputs are not one array per argument leaf"
    found = data_axis(input_shardings)
    if found is None:
        return None, "no input is sharded over a mesh axis (no data axis)"
    mesh, axis = found
    devices = set(mesh.devices.flat)
    replicated = [s.is_fully_replicated and s.device_set == devices for s in input_shardings]
    num_shards = mesh.shape[axis]
    inputs = [v.aval for v in jaxpr.invars]
    outputs = [v.aval for v in jaxpr.outvars]
    consumed: set[int] = set()
    scanned: set[int] = set()
    origins = elementwise_origins(jaxpr, [frozenset({i}) for i in range(len(inputs))], consumed, scanned)
    stacked = stacked_leaves(origins, scanned)
    if whole_layers:
        if not stacked:
            return None, "no leaf is stacked on a layer axis (no layers under a scan)"
        stacked = frozenset()
    split_mesh = factored_mesh(mesh, axis) if split else None
    factors = factor_axes(split_mesh, mesh)
    state, updated = choose_layout(jaxpr, inputs, outputs, replicated, num_shards, (origins, consumed), factors)
    if not state:
        return None, "no replicated optimizer state updated elementwise that the data axis splits evenly"
    groups = leaf_groups(origins, state)
    path_of = lambda i: jax.tree_util.keystr(with_paths[i][0])  # noqa: E731
    spec_of = functools.partial(spec_for, axis=axis, num_shards=num_shards, factors=factors, largest=largest)
    reason = params.uneven_reason(num_shards, axis, mesh, split)
    parameters, kept_whole = params.find_parameters(
        origins,
        consumed,
        inputs,
        outputs,
        replicated,
        set(state),
        groups,
        reason,
        path_of,
        lambda i: spec_of(inputs[i].shape, stacked=i in stacked),
    )
    return Layout(
        mesh,
        axis,
        num_shards,
        {i: spec_of(inputs[i].shape, stacked=i in stacked) for i in state},
        {j: spec_of(outputs[j].shape, stacked=bool(origins[j] & stacked)) for j in updated},
        {i: path_of(i) for i in state},
        groups,
        {j: origins[j] for j in updated},
        parameters,
        kept_whole,
        split_mesh=split_mesh,
        stacked=frozenset(i for i in stacked if i in state or i in parameters),
    ), (
        f"{len(state)} optimizer-state leaves sharded {num_shards} ways over {axis!r}"
        f" ({len(parameters)} of their parameters can be sharded too"
        + (f"; {sum(1 for i in stacked if i in state)} stacked on a layer axis, split after it)" if stacked else ")")
    )


def _jit_options(info) -> dict:
    options = {
        "static_argnums": info.static_argnums,
        "static_argnames": info.static_argnames,
        "donate_argnums": info.donate_argnums,
        "donate_argnames": info.donate_argnames,
        "keep_unused": info.keep_unused,
    }
    if info.compiler_options_kvs:
        options["compiler_options"] = dict(info.compiler_options_kvs)
    return options


def _with_dynamic(args: tuple, kwargs: dict, old_dynamic: tuple, new_dynamic: tuple) -> tuple[tuple, dict]:
    """The call `(args, kwargs)` with its dynamic arguments replaced (static ones stay)."""
    new_args, new_kwargs = new_dynamic
    positional = iter(new_args)
    remaining = list(old_dynamic[0])
    out = []
    for a in args:
        if remaining and a is remaining[0]:
            remaining.pop(0)
            out.append(next(positional))
        else:
            out.append(a)
    return tuple(out), {k: new_kwargs.get(k, v) for k, v in kwargs.items()}


def relower_positional(step, args: tuple, compiled, leaves=None) -> tuple:
    """(lowered or None, `Layout` or None, reason) for a jitted step called with positional `args`
    only, every one dynamic (the zoo's steps lowered from shapes): the step lowered again with its
    optimizer state sharded. `compiled`: the unmodified step's executable; `leaves(layout)`: the
    leaf indices to shard (default all; none: lowered is None)."""
    layout, reason = find_layout(step, args, {}, args, {}, jax.tree.leaves(compiled.input_shardings))
    if layout is None:
        return None, None, reason
    if leaves is not None:
        chosen = leaves(layout)
        if not chosen:
            return None, layout, "no leaf chosen"
        layout = layout.subset(chosen)
    return relower(step, layout, args, {}, (args, {}), compiled)[0], layout, reason


def relower(fn, layout: Layout, args: tuple, kwargs: dict, dynamic: tuple, default: Any) -> tuple:
    """(lowered, resharded dynamic args, kwargs): the user's function jitted again with its own
    jit options but its shardings: the state leaves in `layout`'s sharding at input and output
    (and its sharded parameters, all-gathered before the function runs: `params.gathering`),
    every other leaf in the sharding the unmodified step's executable (`default`) gives it (the
    user's `in_shardings`/`out_shardings`, where the jit fixed them)."""
    leaves, tree = jax.tree.flatten(dynamic)
    shardings = [layout.on_step_mesh(s) for s in jax.tree.leaves(default.input_shardings)]
    leaves = [put(x, s) for x, s in zip(leaves, shardings)]
    resharded = layout.reshard(*jax.tree.unflatten(tree, leaves))
    out_leaves, out_tree = jax.tree.flatten(default.output_shardings)
    out_leaves = [layout.on_step_mesh(s) for s in out_leaves]
    for j, spec in layout.outputs.items():
        out_leaves[j] = layout.sharding(spec)
    inner = params.gathering(fn.__wrapped__, fn._jit_info, layout)
    if layout.remat:  # the loops' residuals recomputed in the backward loops (`sharding.remat`)
        inner = remat.rematerializing(inner, fn._jit_info, layout.remat)
    if layout.prefetch or layout.split_carries:  # loops rotated / their carries split (`sharding.prefetch`)
        inner = prefetch.rotating(inner, fn._jit_info, layout)
    jitted = jax.jit(
        inner,
        out_shardings=jax.tree.unflatten(out_tree, out_leaves),
        **_jit_options(fn._jit_info),
    )
    call_args, call_kwargs = _with_dynamic(args, kwargs, dynamic, resharded)
    return jitted.lower(*call_args, **call_kwargs), resharded


def memory(compiled: Any, held: dict[int, Any]) -> dict:
    """Per-device bytes from the compiled executable: its memory analysis (arguments, outputs,
    temporaries, aliased) and the bytes of the `held` input leaves (index -> aval: parameters and
    optimizer state, the leaves the replicated step holds whole on every device) under its input
    shardings."""
    analysis = compiled.memory_analysis()
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes")
    figures = {f: int(getattr(analysis, f)) for f in fields if analysis is not None and hasattr(analysis, f)}
    shardings = jax.tree.leaves(compiled.input_shardings)
    figures["params_and_state_bytes_per_device"] = sum(
        math.prod(shardings[i].shard_shape(aval.shape)) * aval.dtype.itemsize for i, aval in held.items()
    )
    return figures


class Resharding:
    """What the first call of a sharded-update program runs: its state arguments moved to the
    layout's sharding (once: the step returns them sharded), then the executable (`steady`,
    which later calls reach directly)."""

    def __init__(self, steady: Any, layout: Layout):
        self.steady, self.layout = steady, layout

    def reshard(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return self.layout.reshard(args, kwargs)

    def __call__(self, *args, **kwargs):
        args, kwargs = self.layout.reshard(args, kwargs)
        return self.steady(*args, **kwargs)

    def as_text(self) -> str:
        return self.steady.as_text()


def not_applicable(reason: str) -> dict:
    _warnings.warn(
        f"disco-jax: sharded weight update not applicable ({reason}); running the replicated update",
        UserWarning,
    )
    return {"mode": "replicated", "requested": "sharded", "reason": reason}


def collectives(text: str) -> dict[str, int]:
    """Collectives and slices in a compiled module's text (all computations)."""
    ops = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute", "dynamic-slice")
    return {op: len(re.findall(rf"\s{op}(?:-start)?\(", text)) for op in ops}


def sharded_step(fn, step: Captured, args: tuple, kwargs: dict, backend, check: bool):
    """(the program to optimize, its `Layout` or None, what the report and plan record): `step`
    (the call as made) lowered again with the sharded update, or `step` itself with a warning
    when no leaf qualifies. `check`: run both once and fall back when their outputs differ
    beyond the validation tolerance (the partitioner may sum in another order)."""
    input_shardings = jax.tree.leaves(step.default_compiled.input_shardings)
    layout, reason = find_layout(fn, args, kwargs, step.args, step.kwargs, input_shardings)
    if layout is None:
        return step, None, not_applicable(reason)
    # The layout's conditions (state updated elementwise, N divides the split dimension) are the
    # side conditions of the rules that make the sharded update equal the replicated one.
    try:
        cited = cited_rules(layout)
    except rules.RuleNotProven as e:
        return step, None, not_applicable(f"the rule it rests on is not proven here ({e})")
    sharded = relowered(fn, step, layout, args, kwargs, backend)
    held = held_leaves(step)
    info = {
        "mode": "sharded",
        "requested": "sharded",
        "reason": reason,
        **layout.to_json(),
        "rules": cited,
        "state_bytes_per_device": {
            "replicated": layout.state_bytes(held) * layout.num_shards,
            "sharded": layout.state_bytes(held),
        },
        "memory": {
            "replicated": memory(step.default_compiled, held),
            "sharded": memory(sharded.default_compiled, held),
        },
        "collectives": {
            "replicated": collectives(step.default_compiled.as_text()),
            "sharded": collectives(sharded.default_compiled.as_text()),
        },
    }
    if check:
        comparison = check_outputs(step, sharded)
        info["check"] = dataclasses.asdict(comparison)
        if not comparison.within_tolerance:
            reason = f"its outputs differ from the replicated update's: {comparison.summary()}"
            return step, None, not_applicable(reason)
    return sharded, layout, info


def hook_backend(backend, layout: Layout | None):
    """The backend a program with `layout` is compiled for: `backend`, with the re-gather rule
    among its hook rules where the layout gathers its parameters again for each use (the
    program's every compile then applies it: its capture, its plans' rewrites)."""
    if layout is None or not (layout.regather and layout.gathered) or apply.REGATHER_RULE in backend.hook_rules:
        return backend
    return dataclasses.replace(backend, hook_rules=backend.hook_rules | {apply.REGATHER_RULE})


def relowered(fn, step: Captured, layout: Layout, args: tuple, kwargs: dict, backend) -> Captured:
    """The program of `step` lowered again with `layout` (`relower`), captured (for
    `hook_backend(backend, layout)`). It computes the same call: it shares `step`'s float64 run."""
    lowered, (dynamic_args, dynamic_kwargs) = relower(
        fn, layout, args, kwargs, (step.args, step.kwargs), step.default_compiled
    )
    program = capture(lowered, hook_backend(backend, layout), dynamic_args, dynamic_kwargs)
    program.exact = step.exact
    return program


def held_leaves(step: Captured) -> dict[int, Any]:
    """Index -> aval of the input leaves the replicated step holds whole on every device
    (`replicated_leaves` of its executable and arguments)."""
    return replicated_leaves(step.default_compiled, step.args, step.kwargs)


def replicated_leaves(compiled: Any, args: tuple, kwargs: dict) -> dict[int, Any]:
    """Index -> aval of the leaves of `(args, kwargs)` that `compiled` takes whole on every device
    (none where the executable's inputs are not one per leaf)."""
    shardings = jax.tree.leaves(compiled.input_shardings)
    leaves = jax.tree.leaves((args, kwargs))
    if len(shardings) != len(leaves):  # XLA dropped unused arguments: no leaf-by-leaf account
        return {}
    return {i: jax.typeof(x) for i, x in enumerate(leaves) if shardings[i].is_fully_replicated}


def check_outputs(step: Captured, sharded: Captured) -> _validate.Comparison:
    """The sharded program's outputs against the replicated one's check (`step.output_check`: the
    float64 run of the call where it runs, else the ulp tolerance; a reduce-scatter may sum in
    another order than an all-reduce: not bitwise). Each process compares the regions of its own
    shards of the sharded program's outputs; every process's verdict merged in a multi-process job."""
    merge_key = None if step.scope is None else f"{step.scope}/weight-update-check"
    runner = sharded.runner(sharded.default_compiled)
    return step.output_check.compare(runner(), merge_key=merge_key, rerun=runner.on)
