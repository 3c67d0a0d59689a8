"""FSDP as users write it (`Layout.at_use`, `offline.AT_USE`): parameters and optimizer state held
sharded between steps, each leaf on its largest divisible dimension, and no replicated constraint
at the step's entry, so XLA's partitioner gathers each parameter where a dot reads it (in a scanned
loop, per iteration) and frees it after.

Deviceless for 8 H100s, a 2-layer scanned GPT with full remat (width 256; issue 44's check is the
32-layer width-4096 one, `scripts/fsdp_memory.py`): its peak (XLA's memory analysis, state donated)
is no higher than the hand-written `NamedSharding` FSDP's and lower than ZeRO-3 gathered at the
step's entry. On 8 CPU devices the step computes what the replicated one does."""

import jax
import optax
import pytest

from disco_jax import backends, offline, targets, zoo
from disco_jax._compile import capture
from disco_jax.eval import handwritten
from disco_jax.sharding import choice, update

GPT = {
    "d_model": 256,
    "num_heads": 2,
    "num_layers": 2,
    "seq_len": 128,
    "vocab_size": 1024,
    "compute_dtype": "bfloat16",
    "scan_layers": True,
    "remat": "full",
}


def _bodies_with(text: str, op: str) -> dict[str, int]:
    """Per computation of a compiled module, how many `op` instructions it holds."""
    found, name = {}, None
    for line in text.splitlines():
        if line and not line.startswith(" ") and "{" in line and "(" in line:
            name = "ENTRY" if line.startswith("ENTRY") else line.split(" ")[0].lstrip("%")
        elif name is not None and f" {op}" in line:
            found[name] = found.get(name, 0) + 1
    return found


@pytest.fixture(scope="module")
def deviceless():
    spec, optimizer = zoo.resized("gpt", "paper", **GPT), optax.adam(1e-3)
    mesh = targets.mesh("h100-sxm", 8)
    step = zoo.build_train_step(spec, optimizer, mesh, "jit", donate=True)
    args = zoo.abstract_state_and_batch(spec, optimizer, mesh)
    replicated = step.lower(*args).compile()
    out = {}
    for label in (offline.AT_USE, offline.ALL_SHARDED):
        lowered, layout, _ = offline.SHARDED_UPDATES[label](step, args, {}, replicated)
        compiled = offline._compiled_xla(lowered, layout).compiled
        out[label] = (layout, compiled)
    hand, hand_args = handwritten.fsdp_step(spec, optimizer, mesh)
    out["hand-written"] = (None, hand.lower(*hand_args).compile())
    return out


def test_fsdp_at_use_peaks_no_higher_than_hand_written_fsdp_and_gathers_in_the_loops(deviceless):
    layout, at_use = deviceless[offline.AT_USE]
    _, zero3 = deviceless[offline.ALL_SHARDED]
    _, hand = deviceless["hand-written"]
    peak = lambda c: choice.footprint(update.memory(c, {}))  # noqa: E731
    assert layout.at_use and layout.gathered and layout.gathered_before_step == ()
    assert layout.to_json()["at_use"]
    assert peak(at_use) <= peak(hand)
    assert peak(at_use) < peak(zero3)  # ZeRO-3 gathers whole stacks at the entry and keeps them
    # Parameters and state held as the hand-written step holds them: the same argument bytes.
    assert at_use.memory_analysis().argument_size_in_bytes == hand.memory_analysis().argument_size_in_bytes
    gathers = _bodies_with(at_use.as_text(), "all-gather-start(")
    in_loops = sum(n for name, n in gathers.items() if name != "ENTRY")
    assert in_loops >= 2, gathers  # the forward and the backward body each gather their layer


def scanned_gpt_at_use(remat: str = "dots", **gpt) -> tuple:
    """(step, args, its capture on the CPU devices, the layout splitting each leaf on its largest
    dimension, the leaves the replicated step holds) of a scanned zoo GPT with Adam and `nn.remat`
    of dots (`remat`; `gpt`: `zoo.resized` fields); `choice.candidate(..., at_use=True)` lowers it at use."""
    spec = zoo.resized("gpt", scan_layers=True, remat=remat, **gpt)
    step, state, batch = zoo.make_train_step(spec, optax.adam(1e-3), zoo.data_mesh(), "jit")
    args = (state, batch)
    program = capture(step.lower(*args), backends.CPU, args, {})
    shardings = [x.sharding for x in jax.tree.leaves(args)]
    layout, _ = update.find_layout(step, args, {}, args, {}, shardings, largest=True)
    return step, args, program, layout, update.held_leaves(program)


def test_fsdp_at_use_on_cpu_devices_computes_what_the_replicated_step_computes():
    step, args, program, layout, held = scanned_gpt_at_use(num_layers=2)
    at_use = choice.candidate(step, program, layout, layout.all_leaves(), args, {}, backends.CPU, held, at_use=True)
    assert at_use.layout.at_use and not at_use.layout.regather and "gathered where used" in at_use.label
    check = update.check_outputs(program, at_use.step)
    assert check.within_tolerance, check
    # Held sharded between steps: every sharded leaf's input sharding is the layout's, 1/8 per device.
    inputs = jax.tree.leaves(at_use.step.default_compiled.input_shardings)
    leaves = jax.tree.leaves(args)
    for i, spec_ in at_use.layout.inputs.items():
        assert inputs[i].spec == spec_
        shard = inputs[i].shard_shape(leaves[i].shape)
        assert shard != leaves[i].shape and leaves[i].size == 8 * jax.numpy.prod(jax.numpy.array(shard))
