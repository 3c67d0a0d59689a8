"""Rematerialization chosen by disco-jax: a scanned layer group's residuals recomputed in the
backward loop instead of stacked by the forward loop, applied to the step as it is, after
differentiation (the user's step holds `jax.grad`; there is no model left to wrap in `nn.remat`).

A differentiated scan is two loops in the step's jaxpr: the forward loop, which besides its
carries stacks one residual per iteration for each value the backward pass reads, and the
backward loop (`reverse=True`, same length), which reads those stacks as its per-iteration
inputs. Kept, every residual is an `(L, ...)` array alive from the forward loop to the backward
one: for a decoder, the activations of every layer. The rewrite (`rematerializing`):

- the forward loop stacks, instead of the residuals it drops, its carries as they enter each
  iteration (the layer's input: one activation per layer);
- the backward loop also takes those stacks, the forward loop's per-iteration inputs (the layer's
  parameters) and its constants, and at the top of each iteration runs again the part of the
  forward body that computes the dropped residuals from them (the body's equations those
  residuals depend on, nothing else), then the backward body unchanged.

Policies (`POLICIES`), as `jax.checkpoint_policies` name them: `"full"` drops every residual
(`nothing_saveable`: a layer's input is all that is kept); `"dots"` keeps the outputs of dots
with no batch dimensions and recomputes the rest from them (`dots_with_no_batch_dims_saveable`,
MaxText's "minimal"). The recomputation runs the same equations on the same values, so the
step computes what it computed; the backward loop is a separate `while` body, so XLA cannot
fold the recomputation back into the forward loop. Loops nested in loops and unrolled layers
are left as they are; `rematerialized_loops` says which loops a policy changed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
from jax.extend import core as jex_core

from disco_jax.sharding.constrain import INLINED, SCAN, bind, scan_counts, sub_jaxpr
from disco_jax.sharding.prefetch import dynamic_call, evaluate

POLICIES = ("dots", "full")


@dataclasses.dataclass(frozen=True)
class _Pair:
    """A forward loop (equation index) and the backward loop that reads its residuals."""

    forward: int
    backward: int
    dropped: tuple[int, ...]  # forward ys positions recomputed in the backward loop
    kept: tuple[int, ...]  # forward ys positions still stacked


def _dot_saved(eqn, policy: str) -> bool:
    """Whether `policy` keeps `eqn`'s output stacked: "dots" keeps a dot's without batch dimensions."""
    if policy != "dots" or eqn.primitive.name != "dot_general":
        return False
    (_, _), (batch_lhs, _) = eqn.params["dimension_numbers"]
    return not batch_lhs


def pairs(jaxpr, policy: str) -> list[_Pair]:
    """The (forward, backward) scan pairs of a flat jaxpr and, per forward loop, the stacked
    outputs `policy` drops: those only a backward loop of the same length reads, as per-iteration
    inputs, and the policy does not keep. A forward loop with nothing to drop is not paired."""
    uses: dict = {}
    for k, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not isinstance(v, jex_core.Literal):
                uses.setdefault(v, []).append(k)
    outputs = {v for v in jaxpr.outvars if not isinstance(v, jex_core.Literal)}
    found = []
    for k, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive.name != SCAN or eqn.params["reverse"]:
            continue
        consts_n, carry_n = scan_counts(eqn.params, len(eqn.invars))
        body, _ = sub_jaxpr(eqn)
        saved = {e.outvars[0] for e in body.eqns if _dot_saved(e, policy)}
        readers = {j for v in eqn.outvars[carry_n:] for j in uses.get(v, [])}
        backward = [
            j
            for j in sorted(readers)
            if jaxpr.eqns[j].primitive.name == SCAN
            and jaxpr.eqns[j].params["reverse"]
            and jaxpr.eqns[j].params["length"] == eqn.params["length"]
        ]
        if not backward:
            continue
        b = jaxpr.eqns[backward[0]]
        b_consts, b_carry = scan_counts(b.params, len(b.invars))
        b_xs = set(b.invars[b_consts + b_carry :])
        dropped, kept = [], []
        for y, (v, inner) in enumerate(zip(eqn.outvars[carry_n:], body.outvars[carry_n:])):
            only_backward = uses.get(v) == [backward[0]] and v in b_xs and v not in outputs
            only_backward = only_backward and b.invars.count(v) == 1
            recomputed = only_backward and not isinstance(inner, jex_core.Literal) and inner not in saved
            (dropped if recomputed else kept).append(y)
        if dropped:
            found.append(_Pair(k, backward[0], tuple(dropped), tuple(kept)))
    return found


def _recomputation(body, wanted: list, given: list) -> list:
    """The equations of `body` that compute `wanted` from its inputs and the `given` values."""
    have = set(given) | set(body.invars) | set(body.constvars)
    needed = {v for v in wanted if not isinstance(v, jex_core.Literal) and v not in have}
    eqns = []
    for eqn in reversed(body.eqns):
        if any(o in needed for o in eqn.outvars):
            eqns.append(eqn)
            needed |= {v for v in eqn.invars if not isinstance(v, jex_core.Literal) and v not in have}
    return eqns[::-1]


def _eval(eqns, env: dict, wanted: list) -> list:
    def read(v):
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    for eqn in eqns:
        env.update(zip(eqn.outvars, bind(eqn, [read(v) for v in eqn.invars])))
    return [read(v) for v in wanted]


class _Remat:
    """The step's jaxpr run again with nested jits inlined and each paired loop rewritten."""

    def __init__(self, policy: str):
        self.policy = policy
        self.loops: list[dict] = []

    def run(self, jaxpr, consts) -> Callable:
        """A function of the jaxpr's inputs computing its outputs with the paired loops rewritten."""
        return self._flat(_inlined(jaxpr, consts))

    def _flat(self, closed):
        jaxpr = closed.jaxpr
        found = pairs(jaxpr, self.policy)
        forward = {id(jaxpr.eqns[p.forward]): p for p in found}
        backward = {id(jaxpr.eqns[p.backward]): p for p in found}
        saved: dict = {}  # forward index -> what its backward loop needs

        def rewritten(eqn, inputs):  # a dropped residual's value is None, read by its backward loop only
            if id(eqn) in forward:
                return self._forward(eqn, forward[id(eqn)], inputs, saved)
            if id(eqn) in backward:
                pair = backward[id(eqn)]
                return self._backward(eqn, jaxpr.eqns[pair.forward], pair, inputs, saved)
            return None

        return lambda *args: evaluate(jaxpr, closed.consts, args, rewritten)

    def _forward(self, eqn, pair: _Pair, inputs, saved: dict) -> list:
        body, body_consts = sub_jaxpr(eqn)
        consts_n, carry_n = scan_counts(eqn.params, len(inputs))
        consts, init, xs = inputs[:consts_n], inputs[consts_n : consts_n + carry_n], inputs[consts_n + carry_n :]
        kept_vars = [body.outvars[carry_n + y] for y in pair.kept]
        wanted = [body.outvars[carry_n + y] for y in pair.dropped]
        # "dots": the outputs of dots with no batch dimensions the recomputation starts from (a
        # residual is often a reshape of one), stacked too; "full": none.
        dots = [e.outvars[0] for e in body.eqns if _dot_saved(e, self.policy)]
        eqns = _recomputation(body, wanted, kept_vars + dots)
        used = {v for e in eqns for v in e.invars if not isinstance(v, jex_core.Literal)} | set(wanted)
        stacked_dots = [d for d in dots if d in used and d not in kept_vars]

        def stacking(carry, x):
            env = dict(zip(body.constvars, body_consts))
            env.update(zip(body.invars, [*consts, *carry, *x]))
            outs = _eval(body.eqns, env, [*body.outvars, *stacked_dots])
            ys, more = outs[carry_n : len(body.outvars)], outs[len(body.outvars) :]
            return outs[:carry_n], ([ys[y] for y in pair.kept], more, list(carry))

        carry, (kept, more, entered) = jax.lax.scan(
            stacking, list(init), list(xs), length=eqn.params["length"], unroll=eqn.params.get("unroll", 1)
        )
        saved[pair.forward] = {
            "consts": consts,
            "xs": xs,
            "entered": entered,
            "given": (kept_vars + stacked_dots, list(kept) + list(more)),
            "eqns": eqns,
            "wanted": wanted,
        }
        self.loops.append(
            {
                "length": eqn.params["length"],
                "policy": self.policy,
                "recomputed": len(pair.dropped),
                "dots_stacked": len(stacked_dots),
            }
        )
        ys: list = [None] * (len(eqn.outvars) - carry_n)
        for y, value in zip(pair.kept, kept):
            ys[y] = value
        return list(carry) + ys

    def _backward(self, eqn, forward, pair: _Pair, inputs, saved: dict) -> list:
        fbody, fconsts = sub_jaxpr(forward)
        _, f_carry_n = scan_counts(forward.params, len(forward.invars))
        body, body_consts = sub_jaxpr(eqn)
        consts_n, carry_n = scan_counts(eqn.params, len(inputs))
        state = saved.pop(pair.forward)
        xs_n = len(inputs) - consts_n - carry_n
        dropped_vars = [forward.outvars[f_carry_n + y] for y in pair.dropped]
        at = {eqn.invars.index(v) - consts_n - carry_n: i for i, v in enumerate(dropped_vars)}
        given_vars, given = state["given"]
        xs = [x for j, x in enumerate(inputs[consts_n + carry_n :]) if j not in at]

        def recomputing(carry, sliced):
            own, (entered, fxs, given_now) = sliced
            env = dict(zip(fbody.constvars, fconsts))
            env.update(zip(fbody.invars, [*state["consts"], *entered, *fxs]))
            env.update(zip(given_vars, given_now))
            again = _eval(state["eqns"], env, state["wanted"])
            own = iter(own)
            x = [again[at[j]] if j in at else next(own) for j in range(xs_n)]
            outs = jax.core.eval_jaxpr(body, body_consts, *inputs[:consts_n], *carry, *x)
            return outs[:carry_n], outs[carry_n:]

        carry, ys = jax.lax.scan(
            recomputing,
            list(inputs[consts_n : consts_n + carry_n]),
            (xs, (state["entered"], list(state["xs"]), given)),
            length=eqn.params["length"],
            reverse=True,
            unroll=eqn.params.get("unroll", 1),
        )
        return list(carry) + list(ys)


def _inlined(jaxpr, consts):
    """The jaxpr with every nested jit inlined (its boundary means nothing to the partitioner, and
    a forward loop and its backward loop may sit in different ones)."""
    return jax.make_jaxpr(lambda *flat: _inline_eval(jaxpr, consts, flat))(*[v.aval for v in jaxpr.invars])


def _inline_eval(jaxpr, consts, args):
    def inline(eqn, inputs):
        if eqn.primitive.name in INLINED and sub_jaxpr(eqn) is not None:
            return _inline_eval(*sub_jaxpr(eqn), inputs)
        return None

    return evaluate(jaxpr, consts, args, inline)


def rematerializing(inner: Callable, info, policy: str) -> Callable:
    """The user's function `inner` (jit options `info`) with every differentiated scan's residuals
    recomputed in its backward loop as `policy` says (module docstring); what `update.relower`
    jits where `layout.remat`."""
    if policy not in POLICIES:
        raise ValueError(f"unknown remat policy {policy!r}; expected one of {POLICIES}")

    def transform(closed, leaves):
        walk = _Remat(policy)
        return walk.run(closed.jaxpr, closed.consts)(*leaves)

    return dynamic_call(inner, info, transform)


def rematerialized_loops(inner: Callable, policy: str, *args) -> list[dict]:
    """The loops `policy` rewrites in `inner(*args)` (positional, abstract arguments): per loop its
    trip count, the policy, how many stacked residuals it recomputes and how many dots' outputs
    it stacks instead (what a test or a reader checks the rewrite by)."""
    closed = jax.make_jaxpr(inner)(*args)
    leaves = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in jax.tree.leaves(args)]
    walk = _Remat(policy)
    jax.make_jaxpr(walk.run(closed.jaxpr, closed.consts))(*leaves)
    return walk.loops
