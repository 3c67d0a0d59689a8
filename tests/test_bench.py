"""Every tiny zoo model trains under both data-parallel styles with a plan enacted by the
decorator, equal to the unmodified step, and the two styles agree (the zoo's end-to-end check:
test_zoo.py holds its cheap ones); the bench's rows and report hold together."""

import dataclasses
import functools
import json
import os
import re
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from _hlo_text import module_kernels
from _trees import assert_trees_close, max_abs
from _zoo_sizes import CPU_SMALL, small

from disco_jax import (
    _capture,
    _compile,
    _pipeline,
    _plan,
    _program,
    _ranking,
    _validate,
    backends,
    optimize_distributed,
    schedule_options,
    zoo,
)
from disco_jax._files import write_json_atomic
from disco_jax.cost import ChainEstimator, CostModel, sharded
from disco_jax.eval import (
    baselines,
    bench,
    clusters,
    headroom,
    report,
    report_large,
    report_measured,
    report_text,
    rows,
)

REPORT = Path(__file__).resolve().parents[1] / "report"

MODELS = sorted(zoo.MODELS)


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    return zoo.data_mesh(8)


# SGD with momentum: the first update is exactly -LEARNING_RATE * grad, so comparing the two
# styles' updates compares their gradients, and the optimizer state has leaves that must come back
# replicated.
LEARNING_RATE = 0.1
OPTIMIZER = optax.sgd(LEARNING_RATE, momentum=0.9)


def _decorated_step_with_a_handmade_plan(name, style, mesh, plan_dir, monkeypatch):
    """One style of a tiny zoo model's step, decorated with a hand-made plan (XLA's fusions, one
    all-reduce per gradient: the JAX_op_fusion baseline) and called once without a search: the
    plan must be enacted and its outputs bitwise equal to the unmodified step's, which only
    regroups all-reduces. Returns (initial state, outputs)."""
    spec = small(name, CPU_SMALL)
    step, state, batch = zoo.make_train_step(spec, OPTIMIZER, mesh, style)
    captured = _compile.capture(step.lower(state, batch), backends.CPU, (state, batch), {})
    graph, default = captured.graph, captured.default_compiled
    reference = default(state, batch)
    strategy = baselines.jax_op_fusion(captured.program).strategy
    machine = _plan.MachineKey.current(_compile.step_devices((state, batch), {}))
    _plan.save_plan(
        _plan.Plan(graph.fingerprint, graph.module.name, machine, False, strategy.to_json(graph), "made by a test"),
        plan_dir,
    )
    # The decorator would capture the same module again (one more compile); it is given ours
    # (the plan compile still goes through the hook, which checks the module's fingerprint).
    monkeypatch.setattr(_pipeline, "capture", lambda lowered, *a, **k: captured)

    decorated = optimize_distributed(search=False, plan_dir=plan_dir, verbose=False)(step)
    outputs = decorated(state, batch)
    step_report = decorated.last_report
    assert step_report.applied, step_report.reason
    assert step_report.compile_status == "rewritten"
    assert step_report.plan_counts["all-reduce"] == len(graph.gradients)
    # Plain jit data parallelism: the SPMD partitioner must have inserted the gradient all-reduces.
    assert 1 <= step_report.default_counts["all-reduce"] <= len(graph.gradients)
    assert _validate.compare_outputs(reference, outputs, bitwise=True).bitwise_equal
    return state, outputs


@pytest.mark.parametrize("name", MODELS)
def test_decorated_tiny_model_trains_and_equals_the_unmodified_step(name, mesh, tmp_path, monkeypatch):
    """Both data-parallel styles of the model, each with a plan enacted by @optimize_distributed
    (bitwise equal to its unmodified step), train one step and agree with each other: the same
    loss, parameters and model state, and the same update (so the same gradients)."""
    state, (jit_state, jit_loss) = _decorated_step_with_a_handmade_plan(
        name, "jit", mesh, tmp_path / "jit", monkeypatch
    )
    same_state, (shard_map_state, shard_map_loss) = _decorated_step_with_a_handmade_plan(
        name, "shard_map", mesh, tmp_path / "shard_map", monkeypatch
    )
    assert _validate.compare_outputs(state, same_state, bitwise=True).bitwise_equal  # one seed, one state

    assert np.isfinite(float(jit_loss)) and np.isfinite(float(shard_map_loss))
    jit_update = jax.tree.map(np.subtract, jit_state.params, state.params)
    shard_map_update = jax.tree.map(np.subtract, shard_map_state.params, state.params)
    changed = [float(np.max(np.abs(u))) > 0 for u in jax.tree.leaves(jit_update)]
    assert np.mean(changed) > 0.9, f"only {sum(changed)} of {len(changed)} parameter arrays changed"

    np.testing.assert_allclose(shard_map_loss, jit_loss, rtol=1e-5)
    assert_trees_close(shard_map_state.params, jit_state.params, 1e-4, 1e-6, "params")
    # The updates are -lr * grad: the styles must compute the same gradients, not just close params.
    assert_trees_close(shard_map_update, jit_update, 1e-3, 1e-4, "update")
    assert_trees_close(shard_map_state.model_state, jit_state.model_state, 1e-4, 1e-6, "model_state")
    if "batch_stats" in state.model_state:  # ResNet: the step updates the running averages
        assert max_abs(jax.tree.map(np.subtract, jit_state.model_state, state.model_state)) > 0
    assert jax.tree.structure(shard_map_state) == jax.tree.structure(state)


def test_fo_is_the_lowest_baseline_bound_never_disco_jax():
    strategies = {
        "JAX_default": {"simulated": {"full_overlap_us": 90.0}},
        "Horovod": {"simulated": {"full_overlap_us": 80.0}},
        "PyTorch_DDP": {"simulated": None},  # not enacted
        rows.DISCO: {"simulated": {"full_overlap_us": 50.0}},
    }
    assert rows.full_overlap_us(strategies) == 80.0


def test_summary_speedup_and_headroom():
    s = rows.summarize({"A": 120.0, "B": 100.0, rows.DISCO: 90.0}, fo_us=80.0)
    assert s["best_baseline"] == "B"
    assert s["speedup"] == pytest.approx(10 / 90)
    assert s["headroom_captured"] == pytest.approx(0.5)
    assert rows.summarize({"B": 100.0, rows.DISCO: 100.0}, fo_us=100.0)["headroom_captured"] is None
    loss = rows.summarize({"B": 100.0, rows.DISCO: 110.0}, fo_us=50.0)
    assert loss["speedup"] < 0 and loss["headroom_captured"] == pytest.approx(-0.2)


@pytest.fixture(scope="module")
def simulated_rows(mesh):
    spec = zoo.get_model("mlp", "tiny")
    lowered = zoo.lower_abstract(spec, optax.adam(1e-3), mesh, "jit")
    program = _program.build_program(_capture.capture(lowered)[0], backends.CPU)
    return program, {name: rows.simulated_row(program, c, budget_s=1.0) for name, c in clusters.CLUSTERS.items()}


def test_simulated_row_has_every_strategy_and_a_consistent_bound(simulated_rows):
    program, by_cluster = simulated_rows
    graph = program.graph
    for name, row in by_cluster.items():
        assert set(row["strategies"]) == {*rows.BASELINE_ORDER, rows.DISCO}
        times = row["time_us"]
        assert all(t is not None and t > 0 for t in times.values()), name
        # The search starts from every baseline: it is never worse in simulation.
        assert times[rows.DISCO] <= row["best_baseline_us"] + 1e-6
        # FO is the baselines' bound, never disco-jax's own.
        simulated = {k: v["simulated"] for k, v in row["strategies"].items()}
        assert row["fo_us"] == min(simulated[b]["full_overlap_us"] for b in rows.BASELINE_ORDER)
        assert row["fo_us"] <= min(times[b] for b in rows.BASELINE_ORDER) + 1e-6
        # The dependency bound is disco-jax's plan's: between its plan's FO and its simulated time.
        bound = row["dependency_bound_us"]
        assert simulated[rows.DISCO]["dependency_bound_us"] == bound
        assert simulated[rows.DISCO]["full_overlap_us"] - 1e-6 <= bound <= times[rows.DISCO] + 1e-6
        assert row["search"]["evaluated"] >= len(rows.BASELINE_ORDER)
        # XLA's all-reduce combining on a GPU cluster is XLA:GPU's combiner.
        assert row["strategies"]["JAX_default"]["buckets"] == len(baselines.xla_gpu_buckets(graph))
        json.dumps(row)  # rows are JSON


def test_report_is_written_from_rows(simulated_rows, tmp_path):
    program, by_cluster = simulated_rows
    graph = program.graph
    for name, row in by_cluster.items():
        cluster = clusters.CLUSTERS[name]
        full = {
            **rows.common_fields(
                "mlp", name, "jit", graph.summary(), cluster.kernel_estimator().name, cluster.num_devices
            ),
            **row,
            "elapsed_s": 1.0,
        }
        write_json_atomic(rows.row_path(tmp_path, "mlp", name, "jit"), full)
    readme = report.write_report(tmp_path, run_info={"elapsed_s": 3.0, "config": {"budget_s": 1.0}})
    text = readme.read_text()
    assert "disco-jax bench --out report" in text
    assert "$" not in text  # every placeholder of the template was filled
    for name in clusters.CLUSTERS:
        assert name in text
    assert "analytical-scaled" in text
    assert "| DB | DB allows |" in text and "The dependency bound (DB) of disco-jax's plans" in text
    assert (tmp_path / "fig6_iteration_time.png").stat().st_size > 1000
    assert any(p.name.startswith("fig7_breakdown_") for p in tmp_path.glob("*.png"))
    # Resumable: a run whose rows all exist starts no model process and only rewrites the report.
    config = bench.BenchConfig(models=("mlp",), platforms=tuple(clusters.CLUSTERS), out=str(tmp_path))
    assert bench.run(config) == readme
    assert not list((tmp_path / "logs").iterdir())
    assert json.loads((tmp_path / "run.json").read_text())["failures"] == []


def test_a_variant_has_rows_of_its_own_shown_beside_its_models(tmp_path):
    """`disco-jax bench --models transformer:scan_layers=True` writes the variant's rows under a
    name of their own; the report orders it right after its model and puts the two side by side
    (JAX default's and disco-jax's times and their ratios) on every platform both ran."""
    variant = "transformer:scan_layers=True"
    path = rows.row_path(tmp_path, variant, "8xH100-NVLink", "jit")
    assert path.name == "transformer+scan_layers=True.paper.jit.8xH100-NVLink.json"
    assert path != rows.row_path(tmp_path, "transformer", "8xH100-NVLink", "jit")
    listed = [{"model": m} for m in ("mlp", variant, "vgg19", "transformer")]
    assert rows.model_order(listed) == ["vgg19", "transformer", variant, "mlp"]
    by_key = {
        ("8xH100-NVLink", m): {"time_us": {"JAX_default": base, rows.DISCO: disco}, "capture_s": capture}
        for m, base, disco, capture in (("transformer", 2000.0, 1800.0, 160.0), (variant, 3000.0, 2700.0, 60.0))
    }
    [block] = report._variants(by_key, ["8xH100-NVLink", "cpu-8dev"], ["transformer", variant])
    [line] = [ln for ln in block.splitlines() if ln.startswith("| 8xH100-NVLink")]
    assert line == f"| 8xH100-NVLink | transformer | {variant} | 2.00 / 3.00 | 1.500 | 1.80 / 2.70 | 1.500 | 160 / 60 |"
    assert report._variants(by_key, ["cpu-8dev"], ["transformer", variant]) == []


def test_template_sections_are_all_used_and_filled():
    """Every section of the report template is used by the report writer, and no section asks for
    a value the writer does not give (string.Template would raise)."""
    source = Path(report.__file__).read_text() + Path(report_measured.__file__).read_text()
    names = set(report_text.sections())
    assert {"header", "headline", "caveats", "accuracy", "clusters"} <= names
    used = set(re.findall(r'fill\(\s*"(\w+)"', source))
    assert used == names, (names - used, used - names)


@pytest.mark.skipif(not (REPORT / "rows").is_dir(), reason="no committed report rows")
def test_report_from_the_committed_rows_has_the_committed_sections(tmp_path):
    """The committed rows (measured and simulated) render with every section the committed report
    has, in the same order (nothing is run; figures are not drawn)."""
    committed = [report_measured.readable(r) for r in rows.load_rows(REPORT)]
    run_info = json.loads((REPORT / "run.json").read_text()) if (REPORT / "run.json").exists() else {}
    figures = {
        "fig6": "fig6_iteration_time.png",
        **{f"table2_{p}": f"table2_simulated_vs_measured_{p}.png" for p in rows.MEASURED_PLATFORMS},
        **{f"fig7_{p}": f"fig7_breakdown_{p}.png" for p in rows.platform_order(committed)},
    }
    text = report.report_markdown(committed, figures, run_info, extra=report_large.blocks(REPORT))
    headings = [line for line in text.splitlines() if line.startswith("#")]
    expected = [line for line in (REPORT / "README.md").read_text().splitlines() if line.startswith("#")]
    assert headings == expected
    assert "$" not in text


def test_each_job_shape_gets_its_own_worker():
    config = bench.BenchConfig(timeout_s=60.0)
    jobs = bench.worker_jobs("mlp", [rows.CPU_PLATFORM, rows.GLOO_PLATFORM, "8xH100-NVLink"], config, "/scratch")
    (plain, plain_env), (launched, launched_env) = jobs
    assert plain[plain.index("--platforms") + 1 : plain.index("--style")] == [rows.CPU_PLATFORM, "8xH100-NVLink"]
    assert "--xla_force_host_platform_device_count=8" in plain_env["XLA_FLAGS"]
    # The gloo platform runs as a two-process job of one device each, started by `disco-jax launch`.
    assert launched[1:8] == ["-m", "disco_jax.cli", "launch", "-n", "2", "--devices-per-process", "1"]
    assert launched[launched.index("--platforms") + 1] == rows.GLOO_PLATFORM
    # Kernel times of 8 devices sharing the cores are not those of one device: separate profiles.
    assert plain_env["DISCO_JAX_PROFILE_DIR"] != launched_env["DISCO_JAX_PROFILE_DIR"]


def test_force_replaces_rows_as_they_are_written_and_keeps_those_a_failed_worker_did_not(tmp_path, monkeypatch):
    """`--force` redoes rows that exist; a worker that fails (or a run stopped early) must not
    lose the rows it did not rewrite."""
    (tmp_path / "rows").mkdir()
    for model in ("mlp", "dlrm"):
        path = bench.row_path(tmp_path, model, "8xH100-NVLink", "jit")
        bench.write_json_atomic(path, {"old": model})
        os.utime(path, (1e9, 1e9))  # written by an earlier run
    commands = []

    def worker(cmd, env, log_path, timeout_s, progress):
        commands.append(cmd)
        model = cmd[cmd.index("--model") + 1]
        if model == "dlrm":
            return 1  # fails before writing its row
        bench.write_json_atomic(bench.row_path(tmp_path, model, "8xH100-NVLink", "jit"), {"new": model})
        return 0

    monkeypatch.setattr(bench, "run_worker", worker)
    monkeypatch.setattr(bench, "write_report", lambda out, **kw: out / "README.md")
    config = bench.BenchConfig(models=["mlp", "dlrm"], platforms=["8xH100-NVLink"], out=str(tmp_path), force=True)
    bench.run(config)
    assert all("--force" in cmd for cmd in commands) and len(commands) == 2
    read = lambda m: json.loads(bench.row_path(tmp_path, m, "8xH100-NVLink", "jit").read_text())  # noqa: E731
    assert read("mlp") == {"new": "mlp"} and read("dlrm") == {"old": "dlrm"}


def test_a_measured_platform_is_refused_in_a_job_of_another_shape(tmp_path):
    with pytest.raises(RuntimeError, match="gloo-2x1 is measured by a job of 2 process"):
        bench.run_model(
            "mlp",
            (rows.GLOO_PLATFORM,),
            style="jit",
            budget_s=1.0,
            cpu_budget_s=1.0,
            pairs=4,
            out=str(tmp_path),
            force=False,
            plan_dir=str(tmp_path),
        )


def _timed(ratios: list[float], reference_us: float = 1000.0) -> dict:
    """A configuration's `measured` record from per-pair ratios to the reference."""
    timing = _validate.summarize([reference_us] * len(ratios), [reference_us * x for x in ratios])
    return rows.measured_json(timing)


def _spread(median: float, width: float, pairs: int = 40) -> list[float]:
    """`pairs` ratios evenly over median -+ width, in a scrambled order (timed pairs do not come
    sorted; a sorted run would read as neighbouring pairs moving together)."""
    return [median + width * (2 * (i * 17 % pairs) / (pairs - 1) - 1) for i in range(pairs)]


def _fair_row(model: str, applied: bool, disco: list[float], weight_update: str = "replicated") -> dict:
    """The committed mlp row on cpu-8dev, remeasured on paper: every configuration at a ratio of
    1.0 to 1.03 of the reference (JAX_default 1.0, within 2%), disco-jax at `disco` (its fusion plan
    `applied` or not, on the `weight_update` it chose), and a decorator that costs 2% of the
    executable's time per call."""
    row = json.loads((REPORT / "rows" / "mlp.tiny.jit.cpu-8dev.json").read_text())
    strategies = row["strategies"]
    for i, name in enumerate(rows.BASELINE_ORDER):
        strategies[name]["measured"] = _timed(_spread(1.0 + 0.01 * abs(i - 3), 0.02))
    strategies[rows.DISCO].update(
        applied=applied,
        weight_update=weight_update,
        weight_update_reason=None,
        search=None,  # the committed row's record of the search is not this row's
        measured=_timed(disco),
        overhead=rows.overhead_json(_validate.summarize([5000.0] * 40, [5000.0 * x for x in _spread(1.02, 0.01)])),
    )
    return {
        **row,
        "model": model,
        "reference": {"executable": "a second compile", "us": 1000.0, "pairs": 40},
        **rows.measured_summary(strategies, 1000.0),
    }


@pytest.mark.skipif(not (REPORT / "rows").is_dir(), reason="no committed report rows")
def test_measured_rows_are_told_against_one_reference_with_intervals():
    """Every configuration, JAX_default included, is a ratio to the row's reference; JAX_default is
    no longer 1.0 by definition; speed-ups, plans slower than JAX_default and the decorator's
    overhead are told with intervals."""
    measured = [
        _fair_row("mlp", True, _spread(0.90, 0.02)),  # faster than every baseline, surely
        _fair_row("bert", True, _spread(1.02, 0.05)),  # slower than JAX_default, but not surely
        _fair_row("dlrm", True, _spread(1.10, 0.01)),  # slower, surely
        _fair_row("rnnlm", False, _spread(1.0, 0.10)),
        # The sharded update chosen and kept, its fusion plan rejected: a plan applied all the same.
        _fair_row("reformer", False, _spread(0.85, 0.02), weight_update="sharded"),
    ]
    measured[4]["strategies"][rows.DISCO]["search"] = {
        "weight_update": {
            "mode": "sharded",
            "candidates": [
                {"label": "replicated"},
                {"label": "sharded (4 groups, 12 leaves)", "ratio": 0.9, "ratio_ci95": [0.85, 0.95]}
                | {"verdict": "faster"},
            ],
        },
        "fusion_search": {"evaluated": 120, "packing_offered": True, "starts_us": {"xla": 1000.0}}
        | {"packed_start_us": 800},
        "measured_candidates": [
            {"origin": "xla+packed-allreduce", "packed": True, "measured_ratio": 0.97, "ratio_ci95": [0.9, 1.04]}
            | {"verdict": "undecided", "picked": False, "ineligible": None},
        ],
        "validation": None,
        "chosen": {"applied": False, "weight_update": "sharded", "packed": False, "buckets": None, "origin": None},
    }
    mlp = measured[0]
    assert mlp["time_us"]["JAX_default"] == pytest.approx(mlp["strategies"]["JAX_default"]["measured"]["ratio"] * 1000)
    assert rows.BASELINE_ORDER[3] == mlp["best_baseline"] == "JAX_default"  # the lowest ratio here
    low, high = mlp["speedup_ci95"]
    assert 0 < low < mlp["speedup"] < high
    low, high = measured[2]["speedup_ci95"]
    assert low < measured[2]["speedup"] < high < 0
    text = report.report_markdown(measured, {}, {})
    assert "Plans: **4 of 5 applied** (sharded weight update 1, fusion/bucket plan 3;" in text
    assert "1 with XLA's program unchanged; **2** applied and measured faster than XLA's program" in text
    assert "with the 95% interval below 1 (" in text and "mlp 0.900 [" in text and "reformer 0.850 [" in text
    assert "reformer: sharded weight update, 0.850 [" in text
    assert "measured slower than JAX_default afterwards: **2** (median ratio above 1; bert 1.020 [" in text
    assert "), 1 of them with the 95% interval above 1." in text
    assert (
        "against one reference (a second compile); JAX_default's own ratio to it, the noise floor, is a median" in text
    )
    assert "interval above 0 on **2** models, below 0 on 1, holding 0 on 2 (0 without an interval)" in text
    assert "a median +100 µs (from +100 to +100 over models)" in text
    assert "medians of interleaved pairs against a second compile, one time scale per row" in text
    assert re.search(r"\| mlp \|.*\| JAX_default \| \+\d+\.\d% \[\+\d+\.\d%, \+\d+\.\d%\] \|", text)
    assert "The decorator's own cost per call in µs" in text and "$" not in text
    # What the search did, for the one row that records it.
    assert (
        "- reformer: weight update sharded (sharded (4 groups, 12 leaves) 0.900 [0.850, 0.950] faster); fusion "
        "search 120 simulated, packing offered (packed start simulated 0.800x XLA's plan); measured "
        "xla+packed-allreduce packed 0.970 [0.900, 1.040] undecided; runs: XLA's fusion and buckets, weight "
        "update sharded\n" in text
    )
    assert text.count("- mlp: weight update") == 0


@pytest.fixture(scope="module")
def gpu_mlp(xla_gpu_zoo):
    """The tiny MLP's Adam step lowered for 8 H100s (deviceless) and captured (the session's
    `conftest.xla_gpu_zoo`), with its compiled programs, which the GPU rows below share (as one
    target's rows do in the bench)."""
    lowered, program, text = xla_gpu_zoo("mlp")
    return lowered, program, text, _compile.Programs(lowered, program)


def test_gpu_cluster_row_costs_every_strategy_on_the_program_xla_gpu_compiled(gpu_mlp):
    """A cluster row on XLA:GPU's module (deviceless, H100 target): every baseline compiled as
    XLA:GPU enacts it (JAX_default: XLA:GPU's own program) and costed by the compiled-program
    model, kernel for kernel of its module; disco-jax's candidates compiled and ranked with XLA's
    program by compiled cost, the cheapest taken; FO from the baselines' compiled costs."""
    lowered, program, text, programs = gpu_mlp
    graph = program.graph
    cluster = clusters.get_cluster("8xH100-NVLink")
    assert cluster.target == "h100-sxm" and clusters.get_cluster("clusterA-12x1080Ti").target is None
    no_combining = [("all-reduce combine threshold", [{schedule_options.THRESHOLDS["all-reduce"]: "0"}])]
    row = rows.simulated_row(program, cluster, budget_s=1.0, lowered=lowered, programs=programs, schedule=no_combining)
    assert row["cost_model"] == rows.COMPILED_MODEL and "not_compiled" not in row
    xla_allreduces = _compile.compiled_stats(text)["all-reduce"]
    assert row["strategies"]["JAX_default"]["buckets"] == len(graph.xla_buckets) == xla_allreduces
    texts = {p.name: p.text for p in programs}
    for name in rows.STRATEGY_ORDER:
        strategy = row["strategies"][name]
        program = strategy["program"]
        assert program["status"] in _compile.ENACTED and program["compiled"]["fusion"] > 0, name
        if name in rows.BASELINE_ORDER:
            assert program["enacted_by"] == ("rewrite" if name in ("PyTorch_DDP", "Horovod") else "compile options")
        # The figure is the compiled program's cost: every kernel of its module, and nothing else.
        compute, collectives = module_kernels(texts[program["same_program_as"] or program["name"]])
        figure = strategy["simulated"]
        assert strategy["cost_model"] == rows.COMPILED_MODEL, name
        assert (figure["num_kernels"], figure["num_collectives"]) == (compute, len(collectives)), name
        assert sum(figure["costed_by"].values()) == compute + len(collectives)
        assert figure["costed_by"]["collective model"] == len(collectives)
        assert row["time_us"][name] == figure["iteration_us"] > 0
        assert strategy["graph_simulated"]["iteration_us"] > 0  # the search's model, kept beside it
    default = row["strategies"]["JAX_default"]["program"]
    assert default["compiler_options"] == {} and default["compiled"]["all-reduce"] == xla_allreduces
    assert row["strategies"]["JAX_no_fusion"]["program"]["compiled"]["multi_op_loop_fusions"] == 0
    # disco-jax: XLA's program among its ranked candidates, the cheapest compiled taken.
    disco = row["strategies"][rows.DISCO]
    ranked = disco["ranked"]
    assert ranked[0]["label"] == disco["chosen"] and len(ranked) >= 2
    assert _ranking.XLA_PROGRAM in [r["label"] for r in ranked]
    compiled_us = [r["compiled_us"] for r in ranked if r["compiled_us"] is not None]
    assert compiled_us == sorted(compiled_us) and row["time_us"][rows.DISCO] == compiled_us[0]
    assert row["time_us"][rows.DISCO] <= row["time_us"]["JAX_default"]
    assert all(r["graph_simulated_us"] is not None for r in ranked)
    # The compiled programs' collectives, not the plans' buckets: JAX_no_fusion's one per gradient.
    assert row["strategies"]["JAX_default"]["collectives"]["all-reduce"]["count"] == xla_allreduces
    assert row["strategies"]["JAX_no_fusion"]["collectives"]["all-reduce"]["count"] == len(graph.gradients)
    assert disco["collectives"]["all-reduce"]["count"] >= 1
    # Each part's own gain: the options search ran (XLA's defaults and combining off), and its
    # gain is XLA's program's cost over the cheapest of the two (1.0: XLA's own kept).
    searched = row["schedule_options"]
    assert [c["label"] for c in searched["candidates"]][0] == schedule_options.DEFAULTS
    assert len(searched["candidates"]) == 2
    assert row["parts"]["collective_options"] == searched["gain"] >= 1.0
    # The weight-update record is of the program disco-jax took (none sharded under options).
    assert row["weight_update"]["sharded_gradients"] == disco["sharded_gradients"]
    assert set(row["parts"]) == {"weight_update", "rewrite", "collective_options", "combined"}
    # No sharded update without `relower`: nothing to combine with the options.
    assert row["parts"]["combined"] is None and searched["combined"] is None
    # FO: the baselines' compiled bounds only.
    assert row["fo_us"] == min(row["strategies"][b]["simulated"]["full_overlap_us"] for b in rows.BASELINE_ORDER)
    json.dumps(row)


def test_ranking_keeps_xla_program_when_no_candidate_beats_it_compiled(gpu_mlp):
    """`rank_by_compiled_cost`: a candidate the graph simulator rates above XLA's plan but whose
    compiled program costs more (the unfused graph, one all-reduce per gradient) ranks below
    XLA's own program, which is then what is chosen."""
    lowered, program, _, programs = gpu_mlp
    graph = program.graph
    cluster = clusters.get_cluster("8xH100-NVLink")
    xla = programs.compile("JAX_default", None, {})
    worse = baselines.jax_no_fusion(program).strategy
    ranked = _ranking.rank_by_compiled_cost(
        xla,
        [(worse, 1.0)],  # a graph figure that would win on the graph
        lambda label, s: programs.compile(label, s, None),
        _ranking.ProgramCosts(backends.GPU, cluster.kernel_estimator(), cluster.allreduce_model()),
    )
    assert [r.label for r in ranked][0] == _ranking.XLA_PROGRAM and ranked[0].strategy is None
    assert ranked[1].strategy is worse and ranked[1].compiled_us > ranked[0].compiled_us
    assert ranked[1].cost.to_json()["num_collectives"] == len(graph.gradients)


def test_measured_search_times_only_candidates_that_compile_below_xla_on_xla_gpu(gpu_mlp, simulated_rows):
    """The pipeline's measured search on XLA:GPU ranks each round's candidates by compiled cost
    first (`_ranking.CompiledRanking`): one that compiles above XLA's program is not timed, and
    the ranking is recorded; on XLA:CPU the search's order is kept (no ranking)."""
    lowered, program, _, programs = gpu_mlp
    cluster = clusters.get_cluster("8xH100-NVLink")
    model = CostModel(ChainEstimator([cluster.kernel_estimator()]), cluster.allreduce_model(), {})
    xla = programs.compile("JAX_default", None, {}).compiled
    step = _compile.Captured(lowered, program, xla, (), {}, [], None)
    rank = _ranking.CompiledRanking.of(step, model)
    worse = baselines.jax_no_fusion(program).strategy
    assert rank([(worse, 1.0)]) == []
    (ranking,) = rank.rounds
    assert ranking[0]["label"] == _ranking.XLA_PROGRAM and ranking[1]["compiled_us"] > ranking[0]["compiled_us"]
    cpu_program = simulated_rows[0]
    assert _ranking.CompiledRanking.of(dataclasses.replace(step, program=cpu_program), model) is None


def test_a_gpu_row_ranks_a_sharded_update_by_lowering_the_step_again(gpu_mlp):
    """The search may shard weight updates (`Strategy.sharded`); a GPU row compiles such a
    candidate as the step lowered again with that state sharded (XLA:GPU's own program of it),
    and reports the optimizer-state bytes per device of what it took."""
    program = gpu_mlp[1]
    graph = program.graph
    shardable = sharded.regions_of(graph).shardable
    relower = _mlp_relower(graph)
    relowered = relower(shardable)
    assert relowered.enacted and relowered.compiler_options == {}
    opcodes = {k.collective for k in backends.GPU.read_kernels(relowered.text) if k.is_collective}
    assert "all-gather" in opcodes  # the updated parameters, gathered
    row = _mlp_row(gpu_mlp, schedule=False)
    disco, update = row["strategies"][rows.DISCO], row["weight_update"]
    assert update["shardable_gradients"] == len(shardable) > 0
    state = update["state_bytes_per_device"]
    if disco["sharded_gradients"]:
        assert disco["program"]["enacted_by"].startswith("relowered") and state[rows.DISCO] < state["replicated"]
        assert update["sharded_gradients"] == disco["sharded_gradients"]
    else:
        assert state[rows.DISCO] == state["replicated"] and update["sharded_gradients"] == 0
    assert row["time_us"][rows.DISCO] == disco["ranked"][0]["compiled_us"]
    # Which updates to shard is chosen on compiled programs: every shardable gradient's update
    # sharded is compiled whatever the graph simulator preferred, each distinct program once
    # with both figures, and none of them compiles cheaper than what disco-jax took.
    choice = disco["weight_update_choice"]
    assert len({c["program"] for c in choice}) == len(choice) >= 2
    cluster = clusters.get_cluster("8xH100-NVLink")
    estimator = ChainEstimator([cluster.kernel_estimator()])
    costs = _ranking.ProgramCosts(backends.GPU, estimator, cluster.allreduce_model(), cluster.simulator_params())
    every = [c for c in choice if c["sharded_gradients"] == len(shardable)]
    assert len(every) == 1 and every[0]["compiled_us"] == pytest.approx(costs(relowered).iteration_us)
    assert all(c["graph_simulated_us"] is not None and c["compiled_us"] >= row["time_us"][rows.DISCO] for c in choice)
    json.dumps(row)


def _mlp_relower(graph):
    """The tiny MLP's step lowered again for 8 H100s with a set of its gradients' updates sharded."""
    return functools.partial(rows.sharded_paper_program, "mlp", "jit", "h100-sxm", graph, config="tiny")


def _mlp_row(gpu_mlp, schedule, update_schedule=False, say=None) -> dict:
    """The tiny MLP's simulated 8xH100-NVLink row, its weight update relowered (`_mlp_relower`)."""
    lowered, program, _, programs = gpu_mlp
    return rows.simulated_row(
        program,
        clusters.get_cluster("8xH100-NVLink"),
        budget_s=1.0,
        lowered=lowered,
        relower=_mlp_relower(program.graph),
        programs=programs,
        schedule=schedule,
        update_schedule=update_schedule,
        say=say,
    )


def test_a_gpu_row_compiles_the_sharded_update_under_the_searched_options(gpu_mlp):
    """The weight update and the collective options are searched apart (the options on XLA's
    replicated program); the row also compiles the cheapest sharded update under the searched
    options (the chosen set, else the cheapest other distinct one), searches its own collectives'
    options on top (here the all-gather threshold, which the replicated program cannot have),
    costs each as compiled, records the cheapest beside each part's own gain, and takes it where
    it is the cheapest compiled program."""
    off = {schedule_options.SCHEDULER: False}
    no_gather_combining = {schedule_options.THRESHOLDS["all-gather"]: "0"}
    told: list[str] = []
    row = _mlp_row(
        gpu_mlp,
        schedule=[("latency-hiding scheduler", [off])],
        update_schedule=[("all-gather combine threshold", [no_gather_combining])],
        say=told.append,
    )
    # Each option set compiled is told (the bench logs it): two on XLA's program, two sharded.
    assert len(told) == 4 and [line.startswith("sharded update") for line in told] == [False, False, True, True]
    disco, parts, searched = row["strategies"][rows.DISCO], row["parts"], row["schedule_options"]
    off_program = searched["candidates"][1]
    assert off_program["options"] == {schedule_options.SCHEDULER: "False"} and off_program["same_program_as"] is None
    combined = searched["combined"]
    assert combined is not None and combined["options_chosen"] == (searched["options"] != {})
    # The cheapest sharded update ranked, compiled again under the options, then with the
    # all-gather threshold on top: two programs of its own, the cheaper taken.
    updates = [r for r in disco["ranked"] if r["program"]["enacted_by"].startswith("relowered")]
    best = min((r for r in updates if r["compiled_us"] is not None), key=lambda r: r["compiled_us"])
    assert combined["update_compiled_us"] == best["compiled_us"] and combined["sharded_gradients"] > 0
    # The search starts from the cheaper of the update under the options and under XLA's defaults.
    under = combined["under_options_us"]
    assert under is not None and under != best["compiled_us"]
    start, gathered = combined["search"]["candidates"]
    base = {schedule_options.SCHEDULER: "False"} if under < best["compiled_us"] else {}
    assert start["options"] == base and start["compiled_us"] == min(under, best["compiled_us"])
    assert gathered["options"] == {**base, **no_gather_combining}
    assert gathered["same_program_as"] is None and gathered["fingerprint"] != start["fingerprint"]
    cheaper = min((start, gathered), key=lambda c: c["compiled_us"])
    assert combined["options"] == cheaper["options"] == combined["program"]["compiler_options"]
    assert combined["compiled_us"] == cheaper["compiled_us"] and combined["fingerprint"] == cheaper["fingerprint"]
    assert combined["program"]["status"] in _compile.ENACTED
    if combined["options"]:  # a program of its own
        assert combined["same_program_as"] is None
        assert combined["fingerprint"] not in {c["fingerprint"] for c in searched["candidates"]}
    else:  # the ranked sharded update itself
        assert combined["same_program_as"] == best["label"]
    xla_us = row["time_us"]["JAX_default"]
    assert parts["combined"] == pytest.approx(xla_us / combined["compiled_us"])
    assert parts["collective_options"] == pytest.approx(xla_us / searched["chosen"]["compiled_us"])
    # disco-jax's program: the cheapest compiled of the ranked one, the options' and the combination.
    figures = [disco["ranked"][0]["compiled_us"], searched["chosen"]["compiled_us"], combined["compiled_us"]]
    assert row["time_us"][rows.DISCO] == min(figures) <= xla_us
    if min(figures) == combined["compiled_us"]:
        assert disco["chosen"] == combined["label"] and disco["sharded_gradients"] == combined["sharded_gradients"]
    assert row["weight_update"]["sharded_gradients"] == disco["sharded_gradients"]
    json.dumps(row)


def _headroom_row(model: str, disco_us: float, bound_us: float, searched_us: float | None = None) -> dict:
    """A simulated row with best baseline 100 us and FO 90 us: 10 us of headroom."""
    disco = {"simulated": {"iteration_us": disco_us}}
    if searched_us is not None:
        disco["searched"] = {"iteration_us": searched_us}
    return {
        "model": model,
        "best_baseline_us": 100.0,
        "fo_us": 90.0,
        "disco_us": disco_us,
        "headroom_captured": rows.headroom_share(100.0, 90.0, disco_us),
        "dependency_bound_us": bound_us,
        "strategies": {rows.DISCO: disco},
    }


def test_rows_short_of_the_headroom_target_are_told_apart_by_what_limits_them():
    """Enactment first (the searched plan captured the target, its compiled program did not), then
    kernels (the plan's dependency bound allows less), else order (the bound allows it)."""
    enacted = _headroom_row("resnet50", 97.0, 90.0, searched_us=91.0)
    kernels = _headroom_row("mlp", 97.0, 95.0, searched_us=96.0)
    order = _headroom_row("bert", 96.0, 90.0)
    reached = _headroom_row("vgg19", 91.0, 90.0)
    assert headroom.limit(enacted) == (headroom.ENACTMENT, pytest.approx(0.3), pytest.approx(0.9))
    assert headroom.limit(kernels) == (headroom.KERNELS, pytest.approx(0.3), pytest.approx(0.5))
    assert headroom.limit(order) == (headroom.ORDER, pytest.approx(0.4), pytest.approx(1.0))
    assert headroom.limit(reached) is None
    text = headroom.limits_text([enacted, kernels, order, reached])
    assert "resnet50 30% (90% as searched)" in text and "mlp 30% (50% allowed)" in text
    assert "bert 40% (100% allowed)" in text and "vgg19" not in text
    assert headroom.limits_text([reached]).startswith("Every row captures 85%")


def test_a_sharded_row_without_its_programs_simulation_reads_as_not_simulated(tmp_path):
    """Rows written before disco-jax's simulated figure named its program held, for a sharded
    weight update, the replicated program's simulation: read back as none (Table 2 leaves it
    out). Rows that name it, and replicated ones, keep theirs."""
    sim = {"iteration_us": 1000.0, "compute_us": 800.0, "comm_us": 300.0}
    cases = {
        "old": {"weight_update": "sharded", "simulated": sim},
        "new": {"weight_update": "sharded", "simulated": sim, "simulated_by": "search phase"},
        "replicated": {"weight_update": "replicated", "simulated": sim},
    }
    (tmp_path / "rows").mkdir()
    for name, disco in cases.items():
        row = {"format": rows.ROW_FORMAT, "style": "jit", "model": name, "strategies": {rows.DISCO: disco}}
        (tmp_path / "rows" / f"{name}.json").write_text(json.dumps(row))
    read = [report_measured.readable(r) for r in rows.load_rows(tmp_path)]
    loaded = {r["model"]: r["strategies"][rows.DISCO]["simulated"] for r in read}
    assert loaded == {"old": None, "new": sim, "replicated": sim}
