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

* an **async fusion** (`fusion-start` / `fusion-done`, XLA:GPU's dynamic-slice fusions of a loop
  body's stacked parameters) is one compute kernel at its start.

Free, never a kernel: `parameter`, `constant` (data of the executable), `get-tuple-element`,
`tuple`, `bitcast`, `after-all`, and the `-done` / `async-update` halves of async pairs.

**Control flow** is read, not refused (DESIGN.md point 22: scanned layers compile to a `while`):

* a `while` runs its body's kernels in the body's own schedule, once per iteration. Its trip
  count is XLA's `known_trip_count` (backend config) or, where XLA did not record one, the bound
  of its induction variable (a counter from a constant, stepped by a constant, compared with a
  constant in the condition). Both runtimes (XLA:GPU's and XLA:CPU's `WhileThunk`) run a loop
  whose trip count they know as a for loop of the body alone, without the condition; a loop read
  from its induction variable evaluates the condition before every iteration and once more at the
  end (trip count + 1 times). A loop whose trip count cannot be read is refused, naming it;
* a `conditional` runs one of its branches (each read in its own schedule); which one is not in
  the text, so the cost model charges the most expensive and says so;
* a `call` is inlined: its computation's kernels run in the caller's schedule, where the call is.

Each kernel says where it runs (`scope`: ``""`` for the entry, ``"while.3/body"``,
``"while.3/condition"``, ``"conditional.2/branch1"``) and how many times per step (`repeat`: the
trip counts of the loops around it multiplied); `KernelSchedule.control_flow` holds each loop
and conditional (`ControlFlow`) at its position in the schedule of its scope.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Sequence

from disco_jax import _hlo

FREE = frozenset("parameter constant get-tuple-element tuple bitcast after-all async-update".split())
COLLECTIVES = frozenset(
    "all-reduce all-gather reduce-scatter all-to-all collective-permute collective-broadcast ragged-all-to-all".split()
)
_COMPARISONS = {"LT", "LE", "GT", "GE", "NE"}
# Library-call custom-call targets by kernel kind (XLA:GPU's cuDNN and cuBLAS calls).
_LIBRARY_KINDS = (("conv", ("cudnn$conv",)), ("gemm", ("cublas", "gemm", "matmul")))


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    """One kernel of a compiled module (see the module docstring).

    name: the entry instruction (an async collective's start). opcode: its opcode.
    kind: 'fusion' | 'gemm' | 'conv' | 'library' | 'op' | 'collective'.
    position: its index in the schedule of its scope. done_position: an async collective's
      done's index there; None for a kernel that holds the compute stream (every compute kernel,
      and a synchronous collective).
    collective: the collective's name ('all-reduce', 'reduce-scatter', ...; None for compute).
    tensor_bytes: a collective's bytes per device: per operand of an all-reduce, else one entry,
      the larger of its input and output (what `cost.allreduce.collective_time_us` takes).
    scope: the schedule it runs in: ``""`` the entry's, else a part of a `ControlFlow`
      (``"while.3/body"``).
    repeat: how many times it runs per step: the trip counts of the loops around it multiplied
      (a branch's kernels: as often as their conditional runs, if that branch is taken).
    group: a collective's first replica group, device ids (`sharding.slices.replica_groups_of`).
    """

    name: str
    opcode: str
    kind: str
    position: int
    done_position: int | None = None
    collective: str | None = None
    tensor_bytes: tuple[int, ...] = ()
    scope: str = ""
    repeat: int = 1
    # A collective's first replica group (device ids; empty where none is stated or readable):
    # a collective over part of a mesh is costed for its group's size and links.
    group: tuple[int, ...] = ()

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


def _first_group(module: _hlo.HloModuleText, inst: _hlo.Instruction) -> tuple[int, ...]:
    """The device ids of a collective's first replica group (an async wrapper's: its collective's)."""
    from disco_jax.sharding.slices import replica_groups_of

    text = inst.attr("replica_groups")
    if text is None and inst.opcode == "async-start":
        wrapped = [i for i in _called_instructions(module, inst) if i.is_root]
        text = wrapped[0].attr("replica_groups") if wrapped else None
    groups = replica_groups_of(text)
    return tuple(groups[0]) if groups else ()


@dataclasses.dataclass(frozen=True)
class ControlFlow:
    """A `while` or a `conditional` of the module, at `position` in the schedule of `scope`.

    parts: the scopes it runs, in order: a while's ``(body,)`` when its runtime knows the trip
      count, else ``(condition, body)``; a conditional's branches.
    trip_count: a while's iterations (None for a conditional). trip_count_from: where it was
      read: ``"known_trip_count"`` (XLA's backend config) or ``"induction variable"``.
    repeat: how many times it runs per step (the trip counts of the loops around it).
    """

    name: str
    opcode: str
    scope: str
    position: int
    parts: tuple[str, ...]
    trip_count: int | None = None
    trip_count_from: str | None = None
    repeat: int = 1

    @property
    def body(self) -> str | None:
        return self.parts[-1] if self.opcode == "while" else None

    @property
    def condition(self) -> str | None:
        """A while's condition scope when its runtime evaluates it (no known trip count)."""
        return self.parts[0] if self.opcode == "while" and len(self.parts) == 2 else None


@dataclasses.dataclass(frozen=True)
class KernelSchedule(Sequence[CompiledKernel]):
    """What `read_kernels` read: the kernels (every scope's, each scope in its schedule order;
    a sequence of `CompiledKernel`), and the module's loops and conditionals."""

    kernels: tuple[CompiledKernel, ...]
    control_flow: tuple[ControlFlow, ...] = ()

    def __getitem__(self, index):  # type: ignore[override]
        return self.kernels[index]

    def __len__(self) -> int:
        return len(self.kernels)

    def executed(self) -> int:
        """Kernel runs per step: each kernel times its `repeat` (every branch of a conditional
        counted, as if each were taken)."""
        return sum(k.repeat for k in self.kernels)


@dataclasses.dataclass(frozen=True)
class _Affine:
    """A scalar integer an instruction computes: `offset`, plus element `index` of its
    computation's parameter tuple where `index` is not None (a loop's induction variable)."""

    index: int | None
    offset: int


def _affine(module: _hlo.HloModuleText, comp: _hlo.Computation, name: str, bound: dict | None = None) -> _Affine | None:
    """`name`'s value in `comp` as an `_Affine`, through copies, converts, bitcasts, adds and
    subtracts of constants, and fusions; None where it is anything else. `bound`: a fused
    computation's parameters by number."""
    inst = comp.by_name()[name]
    if inst.opcode == "constant":
        try:
            return _Affine(None, int((inst.literal or "").strip()))
        except ValueError:
            return None
    if inst.opcode == "parameter":
        return None if bound is None else bound.get(int(inst.literal or -1))
    if inst.opcode == "get-tuple-element":
        source = comp.by_name()[inst.operands[0]]
        if source.opcode == "parameter" and bound is None:
            return _Affine(int(inst.attr("index") or 0), 0)
        return None
    if inst.opcode in ("copy", "convert", "bitcast") and inst.operands:
        return _affine(module, comp, inst.operands[0], bound)
    if inst.opcode in ("add", "subtract") and len(inst.operands) == 2:
        a, b = (_affine(module, comp, o, bound) for o in inst.operands)
        if a is None or b is None or (a.index is not None and b.index is not None):
            return None
        sign = -1 if inst.opcode == "subtract" else 1
        if b.index is not None:
            return None if sign < 0 else _Affine(b.index, a.offset + b.offset)
        return _Affine(a.index, a.offset + sign * b.offset)
    if inst.opcode == "fusion":
        called = module.computation((inst.attr("calls") or "").lstrip("%"))
        inner = {i: _affine(module, comp, o, bound) for i, o in enumerate(inst.operands)}
        return _affine(module, called, called.root.name, inner)
    return None


def _comparison(module: _hlo.HloModuleText, comp: _hlo.Computation, inst: _hlo.Instruction, bound: dict | None):
    """(direction, lhs, rhs) of the compare a condition's root is (directly or in a fusion)."""
    if inst.opcode == "fusion":
        called = module.computation((inst.attr("calls") or "").lstrip("%"))
        inner = {i: _affine(module, comp, o, bound) for i, o in enumerate(inst.operands)}
        return _comparison(module, called, called.root, inner)
    if inst.opcode != "compare" or len(inst.operands) != 2:
        return None
    lhs, rhs = (_affine(module, comp, o, bound) for o in inst.operands)
    return inst.attr("direction"), lhs, rhs


def _induction_trip_count(module: _hlo.HloModuleText, caller: _hlo.Computation, loop: _hlo.Instruction) -> int | None:
    """The trip count of `loop` from its induction variable: a tuple element the condition
    compares with a constant, that the loop starts at a constant and its body steps by one."""
    condition = module.computation((loop.attr("condition") or "").lstrip("%"))
    body = module.computation((loop.attr("body") or "").lstrip("%"))
    found = _comparison(module, condition, condition.root, None)
    if found is None or found[0] not in _COMPARISONS or None in found[1:]:
        return None
    direction, lhs, rhs = found
    if lhs.index is None and rhs.index is not None:  # constant on the left: mirror it
        lhs, rhs = rhs, lhs
        direction = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE"}.get(direction, direction)
    if lhs.index is None or rhs.index is not None or lhs.offset:
        return None
    k, limit = lhs.index, rhs.offset
    init_tuple = caller.by_name().get(loop.operands[0]) if loop.operands else None
    if init_tuple is None or init_tuple.opcode != "tuple" or body.root.opcode != "tuple":
        return None
    start = _affine(module, caller, init_tuple.operands[k])
    stepped = _affine(module, body, body.root.operands[k])
    if start is None or start.index is not None or stepped is None or stepped.index != k or not stepped.offset:
        return None
    step, first = stepped.offset, start.offset
    if direction in ("LT", "LE", "NE") and step > 0:
        end = limit + (1 if direction == "LE" else 0)
        if direction == "NE" and (limit - first) % step:
            return None  # never equal: it would not stop
        return max(0, -(-(end - first) // step))
    if direction in ("GT", "GE", "NE") and step < 0:
        end = limit - (1 if direction == "GE" else 0)
        if direction == "NE" and (first - limit) % -step:
            return None
        return max(0, -(-(first - end) // -step))
    return None


def _trip_count(module: _hlo.HloModuleText, caller: _hlo.Computation, loop: _hlo.Instruction) -> tuple[int, str]:
    """(trip count, where it was read) of a while loop; a ValueError naming it when unreadable."""
    match = re.search(r'"known_trip_count":\s*\{\s*"n":\s*"?(\d+)', loop.attr("backend_config") or "")
    if match:
        return int(match.group(1)), "known_trip_count"
    found = _induction_trip_count(module, caller, loop)
    if found is None:
        raise ValueError(
            f"{loop.name}: a while loop whose trip count cannot be read (no known_trip_count in its backend "
            "config, no induction variable from a constant to a constant bound) is not costed"
        )
    return found, "induction variable"


def read_kernels(text: str, scheduled: bool = True) -> KernelSchedule:
    """The kernels of a compiled module's text, each scope in its schedule order, and its control
    flow (see the module docstring). `scheduled=False`: a module before scheduling (a capture at
    the hook, `cost.LoopEstimator`), read in its instructions' order."""
    module = _hlo.parse_module(text)
    if scheduled and "is_scheduled=true" not in module.header:
        raise ValueError("not a compiled module (no is_scheduled=true): pass the executable's text")
    kernels: list[CompiledKernel] = []
    flows: list[ControlFlow] = []

    def read(comp: _hlo.Computation, scope: str, repeat: int, positions: itertools.count) -> None:
        shapes = {i.name: i.outputs for i in comp.instructions}
        starts: dict[str, int] = {}  # async start name -> its kernel's index
        for inst in comp.instructions:
            if inst.opcode in FREE:
                continue
            if inst.opcode == "call":
                read(module.computation((inst.attr("to_apply") or "").lstrip("%")), scope, repeat, positions)
                continue
            pos = next(positions)
            if inst.opcode == "while":
                trips, source = _trip_count(module, comp, inst)
                body = module.computation((inst.attr("body") or "").lstrip("%"))
                parts = (f"{inst.name}/body",)
                if source != "known_trip_count":  # the runtime evaluates the condition: trips + 1 times
                    condition = module.computation((inst.attr("condition") or "").lstrip("%"))
                    parts = (f"{inst.name}/condition", *parts)
                    read(condition, parts[0], repeat * (trips + 1), itertools.count())
                flows.append(ControlFlow(inst.name, "while", scope, pos, parts, trips, source, repeat))
                read(body, parts[-1], repeat * trips, itertools.count())
                continue
            if inst.opcode == "conditional":
                branches = inst.called_computations
                parts = tuple(f"{inst.name}/branch{i}" for i in range(len(branches)))
                flows.append(ControlFlow(inst.name, "conditional", scope, pos, parts, repeat=repeat))
                for part, branch in zip(parts, branches):
                    read(module.computation(branch), part, repeat, itertools.count())
                continue
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
                group = _first_group(module, inst)
                kernels.append(
                    CompiledKernel(inst.name, inst.opcode, "collective", pos, None, *found, scope, repeat, group)
                )
            elif inst.opcode == "fusion-start":
                kind = _compute_kind(module, dataclasses.replace(inst, opcode="fusion"))
                kernels.append(CompiledKernel(inst.name, inst.opcode, kind, pos, scope=scope, repeat=repeat))
            elif inst.opcode.endswith("-start"):
                raise ValueError(f"{inst.name}: an async {inst.opcode} of no collective is not costed")
            else:
                kind = _compute_kind(module, inst)
                kernels.append(CompiledKernel(inst.name, inst.opcode, kind, pos, scope=scope, repeat=repeat))
        if starts:
            raise ValueError(f"async collectives never waited for: {sorted(starts)}")

    read(module.entry, "", 1, itertools.count())
    return KernelSchedule(tuple(kernels), tuple(flows))
