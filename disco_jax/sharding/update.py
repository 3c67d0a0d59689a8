"""The sharded weight update (Xu et al. 2020, "Automatic Cross-Replica Sharding of Weight Update in
Data-Parallel Training"; ZeRO stage 1) for `jax.jit` + `NamedSharding` data-parallel steps.

In a data-parallel step every device holds the whole optimizer state and repeats the whole
update. Here the optimizer state is kept sharded over the data axis between steps: each device
updates its own slice of each state tensor and the new parameters are all-gathered. Nothing is
rewritten by hand: the user's function is lowered again with input and output shardings that
keep that state sharded (`P("data")` on one dimension) and everything else as the unmodified step
has it, and XLA's SPMD partitioner emits the collectives.

Which input leaves are such state is read from the step's jaxpr (`choose_layout`): a leaf that is
replicated over the data axis, has a dimension the axis size divides, is used by elementwise
operations only (transitively, through nested jits and custom derivatives), and whose
elementwise descendants include an output of its shape and dtype that depends elementwise on
such leaves only (its updated value). Adam's `mu`/`nu` and SGD's momentum qualify; parameters do
not (they feed the forward pass's dots), nor scalar step counters (no divisible dimension), nor
anything inside a `shard_map` (its collectives are written in the function: the update there is
whatever the function computes).
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from typing import Any

import jax
from jax.extend import core as jax_core
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from disco_jax import _validate
from disco_jax._compile import Captured, capture
from disco_jax.sharding import rules

# The proven rules (`disco-jax rules`) a sharded update rests on; the plan cites them.
JUSTIFYING_RULES = ("sharded_optimizer_state", "sharded_weight_update")

WEIGHT_UPDATES = ("search", "sharded", "replicated")

# Primitives that compute each output element from the same element of each operand.
ELEMENTWISE = frozenset(
    "abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp convert_element_type copy copy_p "
    "cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag integer_pow is_finite le "
    "lgamma log log1p logistic lt max min mul ne neg nextafter not one_minus_square or pow real "
    "reduce_precision rem round rsqrt select_n sign sin sinh sqrt square stop_gradient sub tan tanh "
    "xor".split()
)
# Primitives that call a jaxpr on their operands one to one: followed inside.
_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
_CALLS = frozenset("pjit jit closed_call core_call custom_jvp_call custom_vjp_call remat checkpoint".split())


def check_weight_update(value: Any) -> str:
    if value not in WEIGHT_UPDATES:
        raise ValueError(f"weight_update must be one of {', '.join(map(repr, WEIGHT_UPDATES))}, got {value!r}")
    return value


# ------------------------------------------------------------------------- which leaves to shard


def _inner_jaxpr(eqn) -> Any:
    if eqn.primitive.name not in _CALLS:
        return None
    for name in _CALL_PARAMS:
        inner = eqn.params.get(name)
        if inner is not None:
            return getattr(inner, "jaxpr", inner)
    return None


def elementwise_origins(jaxpr, in_origins: list[frozenset], consumed: set[int]) -> list[frozenset]:
    """Per output of `jaxpr`: the inputs (by `in_origins` labels) it is computed from through
    shape-preserving elementwise operations only. Labels that reach any other operation (a dot,
    a reduction, a broadcast, a collective, control flow, a `shard_map`) go into `consumed`."""
    env: dict = {}

    def origin(atom) -> frozenset:
        return frozenset() if isinstance(atom, jax_core.Literal) else env.get(atom, frozenset())

    for var, labels in zip(jaxpr.invars, in_origins):
        env[var] = labels
    for eqn in jaxpr.eqns:
        operands = [origin(a) for a in eqn.invars]
        inner = _inner_jaxpr(eqn)
        if inner is not None and len(inner.invars) == len(operands) and len(inner.outvars) == len(eqn.outvars):
            results = elementwise_origins(inner, operands, consumed)
        elif eqn.primitive.name in ELEMENTWISE and len(eqn.outvars) == 1:
            shape, labels = eqn.outvars[0].aval.shape, frozenset()
            for atom, operand in zip(eqn.invars, operands):
                if atom.aval.shape == shape:
                    labels |= operand
                else:
                    consumed.update(operand)
            results = [labels]
        else:
            for operand in operands:
                consumed.update(operand)
            results = [frozenset()] * len(eqn.outvars)
        for var, labels in zip(eqn.outvars, results):
            env[var] = labels
    return [origin(v) for v in jaxpr.outvars]


def split_dimension(shape: tuple[int, ...], num_shards: int) -> int | None:
    """The first dimension `num_shards` divides (None: the leaf cannot be split evenly)."""
    return next((d for d, size in enumerate(shape) if size >= num_shards and size % num_shards == 0), None)


def spec_for(shape: tuple[int, ...], axis: str, num_shards: int) -> P:
    d = split_dimension(shape, num_shards)
    return P(*([None] * d), axis)


def choose_layout(jaxpr, inputs: list, outputs: list, replicated: list[bool], num_shards: int, origins=None):
    """(input leaves to shard, outputs that are their updated values), by index. `inputs` /
    `outputs`: avals of the jaxpr's inputs and outputs; `replicated`: per input, whether it is
    held whole on every device of the data axis; `origins`: `(elementwise_origins(jaxpr, one
    label per input), the labels it consumed)` when the caller has them."""
    if origins is None:
        consumed: set[int] = set()
        origins = elementwise_origins(jaxpr, [frozenset({i}) for i in range(len(inputs))], consumed), consumed
    origins, consumed = origins
    state = {
        i
        for i, aval in enumerate(inputs)
        if replicated[i] and i not in consumed and split_dimension(aval.shape, num_shards) is not None
    }
    while True:  # an output is a state's update when it depends elementwise on state leaves only
        updated = {
            j
            for j, labels in enumerate(origins)
            if labels
            and labels <= state
            and all((inputs[i].shape, inputs[i].dtype) == (outputs[j].shape, outputs[j].dtype) for i in labels)
        }
        kept = {i for i in state if any(i in origins[j] for j in updated)}
        if kept == state:
            return sorted(state), sorted(updated)
        state = kept


# ------------------------------------------------------------------------------------ enactment


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the sharded update keeps what: the data axis, its size, and per input leaf (index
    into the call's dynamic leaves) and per output leaf the `PartitionSpec` of the leaves it
    shards. `paths` names the input leaves (`jax.tree_util.keystr`) for the plan."""

    mesh: Any
    axis: str
    num_shards: int
    inputs: dict[int, P]
    outputs: dict[int, P]
    paths: dict[int, str]
    # The choice's units (`weight_update="search"`): input leaves that are updated together (they
    # meet in some output, as a parameter's Adam moments do), and per sharded output the inputs
    # it is computed from. Sharding a union of groups keeps every such output's inputs alike.
    groups: tuple[tuple[int, ...], ...] = ()
    sources: dict[int, frozenset] = dataclasses.field(default_factory=dict)

    def subset(self, leaves) -> Layout:
        """This layout with only the input leaves `leaves` (a union of `groups`) sharded."""
        keep = set(leaves)
        outputs = {j: spec for j, spec in self.outputs.items() if self.sources.get(j, frozenset()) <= keep}
        groups = tuple(g for g in self.groups if set(g) <= keep)
        pick = lambda d: {i: v for i, v in d.items() if i in keep}  # noqa: E731
        return dataclasses.replace(
            self, inputs=pick(self.inputs), outputs=outputs, paths=pick(self.paths), groups=groups
        )

    def state_bytes(self, avals: dict[int, Any]) -> int:
        """Per-device bytes of the sharded leaves (`avals`: index -> aval of every input leaf)."""
        return sum(math.prod(avals[i].shape) * avals[i].dtype.itemsize // self.num_shards for i in self.inputs)

    def to_json(self) -> dict:
        return {
            "axis": self.axis,
            "num_shards": self.num_shards,
            "leaves": {self.paths[i]: [d for d in spec] for i, spec in sorted(self.inputs.items())},
        }

    def reshard(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The call's dynamic arguments with the sharded leaves moved to their sharding (a no-op
        for leaves that have it already)."""
        leaves, tree = jax.tree.flatten((args, kwargs))
        for i, spec in self.inputs.items():
            target = NamedSharding(self.mesh, spec)
            if isinstance(leaves[i], jax.ShapeDtypeStruct):  # an abstract call (deviceless lowering)
                leaves[i] = jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype, sharding=target)
            elif leaves[i].sharding != target:
                leaves[i] = jax.device_put(leaves[i], target)
        return jax.tree.unflatten(tree, leaves)


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
    fn, args: tuple, kwargs: dict, dynamic_args: tuple, dynamic_kwargs: dict, input_shardings: list
) -> tuple[Layout | None, str]:
    """The sharded-update layout of one call of the jitted `fn`, or (None, why not).
    `input_shardings`: per dynamic leaf, its sharding in the unmodified step's executable."""
    if getattr(fn, "_jit_info", None) is None or not hasattr(fn, "__wrapped__"):
        return None, "the step is not a jax.jit function"
    traced = fn.trace(*args, **kwargs)
    jaxpr = getattr(traced.jaxpr, "jaxpr", traced.jaxpr)
    if any(eqn.primitive.name == "shard_map" for eqn in jaxpr.eqns):
        return None, "the step is a shard_map step (its collectives are written in the function)"
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
    origins = elementwise_origins(jaxpr, [frozenset({i}) for i in range(len(inputs))], consumed)
    state, updated = choose_layout(jaxpr, inputs, outputs, replicated, num_shards, (origins, consumed))
    if not state:
        return None, "no replicated optimizer state updated elementwise with a dimension divisible by the data axis"
    return Layout(
        mesh,
        axis,
        num_shards,
        {i: spec_for(inputs[i].shape, axis, num_shards) for i in state},
        {j: spec_for(outputs[j].shape, axis, num_shards) for j in updated},
        {i: jax.tree_util.keystr(with_paths[i][0]) for i in state},
        leaf_groups(origins, state),
        {j: origins[j] for j in updated},
    ), f"{len(state)} optimizer-state leaves sharded {num_shards} ways over {axis!r}"


def leaf_groups(origins: list[frozenset], state: list[int]) -> tuple[tuple[int, ...], ...]:
    """The state leaves joined whenever some output is computed from several of them."""
    group = {i: frozenset({i}) for i in state}
    for labels in origins:
        members = frozenset().union(*(group[i] for i in labels if i in group))
        for i in members:
            group[i] = members
    return tuple(sorted({tuple(sorted(g)) for g in group.values()}))


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
    jit options but its shardings: the state leaves in `layout`'s sharding at input and output,
    every other leaf in the sharding the unmodified step's executable (`default`) gives it (the
    user's `in_shardings`/`out_shardings`, where the jit fixed them)."""
    leaves, tree = jax.tree.flatten(dynamic)
    shardings = jax.tree.leaves(default.input_shardings)
    leaves = [jax.device_put(x, s) if isinstance(x, jax.Array) else x for x, s in zip(leaves, shardings)]
    resharded = layout.reshard(*jax.tree.unflatten(tree, leaves))
    out_leaves, out_tree = jax.tree.flatten(default.output_shardings)
    for j, spec in layout.outputs.items():
        out_leaves[j] = NamedSharding(layout.mesh, spec)
    jitted = jax.jit(
        fn.__wrapped__, out_shardings=jax.tree.unflatten(out_tree, out_leaves), **_jit_options(fn._jit_info)
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


def not_applicable(reason: str, stacklevel: int) -> dict:
    warnings.warn(
        f"disco-jax: sharded weight update not applicable ({reason}); running the replicated update",
        UserWarning,
        stacklevel=stacklevel,
    )
    return {"mode": "replicated", "requested": "sharded", "reason": reason}


def collectives(text: str) -> dict[str, int]:
    """Collectives and slices in a compiled module's text (all computations)."""
    ops = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute", "dynamic-slice")
    return {op: len(re.findall(rf"\s{op}(?:-start)?\(", text)) for op in ops}


def sharded_step(fn, step: Captured, args: tuple, kwargs: dict, backend, check: bool, stacklevel: int):
    """(the program to optimize, its `Layout` or None, what the report and plan record): `step`
    (the call as made) lowered again with the sharded update, or `step` itself with a warning
    when no leaf qualifies. `check`: run both once and fall back when their outputs differ
    beyond the validation tolerance (the partitioner may sum in another order)."""
    input_shardings = jax.tree.leaves(step.default_compiled.input_shardings)
    layout, reason = find_layout(fn, args, kwargs, step.args, step.kwargs, input_shardings)
    if layout is None:
        return step, None, not_applicable(reason, stacklevel + 1)
    # The layout's conditions (state updated elementwise, N divides the split dimension) are the
    # side conditions of the rules that make the sharded update equal the replicated one.
    try:
        cited = {name: str(rules.require(name)) for name in JUSTIFYING_RULES}
    except rules.RuleNotProven as e:
        return step, None, not_applicable(f"the rule it rests on is not proven here ({e})", stacklevel + 1)
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
            return step, None, not_applicable(reason, stacklevel + 1)
    return sharded, layout, info


def relowered(fn, step: Captured, layout: Layout, args: tuple, kwargs: dict, backend) -> Captured:
    """The program of `step` lowered again with `layout` (`relower`), captured. It computes the
    same call: it shares `step`'s float64 run."""
    lowered, (dynamic_args, dynamic_kwargs) = relower(
        fn, layout, args, kwargs, (step.args, step.kwargs), step.default_compiled
    )
    program = capture(lowered, backend, dynamic_args, dynamic_kwargs)
    program.exact = step.exact
    return program


def held_leaves(step: Captured) -> dict[int, Any]:
    """Index -> aval of the input leaves the replicated step holds whole on every device (none
    where the executable's inputs are not one per leaf)."""
    shardings = jax.tree.leaves(step.default_compiled.input_shardings)
    leaves = jax.tree.leaves((step.args, step.kwargs))
    if len(shardings) != len(leaves):  # XLA dropped unused arguments: no leaf-by-leaf account
        return {}
    return {i: jax.typeof(x) for i, x in enumerate(leaves) if shardings[i].is_fully_replicated}


def check_outputs(step: Captured, sharded: Captured) -> _validate.Comparison:
    """The sharded program's outputs against the replicated one's check (`step.output_check`: the
    float64 run of the call where it runs, else the ulp tolerance; a reduce-scatter may sum in
    another order than an all-reduce: not bitwise). Each process compares the regions of its own
    shards of the sharded program's outputs; every process's verdict merged in a multi-process job."""
    merge_key = None if step.scope is None else f"{step.scope}/weight-update-check"
    return step.output_check.compare(sharded.runner(sharded.default_compiled)(), merge_key=merge_key)
