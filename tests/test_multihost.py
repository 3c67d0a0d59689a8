"""Multi-process jobs over loopback (2 processes x 2 CPU devices, gloo): the launcher, the search
on process 0 only, plan broadcast and agreement, and mismatches that fail every process.

Each job is started with `disco_jax._launch.launch` running `_multihost_worker.py`; every wait has
a timeout (the job: JOB_TIMEOUT_S; the key-value store: DISCO_JAX_SYNC_TIMEOUT_S)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from disco_jax import _launch
from disco_jax.cost import AllReduceCostModel

# Under pytest-xdist, every multi-process job runs on one worker, one at a time (`--dist loadgroup`).
pytestmark = pytest.mark.xdist_group("multiprocess")

WORKER = Path(__file__).resolve().parent / "_multihost_worker.py"
REPO = Path(__file__).resolve().parents[1]
JOB_TIMEOUT_S = 180
SYNC_TIMEOUT_S = 60


def run_job(*worker_args, search: bool, num_processes: int = 2, devices_per_process: int = 2):
    """Run the worker as one job; returns (LaunchResult, {process: RESULT dict})."""
    env = dict(os.environ, ENABLE_SEARCH="1" if search else "0", DISCO_JAX_SYNC_TIMEOUT_S=str(SYNC_TIMEOUT_S))
    result = _launch.launch(
        [sys.executable, str(WORKER), *map(str, worker_args)],
        num_processes,
        devices_per_process=devices_per_process,
        timeout_s=JOB_TIMEOUT_S,
        env=env,
        cwd=str(REPO),
    )
    assert not result.timed_out, "job timed out:\n" + "\n".join(result.outputs)
    reports = {}
    for i, output in enumerate(result.outputs):
        for line in output.splitlines():
            if line.startswith("RESULT "):
                reports[i] = json.loads(line[len("RESULT ") :])
    return result, reports


def _succeeded(result, reports, num_processes=2):
    assert result.exit_code == 0, "\n".join(f"--- process {i}:\n{o}" for i, o in enumerate(result.outputs))
    assert sorted(reports) == list(range(num_processes))


def test_the_collectives_cost_is_measured_once_and_taken_by_the_jobs_next_profile(two_process_profiles):
    """The seeding job (`two_process_profiles`): its first profile phase measured the all-reduce fit
    on every process (a collective) and its reduce-scatter / all-gather line, process 0 stored
    them under the device and process count, and the second profile phase measured nothing: every
    process took process 0's stored fit."""
    reports = two_process_profiles.reports
    stored = json.loads((two_process_profiles.directory / "cpu" / "profile.json").read_text())["allreduce"]
    assert list(stored) == ["4 in 2 processes"]  # not under "4": the devices of one process
    assert AllReduceCostModel.from_json(stored["4 in 2 processes"]).to_json() == reports[0]["allreduce"]
    for r in reports.values():
        assert (r["allreduce_measured"], r["scatter_gather_measured"]) == (1, 1)
        assert r["allreduce_fits"] == [None, reports[0]["allreduce"]]
        assert r["allreduce_again"] == reports[0]["allreduce"]


def test_search_on_process_0_then_every_process_enacts_the_plan(tmp_path, two_process_profiles):
    plan_dir = tmp_path / "plans"
    # Process 0's profile directory holds the collectives' cost of 2 processes x 2 devices, process
    # 1's nothing: process 0 decides, and neither measures.
    two_process_profiles.copy_to(tmp_path / "profiles-0")
    # The replicated update: its outputs are whole on every process, so bitwise comparable (the
    # weight-update choice may shard the state over gloo, each process then holding its shards).
    result, reports = run_job(
        plan_dir,
        "--pick-per-gradient",
        "--weight-update",
        "replicated",
        "--profile-dir",
        tmp_path / "profiles-{process}",
        search=True,
    )
    _succeeded(result, reports)
    p0, p1 = reports[0], reports[1]
    seeded = two_process_profiles.reports[0]["allreduce"]
    for r in (p0, p1):
        assert r["allreduce_measured"] == 0 and r["allreduce_fits"] == [seeded]
    assert not list((tmp_path / "profiles-1").rglob("*.json")), "process 1 stored a profile"
    assert (p0["searches"], p0["search_ran"]) == (1, True)
    assert (p1["searches"], p1["search_ran"]) == (0, False)
    for r in (p0, p1):
        assert r["process_count"] == 2 and r["device_count"] == 4 and r["num_processes"] == 2
        assert r["phase"] == "search"
        # Only all-reduces regrouped: validation ran on both processes and required bitwise equality.
        assert r["measured"]["bitwise_required"] and r["measured"]["bitwise_equal"]
        assert r["bitwise_equal"] and r["repeat_bitwise_equal"]
        assert r["output_digest"] == r["reference_digest"]
    for key in ("plan_digest", "applied", "reason", "plan_use_default", "output_digest"):
        assert p0[key] == p1[key], key
    if p0["applied"]:
        assert p0["plan_counts"]["all-reduce"] == p0["plan_buckets"] == p0["gradients"]
    plans = [p for p in plan_dir.glob("*.json") if not p.name.endswith(".timeline.json")]
    assert len(plans) == 1 and plans[0].name.endswith("-p2.json")

    result, reports = run_job(plan_dir, "--weight-update", "replicated", search=False)
    _succeeded(result, reports)
    for r in reports.values():
        assert r["phase"] == "enact" and r["searches"] == 0 and not r["search_ran"]
        assert r["plan_digest"] == p0["plan_digest"] and r["applied"] == p0["applied"]
        assert r["bitwise_equal"] and r["output_digest"] == r["reference_digest"]
        if r["applied"]:
            assert r["plan_counts"]["all-reduce"] == r["gradients"]


def test_a_forced_sharded_update_checks_outputs_across_processes(tmp_path, two_process_profiles):
    """weight_update="sharded": the processes agree before the output check runs both programs, and
    the check's verdict is merged: every process records the same one and keeps the sharding."""
    two_process_profiles.copy_to()  # the profile directory of the test's job
    result, reports = run_job(tmp_path / "plans", "--weight-update", "sharded", search=True)
    _succeeded(result, reports)
    p0, p1 = reports[0], reports[1]
    for r in (p0, p1):
        # The sharded program's reduce-scatters and all-gathers are costed by the stored line.
        assert (r["allreduce_measured"], r["scatter_gather_measured"]) == (0, 0)
        assert r["weight_update"]["mode"] == "sharded", r["weight_update"]["reason"]
        assert r["weight_update"]["check"]["within_tolerance"] and r["within_tolerance"]
        # Each process gathered the inputs and ran the step in float64 on its own CPU device.
        assert r["weight_update"]["check"]["check"] == "float64-reference", r["weight_update"]["check"]
        assert r["output_check"] == "float64-reference", r["output_check_fallback"]
        assert r["sharded_state_leaves"] > 0
    assert p0["weight_update"]["check"] == p1["weight_update"]["check"]


def test_a_process_with_a_different_program_fails_every_process(tmp_path):
    start = time.monotonic()
    result, reports = run_job(tmp_path / "plans", "--width-on-process-1", 48, search=True)
    assert result.exit_code != 0 and not reports
    for output in result.outputs:
        assert "PlanMismatchError" in output and "process 1: fingerprint" in output, output
    assert time.monotonic() - start < JOB_TIMEOUT_S


def test_enactment_without_a_shared_plan_dir_uses_process_0s_plan(tmp_path):
    plan_dirs = tmp_path / "plans-{process}"
    result, reports = run_job(plan_dirs, "--handmade-plan", search=False)
    _succeeded(result, reports)
    for r in reports.values():
        assert r["applied"] and r["plan_from_process"] == 0 and r["searches"] == 0
        assert r["plan_counts"]["all-reduce"] == r["plan_buckets"] == r["gradients"]
        assert r["bitwise_equal"] and r["output_digest"] == r["reference_digest"]
    assert reports[0]["plan_digest"] == reports[1]["plan_digest"]
    assert not list((tmp_path / "plans-1").glob("*.json")), "enactment wrote a plan on process 1"


def test_a_process_holding_another_plan_fails_every_process(tmp_path):
    result, reports = run_job(
        tmp_path / "plans-{process}", "--handmade-plan", "--default-plan-on-process-1", search=False
    )
    assert result.exit_code != 0 and not reports
    for output in result.outputs:
        assert "PlanMismatchError" in output and "process(es) [1] hold a different plan" in output, output


def test_launcher_gives_every_process_the_job_environment():
    code = (
        "import os; print(os.environ['DISCO_JAX_COORDINATOR'], os.environ['DISCO_JAX_NUM_PROCESSES'], "
        "os.environ['DISCO_JAX_PROCESS_ID'], os.environ['JAX_PLATFORMS'], os.environ['XLA_FLAGS'])"
    )
    result = _launch.launch([sys.executable, "-c", code], 3, devices_per_process=2, timeout_s=60)
    assert result.exit_code == 0
    ports = set()
    for i, output in enumerate(result.outputs):
        address, n, pid, platforms, flags = output.strip().split(maxsplit=4)
        assert address.startswith("127.0.0.1:") and (n, pid, platforms) == ("3", str(i), "cpu")
        assert flags.endswith("--xla_force_host_platform_device_count=2") and flags.count("device_count") == 1
        ports.add(address)
    assert len(ports) == 1


def test_launcher_stops_the_others_when_one_process_fails():
    code = "import os, sys, time; pid = os.environ['DISCO_JAX_PROCESS_ID']\nif pid == '1': sys.exit(3)\ntime.sleep(120)"
    start = time.monotonic()
    result = _launch.launch([sys.executable, "-c", code], 2, timeout_s=60)
    assert time.monotonic() - start < 30
    assert result.exit_code == 3 and not result.timed_out
    assert result.returncodes[1] == 3 and result.terminated == [0] and result.returncodes[0] != 0


def test_launcher_times_out_and_stops_everything():
    result = _launch.launch([sys.executable, "-c", "import time; time.sleep(120)"], 2, timeout_s=2)
    assert result.timed_out and result.exit_code == 124 and result.terminated == [0, 1]


def test_initialize_from_env_is_a_no_op_without_a_job(monkeypatch):
    from disco_jax import initialize_from_env

    monkeypatch.delenv("DISCO_JAX_COORDINATOR", raising=False)
    assert initialize_from_env() is False
