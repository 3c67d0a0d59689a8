"""`disco-jax demo`'s table says what ran: the weight update, whether a fusion/bucket plan was
applied, the simulated step of XLA's replicated program and of the program that ran, and what
its CPU figures say about GPUs (no step is run here: the table is drawn from results)."""

import types

from disco_jax import _demo


def _report(mode, applied, candidates=()):
    update = {"mode": mode, "reason": "sharded over 'data': measured faster", "candidates": list(candidates)}
    return types.SimpleNamespace(weight_update=update, applied=applied)


def test_a_sharded_update_with_xlas_fusions_names_both_and_simulates_what_ran():
    plan = {"simulated": {"default": {"iteration_us": 20000.0}, "plan": {"iteration_us": 20000.0}}}
    ran = _demo.ran(_report("sharded", False, [{"simulated_us": 26710.0}, {"simulated_us": 20000.0}]), plan)
    assert ran["weight_update"] == "sharded" and not ran["fusion_plan_applied"]
    assert ran["sim_jax_us"] == 26710.0  # the replicated program, as the choice simulated it
    assert ran["sim_ran_us"] == 20000.0  # the sharded program that ran


def test_a_replicated_step_with_a_plan_simulates_the_plan():
    plan = {"simulated": {"default": {"iteration_us": 30000.0}, "plan": {"iteration_us": 25000.0}}}
    ran = _demo.ran(_report("replicated", True), plan)
    assert (ran["sim_jax_us"], ran["sim_ran_us"], ran["fusion_plan_applied"]) == (30000.0, 25000.0, True)


def test_the_table_names_the_parts_that_ran_and_what_a_gpu_would_see(capsys):
    row = {
        "model": "transformer",
        "phase": "enact",
        "search_ran": False,
        "applied": False,
        "reason": "XLA's plan kept",
        "measured_default_us": 40000.0,
        "measured_plan_us": 28000.0,
        "measured_ratio": 0.7,
        "default_counts": {"all-reduce": 1, "fusion": 50},
        "plan_counts": {"all-reduce": 1, "fusion": 50},
        "outputs_bitwise_equal": False,
        "outputs_within_tolerance": True,
        "max_abs_error": 1e-7,
        **_demo.ran(
            _report("sharded", False, [{"simulated_us": 26710.0}]),
            {"simulated": {"default": {"iteration_us": 20000.0}, "plan": {"iteration_us": 20000.0}}},
        ),
    }
    _demo.print_table([row])
    out = capsys.readouterr().out
    assert "sharded" in out and "XLA's kept" in out and "26.71" in out and "20.00" in out
    assert "weight update sharded" in out and "XLA's fusions and buckets kept" in out
    assert "On a GPU" in out
