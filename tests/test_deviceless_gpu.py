"""XLA:GPU without a GPU: a data-parallel step compiled for 8 H100s through disco-jax's pass
hook, with an edit at the hook, asserted on the compiled module. Runs in CI (the CUDA plugin is
part of the `dev` extra); it is never skipped: a missing plugin is a failure."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from disco_jax import _capture, _hlo, targets

LAYERS, WIDTH = 4, 256


def _step(ws, x):
    def loss(ws):
        h = x
        for w in ws:
            h = jnp.tanh(h @ w)
        return jnp.sum(h ** 2)
    return [w - 0.1 * g for w, g in zip(ws, jax.grad(loss)(ws))]


@pytest.fixture(scope="module")
def lowered():
    mesh = targets.mesh("h100-sxm", 8)
    ws = [jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32, sharding=NamedSharding(mesh, P()))] * LAYERS
    x = jax.ShapeDtypeStruct((64, WIDTH), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    return jax.jit(_step).lower(ws, x)


def _reduced_elements(compiled_text: str) -> list[int]:
    """Elements carried by each all-reduce of the compiled module (sync or async)."""
    entry = _hlo.parse_module(compiled_text).entry
    return sorted(i.outputs[-1].elements for i in entry.instructions
                  if i.opcode in ("all-reduce", "all-reduce-start"))


def test_targets_give_compile_only_h100s():
    mesh = targets.mesh("h100-sxm", 8)
    assert mesh.size == 8 and mesh.devices.flat[0].device_kind == "NVIDIA H100 80GB HBM3"
    with pytest.raises(ValueError, match="shipped targets: h100-sxm"):
        targets.target_config("h200")


def test_hook_edit_is_what_xla_gpu_compiles(lowered):
    seen = []

    def drop_first_allreduce(text):
        module = _hlo.parse_module(text)
        entry = module.entry
        seen.append([i.opcode for i in entry.instructions])
        at = next(k for k, i in enumerate(entry.instructions) if i.opcode == "all-reduce")
        entry.instructions[at] = dataclasses.replace(entry.instructions[at], opcode="copy", attrs=[])
        return module.to_text()

    plain = _capture.compile_with_hook(lowered, lambda text: None, platform="cuda").as_text()
    edited = _capture.compile_with_hook(lowered, drop_first_allreduce, platform="cuda").as_text()
    # The hook saw XLA:GPU's module before fusion and before combining.
    (opcodes,) = seen
    assert "fusion" not in opcodes and opcodes.count("all-reduce") == LAYERS
    # XLA:GPU combined what it was given: every gradient, or the three the edit left.
    assert _reduced_elements(plain) == [LAYERS * WIDTH * WIDTH]
    assert _reduced_elements(edited) == [(LAYERS - 1) * WIDTH * WIDTH]
    assert re.search(r"custom_call_target=\"__cublas\$gemm\"|kind=kCustom", edited)
