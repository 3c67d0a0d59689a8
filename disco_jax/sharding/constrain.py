"""A JAX transformation of a step that inserts sharding constraints on activations: the step's
jaxpr run again, equation by equation, with `jax.lax.with_sharding_constraint` on the outputs of
the dots a `Rule` names, recursing into `scan` bodies and rematerialized (`checkpoint`) regions
(rebound with their transformed bodies, so loops and remat stay what they were) and inlining
nested `jit`s. The user writes no annotation: `constrained(fn, rule)` is `fn` with them.

Every value carries, besides itself, what the walk knows of it (`Origin`): the parameter leaf it
is (read directly, converted, transposed, or one layer of a stacked leaf sliced by a scan) with
which of the leaf's dimensions each of its own dimensions is, and the activation it stems from
through dtype conversions (so that the query, key and value projections of one input are seen
reading the same activation). `dots_reading_parameters` uses the same walk, with a rule that
constrains nothing, to list every dot that reads a parameter (`ParameterDot`): the structure the
per-layer layouts are chosen from (`sharding.operators`).

A constraint never changes what the step computes (XLA's partitioner keeps every value's
meaning; it only moves data), so a wrong rule costs time, not correctness; tests still compare
outputs.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import jax
from jax.extend import core as jex_core

# Primitives whose body is walked: scan bodies and remat regions are rebound with the transformed
# body; nested jits are inlined (their boundary means nothing to the partitioner).
SCAN, REMAT, INLINED = "scan", ("checkpoint", "remat2"), ("pjit", "jit", "closed_call", "core_call")
# Operations a parameter passes through and stays itself (its dimensions renamed by a transpose).
PASS_THROUGH = ("convert_element_type", "copy", "optimization_barrier")


@dataclasses.dataclass(frozen=True)
class Origin:
    """What the walk knows of a value: `parameter` (input leaf index, or None) with `dims` (per
    dimension of the value, the leaf's dimension), and `root` (the value it is a dtype conversion
    of; itself otherwise)."""

    parameter: int | None
    dims: tuple[int, ...]
    root: object


@dataclasses.dataclass(frozen=True)
class ParameterDot:
    """One `dot_general` that reads a parameter leaf: the leaf, which operand it is, the leaf's
    contracted and free dimensions, the other operand's root and shape, the output position of
    the other operand's first free dimension and of each of the leaf's free dimensions, the scope
    (the scans and remat regions around it) and its order in the walk."""

    parameter: int
    operand: int
    contracted: frozenset[int]
    free: tuple[int, ...]
    other_root: object
    other_shape: tuple[int, ...]
    other_free_positions: tuple[int, ...]  # output position of each free dim of the other operand
    parameter_positions: dict  # leaf dimension -> output position
    out_shape: tuple[int, ...]
    scope: tuple[int, ...]
    order: int


# A rule: a dot that reads a parameter -> the spec of its output, or None for no constraint.
Rule = Callable[[ParameterDot], Any]


def sub_jaxpr(eqn):
    """(jaxpr, consts) of an equation's body (a scan's, a jit's, a remat region's), None where it
    has none: what the jaxpr rewrites (`constrain`, `prefetch`, `remat`) run again."""
    value = eqn.params.get("jaxpr")
    if value is None:
        return None
    return (value.jaxpr, value.consts) if hasattr(value, "consts") else (value, ())


def scan_counts(params: dict, num_inputs: int) -> tuple[int, int]:
    """(consts, carry) operand counts of a scan equation (jax >= 0.12 groups them in `ft_in`)."""
    if "ft_in" in params:
        consts, carry, _ = params["ft_in"].update(list(range(num_inputs))).unpack()
        return len(list(consts)), len(list(carry))
    return params["num_consts"], params["num_carry"]


def bind(eqn, inputs, params: dict | None = None) -> list:
    """The outputs (a list) of `eqn` bound again on `inputs`, with `params` in place of its own
    where given, under its own context (the one way the jaxpr rewrites re-emit an equation)."""
    params = eqn.params if params is None else params
    with eqn.ctx.manager:
        outs = eqn.primitive.bind(*inputs, **eqn.primitive.get_bind_params(params))
    return list(outs) if eqn.primitive.multiple_results else [outs]


class _Walk:
    def __init__(self, rule: Rule | None, mesh, record: list | None):
        self.rule, self.mesh, self.record = rule, mesh, record
        self.counter = itertools.count()

    def run(self, jaxpr, consts, args, origins, scope=()):
        env: dict = {}
        known: dict = {}

        def read(v):
            return v.val if isinstance(v, jex_core.Literal) else env[v]

        def origin(v):
            if isinstance(v, jex_core.Literal):
                return Origin(None, (), v)
            return known.get(v) or Origin(None, (), v)

        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x, o in zip(jaxpr.invars, args, origins):
            env[v], known[v] = x, o
        for eqn in jaxpr.eqns:
            inputs = [read(v) for v in eqn.invars]
            in_origins = [origin(v) for v in eqn.invars]
            name = eqn.primitive.name
            if name in INLINED and sub_jaxpr(eqn) is not None:
                inner, inner_consts = sub_jaxpr(eqn)
                outs, out_origins = self.run(inner, inner_consts, inputs, in_origins, scope)
            elif name == SCAN:
                outs, out_origins = self._scan(eqn, inputs, in_origins, scope)
            elif name in REMAT:
                outs, out_origins = self._remat(eqn, inputs, in_origins, scope)
            else:
                outs = bind(eqn, inputs)
                out_origins = self._propagate(eqn, in_origins)
                if name == "dot_general":
                    outs = [self._dot(eqn, in_origins, outs[0], scope)]
            for v, x, o in zip(eqn.outvars, outs, out_origins):
                env[v] = x
                if o is not None:
                    known[v] = o
        return [read(v) for v in jaxpr.outvars], [origin(v) for v in jaxpr.outvars]

    def _propagate(self, eqn, in_origins) -> list:
        name = eqn.primitive.name
        if len(eqn.outvars) != 1 or not in_origins:
            return [None] * len(eqn.outvars)
        first = in_origins[0]
        if name in PASS_THROUGH:
            return [Origin(first.parameter, first.dims, first.root)]
        if name == "transpose" and first.parameter is not None:
            dims = tuple(first.dims[i] for i in eqn.params["permutation"])
            return [Origin(first.parameter, dims, eqn.outvars[0])]
        return [None]

    def _dot(self, eqn, in_origins, out, scope):
        (contract, batch) = eqn.params["dimension_numbers"]
        for k in (0, 1):
            o = in_origins[k]
            if o.parameter is None or len(o.dims) != len(eqn.invars[k].aval.shape):
                continue
            other = 1 - k
            own_c, own_b = contract[k], batch[k]
            other_c, other_b = contract[other], batch[other]
            other_shape = tuple(eqn.invars[other].aval.shape)
            own_rank = len(o.dims)
            lhs_free = [d for d in range(len(eqn.invars[0].aval.shape)) if d not in contract[0] and d not in batch[0]]
            rhs_free = [d for d in range(len(eqn.invars[1].aval.shape)) if d not in contract[1] and d not in batch[1]]
            base = len(batch[0])
            positions = {}
            for i, d in enumerate(lhs_free):
                positions[(0, d)] = base + i
            for i, d in enumerate(rhs_free):
                positions[(1, d)] = base + len(lhs_free) + i
            own_free = [d for d in range(own_rank) if d not in own_c and d not in own_b]
            other_free = [d for d in range(len(other_shape)) if d not in other_c and d not in other_b]
            dot = ParameterDot(
                parameter=o.parameter,
                operand=k,
                contracted=frozenset(o.dims[d] for d in own_c),
                free=tuple(o.dims[d] for d in own_free),
                other_root=in_origins[other].root,
                other_shape=other_shape,
                other_free_positions=tuple(positions[(other, d)] for d in other_free),
                parameter_positions={o.dims[d]: positions[(k, d)] for d in own_free},
                out_shape=tuple(eqn.outvars[0].aval.shape),
                scope=scope,
                order=next(self.counter),
            )
            if self.record is not None:
                self.record.append(dot)
            if self.rule is not None:
                spec = self.rule(dot)
                if spec is not None:
                    return jax.lax.with_sharding_constraint(out, jax.sharding.NamedSharding(self.mesh, spec))
            return out
        return out

    def _scan(self, eqn, inputs, in_origins, scope):
        params = dict(eqn.params)
        body = params["jaxpr"]
        consts_n, carry_n = scan_counts(params, len(inputs))
        body_jaxpr, body_consts = sub_jaxpr(eqn)
        origins = []
        for i, o in enumerate(in_origins):
            if i >= consts_n + carry_n and o.parameter is not None:  # one layer of a stacked leaf
                o = Origin(o.parameter, o.dims[1:], o.root)
            elif consts_n <= i < consts_n + carry_n:
                o = Origin(None, (), o.root)  # a carry changes every iteration
            origins.append(o)
        inner_scope = (*scope, next(self.counter))

        def transformed(*args):
            return self.run(body_jaxpr, body_consts, args, origins, inner_scope)[0]

        new = jax.make_jaxpr(transformed)(*[v.aval for v in body_jaxpr.invars])
        if hasattr(body, "consts"):
            params["jaxpr"] = new
        elif new.consts:
            raise ValueError("the transformed scan body closes over constants")
        else:
            params["jaxpr"] = new.jaxpr
        return bind(eqn, inputs, params), [None] * len(eqn.outvars)

    def _remat(self, eqn, inputs, in_origins, scope):
        params = dict(eqn.params)
        body = params["jaxpr"]
        inner_scope = (*scope, next(self.counter))

        def transformed(*args):
            outs, _ = self.run(body, (), args, in_origins, inner_scope)
            return outs

        new = jax.make_jaxpr(transformed)(*[v.aval for v in body.invars])
        if new.consts:
            raise ValueError("the transformed remat region closes over constants")
        params["jaxpr"] = new.jaxpr
        return bind(eqn, inputs, params), [None] * len(eqn.outvars)


def constrained(fn, rule: Rule, mesh) -> Callable:
    """`fn` (positional arguments) with `with_sharding_constraint(out, NamedSharding(mesh, spec))`
    on every dot output for which `rule(dot)` gives a spec."""

    def step(*args):
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        leaves = jax.tree.leaves(args)
        origins = [Origin(i, tuple(range(len(getattr(x, "shape", ())))), None) for i, x in enumerate(leaves)]
        outs, _ = _Walk(rule, mesh, None).run(closed.jaxpr, closed.consts, leaves, origins)
        return jax.tree.unflatten(jax.tree.structure(shape), outs)

    return step


def dots_reading_parameters(fn, args: tuple) -> list[ParameterDot]:
    """Every dot of `fn(*args)` (abstract arguments) that reads an input leaf, in the walk's order
    (forward pass first, as the step's jaxpr orders it)."""
    closed = jax.make_jaxpr(fn)(*args)
    leaves = jax.tree.leaves(args)
    origins = [Origin(i, tuple(range(len(getattr(x, "shape", ())))), None) for i, x in enumerate(leaves)]
    found: list[ParameterDot] = []
    avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]

    def walk(*flat):
        return _Walk(None, None, found).run(closed.jaxpr, closed.consts, flat, origins)[0]

    jax.make_jaxpr(walk)(*avals)
    return found
