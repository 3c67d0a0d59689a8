"""The measured search (`disco_jax._tuning`): the search proposes, the devices decide.

The loop's logic runs on a fake `measure` (synthetic timings: what the loop does with a
measurement is tested, not the machine); the end-to-end tests run it on the devices through
`optimize_distributed`, in one process and in a two-process job. No timing figure is asserted."""

import dataclasses
import itertools
import json
import random
import types

import pytest
from test_multihost import run_job

from disco_jax import (
    _capture,
    _compile,
    _plan,
    _profile_db,
    _profile_phase,
    _program,
    _search,
    _search_phase,
    _strategy,
    _tuning,
    _tuning_devices,
    _validate,
    backends,
    cost,
    optimize_distributed,
)
from disco_jax.eval import measured, report_measured, rows

from _steps import make_step

SEARCH = _search.SearchConfig(budget_s=1.0, max_unchanged=200, seed=1)


@pytest.fixture(scope="module")
def program():
    step, args = make_step("jit", sizes=(16, 64, 64, 64, 4))
    return _program.build_program(_capture.capture(step.lower(*args))[0], backends.CPU)


@pytest.fixture(scope="module")
def graph(program):
    return program.graph


def cost_model() -> cost.CostModel:
    return cost.CostModel(
        cost.chain(cost.TableEstimator({}), cost.AnalyticalEstimator()),
        cost.AllReduceCostModel(per_byte_us=1e-3, latency_us=20.0),
        {},
    )


def first_search(program, model) -> _search.SearchResult:
    def simulated(s):
        r = model.simulate(program, s)
        return None if r is None else r.iteration_us

    return _search.backtracking_search(program, simulated, SEARCH)


def without_packing(result: _search.SearchResult) -> _search.SearchResult:
    """`result` as a search that offered no packing (a backend that does not pack): for the tests
    that count the candidates the loop measures, the packing candidate it owes aside."""
    return dataclasses.replace(
        result,
        candidates=[(c, s) for c, s in result.candidates if not _tuning.packs(s)],
        start_costs={k: v for k, v in result.start_costs.items() if "packed" not in k},
    )


def timing(ratio: float, pairs: int = 8) -> _validate.Timing:
    return _validate.summarize([100.0] * pairs, [100.0 * ratio] * pairs)


def test_a_candidate_measured_slower_than_predicted_loses_its_rank(program, graph):
    model = cost_model()
    loop = _tuning.MeasuredSearch(
        program,
        model,
        first_search(program, model),
        SEARCH,
        _tuning.TuningConfig(candidates=3, budget_s=60, max_rounds=2),
    )
    ratios = itertools.chain([1.5], itertools.repeat(0.9))  # the model's favourite measures slow
    while (s := loop.next()) is not None:
        loop.record(_tuning.Measurement(timing(next(ratios)), {}, len(s.buckets)))
    tuned = loop.finish()
    favourite, runner_up = tuned.records[0], tuned.records[1]
    assert favourite.round == runner_up.round == 0
    assert favourite.predicted_us <= runner_up.predicted_us  # ranked first by the model
    assert loop.cost(favourite.strategy) > loop.cost(runner_up.strategy)  # ranked below it once measured
    assert tuned.best.key() == runner_up.strategy.key() and tuned.reason is None
    # The second round searched from the best measured candidate, with the recalibrated model.
    assert tuned.rounds and tuned.rounds[0]["start"] == runner_up.strategy.origin
    assert {r.round for r in tuned.records} == {0, 1} and len({r.strategy.key() for r in tuned.records}) == len(
        tuned.records
    )
    assert tuned.recalibration is not None and len(tuned.recalibration["points"]) == len(tuned.records) + 1
    assert tuned.recalibration["applied"] and model.params == tuned_params(tuned.recalibration)


def test_recalibration_recovers_the_parameters_and_keeps_the_measured_step_overhead(program, graph):
    model = cost_model()
    model.params = cost.SimulatorParams(step_overhead_us=50.0)  # as the calibrate phase measured it
    truth = cost.SimulatorParams(compute_scale=3.0, comm_blocking=0.5, step_overhead_us=50.0)
    rng = random.Random(0)
    strategies = list(_profile_phase.calibration_strategies(program).values())
    for move in (_strategy.split, _strategy.split_group, _strategy.merge_buckets, _strategy.split_bucket):
        s = move(program, strategies[0], rng)
        strategies += [s] if s is not None else []
    points = [
        (s, model.simulate(program, s, params=truth).iteration_us * rng.uniform(0.98, 1.02), f"s{i}")
        for i, s in enumerate(strategies)
    ]
    fitted = _tuning.recalibrate(program, model, points)
    assert fitted.free == _profile_phase.CALIBRATED and fitted.misfit < 0.03
    assert model.params == fitted.params and model.params.step_overhead_us == 50.0
    assert model.params.compute_scale == pytest.approx(3.0, rel=0.15)


def tuned_params(recalibration: dict) -> cost.SimulatorParams:
    return cost.SimulatorParams(**recalibration["params"])


def test_measured_kernel_times_enter_the_table_and_cost_the_next_round(program, graph):
    model = cost_model()
    table = _tuning.measured_table(model)
    measured: dict[frozenset[int], float] = {}
    sources_when_measured, sources_in_round_1 = [], []
    calls = itertools.count()

    def measure(s):
        if next(calls) == 2:  # the first candidate of round 1: what does the model say of round 0's kernels?
            sources_in_round_1.extend(model.estimator.estimate_with_source(graph, list(measured)))
        signatures = {graph.kernel_signature(g) for g in measured}
        new = {}
        for g in s.fused_groups:
            signature = graph.kernel_signature(g)
            if signature not in table.times_us and signature not in signatures:
                signatures.add(signature)
                new[g] = 1000.0 + len(measured) + len(new)
        sources_when_measured.extend(source for _, source in model.estimator.estimate_with_source(graph, list(new)))
        measured.update(new)
        return _tuning.Measurement(timing(0.95), new, len(s.buckets))

    tuning = _tuning.TuningConfig(candidates=2, budget_s=60, max_rounds=2)
    tuned = _tuning.measured_search(program, model, first_search(program, model), SEARCH, tuning, measure)
    assert measured, "no candidate formed a kernel the table lacked"
    assert "profile" not in sources_when_measured  # costed by the analytical model before
    # Round 1 searched with round 0's kernels costed from the table, at their measured times.
    assert sources_in_round_1 and all(source == "profile" for _, source in sources_in_round_1)
    assert [r.round for r in tuned.records].count(1) > 0
    kernels = list(measured)
    assert model.estimator.estimate_with_source(graph, kernels) == [(measured[k], "profile") for k in kernels]
    assert sum(r.kernels_added for r in tuned.records) == len(measured)
    assert tuned.kernel_times_us == {graph.kernel_signature(k): t for k, t in measured.items()}  # to be stored


def test_no_candidate_faster_keeps_xla_with_the_evidence(program, graph):
    model = cost_model()
    tuning = _tuning.TuningConfig(candidates=2, budget_s=60, max_rounds=1)

    def measure(s):
        return _tuning.Measurement(timing(1.1), {}, len(s.buckets))

    first = without_packing(first_search(program, model))
    tuned = _tuning.measured_search(program, model, first, SEARCH, tuning, measure)
    assert tuned.best.key() == _strategy.xla_default(graph).key()
    assert "no measured candidate was faster" in tuned.reason
    assert tuned.evidence["ratio"] == pytest.approx(1.1) and tuned.evidence["source"] == "measured candidates"
    a, b = records = json.loads(json.dumps(tuned.to_json()))["measured_candidates"]  # as the plan stores it
    assert all(r["measured_ratio"] == pytest.approx(1.1) and r["pairs"] == 8 for r in records)
    assert a["predicted_us"] <= b["predicted_us"]  # the model's order
    assert a["predicted_ratio"] * b["predicted_us"] == pytest.approx(b["predicted_ratio"] * a["predicted_us"])


def run_loop(loop: _tuning.MeasuredSearch, ratio) -> _tuning.Tuned:
    while (s := loop.next()) is not None:
        loop.record(_tuning.Measurement(timing(ratio(s)), {}, len(s.buckets)))
    return loop.finish()


def test_the_packing_candidate_is_measured_whatever_the_budget(program, graph):
    """Issue 46: on gloo the measured loop spent its budget on the model's favourite, and the
    packing candidate the simulator costs above XLA's plan was offered but never timed. Where the
    search offered packing, its cheapest packing candidate is owed a measurement; where it did not,
    a spent budget still ends the loop after the first candidate."""
    model = cost_model()
    first = first_search(program, model)
    assert "xla+packed-allreduce" in first.start_costs  # the CPU backend packs: packing offered
    cheapest_packed = next(s for _, s in first.candidates if _tuning.packs(s))
    spent = _tuning.TuningConfig(candidates=4, budget_s=0.0, max_rounds=3)
    loop = _tuning.MeasuredSearch(program, model, first, SEARCH, spent)
    assert not any(_tuning.packs(s) for s, _, _ in loop.queue)  # ranked out of the model's top 4
    tuned = run_loop(loop, lambda s: 0.7 if s.packed else 1.1)
    assert [r.strategy.key() for r in tuned.records][1:] == [cheapest_packed.key()]
    assert not tuned.records[0].strategy.packed and tuned.best.key() == cheapest_packed.key()
    stored = json.loads(json.dumps(tuned.to_json()))["measured_candidates"]
    assert [r["packed"] for r in stored] == [False, True] and stored[1]["picked"]
    # The packed start, rebuilt where the search's kept candidates hold no packing one.
    crowded = dataclasses.replace(first, candidates=without_packing(first).candidates)
    tuned = run_loop(_tuning.MeasuredSearch(program, model, crowded, SEARCH, spent), lambda s: 1.1)
    assert [(r.strategy.origin, r.strategy.packed) for r in tuned.records][1:] == [("xla+packed-allreduce", True)]
    assert tuned.records[1].strategy.key() == dataclasses.replace(_strategy.xla_default(graph), packed=True).key()
    assert tuned.records[1].predicted_us == first.start_costs["xla+packed-allreduce"]
    # Packing measured already in the model's order: nothing owed, nothing timed twice.
    packed_first = dataclasses.replace(first, candidates=[(c, s) for c, s in first.candidates if s.packed])
    tuned = run_loop(_tuning.MeasuredSearch(program, model, packed_first, SEARCH, spent), lambda s: 1.1)
    assert len(tuned.records) == 1 and tuned.records[0].strategy.packed
    # Packing not offered (a backend that does not pack): the spent budget ends the loop.
    tuned = run_loop(_tuning.MeasuredSearch(program, model, without_packing(first), SEARCH, spent), lambda s: 1.1)
    assert len(tuned.records) == 1 and not _tuning.packs(tuned.records[0].strategy)
    assert tuned.stop_reason == "time budget of 0 s spent"


def test_a_candidate_whose_outputs_fail_the_check_is_never_chosen(program, graph):
    model = cost_model()
    tuning = _tuning.TuningConfig(candidates=2, budget_s=60, max_rounds=1)
    wrong = _validate.Comparison(False, False, 1.0, 1.0, 3, 0, _validate.FLOAT64_CHECK)
    right = _validate.Comparison(False, True, 1e-7, 1e-6, 3, 0, _validate.FLOAT64_CHECK)
    measured = iter([(0.8, wrong), (0.9, right)])  # the first candidate measures fastest, and is wrong
    loop = _tuning.MeasuredSearch(program, model, without_packing(first_search(program, model)), SEARCH, tuning)
    while (s := loop.next()) is not None:
        ratio, outputs = next(measured)
        loop.record(_tuning.Measurement(timing(ratio), {}, len(s.buckets), outputs))
    tuned = loop.finish()
    bad, good = tuned.records
    assert bad.wrong and not bad.eligible and loop.cost(bad.strategy) is None
    assert tuned.best.key() == good.strategy.key() != bad.strategy.key()
    stored = json.loads(json.dumps(tuned.to_json()))["measured_candidates"]
    assert stored[0]["outputs"] == {"check": "float64-reference", "within_tolerance": False}


def test_when_no_candidate_can_be_chosen_the_reason_says_why_for_each(program, graph):
    """A failed compile, outputs outside the check and other collectives than planned: XLA's plan
    is kept, and the reason (printed, stored) says what befell the candidates."""
    model = cost_model()
    tuning = _tuning.TuningConfig(candidates=3, budget_s=60, max_rounds=1)
    wrong = _validate.Comparison(False, False, 1.0, 1.0, 3, 0, _validate.FLOAT64_CHECK)
    outcomes = iter(["fails", "wrong", "merged"])
    loop = _tuning.MeasuredSearch(program, model, without_packing(first_search(program, model)), SEARCH, tuning)
    while (s := loop.next()) is not None:
        outcome = next(outcomes)
        if outcome == "fails":
            loop.record(None, "XlaRuntimeError: INTERNAL: no layout")
        else:
            outputs = wrong if outcome == "wrong" else None
            loop.record(_tuning.Measurement(timing(0.8), {}, len(s.buckets), outputs, kept=outcome != "merged"))
    tuned = loop.finish()
    assert len(tuned.records) == 3 and tuned.best.key() == _strategy.xla_default(graph).key()
    assert tuned.reason.startswith("none of the 3 candidates could be measured: ")
    for why in (
        "failed (XlaRuntimeError: INTERNAL: no layout)",
        "outputs outside the output check",
        "other collectives",
    ):
        assert why in tuned.reason
    stored = json.loads(json.dumps(tuned.to_json()))["measured_candidates"]
    assert [r["ineligible"] for r in stored] == [r.ineligible for r in tuned.records]


def test_kernel_names_of_a_rewritten_module_map_to_the_strategy_groups(program, graph):
    rng, s = random.Random(0), _strategy.xla_default(graph)
    for _ in range(1000):  # split XLA's fusions until the strategy holds a fusion XLA did not form
        if set(s.fused_groups) - set(graph.xla_groups):
            break
        nxt = _strategy.split_group(program, s, rng)
        s = nxt if nxt is not None and _strategy.kernel_dag(program, nxt) is not None else s
    names = _tuning_devices.kernel_members(graph, s, program.backend.rewriter.rewrite(program, s))
    new = {n: m for n, m in names.items() if n.startswith("disco_fusion.")}
    assert new and set(new.values()) <= set(s.groups)
    assert set(s.fused_groups) <= set(names.values())  # every fused kernel is named
    assert all(frozenset([o]) in names.values() for o in graph.opaque_ops)


def test_optimize_distributed_compiles_times_and_records_its_candidates(tmp_path, monkeypatch):
    compiled = []
    real = _tuning_devices.compile_strategy

    def spy(lowered, graph, strategy):
        out = real(lowered, graph, strategy)
        compiled.append((strategy, _compile.compiled_stats(out[0].as_text())))
        return out

    monkeypatch.setattr(_tuning_devices, "compile_strategy", spy)
    step, args = make_step("jit")
    options = dict(budget_s=3.0, validation_pairs=4, verbose=False, plan_dir=tmp_path, measured_candidates=2)
    wrapped = optimize_distributed(search=True, **options)(step)
    wrapped(*args)
    report = wrapped.last_report
    records = report.search["measured_candidates"]
    assert records and len(records) == len(compiled)
    for r, (s, counts) in zip(records, compiled):
        assert counts["all-reduce"] == len(s.buckets) == r["allreduces"]["planned"] == r["allreduces"]["compiled"]
        assert r["origin"] == s.origin and r["pairs"] == 6
        assert r["outputs"]["within_tolerance"], r["outputs"]  # checked as validation checks them
        assert r["predicted_us"] > 0 and r["measured_us"] > 0 and r["predicted_ratio"] > 0 and r["measured_ratio"] > 0
    assert report.search["recalibration"]
    # The candidates' kernels went into the profile database beside those the profile phase timed.
    stored = _profile_db.ProfileDatabase().load("cpu", "cpu", 8).kernel_times_us
    assert len(stored) == report.search["cost_model"]["kernel_times"] + sum(r["kernels_added"] for r in records)
    assert _plan.read_plan_file(report.plan_path).search["measured_candidates"] == records
    fastest = min(records, key=lambda r: r["measured_ratio"])
    # A bench row's record of the search (`measured.search_record`) reads the same report.
    record = measured.search_record(report, packs=True)
    assert record["fusion_search"]["packing_offered"] and record["fusion_search"]["evaluated"] > 0
    assert record["fusion_search"]["starts_us"] == report.search["start_costs"]
    assert [(c["origin"], c["measured_ratio"], c["packed"]) for c in record["measured_candidates"]] == [
        (r["origin"], r["measured_ratio"], r["packed"]) for r in records
    ]
    assert all(c["verdict"] in ("faster", "slower", "undecided") and len(c["ratio_ci95"]) == 2 for c in records)
    assert record["measured_loop_stop"] == report.search["tuning"]["stop_reason"]
    assert record["chosen"]["applied"] == report.applied and record["weight_update"]["mode"] == "replicated"
    if fastest["measured_ratio"] >= 1.0:
        assert not report.applied and report.reason.startswith("no measured candidate was faster")
        assert not any(r["picked"] for r in records) and record["validation"] is None
    else:  # the fastest candidate went to validation
        assert "bitwise_required" in report.measured
        assert report.plan_counts["all-reduce"] == fastest["allreduces"]["planned"]
        assert [r["picked"] for r in records] == [r is fastest for r in records]
        assert record["validation"]["ratio"] == report.measured["ratio"]
    row = {"model": "mlp", "strategies": {rows.DISCO: {"search": record}}}
    text = report_measured.search_summary(row)
    assert text.startswith("mlp: weight update replicated; fusion search ") and "packing offered" in text
    assert f"{fastest['origin']}{' packed' if fastest['packed'] else ''} {fastest['measured_ratio']:.3f} [" in text
    assert report_measured.search_summary({"model": "mlp", "strategies": {rows.DISCO: {}}}) == ""


def test_measured_candidates_0_measures_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(_search_phase, "tune", lambda *a, **k: pytest.fail("a candidate was measured"))
    # The measured phases before the search are not what this test is about: a model stands in.
    monkeypatch.setattr(_search_phase, "profile", lambda *a, **k: cost_model())
    monkeypatch.setattr(_search_phase, "calibrate", lambda *a, **k: types.SimpleNamespace(to_json=dict))
    step, args = make_step("jit")
    options = dict(budget_s=1.0, validation_pairs=4, verbose=False, plan_dir=tmp_path, measured_candidates=0)
    wrapped = optimize_distributed(search=True, **options)(step)
    wrapped(*args)
    assert wrapped.last_report.search_ran and "measured_candidates" not in wrapped.last_report.search
    with pytest.raises(ValueError, match="measured_candidates"):
        optimize_distributed(measured_candidates=-1)


@pytest.mark.xdist_group("multiprocess")
def test_every_process_measures_the_candidates_process_0_picks(tmp_path, two_process_profiles):
    """Two processes: process 0 searches and picks, both compile and time the same candidates
    (collectives: a mismatch would hang or fail the job), and both end with process 0's plan."""
    plan_dir = tmp_path / "plans"
    two_process_profiles.copy_to()  # the collectives' cost is not this test's
    # The replicated update: one program, one plan (the weight-update choice is not this test's).
    result, reports = run_job(plan_dir, "--weight-update", "replicated", search=True)
    assert result.exit_code == 0, "\n".join(result.outputs)
    p0, p1 = reports[0], reports[1]
    assert p0["searches"] >= 1 and p1["searches"] == 0
    for key in ("plan_digest", "applied", "reason", "plan_use_default", "output_digest"):
        assert p0[key] == p1[key], key
    (plan,) = [p for p in plan_dir.glob("*.json") if not p.name.endswith(".timeline.json")]
    records = json.loads(plan.read_text())["search"]["measured_candidates"]
    assert records and all(r["pairs"] > 0 and r["allreduces"]["compiled"] is not None for r in records)
