"""Test setup: 8 virtual CPU devices, set before jax is imported anywhere, and one persistent
compilation cache for the whole run, shared by both xdist workers and the processes tests start
(`_xla_cache.share`: tests compile the same steps, timing programs and estimator buckets again and
again; the cache is also how many clusters run JAX, and disco-jax must work under it)."""

import dataclasses
import fcntl
import json
import os
import shutil
from pathlib import Path

import _xla_cache

os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    + ["--xla_force_host_platform_device_count=8"]
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.pop("ENABLE_SEARCH", None)
os.environ.pop("DISCO_JAX_PLAN_DIR", None)
_xla_cache.share()

import pytest  # noqa: E402

# Files whose tests take the most time (deviceless XLA:GPU compiles, searches in worker processes),
# longest first (CPU seconds per file of a quiet full run, docs/testing.md). They run first, so that
# under `--dist loadfile` (pyproject's addopts) the short files fill both workers at the end
# rather than one long file running alone. test_compiled_cost right after test_backends_gpu: the
# worker that ran the shorter of the first two (test_backends_gpu) usually takes it next and finds
# its transformer and RNNLM captured (`xla_gpu_zoo`).
LONGEST_FILES = (
    "test_layout_search.py",
    "test_bench.py",
    "test_backends_gpu.py",
    "test_compiled_cost.py",
    "test_tuning.py",
    "test_multihost.py",
    "test_offline_memory.py",
    "test_gpu_records.py",
    "test_mesh_plan.py",
    "test_fsdp_at_use.py",
    "test_remat.py",
    "test_faults.py",
    "test_zoo.py",
    "test_scanned_layers.py",
    "test_calls.py",
    "test_weight_update_choice.py",
    "test_api.py",
    "test_facts.py",
    "test_rewrite.py",
)


def pytest_collection_modifyitems(config, items):
    """The longest files first (`LONGEST_FILES`), the rest in collection order."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def made_once(name: str, make) -> Path:
    """The run's directory `name`, made by `make(directory)` in the first process of the run that
    asks: under pytest-xdist the others wait on a file lock in the run's shared directory (the
    compilation cache's, `_xla_cache`) and find it made."""
    made = Path(os.environ[_xla_cache.RUN_CACHE_ENV]) / name
    with open(made.with_name(name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not made.exists():
            making = made.with_name(name + ".making")
            shutil.rmtree(making, ignore_errors=True)
            making.mkdir()
            make(making)
            os.replace(making, made)
    return made


@pytest.fixture(scope="session")
def measured_collectives() -> Path:
    """A profile directory holding what a search measures of the collectives on all 8 devices (the
    all-reduce fit and the reduce-scatter / all-gather line), measured once for the run by the
    functions the profile phase calls. Every test's profile directory starts as a copy
    (`_isolated_caches`), as a user's does after their first search: a search measures its own
    kernel times, but not the collectives again (~10 CPU seconds each; docs/testing.md)."""

    def measure(root: Path) -> None:
        import jax
        import numpy as np

        from disco_jax import _device_timing, _profile_db

        devices = jax.devices()
        mesh = jax.sharding.Mesh(np.array(devices), ("all",))
        allreduce, points = _device_timing.measure_allreduce_cost(mesh)
        line, _ = _device_timing.measure_scatter_gather_cost(mesh)
        profile = _profile_db.Profile.for_devices(
            devices, allreduce=dataclasses.replace(allreduce, scatter_gather=line), allreduce_points=points
        )
        _profile_db.ProfileDatabase(root).save(profile)

    return made_once("eight-device-profiles", measure)


@pytest.fixture(autouse=True)
def _isolated_caches(measured_collectives, tmp_path, tmp_path_factory, monkeypatch):
    """Every test gets its own plan and profile directories and ENABLE_SEARCH unset; its profile
    directory (beside `tmp_path`, which tests use as they like) starts with the run's measured
    collectives."""
    profiles = tmp_path_factory.mktemp("profiles") / "profiles"
    shutil.copytree(measured_collectives, profiles)
    monkeypatch.setenv("DISCO_JAX_PLAN_DIR", str(tmp_path / "plans"))
    monkeypatch.setenv("DISCO_JAX_PROFILE_DIR", str(profiles))
    monkeypatch.delenv("ENABLE_SEARCH", raising=False)
    yield


@pytest.fixture(scope="session")
def xla_gpu_zoo():
    """`get(model)`: a zoo model's Adam step at its `_zoo_sizes.SMALL` size compiled deviceless
    for 8 H100s and captured (`_compile.capture_program`: XLA's program as the rows' JAX_default),
    as (lowered, program, compiled module text); each model compiled once per session, for every
    test module that reads it (test_backends_gpu, test_compiled_cost, test_bench)."""
    import optax
    from _zoo_sizes import small

    from disco_jax import _compile, backends, targets, zoo

    cache = {}

    def get(model: str):
        if model not in cache:
            spec = small(model)
            lowered = zoo.lower_abstract(spec, optax.adam(1e-3), targets.mesh("h100-sxm", 8), "jit")
            program, compiled = _compile.capture_program(lowered, backends.GPU)
            cache[model] = (lowered, program, compiled.as_text())
        return cache[model]

    return get


@dataclasses.dataclass(frozen=True)
class SeedProfiles:
    """A profile directory holding what a 2-process x 2-device job over gloo measured of its
    collectives (the all-reduce fit and the reduce-scatter / all-gather line, stored under
    '4 in 2 processes'), and each process's report of that job (`_multihost_worker.py
    --profile-only`), by process index."""

    directory: Path
    reports: dict[int, dict]

    def copy_to(self, profile_dir: Path | None = None) -> None:
        """Add the stored collectives' cost to `profile_dir` (a `DISCO_JAX_PROFILE_DIR`; default:
        the test's own, `_isolated_caches`), beside what it holds."""
        from disco_jax import _profile_db

        stored = _profile_db.ProfileDatabase(self.directory).load("cpu", "cpu", 4, num_processes=2)
        _profile_db.ProfileDatabase(profile_dir).save(stored)


@pytest.fixture(scope="session")
def two_process_profiles() -> SeedProfiles:
    """The collectives' cost of a 2-process x 2-device job, measured once for the run (~35 CPU s
    per process, `made_once`) so that the multi-process tests' searches do not each measure it."""
    from test_multihost import _succeeded, run_job

    def measure(root: Path) -> None:
        result, reports = run_job(root / "plans", "--profile-only", "--profile-dir", root, search=True)
        _succeeded(result, reports)
        (root / "job.json").write_text(json.dumps(reports))

    seed = made_once("two-process-profiles", measure)
    reports = {int(i): r for i, r in json.loads((seed / "job.json").read_text()).items()}
    return SeedProfiles(seed, reports)
