"""Small data-parallel training steps on 8 CPU devices, in both styles, for the core's tests."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def mlp_init(key, sizes):
    params = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        key, k = jax.random.split(key)
        params.append({"w": jax.random.normal(k, (a, b)) * (1.0 / a) ** 0.5, "b": jnp.zeros(b)})
    return params


def mlp_loss(params, x, y):
    h = x
    for i, p in enumerate(params):
        h = h @ p["w"] + p["b"]
        if i < len(params) - 1:
            h = jnp.tanh(h)
    return jnp.mean((h - y) ** 2)


def make_step(style: str, sizes=(16, 32, 32, 4), batch=64, optimizer=None):
    """(jitted step, args) for `style` 'jit' (NamedSharding batch) or 'shard_map' (explicit psum)."""
    mesh = jax.make_mesh((8,), ("data",))
    opt = optimizer or optax.sgd(0.1)
    params = mlp_init(jax.random.PRNGKey(0), list(sizes))
    opt_state = opt.init(params)
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params, opt_state = jax.device_put((params, opt_state), replicated)
    x = jax.device_put(jax.random.normal(jax.random.PRNGKey(1), (batch, sizes[0])), sharded)
    y = jax.device_put(jax.random.normal(jax.random.PRNGKey(2), (batch, sizes[-1])), sharded)

    if style == "jit":

        def step(params, opt_state, x, y):
            loss, grads = jax.value_and_grad(mlp_loss)(params, x, y)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss
    elif style == "shard_map":

        @functools.partial(
            jax.shard_map, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")), out_specs=(P(), P(), P())
        )
        def step(params, opt_state, x, y):
            # check_vma: grads of replicated params come back summed over devices already.
            loss, grads = jax.value_and_grad(mlp_loss)(params, x, y)
            grads = jax.tree.map(lambda g: g / mesh.size, grads)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")
    else:
        raise ValueError(style)
    return jax.jit(step), (params, opt_state, x, y)


def store_per_gradient_plan(step, args, plan_dir):
    """A plan made by hand and stored in `plan_dir`: XLA's fusions, one all-reduce per gradient.
    Returns (plan, number of gradients)."""
    from disco_jax import _capture, _compile, _graph, _plan, _strategy, backends

    graph = _graph.build_graph(_capture.capture(step.lower(*args))[0], backends.CPU.fusible)
    s = _strategy.with_buckets(_strategy.xla_default(graph), [(g.id,) for g in graph.gradients], "test")
    machine = _plan.MachineKey.current(_compile.step_devices(args, {}))
    plan = _plan.Plan(graph.fingerprint, graph.module.name, machine, False, s.to_json(graph), "made by a test")
    _plan.save_plan(plan, plan_dir)
    return plan, len(graph.gradients)


def gradient_sums(optimizer, sizes=(16, 32, 4), batch=64):
    """(XLA's data-parallel step, variants of it written with `shard_map` that combine the devices'
    gradients by hand, args). Each variant gathers every device's gradient of its batch shard and
    combines the stack with its function: 'reordered' sums them last device first and divides by
    the device count (the same math, another summation order), 'undivided' forgets the division,
    'dropped' leaves device 0's gradient out."""
    mesh = jax.make_mesh((8,), ("data",))
    params = mlp_init(jax.random.PRNGKey(0), list(sizes))
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params, opt_state = jax.device_put((params, optimizer.init(params)), replicated)
    x = jax.device_put(jax.random.normal(jax.random.PRNGKey(1), (batch, sizes[0])), sharded)
    y = jax.device_put(jax.random.normal(jax.random.PRNGKey(2), (batch, sizes[-1])), sharded)

    def update(params, opt_state, loss, grads):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def default(params, opt_state, x, y):
        return update(params, opt_state, *jax.value_and_grad(mlp_loss)(params, x, y))

    def by_hand(combine):
        @functools.partial(
            jax.shard_map,
            mesh=mesh,
            in_specs=(P(), P(), P("data"), P("data")),
            out_specs=(P(), P(), P()),
            check_vma=False,  # each device's own gradient, not their sum
        )
        def step(params, opt_state, x, y):
            loss, grads = jax.value_and_grad(mlp_loss)(params, x, y)
            grads = jax.tree.map(lambda g: combine(jax.lax.all_gather(g, "data")), grads)
            return update(params, opt_state, jax.lax.pmean(loss, "data"), grads)

        return jax.jit(step)

    n = mesh.size
    variants = {
        "reordered": by_hand(lambda gs: functools.reduce(jnp.add, [gs[i] for i in reversed(range(n))]) / n),
        "undivided": by_hand(lambda gs: gs.sum(0)),
        "dropped": by_hand(lambda gs: gs[1:].sum(0) / n),
    }
    return jax.jit(default), variants, (params, opt_state, x, y)
