"""XLA:GPU's collective options searched on the compiled program (`disco_jax.schedule_options`),
deviceless for 8 H100s, and plans that are XLA's program under compile options, enacted by the
decorator (on this machine's CPU devices). The tiny MLP's Adam step, state donated: XLA:GPU combines
its gradients' all-reduces into one, whose combined buffer raises its peak (336,624 bytes per
device against 274,928 with combining off): a limit between the two is one XLA's default schedule
does not meet and another schedule does."""

import jax
import numpy as np
import optax
import pytest

from disco_jax import _compile, _enact_phase, _plan, offline, optimize_distributed, schedule_options, targets, zoo
from disco_jax._search import SearchConfig
from disco_jax.eval import clusters
from disco_jax.sharding import choice, update

from _steps import make_step

NO_COMBINING = {schedule_options.THRESHOLDS["all-reduce"]: "0"}
THRESHOLD_DIMENSION = [("all-reduce combine threshold", [NO_COMBINING])]


@pytest.fixture(scope="module")
def mlp_step():
    spec, optimizer = zoo.get_model("mlp", "tiny"), optax.adam(1e-3)
    mesh = targets.mesh("h100-sxm", 8)
    args = zoo.abstract_state_and_batch(spec, optimizer, mesh)
    return zoo.build_train_step(spec, optimizer, mesh, "jit", donate=True), args


@pytest.fixture(scope="module")
def replicated(mlp_step):
    """The replicated update, compiled with XLA's defaults for the target and costed."""
    step, args = mlp_step
    costs = offline.program_costs(clusters.node_of("h100-sxm", 8))
    candidate = offline.UpdateCandidate(offline.REPLICATED, step.lower(*args), None)
    candidate.xla = _compile.compile_program(candidate.lowered, None, "XLA's program", None, {})
    candidate.memory = update.memory(candidate.xla.compiled, {})
    candidate.cost = costs(candidate.xla)
    return candidate


def test_dimensions_are_the_programs_own():
    """Thresholds only for the kinds a program runs; loop options only where it has a `while`."""
    flat = "  %all-reduce-start.1 = f32[8] all-reduce-start(f32[8] %p)\n"
    names = [name for name, _ in schedule_options.dimensions(flat)]
    assert names == [
        "all-reduce combine threshold",
        "combine count bound",
        "latency-hiding scheduler",
        "scheduler memory limit",
        "collectives in flight",
        "collectives started early",
    ]
    values = dict(schedule_options.dimensions(flat))["all-reduce combine threshold"]
    assert [int(v[schedule_options.THRESHOLDS["all-reduce"]]) for v in values] == [
        0,
        *(1 << k for k in range(20, 31, 2)),
    ]
    looped = flat + "  %all-gather-start.2 = f32[64] all-gather-start(f32[8] %q)\n  %w = (f32[8]) while((f32[8]) %t)\n"
    dims = dict(schedule_options.dimensions(looped))
    assert "all-gather combine threshold" in dims and "reduce-scatter combine threshold" not in dims
    piped = dims["collective pipelining"]
    assert {k for p in piped for k in p} == {
        schedule_options.PIPELINING["all-reduce"],
        schedule_options.PIPELINING["all-gather"],
        schedule_options.SCHEDULER,
    }
    assert dims["loop double-buffering"] == [{schedule_options.DOUBLE_BUFFERING: True}]
    # A sharded update's program adds its own kinds' thresholds and their order, not all-reduce's.
    added = dict(schedule_options.update_dimensions(looped))
    assert list(added) == [
        "all-gather combine threshold",
        "combine count bound",
        "collectives in flight",
        "collectives started early",
        "collective pipelining",
        "loop double-buffering",
    ]
    assert [{k for k in p} for p in added["collective pipelining"]] == [
        {schedule_options.PIPELINING["all-gather"], schedule_options.SCHEDULER}
    ]
    assert schedule_options.update_dimensions(flat) == []
    assert [name for name, _ in schedule_options.dimensions("  %d = f32[8] dot(f32[8] %p)\n")] == [
        "latency-hiding scheduler",
        "scheduler memory limit",
    ]


def test_option_sets_that_compile_to_one_program_are_one_candidate(replicated):
    """A threshold above the step's gradient bytes combines as XLA's default does: the same
    compiled program (fingerprint), costed once; combining off is another program."""
    costs = offline.program_costs(clusters.node_of("h100-sxm", 8))
    big = {schedule_options.THRESHOLDS["all-reduce"]: str(1 << 30)}
    found = schedule_options.search_options(
        replicated.lowered,
        costs,
        dims=[("all-reduce combine threshold", [big, NO_COMBINING])],
        default=replicated.xla,
    )
    default, combined, off = found.candidates
    assert combined.same_as == schedule_options.DEFAULTS and combined.fingerprint == default.fingerprint
    assert combined.cost is default.cost
    assert off.fingerprint != default.fingerprint and off.same_as is None
    summary = schedule_options.collective_summary(off.program.text)
    assert summary["all-reduce"]["count"] == _compile.compiled_stats(off.program.text)["all-reduce"] > 1
    assert schedule_options.collective_summary(default.program.text)["all-reduce"]["count"] == 1
    # Both programs all-reduce the same gradients.
    assert (
        summary["all-reduce"]["bytes"]
        == schedule_options.collective_summary(default.program.text)["all-reduce"]["bytes"]
    )
    # Without a limit the cheapest is chosen; on 8 H100s one combined all-reduce is.
    assert found.chosen is default and found.options == {} and found.gain == 1.0


def test_the_count_bound_splits_what_the_bytes_threshold_combines(replicated):
    """The combiners' count bound draws boundaries the bytes threshold cannot: the tiny MLP's
    gradients, one all-reduce under XLA's defaults (all under 30 MiB), become several when at
    most 4 may be combined, as the compiled program runs them; the gradients' bytes are the same."""
    capped = _compile.compile_program(replicated.lowered, None, "count 4", None, {schedule_options.COMBINE_COUNT: "4"})
    default = schedule_options.collective_summary(replicated.xla.text)["all-reduce"]
    split = schedule_options.collective_summary(capped.text)["all-reduce"]
    assert split["count"] > default["count"] and split["bytes"] == default["bytes"]
    assert schedule_options.program_fingerprint(capped.text) != schedule_options.program_fingerprint(
        replicated.xla.text
    )


def test_a_default_schedule_over_the_limit_gives_a_plan_under_another_that_fits(mlp_step, replicated, tmp_path):
    step, args = mlp_step
    off = _compile.compile_program(replicated.lowered, None, "no combining", None, NO_COMBINING)
    low, high = choice.executable_peak(off.compiled), replicated.peak_bytes
    assert low < high  # what the test rests on: the combined buffer raises the peak
    limit = (low + high) // 2
    plan = offline.plan_for_target(
        step,
        *args,
        memory_limit_bytes=limit,
        weight_updates=[replicated],
        plan_dir=tmp_path,
        config=SearchConfig(budget_s=1.0),
        ranked=1,
        schedule_dims=THRESHOLD_DIMENSION,
    )
    searched = plan.search["schedule_options"]
    assert searched["default_fits"] is False and "does not fit" in searched["reason"]
    assert plan.compile_options == NO_COMBINING and plan.strategy is None and not plan.use_default
    # Both peaks in the plan, as XLA's memory analysis gives them.
    assert plan.simulated["default"]["peak_bytes"] == high > limit
    assert plan.simulated["plan"]["peak_bytes"] == low <= limit
    assert searched["chosen"]["fingerprint"] == schedule_options.program_fingerprint(off.text)
    assert searched["chosen"]["collectives"]["all-reduce"]["count"] > 1
    assert "under XLA's default schedule" in plan.weight_update["reason"]
    stored = _plan.read_plan_file(tmp_path / plan.file_name)
    assert stored.compile_options == NO_COMBINING
    # Under a limit no schedule meets, there is no plan.
    with pytest.raises(offline.NothingFits):
        offline.plan_for_target(
            step,
            *args,
            memory_limit_bytes=low // 2,
            weight_updates=[replicated],
            plan_dir=tmp_path,
            config=SearchConfig(budget_s=1.0),
            ranked=1,
            schedule_dims=THRESHOLD_DIMENSION,
        )


# XLA:CPU's combiner off by name: the enacted program all-reduces each gradient on its own.
CPU_NO_COMBINING = {"xla_disable_hlo_passes": "cpu-all-reduce-combiner"}


def _store_options_plan(step, args, plan_dir, compile_options):
    """An unmeasured plan of XLA's own program under `compile_options`, as `apply_to_plan` makes
    one offline, for this CPU machine."""
    from disco_jax import _capture, _graph, backends

    graph = _graph.build_graph(_capture.capture(step.lower(*args))[0], backends.CPU.fusible)
    machine = _plan.MachineKey.current(_compile.step_devices(args, {}))
    plan = _plan.Plan(
        graph.fingerprint,
        graph.module.name,
        machine,
        False,
        None,
        "XLA's program under compile options, by a test; not measured yet",
        simulated={"default": {"compiled_us": 100.0}, "plan": {"iteration_us": None, "compiled_us": 90.0}},
        search={"offline": {"cluster": None}},
        compile_options=compile_options,
    )
    return _plan.save_plan(plan, plan_dir)


def test_the_decorator_enacts_and_measures_an_options_plan(tmp_path, monkeypatch):
    step, args = make_step("jit")
    reference = step(*args)
    path = _store_options_plan(step, args, tmp_path, CPU_NO_COMBINING)
    first = optimize_distributed(search=False, plan_dir=tmp_path, validation_pairs=4, verbose=False)(step)
    out = first(*args)
    report = first.last_report
    assert report.measured["verdict"] in ("faster", "slower", "undecided")
    assert report.measured["bitwise_required"] is False  # another combining: not bitwise
    assert report.plan_counts["all-reduce"] > 1  # the options were compiled in
    for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(out), strict=True):
        assert np.allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    stored = _plan.read_plan_file(path)
    assert stored.measured == report.measured and stored.use_default == (not report.applied)
    if report.applied:
        assert _compile.compiled_stats(first.executable(*args).as_text())["all-reduce"] > 1
    # The next run reads the verdict: nothing is measured again.
    monkeypatch.setattr(_enact_phase, "validate", lambda *a, **k: pytest.fail("measured twice"))
    again = optimize_distributed(search=False, plan_dir=tmp_path, validation_pairs=4, verbose=False)(step)
    again(*args)
    assert again.last_report.applied == report.applied


def test_an_options_plan_over_the_memory_limit_is_not_run(tmp_path):
    step, args = make_step("jit")
    _store_options_plan(step, args, tmp_path, CPU_NO_COMBINING)
    run = optimize_distributed(
        search=False, plan_dir=tmp_path, validation_pairs=4, verbose=False, memory_limit_bytes=1
    )(step)
    with pytest.warns(_plan.PlanWarning, match="over memory_limit_bytes"):
        run(*args)
    assert not run.last_report.applied and "exceeds the memory limit" in run.last_report.reason
