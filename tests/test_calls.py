"""How a decorated step is called: static arguments (by position or keyword), keyword and
donated arguments, plain functions, and the per-call fast path, in both phases."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from disco_jax import _api, _validate, optimize_distributed

FAST = dict(budget_s=1.0, validation_pairs=4, verbose=False)


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.tanh(nn.Dense(32)(x))
        x = nn.Dropout(0.25, deterministic=not train)(x)
        return nn.Dense(4)(x)


def _flax_step(params, opt_state, x, y, key, train=True):
    """A Flax linen step with AdamW; `train` (static) turns dropout on: two programs."""

    def loss_fn(p):
        out = _Net().apply(p, x, train, rngs={"dropout": key})
        return jnp.mean((out - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = _OPT.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


_OPT = optax.adamw(1e-2)


def _state():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params = _Net().init(jax.random.PRNGKey(0), jnp.ones((1, 16)), False)
    opt_state = _OPT.init(params)
    params, opt_state = jax.device_put((params, opt_state), replicated)
    x = jax.device_put(jax.random.normal(jax.random.PRNGKey(1), (64, 16)), sharded)
    y = jax.device_put(jax.random.normal(jax.random.PRNGKey(2), (64, 4)), sharded)
    key = jax.device_put(jax.random.PRNGKey(3), replicated)
    return params, opt_state, x, y, key


def _copy(tree):
    return jax.tree.map(lambda a: a.copy(), tree)


@pytest.mark.parametrize("how", ["keyword", "positional"])
def test_static_argument_search_then_enact_one_plan_per_value(how, tmp_path, monkeypatch):
    if how == "keyword":
        step = jax.jit(_flax_step, static_argnames=("train",), donate_argnums=(0, 1))

        def call(f, state, train):
            return f(*state, train=train)
    else:
        step = jax.jit(_flax_step, static_argnums=(5,), donate_argnums=(0, 1))

        def call(f, state, train):
            return f(*state, train)

    state = _state()
    reference = {train: call(step, _copy(state), train) for train in (True, False)}
    assert not _validate.compare_outputs(reference[True], reference[False], bitwise=False).within_tolerance

    monkeypatch.setenv("ENABLE_SEARCH", "1")
    searching = optimize_distributed(**FAST, plan_dir=tmp_path)(step)
    for train in (True, False, True):  # a static value comes back: its program is reused
        out = call(searching, _copy(state), train)
        assert _validate.compare_outputs(reference[train], out, bitwise=False).within_tolerance
    assert len(searching.reports) == 2 and all(r.search_ran for r in searching.reports)
    fingerprints = {r.fingerprint for r in searching.reports}
    assert len(fingerprints) == 2 and len(list(tmp_path.glob("*.json"))) >= 2  # plan (+ timeline) per value

    monkeypatch.setenv("ENABLE_SEARCH", "0")
    enacting = optimize_distributed(**FAST, plan_dir=tmp_path)(step)
    for train in (False, True, False):
        out = call(enacting, _copy(state), train)
        assert _validate.compare_outputs(reference[train], out, bitwise=False).within_tolerance
    assert {r.fingerprint for r in enacting.reports} == fingerprints
    assert all(r.plan for r in enacting.reports), "a stored plan was not found"


def test_plain_function_is_jitted_with_the_given_options(tmp_path):
    wrapped = optimize_distributed(**FAST, plan_dir=tmp_path, static_argnames=("train",))(_flax_step)
    state = _state()
    out = wrapped(*_copy(state), train=False)
    expected = jax.jit(_flax_step, static_argnames=("train",))(*_copy(state), train=False)
    assert _validate.compare_outputs(expected, out, bitwise=True).bitwise_equal
    with pytest.raises(TypeError, match="jitted already"):
        optimize_distributed(static_argnums=(1,))(jax.jit(_flax_step))
    with pytest.raises(TypeError, match="expects a function"):
        optimize_distributed(42)


def test_keyword_arguments_and_donation_in_both_phases(tmp_path, monkeypatch):
    step = jax.jit(
        lambda params, opt_state, *, x, y, key: _flax_step(params, opt_state, x, y, key),
        donate_argnames=("params", "opt_state"),
    )
    params, opt_state, x, y, key = _state()
    reference = step(_copy(params), _copy(opt_state), x=x, y=y, key=key)
    for phase in ("1", "0"):
        monkeypatch.setenv("ENABLE_SEARCH", phase)
        wrapped = optimize_distributed(**FAST, plan_dir=tmp_path)(step)
        p, o = _copy(params), _copy(opt_state)
        out = wrapped(p, o, x=x, y=y, key=key)
        assert p[next(iter(p))]["Dense_0"]["kernel"].is_deleted(), "the step's donation was lost"
        assert _validate.compare_outputs(reference, out, bitwise=False).within_tolerance
        new_params, new_opt_state, _ = out
        wrapped(new_params, new_opt_state, x=x, y=y, key=key)  # the returned state feeds the next call


def test_later_calls_skip_the_signature_and_new_shapes_are_prepared(monkeypatch):
    wrapped = optimize_distributed(**FAST)(jax.jit(lambda a, b: (a * b).sum()))
    wrapped(jnp.ones(4), 2.0)
    monkeypatch.setattr(_api, "_signature", lambda *a: pytest.fail("the fast path was not taken"))
    assert float(wrapped(jnp.ones(4), 3.0)) == 12.0
    monkeypatch.undo()
    assert float(wrapped(jnp.ones(6), 3.0)) == 18.0  # another program: the executable refuses it
    assert float(wrapped(jnp.ones(4), 1.0)) == 4.0  # and back: that program was kept
    assert len(wrapped.reports) == 2
