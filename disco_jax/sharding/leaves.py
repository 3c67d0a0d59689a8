"""Which input leaves of a step are optimizer state the sharded update can split, read from the
step's jaxpr (`update` explains the conditions): the elementwise origins of every output, the state
leaves and their groups, and how each is split.

A leaf is split on its first dimension the data axis's size N divides (`P(None, "data")`); a
stacked leaf (`stacked_leaves`: the `(layers, ...)` parameters a `lax.scan` runs its layers over,
Flax `nn.scan`'s, and the state updated with them) on its first such dimension after the layer
axis where it has one, so that each layer's slice is split and a loop body gathers its own layer
(FSDP per layer) rather than the whole stack being gathered around the loop. A leaf
with no such dimension whose size N still divides (RNNLM's 1500 x 1500 kernels on 8 devices) is split
over several dimensions: the data axis is viewed as its prime factors, each a mesh axis of its own
(`factored_mesh`: "data" of 8 as "data.0", "data.1", "data.2" of 2, the same devices in the same
order), and each factor goes to a dimension it divides (`P(("data.0", "data.1"), "data.2")`: 12 x 6
in blocks of 3 x 3). JAX takes such a leaf's sharding on its own mesh only where the axes are Auto
(with Explicit axes a step takes one mesh); a leaf whose size N does not divide stays whole, since
JAX refuses uneven shardings of a jit's inputs and outputs and padding it would change the pytree."""

from __future__ import annotations

from typing import Any

import numpy as np
from jax.extend import core as jax_core
from jax.sharding import AxisType, Mesh
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


def _scanned_operands(eqn) -> list[int]:
    """The operands a `scan` runs over (its `xs`: sliced on their leading axis, one slice per
    iteration), told from its body's inputs, which have that axis dropped; [] for another op."""
    if eqn.primitive.name != "scan":
        return []
    body = eqn.params.get("jaxpr")
    body = getattr(body, "jaxpr", body)
    length = eqn.params.get("length")
    if body is None or len(body.invars) != len(eqn.invars):
        return []
    return [
        k
        for k, (outer, inner) in enumerate(zip(eqn.invars, body.invars))
        if getattr(outer.aval, "shape", ())[:1] == (length,) and inner.aval.shape == outer.aval.shape[1:]
    ]


def elementwise_origins(
    jaxpr, in_origins: list[frozenset], consumed: set[int], scanned: set[int] | None = None
) -> list[frozenset]:
    """Per output of `jaxpr`: the inputs (by `in_origins` labels) it is computed from through
    shape-preserving elementwise operations only. Labels that reach any other operation (a dot,
    a reduction, a broadcast, a collective, control flow, a `shard_map`) go into `consumed`;
    those that reach a `scan` as an operand it runs over (its `xs`: a stacked `(layers, ...)`
    parameter), into `scanned` too, where given."""
    env: dict = {}

    def origin(atom) -> frozenset:
        return frozenset() if isinstance(atom, jax_core.Literal) else env.get(atom, frozenset())

    for var, labels in zip(jaxpr.invars, in_origins):
        env[var] = labels
    for eqn in jaxpr.eqns:
        operands = [origin(a) for a in eqn.invars]
        inner = _inner_jaxpr(eqn)
        if scanned is not None:
            for k in _scanned_operands(eqn):
                scanned.update(operands[k])
        if inner is not None and len(inner.invars) == len(operands) and len(inner.outvars) == len(eqn.outvars):
            results = elementwise_origins(inner, operands, consumed, scanned)
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


def stacked_leaves(origins: list[frozenset], scanned: set[int]) -> frozenset[int]:
    """The input leaves stacked on a leading layer axis: those a scan runs over (`scanned`, from
    `elementwise_origins`), and every leaf updated elementwise with one (a stacked parameter's
    optimizer state: an output's origins hold both)."""
    stacked = set(scanned)
    changed = True
    while changed:
        changed = False
        for labels in origins:
            if labels & stacked and not labels <= stacked:
                stacked |= labels
                changed = True
    return frozenset(stacked)


def split_dimension(
    shape: tuple[int, ...], num_shards: int, stacked: bool = False, largest: bool = False
) -> int | None:
    """The first dimension `num_shards` divides (None: the leaf cannot be split on one dimension);
    for a `stacked` leaf the first after its layer axis where one is, else the layer axis. With
    `largest`, the largest such dimension (the first of equals), as FSDP guides split a leaf:
    a dot's kernel then splits on its wider side, which XLA's partitioner gathers per use
    without resharding the activations it meets (smaller temporaries on XLA:GPU)."""
    divisible = [d for d, size in enumerate(shape) if size >= num_shards and size % num_shards == 0]
    if stacked and len(divisible) > 1 and divisible[0] == 0:
        divisible = divisible[1:]
    if not divisible:
        return None
    return max(divisible, key=lambda d: (shape[d], -d)) if largest else divisible[0]


def prime_factors(n: int) -> list[int]:
    out, p = [], 2
    while p * p <= n:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out + ([n] if n > 1 else [])


def factored_mesh(mesh, axis: str) -> Mesh | None:
    """`mesh` with `axis` viewed as its prime factors, one Auto axis each (`axis.0`, `axis.1`,
    ...; the same devices in the same order), for leaves split over several dimensions; None
    where the size is prime or the mesh has Explicit axes (a step then takes one mesh only)."""
    primes = prime_factors(mesh.shape[axis])
    if len(primes) < 2 or any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
        return None
    at = mesh.axis_names.index(axis)
    names = [f"{axis}.{k}" for k in range(len(primes))]
    if set(names) & set(mesh.axis_names):
        return None
    devices = np.asarray(mesh.devices)
    shape = devices.shape[:at] + tuple(primes) + devices.shape[at + 1 :]
    axis_names = (*mesh.axis_names[:at], *names, *mesh.axis_names[at + 1 :])
    return Mesh(devices.reshape(shape), axis_names, axis_types=(AxisType.Auto,) * len(axis_names))


def factor_axes(split_mesh: Mesh | None, mesh) -> tuple[tuple[str, int], ...]:
    """(name, size) of the axes `split_mesh` (`factored_mesh`) views the data axis of `mesh` as."""
    if split_mesh is None:
        return ()
    return tuple((n, split_mesh.shape[n]) for n in split_mesh.axis_names if n not in mesh.axis_names)


def spec_for(
    shape: tuple[int, ...], axis: str, num_shards: int, factors: tuple = (), stacked: bool = False, largest=False
) -> P | None:
    """The spec splitting `shape` over `axis` on its first divisible dimension (`stacked`: after
    the layer axis; `largest`: the largest: `split_dimension`); else, given the axis's prime
    `factors` (`factor_axes`), each factor on the first dimension it still divides; None: the
    leaf cannot be split evenly."""
    d = split_dimension(shape, num_shards, stacked, largest)
    if d is not None:
        return P(*([None] * d), axis)
    if not factors:
        return None
    remaining, entries = list(shape), [[] for _ in shape]
    for name, size in factors:  # per prime, first dimension first: splits whenever any split does
        d = next((d for d, r in enumerate(remaining) if r % size == 0), None)
        if d is None:
            return None
        remaining[d] //= size
        entries[d].append(name)
    return P(*(None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries))


def choose_layout(
    jaxpr, inputs: list, outputs: list, replicated: list[bool], num_shards: int, origins=None, factors: tuple = ()
):
    """(input leaves to shard, outputs that are their updated values), by index. `inputs` /
    `outputs`: avals of the jaxpr's inputs and outputs; `replicated`: per input, whether it is
    held whole on every device of the data axis; `origins`: `(elementwise_origins(jaxpr, one
    label per input), the labels it consumed)` when the caller has them; `factors`: the data
    axis's prime factors where a leaf may be split over several dimensions (`spec_for`)."""
    if origins is None:
        consumed: set[int] = set()
        origins = elementwise_origins(jaxpr, [frozenset({i}) for i in range(len(inputs))], consumed), consumed
    origins, consumed = origins
    state = {
        i
        for i, aval in enumerate(inputs)
        if replicated[i] and i not in consumed and spec_for(aval.shape, "", num_shards, factors) is not None
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
