"""Which input leaves of a step are optimizer state the sharded update can split, read from the
step's jaxpr (`update` explains the conditions): the elementwise origins of every output, the state
leaves and their groups, and the dimension each is split on."""

from __future__ import annotations

from typing import Any

from jax.extend import core as jax_core
from jax.sharding import PartitionSpec as P

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


def spec_for(shape: tuple[int, ...], axis: str, num_shards: int) -> P | None:
    """The spec splitting `shape` over `axis` on its first divisible dimension (None: none is)."""
    d = split_dimension(shape, num_shards)
    return None if d is None else P(*([None] * d), axis)


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


def leaf_groups(origins: list[frozenset], state: list[int]) -> tuple[tuple[int, ...], ...]:
    """The state leaves joined whenever some output is computed from several of them."""
    group = {i: frozenset({i}) for i in state}
    for labels in origins:
        members = frozenset().union(*(group[i] for i in labels if i in group))
        for i in members:
            group[i] = members
    return tuple(sorted({tuple(sorted(g)) for g in group.values()}))
