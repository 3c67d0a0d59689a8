"""Prefetch across loop iterations (`sharding.prefetch`, `Layout.prefetch`): a scan that reads a
sharded stacked parameter's layer i gathered is rotated to carry the gathered layer and gather
layer i+1 (i-1 in a reversed scan) one iteration early. On 8 CPU devices: the rotated step computes
what the unmodified one computes, the compiled loops carry the gathered layer (the plan was
enacted), and the plan records and cites it."""

import dataclasses
import json
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_fsdp_at_use import scanned_gpt_at_use

from disco_jax import backends, zoo
from disco_jax.sharding import choice, prefetch, rules, update
from disco_jax.sharding.layouts import Layout
from disco_jax.sharding.params import Parameter

NO_STATICS = types.SimpleNamespace(static_argnums=(), static_argnames=())


def _while_tuples(text: str) -> list[str]:
    """The carried tuple's type of each `while` of a compiled module."""
    return [m.group(1) for m in re.finditer(r"= \((.*?)\) while\(", text)]


def _loss_and_grad(w, x):
    def body(h, layer):
        return jnp.tanh(h @ layer), None

    def loss(w):
        h, _ = jax.lax.scan(body, x, w)
        return (h * h).sum()

    return jax.value_and_grad(loss)(w)


def test_a_rotated_scan_and_its_gradient_compute_the_same_and_carry_the_gathered_layer():
    mesh = zoo.data_mesh()
    spec = P(None, None, "data")  # each layer split on its columns, the layer axis whole
    layout = Layout(
        mesh,
        "data",
        8,
        inputs={0: spec},
        outputs={},
        paths={0: "w"},
        parameters={0: Parameter((), spec, 0, "w")},
        stacked=frozenset({0}),
        at_use=True,
        prefetch=True,
    )
    rng = np.random.default_rng(0)
    w = jax.device_put(rng.standard_normal((4, 16, 16), np.float32) / 4, NamedSharding(mesh, spec))
    x = jax.device_put(rng.standard_normal((8, 16), np.float32), NamedSharding(mesh, P("data")))
    loops = prefetch.rotated_loops(_loss_and_grad, layout, w, x)
    assert [(loop["length"], loop["reverse"], loop["leaves"]) for loop in loops] == [(4, False, [0]), (4, True, [0])]
    original = jax.jit(_loss_and_grad)
    rotated = jax.jit(prefetch.rotating(_loss_and_grad, NO_STATICS, layout))
    (loss, grad), (loss_r, grad_r) = original(w, x), rotated(w, x)
    np.testing.assert_allclose(loss_r, loss, rtol=1e-6)
    np.testing.assert_allclose(grad_r, grad, rtol=1e-5, atol=1e-6)
    # Enacted: both loops carry one whole gathered layer (f32[16,16]); the original's carry none.
    assert all("f32[16,16]" in t for t in _while_tuples(rotated.lower(w, x).compile().as_text()))
    assert not any("f32[16,16]" in t for t in _while_tuples(original.lower(w, x).compile().as_text()))
    assert "loop_rotation" in update.cited_rules(layout)
    # The loops' per-example carries split over the batch only (no rotation): the same values.
    split = dataclasses.replace(layout, prefetch=False, split_carries=True)
    assert prefetch.rotated_loops(_loss_and_grad, split, w, x) == []
    loss_s, grad_s = jax.jit(prefetch.rotating(_loss_and_grad, NO_STATICS, split))(w, x)
    np.testing.assert_allclose(loss_s, loss, rtol=1e-6)
    np.testing.assert_allclose(grad_s, grad, rtol=1e-5, atol=1e-6)


def test_prefetch_on_a_scanned_gpt_computes_what_the_unmodified_step_computes_and_is_recorded():
    d = 32
    step, args, program, layout, held = scanned_gpt_at_use(num_layers=3, d_model=d)
    leaves = layout.all_leaves()
    rotated = choice.candidate(step, program, layout, leaves, args, {}, backends.CPU, held, at_use=True, prefetch=True)
    assert rotated.layout.prefetch and "next layer prefetched" in rotated.label
    # Outputs (the loss, the new parameters and optimizer state, two steps of it) within the check.
    check = update.check_outputs(program, rotated.step)
    assert check.within_tolerance, check
    # Enacted: the forward and the backward loop each carry a gathered layer of the attention's
    # output kernel (d_model x d_model, whole), which the at-use program's loops do not.
    whole = f"f32[{d},{d}]"
    tuples = _while_tuples(rotated.step.default_compiled.as_text())
    assert len(tuples) == 2 and all(whole in t for t in tuples), tuples
    sub = layout.subset(leaves, at_use=True)
    plain = update.relowered(step, program, sub, args, {}, backends.CPU)
    assert not any(whole in t for t in _while_tuples(plain.default_compiled.as_text()))
    # Recorded: the layout (what a stored decision holds) and the candidate's record, through JSON.
    decided = json.loads(json.dumps(rotated.layout.to_json()))
    assert decided["prefetch"] and decided["at_use"]
    record = json.loads(json.dumps(rotated.to_json(layout, held, None)))
    assert record["prefetch"] and record["at_use"] and "next layer prefetched" in record["label"]
    assert rules.require("loop_rotation").name in update.cited_rules(rotated.layout)
    # The search's candidate before it (`choice.parameter_candidates`): the loops' state split only.
    split_only = {"at_use": True, "split_carries": True}
    split = choice.candidate(step, program, layout, leaves, args, {}, backends.CPU, held, **split_only)
    assert split.layout.gathering() == {
        "regather": False,
        "at_use": True,
        "prefetch": False,
        "split_carries": True,
        "remat": "",
    }
    assert "loop state split over the batch" in split.label and "prefetched" not in split.label
    assert split.layout.to_json()["split_carries"] and "prefetch" not in split.layout.to_json()
    assert layout.subset(leaves, **rotated.layout.gathering()).gathering() == rotated.layout.gathering()
    check = update.check_outputs(program, split.step)
    assert check.within_tolerance, check
    # Enacted: at use, XLA's partitioner splits the forward loop's stacked activations (16
    # sequences of 8 tokens, 3 layers) on their features (96 / 8); split, they are on the batch.
    split_tuples = _while_tuples(split.step.default_compiled.as_text())
    plain_tuples = _while_tuples(plain.default_compiled.as_text())
    assert "f32[3,16,8,12]" in plain_tuples[0] and "f32[3,16,8,12]" not in split_tuples[0]
    assert "f32[3,2,8,96]" in split_tuples[0], split_tuples
