"""The HLO text layer: parsing real compiled modules, printing XLA accepts, fingerprints."""

import jax
import pytest
from jax._src.lib import xla_client

from disco_jax import _capture, _hlo

from _steps import make_step


@pytest.fixture(scope="module")
def captured():
    step, args = make_step("jit")
    text, _ = _capture.capture(step.lower(*args))
    return text


def test_parse_real_module_finds_entry_allreduce_and_fusions(captured):
    module = _hlo.parse_module(captured)
    entry = module.entry
    opcodes = [i.opcode for i in entry.instructions]
    assert opcodes.count("all-reduce") == 1  # XLA:CPU's combiner merged all gradients
    assert "fusion" in opcodes
    allreduce = next(i for i in entry.instructions if i.opcode == "all-reduce")
    assert len(allreduce.operands) == 7  # 6 parameter gradients + the loss
    assert allreduce.attr("to_apply") is not None
    assert all(s.dtype == "f32" for s in allreduce.outputs)


def test_printed_module_is_accepted_by_xla(captured):
    module = _hlo.parse_module(captured)
    for drop in (False, True):
        reparsed = xla_client.hlo.hlo_module_from_text(module.to_text(drop_metadata=drop))
        assert "ENTRY" in reparsed.to_string()


def test_fingerprint_ignores_metadata_but_not_the_program(captured):
    module = _hlo.parse_module(captured)
    assert _hlo.fingerprint(captured) == _hlo.fingerprint(module.to_text(drop_metadata=True))
    other_step, other_args = make_step("jit", sizes=(16, 32, 4))
    other, _ = _capture.capture(other_step.lower(*other_args))
    assert _hlo.fingerprint(other) != _hlo.fingerprint(captured)


def test_fingerprint_is_stable_across_compiles():
    step, args = make_step("jit")
    first, _ = _capture.capture(step.lower(*args))
    jax.clear_caches()
    second, _ = _capture.capture(step.lower(*args))
    assert _hlo.fingerprint(first) == _hlo.fingerprint(second)


def test_shapes_and_bytes():
    specs = _hlo.parse_shape("(f32[8,4]{1,0}, /*index=1*/bf16[3]{0}, s32[])")
    assert [s.bytes for s in specs] == [128, 6, 4]


def test_parse_instruction_with_constant_literal_and_attributes():
    inst = _hlo.parse_instruction('  %c = f32[2]{0} constant({1, 2}), metadata={op_name="x, y"}')
    assert inst.opcode == "constant" and inst.operands == [] and inst.literal == "{1, 2}"
    assert inst.attr("metadata") == '{op_name="x, y"}'
    assert "metadata" not in inst.to_text(drop_metadata=True)


def test_not_hlo_text_is_a_clear_error():
    with pytest.raises(ValueError, match="not HLO module text"):
        _hlo.parse_module("hello")
