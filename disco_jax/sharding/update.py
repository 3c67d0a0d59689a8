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
import functools
import math
import re
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from disco_jax import _validate, _warnings
from disco_jax._compile import Captured, capture
from disco_jax.sharding import apply, params, rules
from disco_jax.sharding.leaves import (  # noqa: F401  (the layout's reading of the jaxpr, re-exported)
    choose_layout,
    elementwise_origins,
    leaf_groups,
    spec_for,
)
from disco_jax.sharding.params import Parameter

# The proven rules (`disco-jax rules`) a sharded update rests on; the plan cites them.
JUSTIFYING_RULES = ("sharded_optimizer_state", "sharded_weight_update")
# ... and those a step with its parameters sharded too rests on (`sharding.params`).
PARAMETER_RULES = ("all_gather_before_use", "sharded_parameter_gradient")


def cited_rules(layout: Layout) -> dict[str, str]:
    """The rules `layout`'s sharding rests on, by name, as the plan cites them (raises
    `rules.RuleNotProven` where one is not proven here)."""
    names = JUSTIFYING_RULES + (PARAMETER_RULES if layout.gathered else ())
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
    # Parameters and state sharded (ZeRO-3; `sharding.params`): per parameter leaf whose new value
    # is computed elementwise from it and one group's state only, that group, its spec and its new
    # value's output. A parameter is sharded (and all-gathered before use) only when in `inputs`.
    parameters: dict[int, Parameter] = dataclasses.field(default_factory=dict)
    # Leaves of the update (parameters, state) kept replicated, by path, and why.
    kept_whole: dict[str, str] = dataclasses.field(default_factory=dict)
    # The sharded parameters gathered again for each use (`sharding.regather`, applied at the hook:
    # `hook_backend`), not once for the step: less memory, more all-gathers.
    regather: bool = False

    def subset(self, leaves, regather: bool = False) -> Layout:
        """This layout with only the input leaves `leaves` sharded: a union of `groups`, plus the
        parameters (`parameters`) of some of those groups for parameters and state sharded,
        gathered again for each use with `regather`."""
        keep = set(leaves)
        for p in keep & self.parameters.keys():
            if not set(self.parameters[p].group) <= keep:
                raise ValueError(f"parameter {self.parameters[p].path} sharded without its state")
        specs = {**self.inputs, **{p: q.spec for p, q in self.parameters.items()}}
        outputs = {**self.outputs, **{q.output: q.spec for q in self.parameters.values()}}
        sources = {**self.sources, **{q.output: frozenset({p, *q.group}) for p, q in self.parameters.items()}}
        paths = {**self.paths, **{p: q.path for p, q in self.parameters.items()}}
        pick = lambda d: {i: v for i, v in d.items() if i in keep}  # noqa: E731
        return dataclasses.replace(
            self,
            inputs=pick(specs),
            outputs={j: spec for j, spec in outputs.items() if sources.get(j, frozenset()) <= keep},
            paths=pick(paths),
            groups=tuple(g for g in self.groups if set(g) <= keep),
            regather=regather,
        )

    def all_leaves(self, parameters: bool = True) -> tuple[int, ...]:
        """Every leaf this layout can shard: the groups' state, and with `parameters` their
        parameters (the fully sharded step: ZeRO-3)."""
        state = [i for g in self.groups for i in g]
        return tuple(sorted(state + (list(self.parameters) if parameters else [])))

    @property
    def gathered(self) -> tuple[int, ...]:
        """The sharded parameter leaves: all-gathered before use inside the step."""
        return tuple(sorted(set(self.inputs) & self.parameters.keys()))

    def all_paths(self) -> dict[str, int]:
        """Path -> index of every leaf this layout can shard (state and parameters)."""
        return {path: i for i, path in {**self.paths, **{p: q.path for p, q in self.parameters.items()}}.items()}

    def state_bytes(self, avals: dict[int, Any]) -> int:
        """Per-device bytes of the sharded optimizer-state leaves (`avals`: index -> aval of every
        input leaf)."""
        return self._bytes(avals, [i for i in self.inputs if i not in self.parameters])

    def _bytes(self, avals: dict[int, Any], leaves) -> int:
        return sum(math.prod(avals[i].shape) * avals[i].dtype.itemsize // self.num_shards for i in leaves)

    @property
    def parameter_of(self) -> dict[tuple[int, ...], int]:
        """State group -> the parameter leaf it updates (groups without one are absent)."""
        return {q.group: p for p, q in self.parameters.items()}

    def group_names(self) -> dict[str, tuple[int, ...]]:
        """Name -> state group: a group is named by its parameter's path where it has one, else by
        its first leaf's path (the names `choices` and `leaves_for` use)."""
        param_of = self.parameter_of
        return {
            self.parameters[param_of[g]].path if g in param_of else self.paths.get(g[0], str(g)): g for g in self.groups
        }

    def layers(self) -> dict[str, tuple[str, ...]]:
        """Layer -> names of its groups, in the order of the groups: a layer is a parameter's path
        without its last key (`['Dense_0']['kernel']` and `['Dense_0']['bias']` form `['Dense_0']`),
        so that a layer's parameters are sharded together."""
        out: dict[str, list[str]] = {}
        for name in self.group_names():
            layer = name[: name.rfind("[")] if name.endswith("]") and "[" in name else name
            out.setdefault(layer, []).append(name)
        return {k: tuple(v) for k, v in out.items()}

    def leaves_for(self, choices: dict[str, str]) -> tuple[int, ...]:
        """The leaves to shard for a choice per group (name -> 'replicated', 'state' or 'params';
        a group not named stays replicated): what `subset` takes."""
        names, leaves, param_of = self.group_names(), [], self.parameter_of
        for name, choice in choices.items():
            if choice not in ("replicated", "state", "params"):
                raise ValueError(f"choice for {name} must be 'replicated', 'state' or 'params', got {choice!r}")
            if name not in names:
                raise ValueError(f"no parameter group {name!r}; groups: {', '.join(names)}")
            group = names[name]
            if choice == "params" and group not in param_of:
                raise ValueError(f"group {name} has no parameter that can be sharded")
            leaves += [] if choice == "replicated" else [*group, *([param_of[group]] if choice == "params" else [])]
        return tuple(sorted(leaves))

    def choices(self) -> dict[str, str]:
        """Per sharded group (named by its parameter's path where it has one, else its first
        leaf's), its choice: 'state' (optimizer state sharded) or 'params' (parameter and state)."""
        param_of = self.parameter_of
        return {name: "params" if param_of.get(g) in self.inputs else "state" for name, g in self.group_names().items()}

    def to_json(self) -> dict:
        return {
            "axis": self.axis,
            "num_shards": self.num_shards,
            "leaves": {self.paths[i]: [d for d in spec] for i, spec in sorted(self.inputs.items())},
            "parameters": sorted(self.paths[i] for i in self.gathered),
            "choices": self.choices(),
            "kept_whole": dict(self.kept_whole),
            **({"regather": True} if self.regather and self.gathered else {}),
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
    origins = elementwise_origins(jaxpr, [frozenset({i}) for i in range(len(inputs))], consumed)
    state, updated = choose_layout(jaxpr, inputs, outputs, replicated, num_shards, (origins, consumed))
    if not state:
        return None, "no replicated optimizer state updated elementwise with a dimension divisible by the data axis"
    groups = leaf_groups(origins, state)
    path_of = lambda i: jax.tree_util.keystr(with_paths[i][0])  # noqa: E731
    split = functools.partial(spec_for, axis=axis, num_shards=num_shards)
    parameters, kept_whole = params.find_parameters(
        origins, consumed, inputs, outputs, replicated, set(state), groups, num_shards, axis, path_of, split
    )
    return Layout(
        mesh,
        axis,
        num_shards,
        {i: spec_for(inputs[i].shape, axis, num_shards) for i in state},
        {j: spec_for(outputs[j].shape, axis, num_shards) for j in updated},
        {i: path_of(i) for i in state},
        groups,
        {j: origins[j] for j in updated},
        parameters,
        kept_whole,
    ), (
        f"{len(state)} optimizer-state leaves sharded {num_shards} ways over {axis!r}"
        f" ({len(parameters)} of their parameters can be sharded too)"
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
    shardings = jax.tree.leaves(default.input_shardings)
    leaves = [jax.device_put(x, s) if isinstance(x, jax.Array) else x for x, s in zip(leaves, shardings)]
    resharded = layout.reshard(*jax.tree.unflatten(tree, leaves))
    out_leaves, out_tree = jax.tree.flatten(default.output_shardings)
    for j, spec in layout.outputs.items():
        out_leaves[j] = NamedSharding(layout.mesh, spec)
    jitted = jax.jit(
        params.gathering(fn.__wrapped__, fn._jit_info, layout),
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
    return step.output_check.compare(sharded.runner(sharded.default_compiled)(), merge_key=merge_key)
