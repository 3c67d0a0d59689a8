"""Plans: JSON round trip, atomic writes, and refusal of stale, foreign or corrupt plans."""

import dataclasses
import json
import os
import warnings

import pytest

from disco_jax import _files, _plan


def _plan_for(fingerprint="abc123", **machine):
    key = dataclasses.replace(_plan.MachineKey("cpu", "cpu", 8), **machine)
    return _plan.Plan(
        fingerprint,
        "jit_step",
        key,
        False,
        {"groups": [], "buckets": [["g"]], "origin": "t"},
        "because",
        simulated={"default": {"iteration_us": 2.0}},
        measured={"ratio": 0.9},
    )


def test_round_trip(tmp_path):
    plan = _plan_for()
    path = _plan.save_plan(plan, tmp_path)
    assert path.name == plan.file_name and path.exists()
    loaded, found_at = _plan.find_plan("abc123", plan.machine, tmp_path)
    assert found_at == path
    assert loaded == plan
    assert json.loads(path.read_text())["format_version"] == _plan.PLAN_FORMAT_VERSION


def test_env_var_sets_the_default_directory(tmp_path, monkeypatch):
    monkeypatch.setenv(_plan.PLAN_DIR_ENV, str(tmp_path / "from-env"))
    path = _plan.save_plan(_plan_for())
    assert path.parent == tmp_path / "from-env"


def test_write_is_atomic_and_leaves_no_temp_files(tmp_path):
    _plan.save_plan(_plan_for(), tmp_path)
    _plan.save_plan(_plan_for(), tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [_plan_for().file_name]


def test_missing_plan_is_none_without_warning(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan, _ = _plan.find_plan("abc123", _plan.MachineKey("cpu", "cpu", 8), tmp_path)
    assert plan is None


@pytest.mark.parametrize("change", [dict(jax_version="0.0.1"), dict(jaxlib_version="0.0.1"), dict(num_processes=2)])
def test_stale_plan_is_refused_with_a_warning(tmp_path, change):
    stored = _plan_for(**change)
    path = tmp_path / _plan.plan_file_name("abc123", _plan.MachineKey("cpu", "cpu", 8))
    _files.write_json_atomic(path, stored.to_json())
    with pytest.warns(_plan.PlanWarning, match="does not match"):
        plan, _ = _plan.find_plan("abc123", _plan.MachineKey("cpu", "cpu", 8), tmp_path)
    assert plan is None


def test_foreign_plan_under_our_name_is_refused(tmp_path):
    key = _plan.MachineKey("cpu", "cpu", 8)
    _files.write_json_atomic(tmp_path / _plan.plan_file_name("abc123", key), _plan_for("zzz999").to_json())
    with pytest.warns(_plan.PlanWarning, match="fingerprint"):
        plan, _ = _plan.find_plan("abc123", key, tmp_path)
    assert plan is None


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "[1, 2]",
        json.dumps({"format_version": 99}),
        json.dumps({"format_version": 1, "fingerprint": "abc123"}),
    ],
)
def test_corrupt_plan_is_refused_with_a_warning(tmp_path, content):
    key = _plan.MachineKey("cpu", "cpu", 8)
    (tmp_path / _plan.plan_file_name("abc123", key)).write_text(content)
    with pytest.warns(_plan.PlanWarning, match="ignoring plan"):
        plan, _ = _plan.find_plan("abc123", key, tmp_path)
    assert plan is None


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_directory_is_a_clear_error(tmp_path):
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(OSError, match="cannot write plan"):
            _plan.save_plan(_plan_for(), tmp_path / "sub")
    finally:
        tmp_path.chmod(0o700)


def test_directory_that_is_a_file_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError, match="cannot write plan"):
        _plan.save_plan(_plan_for(), blocker)
