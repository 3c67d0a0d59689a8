"""Parameters sharded too (ZeRO stage 3 / FSDP): which parameter leaves can be kept sharded with
their optimizer state, and the step that all-gathers them before use.

A *parameter* of a state group (`Layout.groups`: a parameter's Adam moments) is the replicated
input leaf whose new value is computed elementwise from it and that group's state only (Adam:
`p + lr * mu_hat / (sqrt(nu_hat) + eps)`; SGD with momentum alike), of the same shape and dtype.
It is read whole by the forward and the backward pass (dots), so it cannot be sliced where it is
used: the step lowered again takes it sharded over the data axis, all-gathers it at the start
(`gathering`: `jax.sharding.reshard` to replicated for explicit mesh axes, a sharding constraint
otherwise; the rule `all_gather_before_use`), runs the user's function on the gathered value, and
returns its new value sharded. XLA's partitioner then reduces the gradient and each device takes
its block (`sharded_parameter_gradient`; a reduce-scatter on XLA:GPU, on XLA:CPU the hook's
`own_block_of_all_reduce`), and the update of the parameter's own block reads the gathered
value's own block, which the hook reads from the shard itself (`own_block_of_all_gather`,
`sharding.gathered`; a hook rule of XLA:CPU only), so there the gathered parameters die after
the backward pass; XLA:GPU keeps them live through it (docs/gpu.md).

Leaves with no dimension the data axis divides are split over several dimensions, as the memory
search's last resort, where their size allows it and the mesh's axes are Auto
(`leaves.factored_mesh`, `update.find_layout(split=True)`); the others stay replicated,
with the reason recorded (`Layout.kept_whole`): JAX refuses uneven shardings of a jit's inputs and
outputs ("implies that array axis 0 is partitioned 8 times, but the dimension size is 4"), and
keeping such a leaf flattened and padded between steps would change the pytree the user's step
takes and returns.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from disco_jax.sharding.leaves import choose_layout, leaf_groups

UNEVEN = (
    "{what} by the {n} devices of {axis!r}: JAX requires a jit's sharded inputs and outputs to divide "
    "evenly, and padding it would change the step's pytree; kept replicated{note}"
)
NOTES = {
    "explicit": " (a leaf whose size they divide is split over several dimensions, as a last resort, where the "
    "mesh's axes are Auto; with Explicit axes a step takes one mesh)",
    "unsplit": " (a leaf whose size they divide is split over several dimensions only where nothing else fits a "
    "memory limit)",
}


def uneven_reason(num_shards: int, axis: str, mesh, split: bool) -> str:
    """Why `find_parameters` keeps a leaf of the update whole (`UNEVEN`); `split`: leaves were
    split over several dimensions where they could be (`leaves.factored_mesh`)."""
    explicit = any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))
    what = "neither a dimension nor the size divisible" if split and not explicit else "no dimension divisible"
    note = NOTES["explicit"] if explicit else "" if split else NOTES["unsplit"]
    return UNEVEN.format(what=what, n=num_shards, axis=axis, note=note)


@dataclasses.dataclass(frozen=True)
class Parameter:
    """A parameter leaf the step updates from one group of optimizer state (`Layout.parameters`)."""

    group: tuple[int, ...]
    spec: P
    output: int
    path: str


def find_parameters(origins, consumed, inputs, outputs, replicated, state, groups, reason, path_of, spec_for):
    """(index -> Parameter, path -> why kept replicated) for the step whose outputs' elementwise
    origins are `origins` (`update.elementwise_origins`): the parameter leaves of the state
    `groups` (`state`: every state leaf the update shards, `groups` their groups; an elementwise-
    updated leaf with no divisible dimension is named in the second result, as is the parameter
    of its group, with `reason`); `consumed`: the labels that reach other operations. `path_of(i)`:
    input leaf i's path; `spec_for(i)`: its spec (None: it cannot be split evenly)."""
    whole_state, _ = choose_layout(None, inputs, outputs, replicated, 1, (origins, consumed))
    kept = {path_of(i): reason for i in whole_state if i not in state}
    group_of = {i: g for g in leaf_groups(origins, whole_state) for i in g}
    found: dict[int, Parameter] = {}
    seen: set[int] = set()
    for j, labels in enumerate(origins):
        rest = [i for i in labels if i not in group_of]
        owners = {group_of[i] for i in labels if i in group_of}
        if len(rest) != 1 or len(owners) != 1:
            continue
        (p,), (g,) = rest, owners
        if not replicated[p] or (inputs[p].shape, inputs[p].dtype) != (outputs[j].shape, outputs[j].dtype):
            continue
        if p in seen:  # two outputs computed from it: not one parameter's update
            found.pop(p, None)
            continue
        seen.add(p)
        spec = spec_for(p) if g in groups else None
        if spec is not None:
            found[p] = Parameter(g, spec, j, path_of(p))
        else:
            kept[path_of(p)] = reason
    return found, kept


def explicit_axes(mesh) -> bool:
    """Whether `mesh` has Explicit axes: shardings are then part of the types the user's function
    sees, so its parameters cannot enter it sharded (`Layout.at_use`) without changing its ops."""
    return any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def replicated_value(x, mesh):
    """`x` all-gathered to every device of `mesh`, inside a traced step: `reshard` where the mesh
    has explicit axes (the sharding is part of the type there), a sharding constraint otherwise."""
    target = NamedSharding(mesh, P())
    if explicit_axes(mesh):
        return jax.sharding.reshard(x, target)
    return jax.lax.with_sharding_constraint(x, target)


def gathering(inner, info, layout):
    """The user's function `inner` (jit options `info`) with the dynamic leaves `layout.gathered`
    all-gathered before it runs: what the relowered step calls, so that the partitioner gathers
    each sharded parameter once and the user's code sees whole parameters."""
    gathered = layout.gathered_before_step
    if not gathered:
        return inner
    static_names = set(info.static_argnames)

    @functools.wraps(inner)
    def step(*args, **kwargs):
        static = {k % len(args) for k in info.static_argnums} if args else set()
        dynamic = (tuple(a for k, a in enumerate(args) if k not in static), {})
        dynamic[1].update((k, v) for k, v in kwargs.items() if k not in static_names)
        leaves, tree = jax.tree.flatten(dynamic)
        for i in gathered:
            leaves[i] = replicated_value(leaves[i], layout.step_mesh)
        new_args, new_kwargs = jax.tree.unflatten(tree, leaves)
        positional = iter(new_args)
        args = tuple(a if k in static else next(positional) for k, a in enumerate(args))
        return inner(*args, **{**kwargs, **new_kwargs})

    return step
