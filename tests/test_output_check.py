"""The output check (`disco_jax._output_check`): a candidate is judged against a float64 run of the
step, with XLA's own program's deviation from it as the yardstick. Adam-family steps that sum
their gradients in another order are accepted; steps with other math (a missing division by the
device count, a dropped gradient) are rejected; a step that cannot run in float64 falls back to
the ulp tolerance and says why."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from disco_jax import _validate
from disco_jax._output_check import Float64Run, OutputCheck, narrow_float

from _steps import gradient_sums, make_step

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
