"""Rematerialization chosen by disco-jax (`sharding.remat`, `Layout.remat`): a differentiated
scan's residuals recomputed in its backward loop instead of stacked by its forward loop, applied
to the step after differentiation (the user wrote no `nn.remat`). On CPU devices: the rewritten
step computes what the unmodified one computes, its compiled forward loop stacks fewer arrays and
its footprint (XLA's memory analysis) is lower, and the memory choice takes it where FSDP at use
alone does not fit."""

import functools
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_fsdp_at_use import scanned_gpt_at_use

from disco_jax import backends
from disco_jax.sharding import choice, mesh_plan, operators, remat, update

NO_STATICS = types.SimpleNamespace(static_argnums=(), static_argnames=())


def _loss_and_grad(w, x):
    def body(h, layer):
        return jnp.tanh(jnp.sin(h @ layer) * 2.0 + h), None

    def loss(w):
        h, _ = jax.lax.scan(body, x, w)
        return (h * h).sum()

    return jax.value_and_grad(loss)(w)


def _forward_scan_outputs(fn, *args) -> int:
    """How many values the first forward (not reversed) scan of `fn`'s jaxpr outputs, nested jits inlined."""
    closed = remat._inlined(jax.make_jaxpr(fn)(*args).jaxpr, jax.make_jaxpr(fn)(*args).consts)
    return next(len(e.outvars) for e in closed.jaxpr.eqns if e.primitive.name == "scan" and not e.params["reverse"])


@pytest.mark.parametrize("policy", remat.POLICIES)
def test_a_rematerialized_scan_and_its_gradient_compute_the_same(policy):
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((4, 16, 16), np.float32) / 4)
    x = jnp.asarray(rng.standard_normal((8, 16), np.float32))
    rewritten = remat.rematerializing(_loss_and_grad, NO_STATICS, policy)
    expected, got = jax.jit(_loss_and_grad)(w, x), jax.jit(rewritten)(w, x)
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
    loops = remat.rematerialized_loops(_loss_and_grad, policy, w, x)
    assert [loop["length"] for loop in loops] == [4] and loops[0]["recomputed"] >= 1
    # The forward loop stacks its carry instead of the residuals it dropped: fewer outputs.
    assert _forward_scan_outputs(rewritten, w, x) < _forward_scan_outputs(_loss_and_grad, w, x)
    with pytest.raises(ValueError, match="unknown remat policy"):
        remat.rematerializing(_loss_and_grad, NO_STATICS, "everything")


@pytest.fixture(scope="module")
def unrematerialized_gpt():
    """A 3-layer scanned zoo GPT written without `nn.remat`, with Adam, captured on 8 CPU devices."""
    return scanned_gpt_at_use(remat="none", num_layers=3)


@pytest.fixture(scope="module")
def at_use_candidates(unrematerialized_gpt):
    """The GPT's FSDP-at-use candidates (`choice.candidate`), compiled once: label -> candidate;
    "at use", "split" (loops' state split) and each remat policy (with the split)."""
    step, args, program, layout, held = unrematerialized_gpt
    build = functools.partial(
        choice.candidate, step, program, layout, layout.all_leaves(), args, {}, backends.CPU, held, at_use=True
    )
    out = {"at use": build(), "split": build(split_carries=True)}
    out.update((policy, build(split_carries=True, remat=policy)) for policy in remat.POLICIES)
    return out


def _stacked_in_first_while(text: str, layers: int) -> int:
    """How many per-layer stacks (`f32[layers,...]`) the first compiled `while` carries."""
    first = re.search(r"= \((.*?)\) while\(", text).group(1)
    return len(re.findall(rf"f32\[{layers},[0-9,]*\]", first))


def test_the_gpt_rematerialized_at_use_computes_the_same_and_needs_less(unrematerialized_gpt, at_use_candidates):
    program = unrematerialized_gpt[2]
    kept = at_use_candidates["split"]
    stacked = _stacked_in_first_while(kept.step.default_compiled.as_text(), 3)
    peaks = {}
    for policy in remat.POLICIES:
        c = at_use_candidates[policy]
        assert c.layout.remat == policy and f"loops rematerialized ({policy})" in c.label
        assert c.layout.to_json()["remat"] == policy
        check = update.check_outputs(program, c.step)
        assert check.within_tolerance, check
        # Enacted: the compiled forward loop carries fewer per-layer stacks (the activations it no
        # longer keeps), and the executable needs less memory.
        assert _stacked_in_first_while(c.step.default_compiled.as_text(), 3) < stacked
        peaks[policy] = choice.footprint(c.memory)
        assert peaks[policy] < choice.footprint(kept.memory)
    assert peaks["full"] < peaks["dots"]  # "dots" keeps the dots' outputs too
    layout = unrematerialized_gpt[3]
    with pytest.raises(ValueError, match="prefetch is not rematerialized"):
        layout.subset(layout.all_leaves(), at_use=True, prefetch=True, remat="dots")
    with pytest.raises(ValueError, match="unknown remat policy"):
        layout.subset(layout.all_leaves(), at_use=True, remat="everything")


def test_the_memory_choice_rematerializes_where_fsdp_at_use_does_not_fit(unrematerialized_gpt, at_use_candidates):
    step, args, program, layout, held = unrematerialized_gpt
    at_use, dots = at_use_candidates["at use"], at_use_candidates["dots"]
    limit = (choice.footprint(at_use.memory) + choice.footprint(dots.memory)) // 2
    candidates = choice.parameter_candidates(step, program, layout, args, {}, backends.CPU, held, limit)
    fits = [c for c in candidates if choice.within(c, limit)]
    assert fits and all(c.layout.remat for c in fits), [c.label for c in candidates]
    assert fits[0].layout.remat == "dots"  # the policy that recomputes least, first
    # Measured, recorded, and chosen again from the records under another limit: the policy kept
    # (the replicated step is over the limit, so memory forces the choice whatever the timing).
    records = [
        choice.Candidate((), program, None, update.memory(program.default_compiled, held)).to_json(layout, held, limit)
    ]
    records += [{**c.to_json(layout, held, limit), **choice.measure(program, c.step, 5, "remat")} for c in fits[:1]]
    assert records[1]["remat"] == "dots" and records[1]["measured"]
    again = choice.rechoose({"mode": "replicated", "candidates": records, "leaves": {}}, limit)
    assert again["mode"] == "sharded" and again["remat"] == "dots" and again["forced"]


def test_the_two_axis_memory_search_rematerializes_where_no_plan_fits(unrematerialized_gpt, monkeypatch):
    step, _, program, _, _ = unrematerialized_gpt
    plain = operators.OperatorPlan(2, 4, {"blocks": "fsdp_tp", "Embed": "tp"})
    monkeypatch.setattr(mesh_plan, "memory_candidates", lambda found: [plain])
    said: list[str] = []
    ui = types.SimpleNamespace(say=said.append)
    assert mesh_plan.choose_for_memory(step, program, backends.CPU, 1, 4, 1, ui) is None
    peaks = {
        m.group(1): int(m.group(2)) for m in map(re.compile(r"layout: (.*): (\d+) bytes per device").match, said) if m
    }
    assert list(peaks) == [plain.label, *(f"{plain.label}, loops rematerialized ({p})" for p in remat.POLICIES)]
    full = peaks[f"{plain.label}, loops rematerialized (full)"]
    assert full < peaks[plain.label]
    chosen = mesh_plan.choose_for_memory(step, program, backends.CPU, (full + peaks[plain.label]) // 2, 4, 1, ui)
    assert chosen is not None, said[-1]
    _, info = chosen
    assert info["plan"]["remat"] in remat.POLICIES and info["check"]["within_tolerance"]
    assert mesh_plan.plan_from_json(info["plan"]).remat == info["plan"]["remat"]
