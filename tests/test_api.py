"""@optimize_distributed end to end: search phase, enactment phase, and bad input."""

import dataclasses
import inspect
import warnings

import jax
import jax.numpy as jnp
import pytest

from disco_jax import (
    _files,
    _plan,
    _search,
    _validate,
    backends,
    optimize_distributed,
)

from _steps import make_step, store_per_gradient_plan

FAST = dict(budget_s=2.0, validation_pairs=4, verbose=False)


@pytest.mark.parametrize("style", ["jit", "shard_map"])
def test_search_phase_then_enactment_phase(style, tmp_path, monkeypatch):
    step, args = make_step(style, optimizer=__import__("optax").adam(1e-2))
    reference = step(*args)
    monkeypatch.setenv("ENABLE_SEARCH", "1")
    searching = optimize_distributed(**FAST, plan_dir=tmp_path)(step)
    out = searching(*args)
    report = searching.last_report
    assert report.phase == "search" and report.search_ran
    assert list(tmp_path.glob("*.json")), "no plan stored"
    assert report.simulated["default"]["iteration_us"] > 0
    assert _validate.compare_outputs(reference, out, bitwise=False).within_tolerance
    plan = _plan.read_plan_file(report.plan_path)
    assert plan.fingerprint == report.fingerprint

    monkeypatch.setenv("ENABLE_SEARCH", "0")
    monkeypatch.setattr(_search, "backtracking_search", lambda *a, **k: pytest.fail("enactment searched"))
    enacting = optimize_distributed(**FAST, plan_dir=tmp_path)(step)
    out = enacting(*args)
    report = enacting.last_report
    assert report.phase == "enact" and not report.search_ran
    assert report.applied == (not plan.use_default)
    if not plan.use_default:
        assert report.plan_counts["all-reduce"] == len(plan.strategy["buckets"])
    assert _validate.compare_outputs(reference, out, bitwise=False).within_tolerance
    # Later calls reuse the compiled executable.
    again = enacting(*args)
    assert len(enacting.reports) == 1
    assert _validate.compare_outputs(out, again, bitwise=True).bitwise_equal


@pytest.mark.parametrize("style", ["jit", "shard_map"])
def test_stored_plan_is_enacted_in_the_compiled_hlo(style, tmp_path):
    step, args = make_step(style)
    reference = step(*args)  # compiled and cached by JAX first: the plan must still be applied
    plan, num_gradients = store_per_gradient_plan(step, args, tmp_path)
    enacting = optimize_distributed(**FAST, plan_dir=tmp_path)(step)
    out = enacting(*args)
    report = enacting.last_report
    assert report.applied
    assert report.default_counts["all-reduce"] == 1
    assert report.plan_counts["all-reduce"] == num_gradients
    assert _validate.compare_outputs(reference, out, bitwise=True).bitwise_equal


def test_no_plan_warns_once_and_runs_the_unmodified_step(tmp_path):
    step, args = make_step("jit")
    wrapped = optimize_distributed(**FAST, plan_dir=tmp_path)(step)
    call_line = inspect.currentframe().f_lineno + 2
    with pytest.warns(_plan.PlanWarning, match="ENABLE_SEARCH=1") as caught:
        out = wrapped(*args)
    # Attributed to the user's call of the step, not to a line inside disco-jax or JAX.
    assert {(w.filename, w.lineno) for w in caught} == {(__file__, call_line)}
    assert not wrapped.last_report.applied
    assert _validate.compare_outputs(step(*args), out, bitwise=True).bitwise_equal


def test_a_backend_not_ready_for_the_decorator_runs_the_jitted_step(monkeypatch):
    """A backend that compiles and rewrites but whose plans have not run on its devices (as XLA:GPU
    was before issue 15): the decorator runs the user's step there, as on a platform without one."""
    assert set(backends.supported_platforms(decorator=True)) == {"cpu", "cuda"}
    not_ready = dataclasses.replace(backends.CPU, decorator_ready=False)
    monkeypatch.setattr(backends, "for_platform", lambda platform: not_ready)
    step, args = make_step("jit")
    wrapped = optimize_distributed(search=True, **FAST)(step)
    with pytest.warns(UserWarning, match="not supported by the decorator yet"):
        wrapped(*args)
    assert wrapped.executable(*args) is step and wrapped.last_report.reason == "unsupported backend"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wrapped(*args)


def test_corrupt_plan_is_refused_and_the_default_runs(tmp_path):
    step, args = make_step("jit")
    plan, _ = store_per_gradient_plan(step, args, tmp_path)
    (tmp_path / plan.file_name).write_text('{"format_version": 1, "garbage": tru')
    wrapped = optimize_distributed(**FAST, plan_dir=tmp_path)(step)
    with pytest.warns(_plan.PlanWarning, match="ignoring plan"):
        out = wrapped(*args)
    assert not wrapped.last_report.applied
    assert _validate.compare_outputs(step(*args), out, bitwise=True).bitwise_equal


def test_plan_naming_unknown_ops_is_refused(tmp_path):
    step, args = make_step("jit")
    plan, _ = store_per_gradient_plan(step, args, tmp_path)
    data = plan.to_json()
    data["strategy"]["buckets"][0] = ["not-an-op"]
    _files.write_json_atomic(tmp_path / plan.file_name, data)
    wrapped = optimize_distributed(**FAST, plan_dir=tmp_path)(step)
    with pytest.warns(_plan.PlanWarning, match="cannot be applied"):
        wrapped(*args)
    assert not wrapped.last_report.applied


def test_unwritable_plan_dir_warns_and_still_trains(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("ENABLE_SEARCH", "1")
    step, args = make_step("jit")
    wrapped = optimize_distributed(**FAST, plan_dir=blocker)(step)
    with pytest.warns(_plan.PlanWarning, match="cannot write plan"):
        out = wrapped(*args)
    assert _validate.compare_outputs(step(*args), out, bitwise=False).within_tolerance


@pytest.mark.parametrize("value", ["yes", "2", "true"])
def test_enable_search_must_be_0_or_1(value, monkeypatch):
    monkeypatch.setenv("ENABLE_SEARCH", value)
    step, args = make_step("jit")
    with pytest.raises(ValueError, match="ENABLE_SEARCH must be 0 or 1"):
        optimize_distributed(**FAST)(step)(*args)


def test_step_without_collectives_still_has_its_fusion_searched(monkeypatch):
    """One device (the one-GPU case): no all-reduce, but XLA's fusion decisions are searched."""
    monkeypatch.setenv("ENABLE_SEARCH", "1")
    step = jax.jit(lambda x: jnp.tanh(x @ x) * 2 + jnp.exp(x))
    wrapped = optimize_distributed(**FAST)(step)
    x = jnp.linspace(0.0, 1.0, 4096).reshape(64, 64)
    out = wrapped(x)
    assert wrapped.last_report.search_ran and wrapped.last_report.reason != "nothing to optimize"
    assert _validate.compare_outputs(step(x), out, bitwise=False).within_tolerance


def test_step_with_nothing_to_optimize_is_left_alone(monkeypatch):
    monkeypatch.setenv("ENABLE_SEARCH", "1")
    wrapped = optimize_distributed(**FAST)(jax.jit(lambda x, y: x @ y))
    out = wrapped(jnp.ones((4, 4)), jnp.ones((4, 4)))
    assert wrapped.last_report.reason == "nothing to optimize"
    assert jnp.allclose(out, 4.0)


def test_bad_options_are_refused_early():
    with pytest.raises(ValueError, match="alpha"):
        optimize_distributed(alpha=0.9)


def test_search_parameter_overrides_enable_search(tmp_path, monkeypatch):
    """`search=` decides the phase; ENABLE_SEARCH is only the default (and is not even read)."""
    step, args = make_step("jit")
    monkeypatch.setenv("ENABLE_SEARCH", "not a number")
    searching = optimize_distributed(search=True, **FAST, plan_dir=tmp_path)(step)
    searching(*args)
    assert searching.last_report.phase == "search" and searching.last_report.search_ran
    monkeypatch.setattr(_search, "backtracking_search", lambda *a, **k: pytest.fail("enactment searched"))
    enacting = optimize_distributed(search=False, **FAST, plan_dir=tmp_path)(step)
    enacting(*args)
    assert enacting.last_report.phase == "enact" and enacting.last_report.plan is not None
    with pytest.raises(TypeError, match="search must be"):
        optimize_distributed(search="yes")


def test_search_config_is_passed_through_and_keywords_replace_its_fields(tmp_path):
    config = _search.SearchConfig(alpha=1.2, beta=3, max_unchanged=50, budget_s=5.0, seed=7)
    wrapped = optimize_distributed(
        search=True, config=config, budget_s=1.5, validation_pairs=4, verbose=False, plan_dir=tmp_path
    )
    assert wrapped(jax.jit(lambda x: x)).options.search == _search.SearchConfig(
        alpha=1.2, beta=3, max_unchanged=50, budget_s=1.5, seed=7
    )
    step, args = make_step("jit")
    searched = wrapped(step)
    searched(*args)
    recorded = searched.last_report.search["options"]["search"]
    assert recorded["alpha"] == 1.2 and recorded["beta"] == 3 and recorded["budget_s"] == 1.5
    assert searched.last_report.search["seconds"] < 5.0  # the keyword's budget, not the config's


def test_unsupported_backend_warns_and_runs_the_jitted_step(monkeypatch):
    """No `Backend` for the platform: the user's own jitted function runs, with one warning."""
    monkeypatch.setattr(backends, "for_platform", lambda platform: None)
    step, args = make_step("jit")
    wrapped = optimize_distributed(search=False, **FAST)(step)
    with pytest.warns(UserWarning, match="not supported by the decorator yet"):
        out = wrapped(*args)
    assert wrapped.executable(*args) is step
    assert wrapped.last_report.reason == "unsupported backend" and not wrapped.last_report.applied
    assert _validate.compare_outputs(step(*args), out, bitwise=True).bitwise_equal
