"""The proven sharding rules applied at the hook (`disco_jax.sharding.apply`, XLA:CPU): an
all-reduce every device reads only as its own block becomes a reduce-scatter, the step's
output all-gathers are grouped, outputs stay bitwise what the all-reduce computed, a value read
otherwise is left alone, an unproven rule is never applied, and plans and reports say which rule
applied where (a plan's buckets: tests/test_sharded_update.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_sharded_update import flax_adam_step

from disco_jax import _capture, _compile, backends
from disco_jax.cost import sharded
from disco_jax.cost.allreduce import transfer_bytes
from disco_jax.sharding import apply, rules, update


def _psum_then_slice(read_whole=False, scale=False, shift=0):
    """A shard_map step: psum of a [16, 4] block, then each device's rows [2i, 2i+2) of the sum
    (of half the sum with `scale`; of the next device's rows with `shift`), and the whole sum
    reduced too with `read_whole`."""
    mesh = jax.make_mesh((8,), ("data",))

    def body(x):
        total = jax.lax.psum(x, "data")
        read = total * 0.5 if scale else total
        i = (jax.lax.axis_index("data") + shift) % 8
        block = jax.lax.dynamic_slice_in_dim(read, i * 2, 2, axis=0)
        return (block, jnp.sum(total)) if read_whole else block

    out_specs = (P("data"), P()) if read_whole else P("data")
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=out_specs))
    x = jax.device_put(jax.random.normal(jax.random.PRNGKey(0), (128, 4)), NamedSharding(mesh, P("data")))
    return step, x


def _compiled_with_rules(step, x):
    lowered = step.lower(x)
    program, compiled = _compile.capture_program(lowered, backends.CPU)
    return program, compiled, lowered.compile()


@pytest.mark.parametrize("scale", [False, True], ids=["slice", "elementwise-then-slice"])
def test_an_all_reduce_read_as_each_devices_block_becomes_a_reduce_scatter(scale):
    step, x = _psum_then_slice(scale=scale)
    program, compiled, plain = _compiled_with_rules(step, x)
    counts = update.collectives(compiled.as_text())
    assert counts["reduce-scatter"] == 1 and counts["all-reduce"] == 0
    assert update.collectives(plain.as_text())["all-reduce"] == 1
    applied = {a["rule"]: a for a in program.rules_applied}
    assert applied["own_block_of_all_reduce"]["result"].startswith("disco_reduce-scatter")
    assert ("own_block_through_elementwise2" in applied) == scale  # x * 0.5: a binary op
    # The reduce-scatter sums in the all-reduce's order on XLA:CPU: bitwise the same block.
    np.testing.assert_array_equal(np.asarray(compiled(x)), np.asarray(plain(x)))


@pytest.mark.parametrize("variant", [dict(read_whole=True), dict(shift=1)], ids=["read-whole", "another-block"])
def test_an_all_reduce_read_otherwise_is_left_alone(variant):
    step, x = _psum_then_slice(**variant)
    program, compiled, _ = _compiled_with_rules(step, x)
    assert program.rules_applied == ()
    counts = update.collectives(compiled.as_text())
    assert counts["reduce-scatter"] == 0 and counts["all-reduce"] == 1
    text = _capture.capture(step.lower(x))[0]
    assert apply.apply_rules(text).text == text


def test_a_rule_that_require_refuses_is_never_applied(monkeypatch):
    step, x = _psum_then_slice()
    text = _capture.capture(step.lower(x))[0]
    assert apply.apply_rules(text).applications
    refused = apply.REDUCE_SCATTER_RULE
    real = rules.require

    def require(name, timeout_s=5.0):
        if name == refused:
            raise rules.RuleNotProven(f"rule {name}: proof unknown")
        return real(name, timeout_s)

    monkeypatch.setattr(rules, "require", require)
    monkeypatch.setattr(apply, "proven", functools.cache(apply.proven.__wrapped__))
    assert refused not in apply.proven()
    assert apply.apply_rules(text).text == text
    assert not backends.CPU.forms_reduce_scatter


@pytest.fixture(scope="module")
def sharded_adam():
    """The Flax Adam step with its state sharded: (lowered sharded program, its arguments)."""
    step, params, opt_state, batches = flax_adam_step()
    args = (params, opt_state, *batches[0])
    default = step.lower(*args).compile()
    layout, _ = update.find_layout(step, args, {}, args, {}, jax.tree.leaves(default.input_shardings))
    lowered, (sharded_args, _) = update.relower(step, layout, args, {}, (args, {}), default)
    return lowered, sharded_args


def test_the_sharded_adam_step_reduce_scatters_once_and_gathers_once(sharded_adam):
    lowered, args = sharded_adam
    program, compiled = _compile.capture_program(lowered, backends.CPU)
    graph = program.graph
    counts = update.collectives(compiled.as_text())
    # Five gradients are read as blocks (Dense_2's 4-wide bias and the loss are not split).
    assert counts["reduce-scatter"] == 1 and counts["all-gather"] == 1 and counts["all-reduce"] == 1
    by_rule = {a["rule"]: a for a in program.rules_applied}
    # Adam reads 0.1 * g and g * g before slicing: binary elementwise ops, moved after the slice.
    # The parameters stay replicated here: no all-gather at the start to read shards of.
    assert set(by_rule) == set(apply.RULES) - {"own_block_through_elementwise", "own_block_of_all_gather"}
    assert len(by_rule["grouped_reduce_scatter"]["at"]) == 5 and len(by_rule["grouped_all_gather"]["at"]) == 5
    assert len(apply.scatterable(graph.module)) == 5
    # The simulator costs what runs: five gradients reduce-scattered, four all-gathers folded into
    # the fifth's latency.
    assert sum(moved < g.nbytes for g, moved in zip(graph.gradients, transfer_bytes(program))) == 5
    assert len(sharded.scattered_gradients(program)) == 5 and len(sharded.grouped_gathers(program)) == 4
    plain = _capture.capture(lowered)[1]  # the same program, no rule applied
    assert update.collectives(plain.as_text())["all-gather"] == 5
    np.testing.assert_array_equal(
        *(np.concatenate([np.ravel(a) for a in jax.tree.leaves(c(*args))]) for c in (compiled, plain))
    )
