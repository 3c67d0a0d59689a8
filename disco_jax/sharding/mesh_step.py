"""A jitted step lowered again on a two-axis mesh with an `operators.OperatorPlan`: its parameters
and their optimizer state held in the plan's layout between steps (input and output shardings,
as the sharded weight update holds its state), its batch split over the data axis, and sharding
constraints on the activations of the dots that read parameters (`constrain.constrained`: the
user writes no annotation). XLA's SPMD partitioner emits the collectives: all-reduces over the
model axis' groups after row dots (reduce-scatters and all-gathers with sequence parallelism),
all-gathers of FSDP parameters where they are used, reduce-scatters of their gradients.

    found = mesh_step.structure(step, args)          # parameters, state, roles: once per step
    lowered, args2 = mesh_step.relower(step, args, found, plan)

`args` are the step's positional arguments (arrays or `ShapeDtypeStruct`s with shardings on the
step's one-axis mesh); `args2` the same on the plan's mesh.

The rules the tensor-parallel layouts rest on (`rules.TENSOR_PARALLEL_RULES`) are cited by
`cited_rules(plan)`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from disco_jax.sharding import constrain, operators, remat, rules, update
from disco_jax.sharding.layouts import put


@dataclasses.dataclass(frozen=True)
class Structure:
    """What the plans of one step are built from: the devices, per parameter leaf its path, shape,
    optimizer-state leaves and output; per state leaf its output; the dots' roles; the stacked
    leaves; the unmodified step's shardings of the batch-like leaves (split over its data axis)."""

    devices: tuple
    parameters: dict[int, str]
    shapes: dict[int, tuple]
    state_of: dict[int, tuple[int, ...]]
    outputs: dict[int, int]  # input leaf (parameter or state) -> the output leaf of its new value
    roles: dict[int, operators.Role]
    stacked: frozenset[int]
    batch: dict[int, P]  # input leaf -> its spec over the data axis (the batch)
    out_batch: dict[int, P]
    donate_argnums: tuple
    num_inputs: int
    num_outputs: int


def structure(step, args: tuple) -> Structure:
    """The `Structure` of the jitted `step` called with positional `args` (see the module docstring)."""
    compiled = step.lower(*args).compile()
    shardings = jax.tree.leaves(compiled.input_shardings)
    layout, reason = update.find_layout(step, args, {}, args, {}, shardings)
    if layout is None or not layout.parameters:
        raise ValueError(f"no parameter updated from its own optimizer state: {reason}")
    parameters = {p: q.path for p, q in layout.parameters.items()}
    leaves = jax.tree.leaves(args)
    outputs = {p: q.output for p, q in layout.parameters.items()}
    for j, sources in layout.sources.items():
        if len(sources) == 1:
            outputs[next(iter(sources))] = j
    dots = constrain.dots_reading_parameters(step.__wrapped__, args)
    batch = {i: s.spec for i, s in enumerate(shardings) if isinstance(s, NamedSharding) and not s.is_fully_replicated}
    out_shardings = jax.tree.leaves(compiled.output_shardings)
    out_batch = {
        j: s.spec for j, s in enumerate(out_shardings) if isinstance(s, NamedSharding) and not s.is_fully_replicated
    }
    return Structure(
        devices=tuple(layout.mesh.devices.flat),
        parameters=parameters,
        shapes={i: tuple(x.shape) for i, x in enumerate(leaves)},
        state_of={p: q.group for p, q in layout.parameters.items()},
        outputs=outputs,
        roles=operators.parameter_roles(dots, parameters),
        stacked=frozenset(layout.stacked),
        batch=batch,
        out_batch=out_batch,
        donate_argnums=tuple(step._jit_info.donate_argnums),
        num_inputs=len(shardings),
        num_outputs=len(out_shardings),
    )


@dataclasses.dataclass(frozen=True)
class Enacted:
    """A plan as lowered: its mesh, every input leaf's spec, the leaves kept whole and why."""

    plan: operators.OperatorPlan
    mesh: Any
    input_specs: dict[int, P]
    output_specs: dict[int, P]
    kept_whole: dict[str, str]

    def to_json(self, found: Structure) -> dict:
        return {
            **self.plan.to_json(),
            "parameters": {found.parameters[p]: list(self.input_specs[p]) for p in sorted(found.parameters)},
            "roles": {found.parameters[p]: r.kind for p, r in sorted(found.roles.items())},
            "kept_whole": dict(self.kept_whole),
            "rules": sorted(cited_rules(self.plan)),
        }


def enact(found: Structure, plan: operators.OperatorPlan) -> Enacted:
    """The specs of every input and output leaf under `plan` on its mesh."""
    mesh = operators.build_mesh(found.devices, plan.data, plan.model)
    specs, kept = operators.parameter_specs(plan, found.parameters, found.shapes, found.roles, set(found.stacked))
    inputs = {i: P() for i in range(found.num_inputs)}
    for i, spec in found.batch.items():  # the batch: over the data axis only
        inputs[i] = _data_only(spec)
    for p, spec in specs.items():
        inputs[p] = spec
        for s in found.state_of[p]:
            if found.shapes[s] == found.shapes[p]:
                inputs[s] = spec
    outputs = {j: P() for j in range(found.num_outputs)}
    for j, spec in found.out_batch.items():
        outputs[j] = _data_only(spec)
    for i, j in found.outputs.items():
        outputs[j] = inputs[i]
    return Enacted(plan, mesh, inputs, outputs, kept)


def _data_only(spec: P) -> P:
    return P(*(operators.DATA if e is not None else None for e in spec))


def rule_for(found: Structure, enacted: Enacted) -> constrain.Rule:
    """The activation constraints of `enacted` (`operators.activation_spec` per forward dot)."""
    plan = enacted.plan

    def rule(dot: constrain.ParameterDot):
        if dot.parameter not in found.parameters:
            return None
        choice = plan.choice(operators.group_of(found.parameters[dot.parameter]))
        return operators.activation_spec(
            dot, plan, found.roles.get(dot.parameter), choice, enacted.input_specs[dot.parameter]
        )

    return rule


def relower(step, args: tuple, found: Structure, plan: operators.OperatorPlan) -> tuple:
    """(lowered, args on the plan's mesh, `Enacted`): the user's function (`step.__wrapped__`),
    its loops rematerialized where the plan says (`sharding.remat`), with the plan's activation
    constraints, jitted with the plan's shardings and the step's donation, lowered on `args`
    moved to the plan's mesh."""
    enacted = enact(found, plan)
    mesh = enacted.mesh
    leaves, tree = jax.tree.flatten(args)
    in_shardings = [NamedSharding(mesh, enacted.input_specs[i]) for i in range(len(leaves))]
    moved = jax.tree.unflatten(tree, [put(x, s) for x, s in zip(leaves, in_shardings)])
    out_tree = jax.tree.structure(jax.eval_shape(step.__wrapped__, *args))
    out_shardings = jax.tree.unflatten(
        out_tree, [NamedSharding(mesh, enacted.output_specs[j]) for j in range(found.num_outputs)]
    )
    fn = step.__wrapped__
    if plan.remat:  # the loops' residuals recomputed in the backward loops, before the constraints
        fn = remat.rematerializing(fn, step._jit_info, plan.remat)
    jitted = jax.jit(
        constrain.constrained(fn, rule_for(found, enacted), mesh),
        in_shardings=jax.tree.unflatten(tree, in_shardings),
        out_shardings=out_shardings,
        donate_argnums=found.donate_argnums,
    )
    return jitted.lower(*moved), moved, enacted


def dot_groups(found: Structure) -> list[str]:
    """The layer groups whose parameters dots read (the groups a plan chooses for), the group with
    the most such parameters (the blocks) first."""
    counts: dict[str, int] = {}
    for p in sorted(found.roles):
        g = operators.group_of(found.parameters[p])
        counts[g] = counts.get(g, 0) + 1
    return sorted(counts, key=lambda g: -counts[g])


def cited_rules(plan: operators.OperatorPlan) -> dict[str, str]:
    """The proven rules a plan's layouts rest on, by name (raises `rules.RuleNotProven`)."""
    names = set()
    choices = [plan.choice(g) for g in plan.choices] or ["replicated"]
    if any(operators.uses_tp(c) for c in choices) and plan.model > 1:
        names |= set(rules.TENSOR_PARALLEL_RULES)
        if any(operators.uses_sp(c) for c in choices):
            names.add("all_reduce_as_reduce_scatter_all_gather")
    if any(operators.uses_fsdp(c) for c in choices) and plan.data > 1:
        names |= set(update.PARAMETER_RULES) | set(update.JUSTIFYING_RULES)
    return {name: str(rules.require(name)) for name in sorted(names)}
