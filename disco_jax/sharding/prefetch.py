"""Prefetch across loop iterations: a scanned step whose loop reads a sharded stacked parameter's
layer i gathered (at-use FSDP: XLA's partitioner all-gathers it inside the body, where a dot
reads it, after the previous layer's compute) runs instead a loop that carries layer i's gathered
value in its state and gathers layer i+1's in iteration i, with layer 0's gathered before the
loop: the gather of the next layer has no data dependence on the current layer's compute, so the
scheduler may run the two at once.

The transformation works on the step's jaxpr (the seam where the gathers can be named: before
partitioning there is no all-gather, only a stacked leaf sliced by a scan), the way
`constrain.py` does: the jaxpr is run again equation by equation, nested jits inlined, and each
`scan` with such an input (`xs` operand whose origin is one layer of a prefetched parameter leaf)
rebound rotated (`rules.require("loop_rotation")`):

    scan(body, carry, xs=(..., w, ...))
 => g0 = gather(w[first]);
    scan(body', (carry, g0, first), xs=(..., ...)), body' reading g where body read w[i] and
    returning gather(w[clamp(i + 1)]) (the stacked w now a loop constant, sliced at i + 1)

`gather` is a sharding constraint to the leaf's use sharding (its spec without the data axis:
replicated for FSDP over one data axis), which the partitioner enacts as one all-gather of the
layer's shard. Forward scans run i = 0..L-1 and prefetch i+1; reversed ones (the backward pass)
run L-1..0 and prefetch i-1. The last iteration prefetches its own layer again (the index is
clamped, not peeled: one wasted gather of one layer per loop, rather than a second copy of the
body in the program), and one more gathered layer lives in the loop state (the peak grows by a
layer's gathered parameters per rotated loop; `scripts/scanned_fsdp_baselines.py --prefetch`
reports it). What the loop computes is unchanged: the rotated body reads, each iteration, the
same value the original read (`loop_rotation`'s invariant); the output check compares anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from disco_jax.sharding.constrain import INLINED, PASS_THROUGH, SCAN, bind, scan_counts, sub_jaxpr

RULE = "loop_rotation"


def use_spec(spec: P, axis: str, factors: Iterable[str] = ()) -> P:
    """The spec of one layer of a leaf sharded with `spec` (its layer axis first) as a dot uses
    it: the data axis (and the factors it is split into) dropped, every other axis kept."""
    drop = {axis, *factors}

    def keep(entry):
        names = tuple(n for n in (entry if isinstance(entry, tuple) else (entry,)) if n and n not in drop)
        return None if not names else names[0] if len(names) == 1 else names

    return P(*(keep(e) for e in tuple(spec)[1:]))


class _Rotation:
    """The walk: values carry the input leaf they are (or None) and the leaf dimensions they keep."""

    def __init__(self, targets: dict, examples: tuple | None = None, stored: dict | None = None):
        self.targets = targets  # leaf index -> sharding of one gathered layer
        self.stored = stored or {}  # leaf index -> sharding of one layer as the leaf is stored (split)
        # (batch sizes, their split over the data axis): a rotated loop's per-example carries
        # (activations: leading dimension a batch size) are kept split so, as data parallelism has them.
        self.examples = examples
        self.rotated: list[dict] = []  # per rotated scan: length, reverse, leaves

    def run(self, jaxpr, consts, args, origins):
        env, known = {}, {}

        def read(v):
            return v.val if isinstance(v, jex_core.Literal) else env[v]

        def origin(v):
            return None if isinstance(v, jex_core.Literal) else known.get(v)

        env.update(zip(jaxpr.constvars, consts))
        for v, x, o in zip(jaxpr.invars, args, origins):
            env[v], known[v] = x, o
        for eqn in jaxpr.eqns:
            inputs, in_origins = [read(v) for v in eqn.invars], [origin(v) for v in eqn.invars]
            name = eqn.primitive.name
            if name in INLINED and sub_jaxpr(eqn) is not None:
                outs, out_origins = self.run(*sub_jaxpr(eqn), inputs, in_origins)
            elif name == SCAN:
                outs, out_origins = self._scan(eqn, inputs, in_origins)
            else:
                outs = bind(eqn, inputs)
                # A leaf stays itself through a dtype conversion or a copy (bf16 compute).
                passes = name in PASS_THROUGH and len(eqn.outvars) == 1 and in_origins
                out_origins = [in_origins[0] if passes else None] + [None] * (len(eqn.outvars) - 1)
            for v, x, o in zip(eqn.outvars, outs, out_origins):
                env[v] = x
                if o is not None:
                    known[v] = o
        return [read(v) for v in jaxpr.outvars], [origin(v) for v in jaxpr.outvars]

    def _scan(self, eqn, inputs, in_origins):
        params = eqn.params
        consts_n, carry_n = scan_counts(params, len(inputs))
        body_jaxpr, body_consts = sub_jaxpr(eqn)
        xs_at = range(consts_n + carry_n, len(inputs))
        prefetched = [
            k for k in xs_at if in_origins[k] is not None and in_origins[k][0] in self.targets and in_origins[k][1] == 0
        ]
        unknown = [None] * len(eqn.outvars)
        if not prefetched and self.examples is None:  # the scan as it was (nested loops keep theirs)
            return bind(eqn, inputs), unknown
        if not prefetched:  # only its per-example carries split (`Layout.split_carries`)
            xs = inputs[consts_n + carry_n :]

            def split_body(carry, x):
                outs = jax.core.eval_jaxpr(body_jaxpr, body_consts, *inputs[:consts_n], *self._per_example(carry), *x)
                return self._per_example(outs[:carry_n]), outs[carry_n:]

            init = self._per_example(inputs[consts_n : consts_n + carry_n])
            carry, ys = jax.lax.scan(split_body, init, xs, length=params["length"], reverse=params["reverse"])
            return list(carry) + list(ys), unknown
        length, reverse = params["length"], params["reverse"]
        shardings = [self.targets[in_origins[k][0]] for k in prefetched]
        stacked = [inputs[k] for k in prefetched]
        # Where the body only converts the layer (bf16 compute), the converted layer is what is
        # gathered and carried: the gather moves what the body's dots read, not the f32 master.
        converts = [_only_converted_to(body_jaxpr, body_jaxpr.invars[k]) for k in prefetched]
        first = length - 1 if reverse else 0
        # Outputs that stack the layer itself (the residuals a backward pass reads: the layer or
        # its conversion) are stacked from the stored shards, not the gathered layer: the loop then
        # keeps no gathered layer beyond the one it carries, and the backward loop, reading them
        # as a layer of the leaf, is rotated too.
        residuals = _layer_residuals(body_jaxpr, carry_n, {body_jaxpr.invars[k]: i for i, k in enumerate(prefetched)})
        self.rotated.append({"length": length, "reverse": reverse, "leaves": [in_origins[k][0] for k in prefetched]})

        def gather(index):
            layers = [w[index] if dtype is None else w[index].astype(dtype) for w, dtype in zip(stacked, converts)]
            return [jax.lax.with_sharding_constraint(x, s) for x, s in zip(layers, shardings)]

        def rotated_body(state, xs_rest):
            carry, gathered, index = state
            # Pinned where the body reads it as well as where it is made: the partitioner gives a
            # loop's carried value one sharding, and left free it picks the stacked leaf's (split).
            gathered = [jax.lax.with_sharding_constraint(g, s) for g, s in zip(gathered, shardings)]
            carry = self._per_example(carry)
            step_inputs = list(inputs[:consts_n]) + list(carry)
            rest = iter(xs_rest)
            now = dict(zip(prefetched, gathered))
            step_inputs += [now[k] if k in now else next(rest) for k in xs_at]
            converted = {body_jaxpr.invars[k] for k, dtype in zip(prefetched, converts) if dtype is not None}
            outs = _eval_converted(body_jaxpr, body_consts, step_inputs, converted)
            # The next iteration's layer, clamped at the loop's last (its gather is then unused).
            following = jnp.maximum(index - 1, 0) if reverse else jnp.minimum(index + 1, length - 1)
            ys = list(outs[carry_n:])
            for j, (i, dtype) in residuals.items():
                layer = stacked[i][index] if dtype is None else stacked[i][index].astype(dtype)
                ys[j] = jax.lax.with_sharding_constraint(layer, self.stored[in_origins[prefetched[i]][0]])
            return (self._per_example(outs[:carry_n]), gather(following), following), ys

        xs_rest = [inputs[k] for k in xs_at if k not in prefetched]
        init = (self._per_example(inputs[consts_n : consts_n + carry_n]), gather(first), jnp.int32(first))
        (carry, _, _), ys = jax.lax.scan(
            rotated_body, init, xs_rest, length=length, reverse=reverse, unroll=params.get("unroll", 1)
        )
        origins = unknown[:carry_n] + [None] * len(ys)
        for j, (i, _) in residuals.items():
            origins[carry_n + j] = (in_origins[prefetched[i]][0], 0)
        return list(carry) + list(ys), origins

    def _per_example(self, carry) -> list:
        if self.examples is None:
            return list(carry)
        sizes, split = self.examples
        return [
            jax.lax.with_sharding_constraint(x, split) if jnp.ndim(x) >= 2 and x.shape[0] in sizes else x for x in carry
        ]


def _layer_residuals(jaxpr, carry_n: int, layers: dict) -> dict[int, tuple[int, object]]:
    """Per output of a scan body that is one of `layers` (body input -> its index among the
    prefetched) or its conversion: (that index, the dtype converted to, or None), by ys position."""
    made = {e.outvars[0]: e for e in jaxpr.eqns if e.primitive.name == "convert_element_type"}
    out = {}
    for j, v in enumerate(jaxpr.outvars[carry_n:]):
        if isinstance(v, jex_core.Literal):
            continue
        if v in layers:
            out[j] = (layers[v], None)
        elif v in made and not isinstance(made[v].invars[0], jex_core.Literal) and made[v].invars[0] in layers:
            out[j] = (layers[made[v].invars[0]], made[v].params["new_dtype"])
    return out


def _only_converted_to(jaxpr, var):
    """The dtype every use of `var` in `jaxpr` converts it to, where it is used only so (and not
    returned); else None."""
    uses = [e for e in jaxpr.eqns if any(v is var for v in e.invars)]
    if not uses or any(v is var for v in jaxpr.outvars):
        return None
    if any(e.primitive.name != "convert_element_type" for e in uses):
        return None
    dtypes = {e.params["new_dtype"] for e in uses}
    return dtypes.pop() if len(dtypes) == 1 else None


def _eval_converted(jaxpr, consts, args, converted: set):
    """`jaxpr` evaluated on `args`, where each input in `converted` is given already converted:
    its conversions pass it through."""

    def passed(eqn, inputs):
        given = eqn.primitive.name == "convert_element_type" and not isinstance(eqn.invars[0], jex_core.Literal)
        return [inputs[0]] if given and eqn.invars[0] in converted else None

    return evaluate(jaxpr, consts, args, passed)


def evaluate(jaxpr, consts, args, override: Callable | None = None) -> list:
    """`jaxpr`'s outputs on `args` (`consts`: the values of its constvars), each equation bound as
    it is, or where `override(eqn, inputs)` gives a list, that list as its outputs: the
    interpreter the jaxpr rewrites (`_Rotation`, `remat`) run bodies with."""
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(v):
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    for eqn in jaxpr.eqns:
        inputs = [read(v) for v in eqn.invars]
        outs = None if override is None else override(eqn, inputs)
        env.update(zip(eqn.outvars, bind(eqn, inputs) if outs is None else outs))
    return [read(v) for v in jaxpr.outvars]


def rotating(inner: Callable, info, layout) -> Callable:
    """The user's function `inner` (jit options `info`) with every scan that reads a layer of one
    of `layout`'s sharded stacked parameters rotated to gather the next layer one iteration early
    (module docstring), and every scan's per-example carries (leading dimension a batch size of
    the call's unsharded inputs) split over the data axis; what `update.relower` jits where
    `layout.prefetch`, or (the carries split only, no rotation) `layout.split_carries`."""
    from disco_jax.sharding import rules

    rules.require(RULE)
    factors = (
        ()
        if layout.step_mesh is layout.mesh
        else tuple(n for n in layout.step_mesh.axis_names if n not in layout.mesh.axis_names)
    )
    targets = {
        i: NamedSharding(layout.step_mesh, use_spec(layout.sharding(layout.inputs[i]).spec, layout.axis, factors))
        for i in layout.gathered
        if layout.prefetch and i in layout.stacked and _splits_after_layer_axis(layout.inputs[i])
    }
    stored = {
        i: NamedSharding(layout.step_mesh, P(*tuple(layout.sharding(layout.inputs[i]).spec)[1:])) for i in targets
    }

    def transform(closed, leaves):
        origins = [(i, 0) for i in range(len(leaves))]
        sharded = set(layout.inputs) | set(layout.parameters)
        sizes = frozenset(x.shape[0] for i, x in enumerate(leaves) if i not in sharded and jnp.ndim(x) >= 2)
        split = NamedSharding(layout.step_mesh, P(layout.sharding(P(layout.axis)).spec[0]))
        walk = _Rotation(targets, (sizes, split) if sizes else None, stored)
        return walk.run(closed.jaxpr, closed.consts, leaves, origins)[0]

    return dynamic_call(inner, info, transform)


def dynamic_call(inner: Callable, info, transform: Callable) -> Callable:
    """`inner` (jit options `info`) as a function whose dynamic arguments' jaxpr is run by
    `transform(closed_jaxpr, flat_dynamic_leaves) -> flat outputs`: the seam the jaxpr rewrites
    of a user's step (`rotating`, `remat.rematerializing`) share."""
    static_names = set(info.static_argnames)

    def step(*args, **kwargs):
        static = {k % len(args) for k in info.static_argnums} if args else set()
        dynamic = (tuple(a for k, a in enumerate(args) if k not in static), {})
        dynamic[1].update((k, v) for k, v in kwargs.items() if k not in static_names)

        def call(dyn_args, dyn_kwargs):
            positional = iter(dyn_args)
            full = tuple(a if k in static else next(positional) for k, a in enumerate(args))
            return inner(*full, **{**kwargs, **dyn_kwargs})

        closed, shape = jax.make_jaxpr(call, return_shape=True)(*dynamic)
        outs = transform(closed, jax.tree.leaves(dynamic))
        return jax.tree.unflatten(jax.tree.structure(shape), outs)

    return step


def _splits_after_layer_axis(spec: P) -> bool:
    """Whether a stacked leaf's spec leaves its layer axis whole (a layer is then a local slice)."""
    return not tuple(spec) or tuple(spec)[0] is None


def rotated_loops(inner: Callable, layout, *args) -> list[dict]:
    """The scans `rotating` rotates in `inner(*args)` (positional, dynamic, abstract arguments):
    per loop its trip count, direction and the input leaves it prefetches (for plans and tests)."""
    targets = {
        i
        for i in layout.gathered
        if layout.prefetch and i in layout.stacked and _splits_after_layer_axis(layout.inputs[i])
    }
    closed = jax.make_jaxpr(inner)(*args)
    leaves = jax.tree.leaves(args)
    replicated = NamedSharding(layout.step_mesh, P())
    walk = _Rotation(dict.fromkeys(targets, replicated), None, dict.fromkeys(targets, replicated))

    def run(*flat):
        return walk.run(closed.jaxpr, closed.consts, flat, [(i, 0) for i in range(len(flat))])[0]

    jax.make_jaxpr(run)(*[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves])
    return walk.rotated
