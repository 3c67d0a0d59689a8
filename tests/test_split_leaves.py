"""Leaves with no dimension the data axis divides, split over several dimensions
(`sharding.leaves.spec_for`, `factored_mesh`, `find_layout(split=True)`): an MLP of width 12 on 8
CPU devices, whose 12 x 12 and 12 x 4 kernels (and their Adam moments) 8 divides only as a whole.
They are the memory search's last resort: under a limit that sharding everything else does not
meet, they are sharded too (state and parameters), come back split between steps, train to the
same values and are recalled from the stored plan. With Explicit mesh axes, and where the size is
not divisible (the biases), they stay whole with the reason."""

import re

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_sharded_update import FAST, MLP, flax_adam_step, train
from test_zero3 import footprints, leaf, searched_under

from disco_jax import optimize_distributed
from disco_jax.sharding import leaves, update

SPLIT = P(("data.0", "data.1"), "data.2")  # 8 devices as 2 x 2 x 2: 4 ways on rows, 2 on columns
KERNELS = ("[0][0]['params']['Dense_1']['kernel']", "[0][0]['params']['Dense_2']['kernel']")


def narrow_adam_step(axis_type=AxisType.Auto):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    return flax_adam_step(MLP(width=12), features=8, mesh=mesh, steps=3)


def layout_of(step, args, split=True):
    return update.find_layout(step, args, {}, args, {}, [x.sharding for x in jax.tree.leaves(args)], split=split)[0]


def test_each_prime_factor_goes_to_a_dimension_it_divides():
    factors = (("d.0", 2), ("d.1", 2), ("d.2", 2))
    assert leaves.spec_for((64, 12), "d", 8, factors) == P("d")  # one dimension divisible: as before
    assert leaves.spec_for((12, 6), "d", 8, factors) == P(("d.0", "d.1"), "d.2")
    assert leaves.spec_for((1500, 1500), "d", 8, factors) == P(("d.0", "d.1"), "d.2")  # RNNLM's kernels
    assert leaves.spec_for((2, 3, 4), "d", 8, factors) == P("d.0", None, ("d.1", "d.2"))
    assert leaves.spec_for((12,), "d", 8, factors) is None  # 8 does not divide 12: not evenly
    assert leaves.spec_for((12, 6), "d", 8) is None  # no factors (Explicit axes): whole
    assert leaves.spec_for((10, 3), "d", 6, (("d.0", 2), ("d.1", 3))) == P("d.0", "d.1")
    assert leaves.prime_factors(12) == [2, 2, 3] and leaves.prime_factors(7) == [7]


def test_the_factored_mesh_is_the_same_devices_in_the_same_order():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    split = leaves.factored_mesh(mesh, "data")
    assert split.axis_names == ("data.0", "data.1", "data.2") and dict(split.shape) == {
        f"data.{k}": 2 for k in range(3)
    }
    assert list(split.devices.flat) == list(mesh.devices.flat)
    assert leaves.factored_mesh(jax.make_mesh((8,), ("data",)), "data") is None  # Explicit axes
    assert leaves.factored_mesh(jax.make_mesh((7,), ("data",), axis_types=(AxisType.Auto,)), "data") is None


def test_kernels_8_does_not_divide_on_any_dimension_are_split_over_two_and_biases_stay_whole():
    step, params, opt_state, batches = narrow_adam_step()
    layout = layout_of(step, (params, opt_state, *batches[0]))
    specs = {layout.paths[i]: spec for i, spec in layout.inputs.items()}
    for kernel in KERNELS:
        moment = kernel.replace("[0][0]", "[0][1][0].mu")
        assert specs[moment] == SPLIT
        assert layout.parameters[layout.all_paths()[kernel]].spec == SPLIT
    assert specs["[0][1][0].mu['params']['Dense_0']['kernel']"] == P("data")  # 8 x 12: rows divide
    # A program with a split leaf runs on the factored mesh only ("data" as its factors), one without on the user's.
    assert layout.step_mesh is layout.split_mesh
    assert layout.sharding(P("data")) == NamedSharding(layout.split_mesh, P(("data.0", "data.1", "data.2")))
    first = layout.subset(layout.leaves_for({"[0][0]['params']['Dense_0']['kernel']": "params"}))
    assert first.step_mesh is layout.mesh and first.sharding(P("data")) == NamedSharding(layout.mesh, P("data"))
    biases = {p for p in layout.kept_whole if p.endswith("['bias']")}
    assert len(biases) == 9 and set(layout.kept_whole) == biases
    assert all("neither a dimension nor the size divisible" in why for why in layout.kept_whole.values())

    # Not asked to split (what every candidate but the last resort uses): they stay whole, and the reason says when.
    narrow = layout_of(step, (params, opt_state, *batches[0]), split=False)
    assert narrow.split_mesh is None and KERNELS[0] in narrow.kept_whole
    assert "only where nothing else fits a memory limit" in narrow.kept_whole[KERNELS[0]]

    # With Explicit axes JAX takes one mesh per step: the same kernels stay whole, and the reason says so.
    step, params, opt_state, batches = narrow_adam_step(AxisType.Explicit)
    layout = layout_of(step, (params, opt_state, *batches[0]))
    assert layout.split_mesh is None and all(spec == P("data") for spec in layout.inputs.values())
    assert KERNELS[0] in layout.kept_whole and "Explicit" in layout.kept_whole[KERNELS[0]]


def test_under_a_limit_only_splitting_meets_the_split_leaves_are_searched_stored_and_reused(tmp_path):
    step, params, opt_state, batches = narrow_adam_step()
    args = (params, opt_state, *batches[0])
    _, (_, _, everything) = footprints(step, args)  # every leaf with a dimension 8 divides sharded
    wide, (_, _, split) = footprints(step, args, split=True)
    assert split < everything
    limit = (split + everything) // 2

    run, new_params, new_state, info, reference = searched_under(limit, step, params, opt_state, batches, tmp_path)
    assert info["leaves"].keys() == wide.subset(wide.all_leaves()).to_json()["leaves"].keys()
    assert "split over several dimensions" in info["reason"]
    chosen = next(c for c in info["candidates"] if c["leaves"] == sorted(info["leaves"]))
    assert chosen["footprint_bytes"] <= limit
    for path in KERNELS:  # stored as JSON: the factors of a dimension as a list
        assert info["leaves"][path] == [["data.0", "data.1"], "data.2"]
        x = leaf((new_params, new_state), path)
        assert x.sharding.spec == SPLIT and x.addressable_shards[0].data.shape == (x.shape[0] // 4, x.shape[1] // 2)
    # The executable that runs takes their 4 x 2 blocks: 12 x 12 -> 3 x 6, 12 x 4 -> 3 x 2 (kernel and moments).
    entry = run.executable(new_params, new_state, *batches[0]).as_text().split("\nENTRY", 1)[1]
    shapes = re.findall(r"= (f32\[[\d,]*\])\S* parameter\(\d+\)", entry)
    assert shapes.count("f32[3,6]") == 3 and shapes.count("f32[3,2]") == 3, shapes

    enacting = optimize_distributed(search=False, plan_dir=tmp_path, memory_limit_bytes=limit, **FAST)(step)
    enacted_params, enacted_state, enacted = train(enacting, params, opt_state, batches)
    assert enacting.reports[0].weight_update["leaves"] == info["leaves"]
    assert leaf((enacted_params, enacted_state), KERNELS[0]).sharding.spec == SPLIT
    np.testing.assert_allclose(enacted, reference, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("wanted", ["state", "params"])
def test_split_leaves_compute_what_the_replicated_step_computes(wanted):
    step, params, opt_state, batches = narrow_adam_step()
    args = (params, opt_state, *batches[0])
    layout = layout_of(step, args)
    sub = layout.subset(layout.all_leaves(parameters=wanted == "params"))
    lowered, dynamic = update.relower(step, sub, args, {}, (args, {}), step.lower(*args).compile())
    got = lowered.compile()(*dynamic[0])
    want = step(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
