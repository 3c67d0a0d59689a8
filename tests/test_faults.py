"""Faults a training job meets, in real processes: a search killed mid-way, two processes
searching the same step into the same plan directory, a plan directory that is missing, a
truncated plan, a step whose outputs hold more than arrays, and JAX's persistent compilation
cache shared by successive runs."""

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import flax.struct
import jax
import jax.numpy as jnp
import pytest

from disco_jax import _plan, _validate, optimize_distributed

from _steps import make_step, store_per_gradient_plan

WORKER = Path(__file__).resolve().parent / "_search_worker.py"
# Tests that run `WORKER` processes go to the pytest-xdist worker of the multi-process jobs.
MULTIPROCESS = pytest.mark.xdist_group("multiprocess")
FAST = dict(budget_s=1.0, validation_pairs=4, verbose=False)


def _worker(plan_dir, budget_s, phase="1", env=None):
    env = {**os.environ, **(env or {}), "ENABLE_SEARCH": phase}
    return subprocess.Popen(
        [sys.executable, str(WORKER), str(plan_dir), str(budget_s)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(proc, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])


def _plans(plan_dir):
    return sorted(p for p in Path(plan_dir).glob("*.json") if not p.name.endswith(".timeline.json"))


@MULTIPROCESS
def test_search_killed_midway_leaves_no_plan_and_the_next_run_searches_again(tmp_path):
    proc = _worker(tmp_path, 120)
    try:
        deadline = time.monotonic() + 240
        for line in proc.stderr:  # the search starts right after calibration
            if "simulator calibrated" in line or time.monotonic() > deadline:
                break
        time.sleep(1.0)
        assert proc.poll() is None, "the worker ended before it could be killed mid-search"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert _plans(tmp_path) == [], "a killed search left a plan"
    result = _result(_worker(tmp_path, 1))
    assert result["search_ran"] and [Path(result["plan_path"])] == _plans(tmp_path)
    _plan.read_plan_file(result["plan_path"])


@MULTIPROCESS
def test_two_processes_searching_one_step_into_one_plan_dir(tmp_path):
    results = [_result(p) for p in [_worker(tmp_path, 2), _worker(tmp_path, 2)]]
    assert all(r["search_ran"] for r in results)
    (path,) = _plans(tmp_path)  # one program, one plan file, written whole
    plan = _plan.read_plan_file(path)
    assert plan.fingerprint == results[0]["fingerprint"] == results[1]["fingerprint"]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    enacted = _result(_worker(tmp_path, 1, phase="0"))
    assert enacted["phase"] == "enact" and enacted["applied"] == (not plan.use_default)


def test_missing_plan_dir_in_both_phases(tmp_path, monkeypatch):
    step, args = make_step("jit")
    missing = tmp_path / "not" / "yet"
    with pytest.warns(_plan.PlanWarning, match="no plan"):
        optimize_distributed(**FAST, plan_dir=missing)(step)(*args)
    assert not missing.exists()
    monkeypatch.setenv("ENABLE_SEARCH", "1")
    wrapped = optimize_distributed(**FAST, plan_dir=missing)(step)
    wrapped(*args)
    assert _plans(missing) == [Path(wrapped.last_report.plan_path)]


def test_truncated_plan_is_refused_and_a_search_replaces_it(tmp_path, monkeypatch):
    step, args = make_step("jit")
    monkeypatch.setenv("ENABLE_SEARCH", "1")
    searched = optimize_distributed(**FAST, plan_dir=tmp_path)(step)
    searched(*args)
    path = Path(searched.last_report.plan_path)
    whole = path.read_text()
    path.write_text(whole[: len(whole) // 2])
    monkeypatch.setenv("ENABLE_SEARCH", "0")
    wrapped = optimize_distributed(**FAST, plan_dir=tmp_path)(step)
    with pytest.warns(_plan.PlanWarning, match="ignoring plan .* not valid JSON"):
        out = wrapped(*args)
    assert not wrapped.last_report.applied
    assert _validate.compare_outputs(step(*args), out, bitwise=True).bitwise_equal
    monkeypatch.setenv("ENABLE_SEARCH", "1")
    optimize_distributed(**FAST, plan_dir=tmp_path)(step)(*args)
    _plan.read_plan_file(path)  # whole again


@flax.struct.dataclass
class _Out:
    params: dict
    loss: jax.Array
    name: str = flax.struct.field(pytree_node=False, default="mlp")


def test_outputs_with_non_array_leaves(tmp_path, monkeypatch):
    base, args = make_step("jit")

    @jax.jit
    def step(params, opt_state, x, y):
        new_params, new_opt_state, loss = base(params, opt_state, x, y)
        return _Out(new_params, loss), None, {"opt_state": new_opt_state, "nothing": (), "count": 3}

    reference = step(*args)
    for phase in ("1", "0"):
        monkeypatch.setenv("ENABLE_SEARCH", phase)
        wrapped = optimize_distributed(**FAST, plan_dir=tmp_path)(step)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", _plan.PlanWarning)
            out = wrapped(*args)
        assert jax.tree.structure(out) == jax.tree.structure(reference)
        assert out[0].name == "mlp" and out[1] is None and int(out[2]["count"]) == 3
        assert _validate.compare_outputs(reference, out, bitwise=False).within_tolerance
    assert jnp.isfinite(out[0].loss)


@MULTIPROCESS
def test_runs_sharing_a_persistent_compilation_cache_capture_and_enact(tmp_path):
    """With `jax_compilation_cache_dir` set (usual on clusters), XLA's executable of the step is in
    the cache before the capture compiles it: the capture must still reach the hook, and a later
    run is served the plan's own executable, not the unmodified step's."""
    import optax

    step, args = make_step("jit", optimizer=optax.adam(1e-2))  # the worker's step
    plan, num_gradients = store_per_gradient_plan(step, args, tmp_path / "plans")
    cache = tmp_path / "cache"
    env = {
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
    }
    entries = []
    for run in range(2):
        result = _result(_worker(tmp_path / "plans", 1, phase="0", env=env))
        entries.append(sorted(p.name for p in cache.iterdir()))
        assert result["phase"] == "enact" and result["applied"], result
        assert result["fingerprint"] == plan.fingerprint
        assert result["plan_counts"]["all-reduce"] == num_gradients  # the plan's executable
        assert result["outputs_match"]
        assert result["compile_status"] == ("rewritten" if run == 0 else "cached")
    assert entries[0], "the runs wrote nothing to the persistent cache"
    assert entries[1] == entries[0], "the second run compiled something new: a capture or the plan was cached anew"
