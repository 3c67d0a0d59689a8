import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from disco_jax import _compile, _console, _profile_phase, backends, cost
from disco_jax._device_timing import (
    hlo_module_name,
    kernel_times_from_trace,
    measure_allreduce_cost,
    measure_kernel_times,
)
from disco_jax._profile_db import (
    FORMAT_VERSION,
    Profile,
    ProfileDatabase,
    ProfileFileWarning,
    device_kind_key,
    sanitize_device_kind,
)
from disco_jax.cost import AllReduceCostModel, fit_allreduce_cost, fit_allreduce_samples

_INSTRUCTION_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(?:\([^=]*?\)|\S+)\s+([\w\-]+)\(", re.M)


def _opcodes(hlo_text: str) -> dict[str, str]:
    return {name: opcode for name, opcode in _INSTRUCTION_RE.findall(hlo_text)}


def _data_parallel_step():
    mesh = jax.make_mesh((8,), ("data",))

    def loss(params, x):
        h = jnp.tanh(x @ params[0])
        h = jnp.tanh(h @ params[1])
        return jnp.mean(h**2)

    def step(params, x):
        grads = jax.grad(loss)(params, x)
        return [p - 0.1 * g for p, g in zip(params, grads)]

    params = jax.device_put([jnp.full((64, 64), 0.01), jnp.full((64, 64), 0.02)], NamedSharding(mesh, P()))
    x = jax.device_put(jnp.ones((64, 64)), NamedSharding(mesh, P("data")))
    return jax.jit(step).lower(params, x).compile(), (params, x)


def test_measure_kernel_times_names_instructions_of_the_compiled_module():
    compiled, args = _data_parallel_step()
    text = compiled.as_text()
    opcodes = _opcodes(text)
    times = measure_kernel_times(compiled, args, steps=2, warmup=1)
    assert times, "no instruction of the module appeared in the trace"
    assert set(times) <= set(opcodes), set(times) - set(opcodes)
    assert all(t > 0 for t in times.values()), times
    seen = {opcodes[name] for name in times}
    assert "all-reduce" in seen, seen
    assert seen & {"fusion", "dot"}, seen


def test_measure_kernel_times_of_another_module_name_is_empty():
    compiled, args = _data_parallel_step()
    assert hlo_module_name(compiled.as_text()) == "jit_step"
    assert measure_kernel_times(compiled, args, steps=1, warmup=0, module_name="no_such_module") == {}


def _xspace(events, plane="/host:CPU"):
    """A synthetic XSpace: events are (line, op, start_ns, duration_ns, device, run)."""
    stat_ids = {"hlo_op": 1, "hlo_module": 2, "device_ordinal": 3, "run_id": 4}
    names = sorted({e[1] for e in events})
    event_ids = {name: i + 1 for i, name in enumerate(names)}
    lines = []
    for line in sorted({e[0] for e in events}):
        body = []
        for _, op, start, duration, device, run in (e for e in events if e[0] == line):
            body.append(
                f"events {{ metadata_id: {event_ids[op]} offset_ps: {start * 1000} duration_ps: {duration * 1000}"
                f' stats {{ metadata_id: 1 str_value: "{op}" }} stats {{ metadata_id: 2 str_value: "jit_f" }}'
                f" stats {{ metadata_id: 3 int64_value: {device} }} stats {{ metadata_id: 4 int64_value: {run} }} }}"
            )
        lines.append(f'lines {{ id: {line} name: "thread{line}" timestamp_ns: 0 {" ".join(body)} }}')
    event_meta = " ".join(
        f'event_metadata {{ key: {i} value {{ id: {i} name: "{n}" }} }}' for n, i in event_ids.items()
    )
    stat_meta = " ".join(f'stat_metadata {{ key: {i} value {{ id: {i} name: "{n}" }} }}' for n, i in stat_ids.items())
    text = f'planes {{ id: 1 name: "{plane}" {" ".join(lines)} {event_meta} {stat_meta} }}'
    return jax.profiler.ProfileData.from_text_proto(text)


def test_kernel_times_from_trace_counts_nested_events_of_one_op_once_and_averages():
    trace = _xspace(
        [
            # device 0, run 1: dot.1 on thread 1 holds thread-pool work of itself on thread 2.
            (1, "dot.1", 0, 100, 0, 1),
            (2, "dot.1", 10, 50, 0, 1),
            (2, "dot.1", 70, 40, 0, 1),
            (1, "add.2", 200, 20, 0, 1),
            (1, "add.2", 300, 20, 0, 1),  # twice in the step: summed
            # device 1, run 1 and both devices in run 2.
            (1, "dot.1", 0, 300, 1, 1),
            (1, "add.2", 400, 40, 1, 1),
            (1, "dot.1", 1000, 100, 0, 2),
            (1, "dot.1", 1000, 100, 1, 2),
        ]
    )
    times = kernel_times_from_trace([trace], "jit_f", steps=2)
    assert times == pytest.approx({"dot.1": (110 + 300 + 100 + 100) / 4 / 1e3, "add.2": (40 + 40) / 4 / 1e3})
    assert kernel_times_from_trace([trace], "jit_other", steps=2) == {}


def test_kernel_times_from_trace_ignores_a_run_id_only_a_few_events_carry():
    """On a GPU a memset can carry a run id of its own: it is not one more execution of every op."""
    ops = [f"fusion.{i}" for i in range(6)]
    events = [(1, op, 100 * i + 1000 * run, 50, 0, run) for run in (1, 2) for i, op in enumerate(ops)]
    trace = _xspace([*events, (1, "fusion.0", 5000, 5, 0, 0)])
    times = kernel_times_from_trace([trace], "jit_f", steps=2)
    assert times["fusion.1"] == pytest.approx(50 / 1e3)
    assert times["fusion.0"] == pytest.approx((50 + 50 + 5) / 2 / 1e3)


def test_measure_allreduce_cost_fits_a_nonnegative_line():
    mesh = jax.make_mesh((8,), ("data",))
    model, points = measure_allreduce_cost(mesh, sizes_bytes=(4096, 65536, 262144), repeats=3, warmup=1, chain=2)
    assert [b for b, _ in points] == [4096, 65536, 262144]
    assert all(t >= 0 for _, t in points) and max(t for _, t in points) > 0, points
    assert model.per_byte_us >= 0 and model.latency_us >= 0
    assert model.time_us(1 << 20) >= model.time_us(4096)
    spread = model.to_json()["spread"]  # how far the fit moves over the repetitions
    assert [s["bytes"] for s in spread["per_size"]] == [4096, 65536, 262144]
    assert all(s["n"] == 3 for s in spread["per_size"])
    assert spread["latency_us"][0] <= spread["latency_us"][1]
    assert AllReduceCostModel.from_json(model.to_json()) == model


def test_fit_allreduce_cost_recovers_a_line_and_clips_negative_coefficients():
    line = [(b, 2e-3 * b + 50.0) for b in (4096, 65536, 1 << 20, 16 << 20)]
    model = fit_allreduce_cost(line)
    assert model.per_byte_us == pytest.approx(2e-3) and model.latency_us == pytest.approx(50.0)
    falling = fit_allreduce_cost([(1000, 30.0), (2000, 20.0), (3000, 10.0)])
    assert falling.per_byte_us == 0.0 and falling.latency_us > 0
    through_origin = fit_allreduce_cost([(1000, 1.0), (2000, 4.0), (3000, 9.0)])
    assert through_origin.latency_us == 0.0 and through_origin.per_byte_us > 0
    assert fit_allreduce_cost([(4096, 12.0)]) == AllReduceCostModel(0.0, 12.0)


def test_fit_allreduce_samples_is_robust_to_a_disturbed_size_and_reports_its_spread():
    rng = np.random.default_rng(0)
    sizes = [4096 << i for i in range(13)]
    truth = AllReduceCostModel(per_byte_us=1e-3, latency_us=800.0)
    samples = {b: list(truth.time_us(b) * rng.lognormal(0.0, 0.05, 9)) for b in sizes}
    samples[sizes[1]] = [5.0 * truth.time_us(sizes[1])] * 9  # one size hit by a burst of load
    samples[sizes[-3]] = [0.3 * truth.time_us(sizes[-3])] * 9  # and one by a lucky quiet spell
    model = fit_allreduce_samples(samples)
    assert model.latency_us == pytest.approx(800.0, rel=0.1)
    assert model.per_byte_us == pytest.approx(1e-3, rel=0.1)
    spread = model.spread
    assert spread["latency_us"][0] < 800.0 * 1.1 and spread["latency_us"][1] > 800.0 * 0.9
    assert len(spread["per_size"]) == 13 and spread["per_size"][0]["n"] == 9
    assert 0 < spread["per_size"][0]["iqr_rel"] < 0.2
    # Repeated points of one size count as their median.
    assert fit_allreduce_cost([(1000, 6.0), (1000, 6.0), (1000, 60.0), (2000, 7.0)]) == AllReduceCostModel(
        pytest.approx(1e-3), pytest.approx(5.0)
    )


def _profile(**fields):
    base = dict(
        device_kind="NVIDIA H100 80GB HBM3",
        backend="gpu",
        num_devices=8,
        allreduce=AllReduceCostModel(per_byte_us=1e-4, latency_us=20.0),
        allreduce_points=[(4096, 20.5), (1 << 20, 125.0)],
        kernel_times_us={"fusion:f32[8]": 3.5},
    )
    return Profile(**{**base, **fields})


def test_device_kind_keys_are_path_safe_and_idempotent():
    assert sanitize_device_kind("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert sanitize_device_kind("nvidia-h100-80gb-hbm3") == "nvidia-h100-80gb-hbm3"
    assert device_kind_key(jax.devices()[0]) == "cpu"
    assert Profile.for_devices().num_devices == 8 and Profile.for_devices().backend == "cpu"


def test_profile_json_round_trip_and_wrong_version_refused():
    profile = _profile()
    d = json.loads(json.dumps(profile.to_json()))
    assert d["format_version"] == FORMAT_VERSION
    assert Profile.from_json(d) == profile
    with pytest.raises(ValueError, match="format_version"):
        Profile.from_json({**d, "format_version": FORMAT_VERSION + 1})
    empty = Profile(device_kind="cpu", backend="cpu", num_devices=2)
    assert Profile.from_json(empty.to_json()) == empty


def test_database_save_load_round_trip_keeps_one_allreduce_fit_per_device_count(tmp_path):
    db = ProfileDatabase(user_dir=tmp_path / "user", shipped_dir=tmp_path / "shipped")
    assert db.load("NVIDIA H100 80GB HBM3", "gpu", 8) is None
    path = db.save(_profile())
    assert path == tmp_path / "user" / "nvidia-h100-80gb-hbm3" / "profile.json"
    db.save(_profile(num_devices=2, allreduce=AllReduceCostModel(5e-5, 8.0), kernel_times_us={"dot:f32[4]": 1.0}))
    eight = db.load("nvidia-h100-80gb-hbm3", "gpu", 8)
    two = db.load("NVIDIA H100 80GB HBM3", "gpu", 2)
    assert eight.allreduce == AllReduceCostModel(1e-4, 20.0)
    assert eight.allreduce_points == [(4096, 20.5), (1 << 20, 125.0)]
    assert two.allreduce == AllReduceCostModel(5e-5, 8.0)
    assert eight.kernel_times_us == two.kernel_times_us == {"fusion:f32[8]": 3.5, "dot:f32[4]": 1.0}
    assert eight.device_kind == "NVIDIA H100 80GB HBM3" and eight.num_devices == 8
    unknown_count = db.load("NVIDIA H100 80GB HBM3", "gpu", 4)
    assert unknown_count.allreduce is None and unknown_count.kernel_times_us
    db.merge_kernel_times("NVIDIA H100 80GB HBM3", {"dot:f32[4]": 2.0, "new": 7.0})
    merged = db.load("NVIDIA H100 80GB HBM3", "gpu", 8).kernel_times_us
    assert merged == {"fusion:f32[8]": 3.5, "dot:f32[4]": 2.0, "new": 7.0}
    assert not list(path.parent.glob("*.tmp")), "atomic write left a temp file"


def test_database_keeps_an_allreduce_fit_per_process_count_and_reads_files_without_one(tmp_path):
    """Devices spread over processes all-reduce over another transport: their fit is kept apart
    from one process's, under a key older files never hold (so they read as before)."""
    db = ProfileDatabase(user_dir=tmp_path / "user", shipped_dir=tmp_path / "shipped")
    db.save(_profile(num_devices=4, allreduce=AllReduceCostModel(1e-4, 20.0)))
    path = db.save(_profile(num_devices=4, num_processes=2, allreduce=AllReduceCostModel(3e-4, 900.0)))
    assert sorted(json.loads(path.read_text())["allreduce"]) == ["4", "4 in 2 processes"]
    assert db.load("NVIDIA H100 80GB HBM3", "gpu", 4).allreduce == AllReduceCostModel(1e-4, 20.0)
    two = db.load("NVIDIA H100 80GB HBM3", "gpu", 4, num_processes=2)
    assert two.allreduce == AllReduceCostModel(3e-4, 900.0) and two.num_processes == 2
    assert db.load("NVIDIA H100 80GB HBM3", "gpu", 4, num_processes=4).allreduce is None
    old = {k: v for k, v in _profile().to_json().items() if k != "num_processes"}  # written before the field
    assert Profile.from_json(old) == _profile()


def test_database_corrupt_file_warns_is_absent_and_is_moved_aside_on_save(tmp_path):
    db = ProfileDatabase(user_dir=tmp_path / "user", shipped_dir=tmp_path / "shipped")
    path = db.user_path("cpu")
    path.parent.mkdir(parents=True)
    path.write_text('{"format_version": 1, "kernel_times_us": {')
    with pytest.warns(ProfileFileWarning, match="unreadable"):
        assert db.load("cpu", "cpu", 8) is None
    with pytest.warns(ProfileFileWarning, match="moved"):
        db.merge_kernel_times("cpu", {"a": 1.0}, backend="cpu")
    assert path.with_name("profile.json.corrupt").read_text().startswith('{"format_version"')
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert db.load("cpu", "cpu", 8).kernel_times_us == {"a": 1.0}
    path.write_text(json.dumps({"format_version": 999, "kernel_times_us": {}, "allreduce": {}}))
    with pytest.warns(ProfileFileWarning, match="format_version"):
        assert db.load("cpu", "cpu", 8) is None


def test_database_prefers_user_cache_over_shipped(tmp_path):
    shipped = ProfileDatabase(user_dir=tmp_path / "shipped")  # writes the shipped layout
    shipped.save(_profile(kernel_times_us={"a": 1.0, "b": 2.0}))
    db = ProfileDatabase(user_dir=tmp_path / "user", shipped_dir=tmp_path / "shipped")
    assert db.load("NVIDIA H100 80GB HBM3", "gpu", 8).kernel_times_us == {"a": 1.0, "b": 2.0}
    db.save(_profile(allreduce=AllReduceCostModel(0.0, 99.0), kernel_times_us={"a": 10.0}))
    merged = db.load("NVIDIA H100 80GB HBM3", "gpu", 8)
    assert merged.kernel_times_us == {"a": 10.0, "b": 2.0}
    assert merged.allreduce == AllReduceCostModel(0.0, 99.0)
    assert db.load("NVIDIA H100 80GB HBM3", "gpu", 2).allreduce is None


def test_database_user_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("DISCO_JAX_PROFILE_DIR", str(tmp_path / "env"))
    db = ProfileDatabase(shipped_dir=tmp_path / "shipped")
    db.save(_profile(device_kind="cpu", backend="cpu"))
    assert (tmp_path / "env" / "cpu" / "profile.json").exists()
    assert ProfileDatabase(user_dir=tmp_path / "env", shipped_dir=tmp_path).load("cpu", "cpu", 8) is not None
    with pytest.warns(ProfileFileWarning, match="backend"):
        assert ProfileDatabase(user_dir=tmp_path / "env", shipped_dir=tmp_path).load("cpu", "gpu", 8) is None


class _ProbeEstimator:
    """An estimator plugin registered in code: 7 us for any kernel of fusible ops."""

    name = "probe"
    created_for: list = []

    def __init__(self, device_kind):
        self.created_for.append(device_kind)

    def estimate(self, graph, kernels):
        return [7.0 if all(graph.ops[o].kind == "fusible" for o in k) else None for k in kernels]


def _two_layer_step(n: int, tmp_path) -> tuple[_compile.Captured, ProfileDatabase]:
    """A two-layer data-parallel step of width `n`, captured, and a profile database holding an
    all-reduce fit for its devices (so the profile phase does not measure one)."""
    mesh = jax.make_mesh((8,), ("data",))
    params = jax.device_put([jnp.full((n, n), 0.01), jnp.full((n, n), 0.02)], NamedSharding(mesh, P()))
    x = jax.device_put(jnp.ones((n, n)), NamedSharding(mesh, P("data")))

    def step(params, x):
        grads = jax.grad(lambda p: jnp.mean(jnp.tanh(jnp.tanh(x @ p[0]) @ p[1]) ** 2))(params)
        return [p - 0.1 * g for p, g in zip(params, grads)]

    captured = _compile.capture(jax.jit(step).lower(params, x), backends.CPU, (params, x), {})
    database = ProfileDatabase(user_dir=tmp_path / "user", shipped_dir=tmp_path / "shipped")
    database.save(Profile.for_devices(captured.devices, allreduce=AllReduceCostModel(1e-4, 20.0, spread={})))
    return captured, database


def test_a_search_profile_measures_the_collectives_once_and_stores_them(tmp_path, monkeypatch):
    """The first profile of an empty database measures the all-reduce fit and stores it with its
    points; the next one (another step, the same devices) reads it and measures none (what every
    test's profile directory, seeded by conftest's `measured_collectives`, relies on)."""
    measured = []

    def measure(mesh, **kwargs):  # the real measurement, at fewer sizes
        measured.append(mesh.size)
        return measure_allreduce_cost(mesh, sizes_bytes=(4096, 65536, 262144), repeats=3, warmup=1, chain=2)

    monkeypatch.setattr(_profile_phase._device_timing, "measure_allreduce_cost", measure)
    captured, database = _two_layer_step(32, tmp_path)
    database = ProfileDatabase(user_dir=tmp_path / "empty", shipped_dir=tmp_path / "shipped")
    ui = _console.Ui(verbose=False)
    first = _profile_phase.profile(captured, captured.runner(captured.default_compiled), database, ui)
    stored = database.load(captured.machine.device_kind, captured.machine.backend, 8)
    assert measured == [8] and stored.allreduce == first.allreduce and len(stored.allreduce_points) == 3
    other, _ = _two_layer_step(16, tmp_path / "other")
    second = _profile_phase.profile(other, other.runner(other.default_compiled), database, ui)
    assert measured == [8] and second.allreduce == first.allreduce


def test_profile_builds_its_estimator_chain_from_the_plugin_registry(tmp_path):
    """The profile phase asks the registry: a plugin added with `register_estimator` and the GNN
    (the `gnn` entry point; CPU weights are shipped) are each calibrated after the measured table,
    and the calibrated analytical estimator comes last."""
    captured, database = _two_layer_step(64, tmp_path)
    cost.register_estimator("probe", _ProbeEstimator)
    try:
        model = _profile_phase.profile(
            captured, captured.runner(captured.default_compiled), database, _console.Ui(verbose=False)
        )
    finally:
        cost.unregister_estimator("probe")
    assert _ProbeEstimator.created_for == [captured.machine.device_kind]
    assert model.sources["estimators"] == ["profile", "calibrated-probe", "calibrated-gnn", "calibrated-analytical"]
    assert model.allreduce == AllReduceCostModel(1e-4, 20.0)
    graph = captured.graph
    # A kernel nobody measured (every fusible op in one) is answered by the calibrated probe.
    [(t, source)] = model.estimator.estimate_with_source(graph, [frozenset(graph.fusible_ops)])
    assert source == "calibrated-probe" and t > 0


def test_calibrate_fits_the_simulator_to_every_calibration_configuration(tmp_path):
    """The calibrate phase measures each of `calibration_strategies` and fits the simulator to all
    of them: the record holds the fitted parameters, one point per configuration and the misfit."""
    captured, database = _two_layer_step(32, tmp_path)
    runner = captured.runner(captured.default_compiled)
    ui = _console.Ui(verbose=False)
    model = _profile_phase.profile(captured, runner, database, ui)
    labels = list(_profile_phase.calibration_strategies(captured.program))
    assert labels[:2] == ["default", "per-gradient"] and len(labels) >= 3
    calibration = _profile_phase.calibrate(model, captured, runner, 6, ui)
    assert model.params == calibration.params and calibration.params.compute_scale > 0
    assert [p.label for p in calibration.points] == labels
    assert all(p.measured_us > 0 and p.simulated_us > 0 for p in calibration.points)
    assert calibration.misfit == pytest.approx(np.median([abs(p.error) for p in calibration.points]))
    record = json.loads(json.dumps(calibration.to_json()))
    assert record["measured_default_us"] == calibration.points[0].measured_us
    assert len(record["points"]) == len(labels) and record["kernel_overhead_us"] >= 0


def test_the_profile_phase_traces_an_executable_compiled_with_the_backends_profile_options():
    # XLA:CPU has none: the executable traced is the one timed.
    x = jnp.arange(8.0)
    lowered = jax.jit(lambda v: jnp.sin(v) * 2).lower(x)
    captured = _compile.capture(lowered, backends.CPU, (x,), {})
    runner = captured.runner(captured.default_compiled)
    assert _profile_phase.traced_runner(captured, runner) is runner
    # XLA:GPU turns command buffers off for it, an option XLA parses per compile (a value that is
    # no command buffer kind is refused, so the empty one is applied, not ignored).
    from disco_jax import targets

    assert backends.GPU.profile_options == {"xla_gpu_enable_command_buffer": ""}
    mesh = targets.mesh("h100-sxm", 1)
    y = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(mesh, P()))
    gpu_lowered = jax.jit(lambda v: jnp.sin(v) * 2).lower(y)
    assert gpu_lowered.compile(compiler_options=dict(backends.GPU.profile_options)).as_text()
    with pytest.raises(jax.errors.JaxRuntimeError, match="not a valid enum value"):
        gpu_lowered.compile(compiler_options={"xla_gpu_enable_command_buffer": "NOT_A_KIND"})
