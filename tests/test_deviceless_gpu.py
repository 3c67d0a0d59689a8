"""XLA:GPU without a GPU: a zoo training step compiled for 8 H100s through disco-jax's pass hook,
with an edit at the hook, asserted on the compiled module. Runs in CI (the CUDA plugin is part of
the `dev` extra); it is never skipped: a missing plugin is a failure."""

import dataclasses
import re

import optax
import pytest

from disco_jax import _capture, _hlo, targets, zoo


@pytest.fixture(scope="module")
def lowered():
    return zoo.lower_abstract(zoo.get_model("mlp", "tiny"), optax.sgd(0.1), targets.mesh("h100-sxm", 8))


def _reduced_elements(compiled_text: str) -> list[int]:
    """Elements carried by each all-reduce of the compiled module (sync or async)."""
    entry = _hlo.parse_module(compiled_text).entry
    return sorted(i.outputs[-1].elements for i in entry.instructions if i.opcode in ("all-reduce", "all-reduce-start"))


def test_targets_give_compile_only_h100s():
    mesh = targets.mesh("h100-sxm", 8)
    assert mesh.size == 8 and mesh.devices.flat[0].device_kind == "NVIDIA H100 80GB HBM3"
    with pytest.raises(ValueError, match="shipped targets: a100-sxm, h100-sxm"):
        targets.target_config("h200")


def test_hook_edit_is_what_xla_gpu_compiles(lowered):
    seen = []

    def drop_largest_allreduce(text):
        module = _hlo.parse_module(text)
        entry = module.entry
        allreduces = [k for k, i in enumerate(entry.instructions) if i.opcode == "all-reduce"]
        seen.append(
            ([i.opcode for i in entry.instructions], [entry.instructions[k].outputs[0].elements for k in allreduces])
        )
        at = max(allreduces, key=lambda k: entry.instructions[k].outputs[0].elements)
        entry.instructions[at] = dataclasses.replace(entry.instructions[at], opcode="copy", attrs=[])
        return module.to_text()

    plain = _capture.compile_with_hook(lowered, lambda text: None, platform="cuda").as_text()
    edited = _capture.compile_with_hook(lowered, drop_largest_allreduce, platform="cuda").as_text()
    # The hook saw XLA:GPU's module before fusion and before combining: one all-reduce per tensor.
    ((opcodes, sizes),) = seen
    assert "fusion" not in opcodes and len(sizes) > 2
    # XLA:GPU combined what it was given into one flat buffer: every tensor, or all but the dropped one.
    assert _reduced_elements(plain) == [sum(sizes)]
    assert _reduced_elements(edited) == [sum(sizes) - max(sizes)]
    assert re.search(r"custom_call_target=\"__cublas\$gemm\"|kind=kCustom", edited)
