"""Plans for a GPU cluster one does not have (`disco_jax.offline`), searched deviceless for 8 H100s,
and the first-run measurement that decides whether such a plan is applied."""

import jax
import optax
import pytest

from disco_jax import (
    _capture,
    _compile,
    _enact_phase,
    _graph,
    _plan,
    _ranking,
    _strategy,
    _validate,
    backends,
    offline,
    optimize_distributed,
    targets,
    zoo,
)
from disco_jax._profile_db import sanitize_device_kind
from disco_jax._search import SearchConfig
from disco_jax.eval import clusters

from _steps import make_step


@pytest.fixture(scope="module")
def h100_step():
    spec, opt = zoo.get_model("mlp", "tiny"), optax.sgd(0.1)
    mesh = targets.mesh("h100-sxm", 8)
    state, batch = zoo.abstract_state_and_batch(spec, opt, mesh)
    return zoo.build_train_step(spec, opt, mesh, "jit"), (state, batch)


def test_plan_for_8_h100s_is_stored_under_the_real_machines_key(h100_step, tmp_path):
    step, args = h100_step
    threshold = offline.schedule_options.THRESHOLDS["all-reduce"]
    plan = offline.plan_for_target(
        step,
        *args,
        plan_dir=tmp_path,
        config=SearchConfig(budget_s=2.0),
        schedule_dims=[("all-reduce combine threshold", [{threshold: "0"}])],  # one more compile
    )
    # What `MachineKey.current` gives on a real 8 x H100 SXM machine (jax.default_backend() is
    # "gpu" there; device_kind as CUDA reports it).
    real = _plan.MachineKey("gpu", sanitize_device_kind("NVIDIA H100 80GB HBM3"), 8, 1)
    assert plan.machine == real
    found, _ = _plan.find_plan(plan.fingerprint, real, tmp_path)
    assert found is not None and found.to_json() == plan.to_json()
    assert plan.measured == {}
    assert plan.use_default or "not measured" in plan.reason
    assert plan.search["offline"]["cluster"]["target"] == "h100-sxm"
    # Chosen by compiled cost among the search's best candidates and XLA's own program.
    ranked = plan.search["offline"]["ranked"]
    assert _ranking.XLA_PROGRAM in [r["label"] for r in ranked] and len(ranked) >= 2
    assert plan.search["offline"]["chosen"] == ranked[0]["label"] or plan.use_default
    assert plan.simulated["plan"]["compiled_us"] <= plan.simulated["default"]["compiled_us"]
    assert plan.use_default == (plan.search["offline"]["chosen"] == _ranking.XLA_PROGRAM and not plan.compile_options)
    assert all(r["graph_simulated_us"] is not None for r in ranked)
    # XLA's collective options searched on the compiled program: taken only where cheaper.
    searched = plan.search["schedule_options"]
    assert [c["label"] for c in searched["candidates"]][0] == offline.schedule_options.DEFAULTS
    assert len(searched["candidates"]) == 2 and searched["default"]["collectives"]["all-reduce"]["count"] >= 1
    if plan.compile_options:
        assert plan.strategy is None and searched["chosen"]["compiled_us"] < searched["default"]["compiled_us"]
    if not plan.use_default:  # the plan XLA:GPU compiles keeps the plan's all-reduces
        lowered = step.lower(*args)
        program, _ = _compile.capture_program(lowered, backends.GPU)
        strategy = _strategy.Strategy.from_json(program.graph, plan.strategy)
        compiled, status = _compile.compile_strategy(lowered, program, strategy)
        assert status in ("rewritten", "cached")  # cached: plan_for_target compiled it already
        assert _compile.compiled_stats(compiled.as_text())["all-reduce"] == len(strategy.buckets)


def test_plan_for_target_refuses_what_it_cannot_plan(h100_step):
    step, args = h100_step
    with pytest.raises(ValueError, match="compile-only GPU devices"):
        offline.plan_for_target(step, *jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args))
    with pytest.raises(ValueError, match="has 32 GPUs"):
        offline.plan_for_target(step, *args, cluster=clusters.get_cluster("4x8xH100-IB400"))
    cpu_step, cpu_args = make_step("jit")
    with pytest.raises(ValueError, match="plans for GPU targets"):
        offline.plan_for_target(cpu_step, *cpu_args)
    with pytest.raises(TypeError, match="jitted function"):
        offline.plan_for_target(lambda x: x, *args)
    with pytest.raises(ValueError, match="1 to 8 GPUs"):
        clusters.node_of("h100-sxm", 16)


def _store_offline_plan(step, args, plan_dir):
    """An unmeasured plan as `plan_for_target` stores one, for this CPU machine: XLA's fusions,
    one all-reduce per gradient."""
    graph = _graph.build_graph(_capture.capture(step.lower(*args))[0], backends.CPU.fusible)
    s = _strategy.with_buckets(_strategy.xla_default(graph), [(g.id,) for g in graph.gradients], "test")
    machine = _plan.MachineKey.current(_compile.step_devices(args, {}))
    plan = _plan.Plan(
        graph.fingerprint,
        graph.module.name,
        machine,
        False,
        s.to_json(graph),
        "searched deviceless by a test; not measured yet",
        simulated={"default": {"iteration_us": 100.0}, "plan": {"iteration_us": 90.0}},
        search={"offline": {"cluster": None}},
    )
    return _plan.save_plan(plan, plan_dir)


def test_an_offline_plan_is_measured_on_its_first_run_and_the_verdict_kept(tmp_path, monkeypatch):
    step, args = make_step("jit")
    reference = step(*args)
    path = _store_offline_plan(step, args, tmp_path)
    first = optimize_distributed(search=False, plan_dir=tmp_path, validation_pairs=4, verbose=False)(step)
    out = first(*args)
    report = first.last_report
    assert report.measured["verdict"] in ("faster", "slower", "undecided")
    assert report.measured["pairs"] >= 4 and report.measured["bitwise_required"]
    assert _validate.compare_outputs(reference, out, bitwise=True).bitwise_equal
    stored = _plan.read_plan_file(path)
    assert stored.measured == report.measured and stored.reason == report.reason
    assert stored.use_default == (not report.applied) == (report.measured["verdict"] != "faster")
    if report.applied:  # what runs is the plan: one all-reduce per gradient
        text = first.executable(*args).as_text()
        assert _compile.compiled_stats(text)["all-reduce"] == len(stored.strategy["buckets"])

    # The next run reads the verdict: nothing is measured again.
    monkeypatch.setattr(_enact_phase, "validate", lambda *a, **k: pytest.fail("measured twice"))
    again = optimize_distributed(search=False, plan_dir=tmp_path, validation_pairs=4, verbose=False)(step)
    again(*args)
    assert again.last_report.applied == report.applied


def test_first_run_rejects_a_plan_whose_outputs_differ(tmp_path, monkeypatch):
    step, args = make_step("jit")
    path = _store_offline_plan(step, args, tmp_path)
    wrong = _validate.Comparison(False, False, 1.0, 1.0, 1, 0)
    monkeypatch.setattr(_validate, "compare_outputs", lambda *a, **k: wrong)
    run = optimize_distributed(search=False, plan_dir=tmp_path, validation_pairs=4, verbose=False)(step)
    run(*args)
    assert not run.last_report.applied and run.last_report.reason.startswith("rejected: outputs differ")
    stored = _plan.read_plan_file(path)
    assert stored.use_default and stored.strategy is None
    # XLA's own executable runs: one all-reduce, not the plan's one per gradient.
    assert _compile.compiled_stats(run.executable(*args).as_text())["all-reduce"] == 1
