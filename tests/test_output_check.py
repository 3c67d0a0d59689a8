"""The output check (`disco_jax._output_check`): a candidate is judged against a float64 run of the
step, with XLA's own program's deviation from it as the yardstick. Adam-family steps that sum
their gradients in another order are accepted; steps with other math (a missing division by the
device count, a dropped gradient) are rejected; a step that cannot run in float64 falls back to
the ulp tolerance and says why."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from disco_jax import _validate
from disco_jax._output_check import STATE_STEPS, Float64Run, OutputCheck, carried_state, narrow_float

from _steps import gradient_sums, make_step, mlp_loss

OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-3),  # lr 1e-3: a sign flip of a near-zero gradient moves a parameter 2e-3
    "adamw": lambda: optax.adamw(1e-3, weight_decay=1e-2),
    "lamb": lambda: optax.lamb(1e-3),
}


@pytest.fixture(scope="module")
def adam_steps():
    """Adam's step, its hand-written variants and its output check, shared by the tests below."""
    step, variants, args = gradient_sums(OPTIMIZERS["adam"]())
    return step, variants, args, OutputCheck.for_call(step, args)


def test_adams_step_summed_in_another_order_is_accepted(adam_steps):
    step, variants, args, check = adam_steps
    _accepts_the_reordered_sum(check, variants["reordered"](*args))


@pytest.mark.parametrize("optimizer", ["adamw", "lamb"])
def test_adamw_and_lamb_steps_summed_in_another_order_are_accepted(optimizer):
    step, variants, args = gradient_sums(OPTIMIZERS[optimizer]())
    _accepts_the_reordered_sum(OutputCheck.for_call(step, args), variants["reordered"](*args))


def _accepts_the_reordered_sum(check: OutputCheck, outputs) -> None:
    comparison = check.compare(outputs)
    assert comparison.check == _validate.FLOAT64_CHECK and comparison.fallback_reason is None
    assert not comparison.bitwise_equal  # another summation order moved the outputs
    assert comparison.within_tolerance, comparison.summary()
    assert comparison.factor == _validate.FACTOR and comparison.floor_ulps == _validate.FLOOR_ULPS
    leaves = len(jax.tree.leaves(outputs))
    assert len(comparison.default_deviation) == len(comparison.plan_deviation) == len(comparison.allowed) == leaves
    # The yardstick is real: XLA's own program is not the float64 result either.
    assert max(comparison.default_deviation) > 0.0


@pytest.mark.parametrize("wrong", ["undivided", "dropped"])
def test_steps_with_other_gradient_math_are_rejected(wrong, adam_steps):
    step, variants, args, check = adam_steps
    comparison = check.compare(variants[wrong](*args))
    assert comparison.check == _validate.FLOAT64_CHECK
    assert not comparison.within_tolerance
    # Far beyond the bound, not at its edge: the optimizer state is off by the gradients' error.
    worst = max(p / a for p, a in zip(comparison.plan_deviation, comparison.allowed) if a)
    assert worst > 100.0
    assert "deviates" in comparison.summary() and "float64" in comparison.summary()


def test_a_step_that_computes_in_float32_falls_back_to_the_ulp_tolerance_and_says_so():
    step, args = make_step("jit", optimizer=optax.adam(1e-3))

    @jax.jit
    def float32_step(params, opt_state, x, y):  # the same step with a hard-coded float32 cast
        return step.__wrapped__(params, opt_state, x.astype(jnp.float32), y)

    check = OutputCheck.for_call(float32_step, args)
    same = check.compare(float32_step(*args))
    assert same.check == _validate.ULP_CHECK and same.within_tolerance and same.bitwise_equal
    assert "float32 (convert_element_type)" in same.fallback_reason
    assert check.exact.outputs() is None
    params, opt_state, loss = float32_step(*args)
    wrong = check.compare((jax.tree.map(lambda p: p * 1.01, params), opt_state, loss))
    assert wrong.check == _validate.ULP_CHECK and not wrong.within_tolerance
    assert "ulp tolerance" in wrong.summary() and "float32" in wrong.summary()


def test_a_function_that_is_not_jitted_falls_back():
    step, args = make_step("jit", optimizer=optax.adam(1e-3))
    run = Float64Run(lambda *a: step(*a), args, {})
    assert run.outputs() is None and run.reason == "the step is not a jax.jit function"


def test_the_float64_run_promotes_floating_inputs_and_keeps_the_rest():
    @jax.jit
    def f(x, n, key):
        return x * 3.0 + n, jax.random.uniform(key, (2,), dtype=x.dtype)

    x = jnp.full((4,), 1.0 / 3.0, jnp.float32)
    run = Float64Run(f, (x, jnp.int32(2), jax.random.key(0, impl="rbg")), {})
    (y, u) = run.outputs()
    assert y.dtype == np.float64 and u.dtype == np.float64
    # 1/3 rounded to float32, times 3 in float64: not 1.0, as float32 arithmetic would give.
    np.testing.assert_array_equal(y, np.float64(np.float32(1.0 / 3.0)) * 3.0 + 2.0)
    assert np.all(y != np.float32(3.0))


def test_narrow_floats_made_from_masks_pass_and_casts_of_computed_floats_do_not():
    with jax.enable_x64(True):
        masked = jax.make_jaxpr(lambda x, mask: x * mask.astype(jnp.float32))(np.ones(3), np.ones(3, bool))
        cast = jax.make_jaxpr(jax.jit(lambda x: x.astype(jnp.float32) * 2))(np.ones(3))
    assert narrow_float(masked.jaxpr) is None  # exact: a bool is 0.0 or 1.0 in any float type
    assert narrow_float(cast.jaxpr) == "float32 (convert_element_type)"  # found inside the nested jit


def test_deviation_counts_matching_nans_and_infinities_as_equal():
    exact = np.array([np.nan, np.inf, 1.0])
    assert _validate.deviation(np.array([np.nan, np.inf, 1.5], np.float32), exact) == 0.5
    assert _validate.deviation(np.array([0.0, np.inf, 1.0], np.float32), exact) == np.inf
    assert _validate.deviation(np.array([np.nan, -np.inf, 1.0], np.float32), exact) == np.inf


def test_the_floor_is_a_few_ulps_of_the_arrays_magnitude():
    eps = float(np.finfo(np.float32).eps)
    assert _validate.deviation_floor(np.array([0.5, -2.0]), np.dtype(np.float32)) == _validate.FLOOR_ULPS * eps * 2.0
    assert _validate.deviation_floor(np.zeros(3), np.dtype(np.float32)) == float(np.finfo(np.float32).tiny)


def test_merged_comparisons_keep_each_arrays_largest_deviation():
    def comparison(within, max_abs, default, plan, allowed):
        return _validate.Comparison(
            False, within, max_abs, 0.0, 2, 0, _validate.FLOAT64_CHECK, None, 8.0, 4.0, default, plan, allowed
        )

    a = comparison(True, 1e-7, [1e-7, 0.0], [2e-7, 0.0], [9e-7, 0.0])
    b = comparison(False, 2e-6, [3e-8, 0.0], [2e-6, 0.0], [5e-7, 0.0])
    merged = _validate.Comparison.merge([dataclasses.asdict(a), dataclasses.asdict(b)])
    assert not merged.within_tolerance and merged.check == _validate.FLOAT64_CHECK
    assert merged.default_deviation == [1e-7, 0.0] and merged.plan_deviation == [2e-6, 0.0]
    assert merged.allowed == [9e-7, 0.0] and merged.max_abs_error == 2e-6


# From a moved state: a fresh optimizer state is zero, so one step from it cannot show how a plan
# treats the state it carries. Each wrong step below is exact from the fresh state and is caught
# only from the state the unmodified step carried out of two steps.

B1, B2, EPS, LR = 0.9, 0.999, 1e-8, 1e-3


def _sgd_momentum(decays: int) -> optax.GradientTransformation:
    """SGD with momentum 0.9 written by hand: the trace decayed `decays` times per step (1 is
    optax's `trace`; 2 is the bug)."""

    def update(grads, state, params=None):
        trace = jax.tree.map(lambda g, t: g + 0.9**decays * t, grads, state.trace)
        return trace, optax.TraceState(trace=trace)

    return optax.chain(optax.GradientTransformation(optax.trace(0.9).init, update), optax.scale_by_learning_rate(0.1))


def _adam_moments(g, mu, nu, count, mu_decays: int = 1):
    """One Adam direction (before the learning rate) of one array as optax computes it, and the
    new moments; mu decayed `mu_decays` times."""
    mu = (1 - B1) * g + B1**mu_decays * mu
    nu = (1 - B2) * g * g + B2 * nu
    mu_hat = mu / (1 - B1**count).astype(mu.dtype)
    nu_hat = nu / (1 - B2**count).astype(nu.dtype)
    return mu_hat / (jnp.sqrt(nu_hat) + EPS), mu, nu


def _adam(mu_decays: int) -> optax.GradientTransformation:
    def update(grads, state, params=None):
        count = optax.safe_int32_increment(state.count)
        out = jax.tree.map(lambda g, m, v: _adam_moments(g, m, v, count, mu_decays), grads, state.mu, state.nu)
        pick = lambda k: jax.tree.map(lambda _, o: o[k], grads, out)  # noqa: E731
        return pick(0), optax.ScaleByAdamState(count=count, mu=pick(1), nu=pick(2))

    return optax.GradientTransformation(optax.scale_by_adam().init, update)


def _moved_verdicts(reference, candidate, args):
    """(verdict on the call's inputs only, verdict from the moved state) of `candidate` against
    `reference`'s check."""
    fresh = OutputCheck.for_call(reference, args).compare(candidate(*args))
    moved = OutputCheck.for_call(reference, args).compare(candidate(*args), rerun=lambda a, k: candidate(*a, **k))
    return fresh, moved


def _same_step(optimizer):
    step, args = make_step("jit", optimizer=optimizer)
    return jax.jit(step.__wrapped__), args


@pytest.mark.parametrize(
    "name, right, wrong",
    [
        ("sgd-momentum, trace decayed twice", optax.sgd(0.1, momentum=0.9), _sgd_momentum(2)),
        ("adam, mu decayed twice", optax.adam(LR), optax.chain(_adam(2), optax.scale_by_learning_rate(LR))),
    ],
)
def test_a_step_that_decays_its_carried_state_twice_is_rejected_from_a_moved_state(name, right, wrong):
    reference, args = make_step("jit", optimizer=right)
    candidate, _ = _same_step(wrong)
    fresh, moved = _moved_verdicts(reference, candidate, args)
    assert fresh.within_tolerance and fresh.state_steps == 0  # blind from the fresh state
    assert fresh.state_reason == "the candidate was not run again"
    assert moved.check == _validate.FLOAT64_CHECK and moved.state_steps == STATE_STEPS
    assert not moved.within_tolerance
    assert max(p / a for p, a in zip(moved.plan_deviation, moved.allowed) if a) > 100.0
    assert f"after {STATE_STEPS} unmodified steps" in moved.summary()


@pytest.mark.parametrize(
    "right, by_hand",
    [
        (optax.sgd(0.1, momentum=0.9), _sgd_momentum(1)),
        (optax.adam(LR), optax.chain(_adam(1), optax.scale_by_learning_rate(LR))),
    ],
)
def test_the_same_updates_written_by_hand_pass_from_the_moved_state(right, by_hand):
    reference, args = make_step("jit", optimizer=right)
    candidate, _ = _same_step(by_hand)
    _, moved = _moved_verdicts(reference, candidate, args)
    assert moved.within_tolerance and moved.state_steps == STATE_STEPS, moved.summary()


def _zero1_adam(shift: int):
    """Adam with its moments sharded over the 8 devices (ZeRO stage 1) written with `shard_map`:
    each device updates its block of every parameter from its block of mu and nu and the
    parameters are all-gathered. `shift` 1 is the bug: device d reads device d+1's block of the
    state (`ppermute`) and writes its own."""
    mesh = jax.make_mesh((8,), ("data",))
    n = mesh.size
    state_specs = (optax.ScaleByAdamState(count=P(), mu=P("data"), nu=P("data")), optax.EmptyState())

    @functools.partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(P(), state_specs, P("data"), P("data")),
        out_specs=(P(), state_specs, P()),
        check_vma=False,
    )
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(mlp_loss)(params, x, y)
        grads = jax.tree.map(lambda g: jax.lax.psum(g, "data") / n, grads)
        adam, empty = opt_state
        count = optax.safe_int32_increment(adam.count)
        here = jax.lax.axis_index("data")

        def block(p, g, m, v):
            rows = p.shape[0] // n
            if shift:
                m, v = (jax.lax.ppermute(t, "data", [(i, (i - shift) % n) for i in range(n)]) for t in (m, v))
            g_block = jax.lax.dynamic_slice_in_dim(g, here * rows, rows)
            direction, m, v = _adam_moments(g_block, m, v, count)
            p_block = jax.lax.dynamic_slice_in_dim(p, here * rows, rows) - LR * direction
            return jax.lax.all_gather(p_block, "data", tiled=True), m, v

        out = jax.tree.map(block, params, grads, adam.mu, adam.nu)
        pick = lambda k: jax.tree.map(lambda _, o: o[k], params, out)  # noqa: E731
        new_state = (optax.ScaleByAdamState(count=count, mu=pick(1), nu=pick(2)), empty)
        return pick(0), new_state, jax.lax.pmean(loss, "data")

    def resharded(params, opt_state, x, y):  # the moments moved to their blocks, as ZeRO holds them
        blocks = NamedSharding(mesh, P("data"))
        adam, empty = opt_state
        moments = jax.tree.map(lambda t: jax.reshard(t, blocks), (adam.mu, adam.nu))
        return step(params, (adam._replace(mu=moments[0], nu=moments[1]), empty), x, y)

    return jax.jit(resharded)


@pytest.mark.parametrize("shift, rejected", [(0, False), (1, True)])
def test_a_device_updating_with_another_devices_block_of_the_state_is_rejected(shift, rejected):
    sizes = (16, 32, 8)  # every leading dimension a multiple of the 8 devices
    reference, args = make_step("jit", sizes=sizes, optimizer=optax.adam(LR))
    candidate = _zero1_adam(shift)
    fresh, moved = _moved_verdicts(reference, candidate, args)
    assert fresh.within_tolerance  # blind from the fresh state: every block of it is zero
    assert moved.check == _validate.FLOAT64_CHECK and moved.state_steps == STATE_STEPS
    assert moved.within_tolerance is not rejected, moved.summary()
    worst = max(p / a for p, a in zip(moved.plan_deviation, moved.allowed) if a)
    assert worst > 100.0 if rejected else worst <= 1.0


def test_carried_state_matches_outputs_to_arguments_by_structure():
    step, args = make_step("jit", optimizer=optax.adam(1e-3))
    assert carried_state(args, step(*args)) == {0: 0, 1: 1}  # params and opt_state; not x, y
    lr = jnp.float32(0.1)  # a lone scalar argument is not taken for the loss's state
    assert carried_state((args[0], lr), (args[0], jnp.float32(1.0))) == {0: 0}
    assert carried_state(args, jnp.float32(0.0)) == {}


def test_a_step_that_carries_no_state_is_judged_from_its_inputs_and_says_so():
    @jax.jit
    def f(x):
        return jnp.sum(x * 2.0)

    x = jnp.arange(8.0)
    comparison = OutputCheck.for_call(f, (x,)).compare(f(x), rerun=lambda a, k: f(*a))
    assert comparison.within_tolerance and comparison.state_steps == 0
    assert comparison.state_reason == "no output carries an argument's state to the next step"


def test_an_output_shaped_like_its_input_that_overflows_when_fed_back_gives_no_moved_verdict():
    """An output shaped like an argument need not be its state: fed back, `x * 1e30` overflows
    float32 on the second step, and a check from infinities would pass any candidate (inf <= inf).
    The step is judged from its inputs alone and says why."""

    @jax.jit
    def f(x):
        return x * 1e30

    x = jnp.arange(1.0, 9.0)
    wrong = jax.jit(lambda x: x * 2e30)  # rejected from the call's inputs all the same
    check = OutputCheck.for_call(f, (x,))
    comparison = check.compare(f(x), rerun=lambda a, k: f(*a))
    assert comparison.within_tolerance and comparison.state_steps == 0
    assert comparison.state_reason == f"the step from the state after {STATE_STEPS} unmodified steps overflows"
    assert check.moved() is None
    assert not check.compare(wrong(x), rerun=lambda a, k: wrong(*a)).within_tolerance
