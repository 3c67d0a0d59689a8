"""Parameters and state sharded (ZeRO-3 / FSDP; `sharding.params`): the third choice per parameter
group of `weight_update="search"`, taken where a memory limit needs it. A Flax + Optax Adam step on 8
CPU devices under a limit below what sharding the optimizer state alone needs, above what sharding
everything needs: searched, stored, reused by a fresh decorator; the program that runs fits the limit
by XLA's memory analysis, all-gathers its parameters before the dots and reduce-scatters their
gradients, keeps parameters and state sharded between steps, and trains to the same losses."""

import re

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from test_sharded_update import FAST, flax_adam_step, train

from disco_jax import _api, _plan, _search, backends, optimize_distributed
from disco_jax._compile import capture
from disco_jax._console import Ui
from disco_jax.sharding import choice, rules, update

from _steps import make_step


def footprints(step, args, split=False):
    """Per-device footprints (XLA's memory analysis) of the replicated step, every group's state
    sharded, and every group's parameters and state sharded (with `split`, leaves no dimension of
    which 8 divides split over several: `find_layout(split=True)`)."""
    default = step.lower(*args).compile()
    shardings = jax.tree.leaves(default.input_shardings)
    layout, _ = update.find_layout(step, args, {}, args, {}, shardings, split=split)
    out = [choice.footprint(update.memory(default, {}))]
    for leaves in (layout.all_leaves(parameters=False), layout.all_leaves()):
        lowered, dynamic = update.relower(step, layout.subset(leaves), args, {}, (args, {}), default)
        out.append(choice.footprint(update.memory(capture(lowered, backends.CPU, *dynamic).default_compiled, {})))
    return layout, out


def searched_under(limit, step, params, opt_state, batches, plan_dir):
    """`step` searched under a per-device memory `limit` and trained on `batches`: (the decorated
    step, its new parameters and state, its weight-update record, the unmodified step's losses).
    Its losses and parameters match the unmodified step's, and it shards parameters."""
    reference_params, _, reference = train(step, params, opt_state, batches)
    run = optimize_distributed(search=True, plan_dir=plan_dir, memory_limit_bytes=limit, **FAST)(step)
    new_params, new_state, losses = train(run, params, opt_state, batches)
    np.testing.assert_allclose(losses, reference, rtol=1e-5, atol=1e-7)
    for a, b in zip(jax.tree.leaves(new_params), jax.tree.leaves(reference_params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    info = run.reports[0].weight_update
    assert info["mode"] == "sharded" and info["parameters"], info["reason"]
    return run, new_params, new_state, info, reference


def leaf(tree, path: str):
    """The leaf of `(params, opt_state)`-shaped `tree` at a `Layout` path (`[0][0]['params']...`)."""
    found = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path((tree, {}))[0]}
    return found[path]


def gathered_before_dots(text: str) -> list[str]:
    """The all-gathers of a compiled module whose result a dot (a fusion of one) reads (a
    kernel's; a bias's is read by the add after the dot)."""
    names = re.findall(r"%(\S+) = \S+ all-gather\(", text)
    return [n for n in names if re.search(rf"fusion\([^)]*%{re.escape(n)}\b[^\n]*dot_general", text)]


def test_layout_names_each_groups_parameter_and_keeps_indivisible_leaves_replicated_with_the_reason():
    step, params, opt_state, batches = flax_adam_step()
    args = (params, opt_state, *batches[0])
    layout, _ = update.find_layout(step, args, {}, args, {}, [x.sharding for x in jax.tree.leaves(args)])
    names = layout.group_names()
    assert set(names) == {
        f"[0][0]['params']['{layer}']['{part}']"
        for layer, part in [("Dense_0", "kernel"), ("Dense_0", "bias"), ("Dense_1", "kernel"), ("Dense_1", "bias")]
    } | {"[0][0]['params']['Dense_2']['kernel']"}
    assert layout.layers()["[0][0]['params']['Dense_0']"] == (
        "[0][0]['params']['Dense_0']['bias']",
        "[0][0]['params']['Dense_0']['kernel']",
    )
    # Dense_2's 4-wide bias and its moments: no dimension 8 divides; JAX refuses uneven jit shardings.
    assert set(layout.kept_whole) == {
        "[0][0]['params']['Dense_2']['bias']",
        "[0][1][0].mu['params']['Dense_2']['bias']",
        "[0][1][0].nu['params']['Dense_2']['bias']",
    }
    assert all("divide evenly" in why for why in layout.kept_whole.values())
    kernel = "[0][0]['params']['Dense_1']['kernel']"
    sub = layout.subset(layout.leaves_for({kernel: "params", "[0][0]['params']['Dense_0']['kernel']": "state"}))
    assert sub.choices() == {kernel: "params", "[0][0]['params']['Dense_0']['kernel']": "state"}
    assert [sub.paths[i] for i in sub.gathered] == [kernel]
    assert len(sub.outputs) == 5  # the kernel's new value and the four moments
    with pytest.raises(ValueError, match="without its state"):
        layout.subset([next(iter(layout.parameters))])
    with pytest.raises(ValueError, match="no parameter group"):
        layout.leaves_for({"nope": "params"})


def test_a_limit_only_parameters_and_state_sharded_meet_is_searched_stored_and_reused(tmp_path, monkeypatch):
    step, params, opt_state, batches = flax_adam_step()
    layout, (replicated, state_only, everything) = footprints(step, (params, opt_state, *batches[0]))
    assert replicated > state_only > everything
    limit = (state_only + everything) // 2  # sharding the state is not enough; sharding everything is

    run, new_params, new_state, info, reference = searched_under(limit, step, params, opt_state, batches, tmp_path)
    chosen = next(c for c in info["candidates"] if c["leaves"] == sorted(info["leaves"]))
    assert chosen["footprint_bytes"] <= limit and "params" in chosen["choices"].values()
    assert all(c["footprint_bytes"] > limit for c in info["candidates"] if "params" not in c["choices"].values())
    # The plan cites the proven rules the sharding rests on; the hook applied its own.
    assert {"all_gather_before_use", "sharded_parameter_gradient", "sharded_optimizer_state"} <= set(info["rules"])
    assert all(rules.require(name) for name in info["rules"])
    applied = {a["rule"] for a in run.reports[-1].rules_applied}
    assert {"own_block_of_all_reduce", "own_block_of_all_gather"} <= applied

    # Parameters and their state come back sharded; leaves the choice left alone come back whole.
    sharded_paths = set(info["leaves"])
    state = (new_params, new_state)
    for path in layout.all_paths():
        x = leaf(state, path)
        if path in sharded_paths:
            assert x.sharding.spec == P("data") and x.addressable_shards[0].data.shape[0] == x.shape[0] // 8
        else:
            assert x.sharding.is_fully_replicated

    # The program that runs is the stored choice: it fits (XLA's memory analysis, per device), holds
    # the all-gathers before the dots and the reduce-scatter of the gradients, and later calls
    # reach it directly: its outputs are sharded as its inputs, no call reshards again.
    steady = run.executable(new_params, new_state, *batches[0])
    assert steady is run._last.run and not isinstance(steady, update.Resharding)
    assert choice.footprint(update.memory(steady, {})) <= limit
    text = steady.as_text()
    kernels = [p for p in info["parameters"] if p.endswith("['kernel']")]
    assert kernels and len(gathered_before_dots(text)) >= len(kernels)
    assert update.collectives(text)["reduce-scatter"] >= 1
    n = len(jax.tree.leaves((params, opt_state)))
    for i, o in zip(jax.tree.leaves(steady.input_shardings)[:n], jax.tree.leaves(steady.output_shardings)[:n]):
        assert i.is_equivalent_to(o, 2)
    monkeypatch.setattr(update.Layout, "reshard", lambda *a: pytest.fail("resharded"))
    monkeypatch.setattr(_api, "prepare", lambda *a, **k: pytest.fail("prepared again"))
    again = run(new_params, new_state, *batches[1])
    assert leaf((again[0], again[1]), info["parameters"][0]).sharding.spec == P("data")
    monkeypatch.undo()

    # A fresh decorator enacts the stored decision without measuring anything.
    monkeypatch.setattr(choice, "time_candidate", lambda *a: pytest.fail("measured in the enact phase"))
    enacting = optimize_distributed(search=False, plan_dir=tmp_path, memory_limit_bytes=limit, **FAST)(step)
    enacted_params, enacted_state, enacted = train(enacting, params, opt_state, batches)
    recalled = enacting.reports[0].weight_update
    assert recalled["leaves"] == info["leaves"] and recalled["parameters"] == info["parameters"]
    assert enacting.reports[0].fingerprint == info["program"]
    assert set(recalled["rules"]) == set(info["rules"])
    for path in info["parameters"]:
        assert leaf((enacted_params, enacted_state), path).sharding.spec == P("data")
    np.testing.assert_allclose(enacted, reference, rtol=1e-5, atol=1e-7)


def test_a_memory_limit_on_a_shard_map_step_says_what_to_do_instead():
    step, args = make_step("shard_map", optimizer=optax.adam(1e-2))
    program = capture(step.lower(*args), backends.CPU, args, {})
    with pytest.warns(UserWarning, match="shard_map step.*psum_scatter.*jax.jit and NamedSharding"):
        chosen, layout, info = choice.choose(
            step, program, args, {}, backends.CPU, None, 1, 4, Ui(False), _search.SearchConfig()
        )
    assert chosen is program and layout is None and info["mode"] == "replicated"
    assert "cannot shard its parameters or optimizer state" in info["reason"]


def test_nothing_fitting_warns_with_the_smallest_peak_found():
    step, params, opt_state, batches = flax_adam_step()
    args = (params, opt_state, *batches[0])
    layout, _ = update.find_layout(step, args, {}, args, {}, [x.sharding for x in jax.tree.leaves(args)])
    program = capture(step.lower(*args), backends.CPU, args, {})
    held = update.held_leaves(program)
    candidates = [choice.Candidate((), program, None, update.memory(program.default_compiled, held))]
    candidates.append(choice.candidate(step, program, layout, layout.all_leaves(), args, {}, backends.CPU, held))
    smallest = choice.footprint(candidates[1].memory)
    with pytest.warns(UserWarning, match=f"smallest per-device peak found is {smallest} bytes"):
        assert choice.preferred_by_simulation(candidates, 1000) == [candidates[1]]


def test_parameters_gathered_again_for_each_use_compute_the_same_and_are_recalled(tmp_path):
    """The re-gathered update (`Layout.regather`, `sharding.regather` at the hook of that program
    only): each reader of a gathered parameter beyond the first gets its own all-gather, the
    outputs stay bitwise equal, `parameter_candidates` tries it when nothing else fits, and a
    stored decision brings it back (with the rule) in the enact phase."""
    step, params, opt_state, batches = flax_adam_step()
    args = (params, opt_state, *batches[0])
    layout, _ = update.find_layout(step, args, {}, args, {}, [x.sharding for x in jax.tree.leaves(args)])
    program = capture(step.lower(*args), backends.CPU, args, {})
    held = update.held_leaves(program)
    once = choice.candidate(step, program, layout, layout.all_leaves(), args, {}, backends.CPU, held)
    again = choice.candidate(step, program, layout, layout.all_leaves(), args, {}, backends.CPU, held, regather=True)
    applied = lambda p: {a["rule"] for a in p.program.rules_applied}  # noqa: E731
    assert "all_gather_before_use" in applied(again.step) and "all_gather_before_use" not in applied(once.step)
    gathers = lambda p: update.collectives(p.default_compiled.as_text())["all-gather"]  # noqa: E731
    assert gathers(again.step) > gathers(once.step)
    assert update.check_outputs(program, again.step).bitwise_equal
    assert "gathered again for each use" in again.label
    assert again.to_json(layout, held, None)["regather"] and not once.to_json(layout, held, None)["regather"]

    tried = choice.parameter_candidates(step, program, layout, args, {}, backends.CPU, held, 1)
    assert tried[-1].layout.regather and not any(c.layout.regather for c in tried[:-1])

    info = {**again.layout.to_json(), "mode": "sharded", "program": again.step.graph.fingerprint}
    _plan.save_plan(choice.decision_plan(program.graph, program.machine, info), tmp_path)
    recalled, recalled_layout, recalled_info = choice.recall(step, program, args, {}, backends.CPU, str(tmp_path))
    assert recalled_layout.regather and recalled_info["regather"]
    assert recalled.graph.fingerprint == again.step.graph.fingerprint and "all_gather_before_use" in applied(recalled)
