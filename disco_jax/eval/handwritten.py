"""The sharded configurations a JAX user writes by hand, as baselines for disco-jax's plans.

A user who wants FSDP writes no transformation: they put a `NamedSharding` on every parameter
and optimizer-state leaf (the FSDP guides' rule: split the leaf's largest dimension the data axis
divides, leave the rest whole), give the jit those shardings at input and output, and donate the
state. XLA's partitioner then all-gathers each parameter where a dot reads it (in a scanned loop,
per iteration) and reduce-scatters its gradient. `fsdp_shardings` is that rule, written here
independently of disco-jax's own layouts (`sharding.leaves.spec_for`) so that the comparison is
against what a user writes, not against disco-jax's choice.

`lower_fsdp(spec, optimizer, mesh)` lowers the zoo model's step written that way, from shapes only
(deviceless for a GPU target).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from disco_jax import zoo

DATA_AXIS = "data"  # the zoo's batch axis


def fsdp_spec(shape: tuple[int, ...], axis: str, num_shards: int, stacked: bool = False) -> P:
    """The FSDP guides' spec of one leaf: `axis` on its largest dimension that `num_shards`
    divides (after the leading layer axis where `stacked`), replicated where none does."""
    first = 1 if stacked and len(shape) > 1 else 0
    dims = [d for d in range(first, len(shape)) if shape[d] % num_shards == 0 and shape[d] >= num_shards]
    if not dims:
        return P()
    d = max(dims, key=lambda d: (shape[d], -d))
    return P(*([None] * d), axis)


def fsdp_shardings(tree, mesh, axis: str = DATA_AXIS, stacked_under: str = "['blocks']"):
    """Per leaf of `tree` (shapes), its FSDP `NamedSharding` on `mesh` (`fsdp_spec`); leaves whose
    path contains `stacked_under` (the zoo GPT's `nn.scan` stack) carry a leading layer axis."""
    num_shards = mesh.shape[axis]

    def spec(path, leaf):
        shape = tuple(getattr(leaf, "shape", ()))
        stacked = stacked_under in jax.tree_util.keystr(path)
        return NamedSharding(mesh, fsdp_spec(shape, axis, num_shards, stacked))

    return jax.tree_util.tree_map_with_path(spec, tree)


def fsdp_step(spec: zoo.ModelSpec, optimizer, mesh, donate: bool = True):
    """(jitted step, abstract (state, batch)) of `spec`'s train step written as FSDP by hand:
    parameters and optimizer state under `fsdp_shardings` at input and output, the batch split
    over the data axis, the state donated."""
    state, batch = zoo.abstract_state_and_batch(spec, optimizer, mesh)
    mesh = jax.tree.leaves(state)[0].sharding.mesh  # the mesh with Auto axes the zoo built
    shardings = fsdp_shardings(state, mesh)
    state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), state, shardings)
    replicated = NamedSharding(mesh, P())
    step = zoo.build_train_step(spec, optimizer, mesh, "jit", donate=donate)
    jitted = jax.jit(
        step.__wrapped__,
        in_shardings=(shardings, NamedSharding(mesh, P(DATA_AXIS))),
        out_shardings=(shardings, replicated),
        donate_argnums=(0,) if donate else (),
    )
    return jitted, (state, batch)


# Megatron-LM's layout of the zoo GPT as a user writes it by parameter name: the first dot of each
# pair split on its output (column), the second on its input (row), the tied embedding on the
# vocabulary; the stacked leaves of `nn.scan` carry a leading layer axis.
MEGATRON = (
    ("['qkv']['kernel']", "column"),
    ("['Dense_0']['kernel']", "column"),
    ("['qkv']['bias']", "column"),
    ("['Dense_0']['bias']", "column"),
    ("['out']['kernel']", "row"),
    ("['Dense_1']['kernel']", "row"),
    ("['embedding']", "vocabulary"),
)


# The configurations of issue 44 by (data, model) shape for n devices of nodes of g, and whether
# FSDP shards over the data axis: data parallel, FSDP, TP over a node (8), data x TP, FSDP x TP.
def configurations(num_devices: int, devices_per_node: int) -> dict[str, tuple[int, int, bool]]:
    tp = min(devices_per_node, num_devices)
    half = max(1, tp // 2)
    return {
        "data parallel": (num_devices, 1, False),
        "FSDP": (num_devices, 1, True),
        f"TP over {tp}": (num_devices // tp, tp, False),
        f"data x TP ({num_devices // half}x{half})": (num_devices // half, half, False),
        f"FSDP x TP ({num_devices // half}x{half})": (num_devices // half, half, True),
    }


def megatron_spec(path: str, shape: tuple[int, ...], data: int, model: int, fsdp: bool) -> P:
    """A user's spec of one leaf (see `MEGATRON`), FSDP over "data" on the largest dimension left."""
    stacked = "['blocks']" in path and len(shape) > 1
    entries = [None] * len(shape)
    for suffix, role in MEGATRON:
        if model > 1 and path.endswith(suffix):
            d = len(shape) - 1 if role == "column" else (len(shape) - 2 if role == "row" else (1 if stacked else 0))
            if shape[d] % model == 0:
                entries[d] = "model"
            break
    if fsdp and data > 1:
        free = [d for d in range(1 if stacked else 0, len(shape)) if entries[d] is None and shape[d] % data == 0]
        if free:
            entries[max(free, key=lambda d: (shape[d], -d))] = DATA_AXIS
    return P(*entries)


def megatron_step(spec: zoo.ModelSpec, optimizer, devices, data: int, model: int, fsdp: bool, donate=True):
    """(jitted step, abstract (state, batch)) of `spec`'s step as a user writes it on a (data, model)
    mesh over `devices`: `megatron_spec` on parameters and optimizer state, the batch over "data",
    no activation constraint (XLA's partitioner propagates the parameters' shardings)."""
    from disco_jax.sharding import operators

    mesh = operators.build_mesh(devices, data, model)
    state, batch = zoo.abstract_state_and_batch(spec, optimizer, _one_axis(devices))

    def sharding(path, leaf):
        return NamedSharding(mesh, megatron_spec(jax.tree_util.keystr(path), tuple(leaf.shape), data, model, fsdp))

    shardings = jax.tree_util.tree_map_with_path(sharding, state)
    state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), state, shardings)
    batch_sharding = NamedSharding(mesh, P(DATA_AXIS))
    batch = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=batch_sharding), batch)
    step = zoo.build_train_step(spec, optimizer, _one_axis(devices), "jit")
    jitted = jax.jit(
        step.__wrapped__,
        in_shardings=(shardings, batch_sharding),
        out_shardings=(shardings, NamedSharding(mesh, P())),
        donate_argnums=(0,) if donate else (),
    )
    return jitted, (state, batch)


@dataclasses.dataclass(frozen=True)
class HandPlan:
    """A configuration of `configurations` as a candidate of the layout search
    (`layout_search.candidate_plans`): `megatron_spec` on every parameter and state leaf by its
    path, the batch over "data" and, where `constrained` (the default), the activation constraints
    the Flax guide writes in the model (`guide_rule`); lowered from the user's step itself
    (`relower`), so that it is compiled and costed as disco-jax's plans are. `constrained=False`:
    shardings on parameters and state only, XLA's partitioner left to propagate them (the
    configuration this module wrote before; kept for the comparison in docs/operator-parallelism.md)."""

    name: str
    data: int
    model: int
    fsdp: bool
    constrained: bool = True

    @property
    def label(self) -> str:
        return f"{self.data}x{self.model} by hand: {self.name}" + ("" if self.constrained else " (no constraint)")

    def to_json(self) -> dict:
        return {
            "mesh": {DATA_AXIS: self.data, "model": self.model},
            "by_hand": self.name,
            "fsdp": self.fsdp,
            "activation_constraints": self.constrained,
        }


@dataclasses.dataclass(frozen=True)
class HandEnacted:
    """A `HandPlan` as lowered: its mesh and every input leaf's spec (as `mesh_step.Enacted`)."""

    plan: HandPlan
    mesh: Any
    input_specs: dict[int, P]

    def to_json(self, found) -> dict:
        return {
            **self.plan.to_json(),
            "parameters": {found.parameters[p]: list(self.input_specs[p]) for p in sorted(found.parameters)},
            "rules": [],  # the user's layout: XLA's partitioner, no substitution of disco-jax's
        }


def hand_plans(num_devices: int, devices_per_node: int, constrained: bool = True) -> list[HandPlan]:
    """`configurations` as `HandPlan`s (`constrained`: with the guide's activation constraints)."""
    return [
        HandPlan(name, *shape, constrained=constrained)
        for name, shape in configurations(num_devices, devices_per_node).items()
    ]


def guide_rule(found, specs: dict[int, P], data: int, model: int):
    """The activation constraints a user writes following Flax's "Scale up Flax Modules on multiple
    devices" guide (google/flax docs/guides/parallel_training/flax_on_pjit: its `DotReluDot`
    writes `with_sharding_constraint(y, P('data', 'model'))` after the column dense and
    `with_sharding_constraint(z, P('data', None))` after the row dense), as MaxText and Flax's lm1b
    example do through logical axes ('activation_batch' -> the data / fsdp axes): on the output of
    every dense layer of the forward pass, the batch over "data", and where the layer's kernel is
    split on an output dimension over "model" (a column kernel, the vocabulary-parallel head),
    that dimension of the output over "model"; everything else replicated. As a
    `constrain.Rule`: the user's step is not edited, the constraints are inserted on the forward
    dots that read each parameter (`found.roles`). Written from the leaves' specs alone, apart
    from `sharding.operators.activation_spec`, so that the baseline is the guide's, not
    disco-jax's (on FSDP and TP without sequence parallelism the two agree)."""

    def rule(dot):
        role = found.roles.get(dot.parameter)
        if role is None or dot.contracted != role.contracted:
            return None  # a dot of the backward pass: the user's constraints sit in the forward model
        entries = [None] * len(dot.out_shape)
        batch = dot.other_free_positions[0] if dot.other_free_positions else None
        if batch is not None and data > 1 and dot.out_shape[batch] % data == 0:
            entries[batch] = DATA_AXIS
        if model > 1:
            for dim, axis in enumerate(specs[dot.parameter]):
                if axis == "model" and dim in dot.parameter_positions:
                    entries[dot.parameter_positions[dim]] = "model"
        return P(*entries)

    return rule


def relower(step, args: tuple, found, plan: HandPlan) -> tuple:
    """(lowered, args on the plan's mesh, `HandEnacted`): the user's function (`step.__wrapped__`)
    jitted as a user writes `plan` (`megatron_spec` by each leaf's path; a batch leaf of the step,
    `found.batch`, over "data"; each new state leaf as its input; the guide's activation
    constraints, `guide_rule`, where `plan.constrained`), lowered on `args` moved there."""
    from disco_jax.sharding import operators
    from disco_jax.sharding.layouts import put

    mesh = operators.build_mesh(found.devices, plan.data, plan.model)
    with_paths, tree = jax.tree_util.tree_flatten_with_path(args)
    specs = {}
    for i, (path, leaf) in enumerate(with_paths):
        if i in found.batch:
            specs[i] = P(*(DATA_AXIS if e is not None else None for e in found.batch[i]))
        else:
            specs[i] = megatron_spec(jax.tree_util.keystr(path), tuple(leaf.shape), plan.data, plan.model, plan.fsdp)
    outputs = {j: P() for j in range(found.num_outputs)}
    for j, spec in found.out_batch.items():
        outputs[j] = P(*(DATA_AXIS if e is not None else None for e in spec))
    for i, j in found.outputs.items():
        outputs[j] = specs[i]
    in_shardings = [NamedSharding(mesh, specs[i]) for i in range(len(with_paths))]
    moved = jax.tree.unflatten(tree, [put(x, s) for (_, x), s in zip(with_paths, in_shardings)])
    out_tree = jax.tree.structure(jax.eval_shape(step.__wrapped__, *args))
    fn = step.__wrapped__
    if plan.constrained:
        from disco_jax.sharding import constrain

        fn = constrain.constrained(fn, guide_rule(found, specs, plan.data, plan.model), mesh)
    jitted = jax.jit(
        fn,
        in_shardings=jax.tree.unflatten(tree, in_shardings),
        out_shardings=jax.tree.unflatten(out_tree, [NamedSharding(mesh, outputs[j]) for j in range(found.num_outputs)]),
        donate_argnums=found.donate_argnums,
    )
    return jitted.lower(*moved), moved, HandEnacted(plan, mesh, specs)


def guide_fsdp_lowered(spec: zoo.ModelSpec, optimizer, mesh) -> Any:
    """`spec`'s donated train step written as FSDP over all of `mesh`'s devices by the Flax guide
    (`HandPlan` "FSDP": the leaves' FSDP specs and the guide's activation constraints), lowered
    from shapes (deviceless for a GPU target): the hand-written FSDP the large-model rows compare to."""
    from disco_jax.sharding import mesh_step

    step = zoo.build_train_step(spec, optimizer, mesh, "jit", donate=True)
    args = zoo.abstract_state_and_batch(spec, optimizer, mesh)
    found = mesh_step.structure(step, args)
    return relower(step, args, found, HandPlan("FSDP", len(found.devices), 1, True))[0]


def _one_axis(devices):
    import numpy as np
    from jax.sharding import AxisType, Mesh

    return Mesh(np.asarray(list(devices), dtype=object), (DATA_AXIS,), axis_types=(AxisType.Auto,))
