"""A compiled module's kernels, in XLA's schedule: what the executable launches, read from its text.

`read_kernels(text)` reads the entry computation of a module after all of XLA's passes (the text
of a compiled executable, `compiled.as_text()`: XLA:GPU's, deviceless or not, and XLA:CPU's;
both are `is_scheduled=true`, the entry's order is the schedule) and returns one
`CompiledKernel` per instruction that launches work, in that order:

* a **fusion**, whatever its kind, is one kernel: kLoop and kInput fusions and XLA:GPU's generated
  custom fusions (Triton normalizations: kind ``fusion``); a custom fusion around a dot or a
  convolution (XLA:GPU's Triton / cuBLAS gemm fusions, XLA:CPU's `__ynn_fusion`s: ``gemm`` /
  ``conv``);
* a **library call** is one kernel: a `custom-call` (cuDNN convolutions, cuBLAS gemms: ``conv`` /
  ``gemm``; any other target: ``library``), and on XLA:CPU the `dot` and `convolution` it left as
  thunks of their own;
* a **collective** (``collective``) runs on the communication stream. An async pair
  (`all-reduce-start` / `all-reduce-done`, `async-start` around a reduce-scatter, ...) is one
  kernel at its start; its done is where the compute stream waits for it (`done_position`). A
  collective without a pair (XLA:CPU's, always; XLA:GPU's where it marked one `is_sync`) blocks
  the compute stream while it runs;
* every other instruction that is not free launches work of its own (kind ``op``): a `copy`
  left unfused (a copy kernel or a device memcpy), `partition-id` / `replica-id` (a 4-byte write
  on the stream), the bare ops XLA:CPU leaves unfused (`concatenate`, ...).

Free, never a kernel: `parameter`, `constant` (data of the executable), `get-tuple-element`,
`tuple`, `bitcast`, `after-all`, and the `-done` / `async-update` halves of async pairs.
Control flow (`while`, `conditional`, `call`) is refused: its kernels run a number of times the
text does not say.
"""

from __future__ import annotations

import dataclasses
import re

from disco_jax import _hlo

FREE = frozenset("parameter constant get-tuple-element tuple bitcast after-all async-update".split())
COLLECTIVES = frozenset(
    "all-reduce all-gather reduce-scatter all-to-all collective-permute collective-broadcast ragged-all-to-all".split()
)
CONTROL_FLOW = frozenset({"while", "conditional", "call"})
# Library-call custom-call targets by kernel kind (XLA:GPU's cuDNN and cuBLAS calls).
_LIBRARY_KINDS = (("conv", ("cudnn$conv",)), ("gemm", ("cublas", "gemm", "matmul")))


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    """One kernel of a compiled module (see the module docstring).

    name: the entry instruction (an async collective's start). opcode: its opcode.
    kind: 'fusion' | 'gemm' | 'conv' | 'library' | 'op' | 'collective'.
    position: its index in the entry's schedule. done_position: an async collective's done's
      index; None for a kernel that holds the compute stream (every compute kernel, and a
      synchronous collective).
    collective: the collective's name ('all-reduce', 'reduce-scatter', ...; None for compute).
    tensor_bytes: a collective's bytes per device: per operand of an all-reduce, else one entry,
      the larger of its input and output (what `cost.allreduce.collective_time_us` takes).
    """

    name: str
    opcode: str
    kind: str
    position: int
    done_position: int | None = None
    collective: str | None = None
    tensor_bytes: tuple[int, ...] = ()

    @property
    def is_collective(self) -> bool:
        return self.collective is not None


def _called_instructions(module: _hlo.HloModuleText, inst: _hlo.Instruction) -> list[_hlo.Instruction]:
    """The instructions of the computations a fusion or async-start calls (nested ones too)."""
    found, stack = [], [inst]
    while stack:
        for name in stack.pop().called_computations:
            comp = module.computation(name)
            found += comp.instructions
            stack += [i for i in comp.instructions if i.opcode == "fusion"]
    return found


def _compute_kind(module: _hlo.HloModuleText, inst: _hlo.Instruction) -> str:
    if inst.opcode in ("dot", "convolution"):
        return "gemm" if inst.opcode == "dot" else "conv"
    if inst.opcode == "custom-call":
        target = (inst.attr("custom_call_target") or "").strip('"').lower()
        return next((kind for kind, keys in _LIBRARY_KINDS if any(k in target for k in keys)), "library")
    if inst.opcode != "fusion":
        return "op"
    if inst.attr("kind") == "kCustom":
        opcodes = {i.opcode for i in _called_instructions(module, inst)}
        if "convolution" in opcodes:
            return "conv"
        if "dot" in opcodes:
            return "gemm"
    return "fusion"


def _bytes(shapes: dict[str, tuple[_hlo.TensorSpec, ...]], names: list[str]) -> list[int]:
    return [sum(t.bytes for t in shapes[n]) for n in names]


def _collective(module: _hlo.HloModuleText, inst: _hlo.Instruction, shapes: dict) -> tuple[str, tuple[int, ...]] | None:
    """(collective, bytes per device) of a collective or the start of an async one, else None."""
    if inst.opcode == "async-start":
        wrapped = [i for i in _called_instructions(module, inst) if i.is_root]
        if not wrapped or wrapped[0].opcode not in COLLECTIVES:
            return None
        name, result = wrapped[0].opcode, wrapped[0].output_bytes
    else:
        name = inst.opcode.removesuffix("-start")
        if name not in COLLECTIVES:
            return None
        # An async start's shape holds its operands and its results: the results are the last half.
        outputs = inst.outputs[len(inst.operands) :] if inst.opcode.endswith("-start") else inst.outputs
        result = sum(t.bytes for t in outputs)
    inputs = _bytes(shapes, inst.operands)
    if name == "all-reduce":
        return name, tuple(inputs)
    return name, (max(sum(inputs), result),)


def read_kernels(text: str) -> list[CompiledKernel]:
    """The kernels of a compiled module's text, in schedule order (see the module docstring)."""
    module = _hlo.parse_module(text)
    if "is_scheduled=true" not in module.header:
        raise ValueError("not a compiled module (no is_scheduled=true): pass the executable's text")
    entry = module.entry
    shapes = {i.name: i.outputs for i in entry.instructions}
    kernels: list[CompiledKernel] = []
    starts: dict[str, int] = {}  # async start name -> its kernel's index
    for pos, inst in enumerate(entry.instructions):
        if inst.opcode in FREE:
            continue
        if inst.opcode in CONTROL_FLOW:
            raise ValueError(f"{inst.name}: control flow ({inst.opcode}) in the entry is not costed")
        if inst.opcode.endswith("-done"):
            k = starts.pop(inst.operands[0], None)
            if k is not None:
                kernels[k] = dataclasses.replace(kernels[k], done_position=pos)
            continue
        found = _collective(module, inst, shapes)
        if found is not None:
            # XLA:GPU runs a pair it marked `is_sync` on the compute stream: it blocks like one without.
            if inst.opcode.endswith("-start") and not re.search(
                r'"is_sync":\s*true', inst.attr("backend_config") or ""
            ):
                starts[inst.name] = len(kernels)
            kernels.append(CompiledKernel(inst.name, inst.opcode, "collective", pos, None, *found))
        elif inst.opcode.endswith("-start"):
            raise ValueError(f"{inst.name}: an async {inst.opcode} of no collective is not costed")
        else:
            kernels.append(CompiledKernel(inst.name, inst.opcode, _compute_kind(module, inst), pos))
    if starts:
        raise ValueError(f"async collectives never waited for: {sorted(starts)}")
    return kernels
