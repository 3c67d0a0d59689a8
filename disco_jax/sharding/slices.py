"""Where a module reads a collective's result only through each device's own block: the match of
`own_block_of_all_reduce` (and `own_block_through_elementwise`) on the HLO text of a post-fusion
module at the hook.

A device's *own block* of a value along axis a is the dynamic-slice that starts at i * size_a / N
on axis a and at 0 elsewhere, size_a / N long on a and whole elsewhere, where i is the device's
position in the collective's replica group (N devices). The partitioner writes the offsets as
arithmetic on `partition-id` (`convert`, `multiply`, sometimes a lookup in a constant table),
inside the fusion that slices or outside it: `OffsetEvaluator` evaluates them for every device,
through fusion parameters, and the match compares them with the replica group
(`group_positions`). A read may sit behind elementwise ops of the value's shape (the optimizer's
`0.1 * g` before the slice); those ops are then applied to the block instead (the rule
`own_block_through_elementwise`), which is what `OwnBlockRead.scopes` lists for the rewrite.

Only SPMD modules are matched: collectives with a `channel_id` (partition ids; with
`use_global_device_ids`, ids that equal the partition ids when there is one replica, as under
`jax.jit`), offsets from `partition-id`.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from disco_jax import _hlo
from disco_jax._hlo import ELEMENTWISE

# Ops of one array applied element by element (a `copy` changes only the layout).
POINTWISE = ELEMENTWISE | {"copy"}
_INTEGER_OPS = {
    "add": lambda a, b: a + b,
    "subtract": lambda a, b: a - b,
    "multiply": lambda a, b: a * b,
    "divide": lambda a, b: int(a / b) if b else None,  # HLO integer division rounds toward zero
    "remainder": lambda a, b: int(math.fmod(a, b)) if b else None,
    "maximum": max,
    "minimum": min,
    "and": lambda a, b: a & b,
    "or": lambda a, b: a | b,
    "xor": lambda a, b: a ^ b,
    "shift-left": lambda a, b: a << b,
    "shift-right-logical": lambda a, b: a >> b,
    "shift-right-arithmetic": lambda a, b: a >> b,
}
_COMPARE = {
    "EQ": lambda a, b: a == b,
    "NE": lambda a, b: a != b,
    "LT": lambda a, b: a < b,
    "LE": lambda a, b: a <= b,
    "GT": lambda a, b: a > b,
    "GE": lambda a, b: a >= b,
}


def dims_of(inst: _hlo.Instruction) -> tuple[int, ...] | None:
    """The dimensions of a one-array instruction (None for tuples)."""
    outputs = inst.outputs
    return outputs[0].dims if len(outputs) == 1 and not inst.shape.startswith("(") else None


def group_positions(replica_groups: str | None) -> tuple[int, list[int]] | None:
    """(devices per group, per device id its position in its group) for a collective's
    `replica_groups`: `mesh['data'=8] {'data'}` (jax 0.12), `{{0,1,..},{..}}`, or the iota form
    `[G,S]<=[dims]` with an optional `T(perm)`; None for any other form or unequal groups."""
    groups = replica_groups_of(replica_groups)
    if groups is None:
        return None
    positions = [0] * sum(len(g) for g in groups)
    for g in groups:
        for position, device in enumerate(g):
            positions[device] = position
    return len(groups[0]), positions


def replica_groups_of(replica_groups: str | None) -> list[list[int]] | None:
    """The device ids of each group of a collective's `replica_groups` (the forms `group_positions`
    reads); None for any other form, unequal groups, or groups that do not cover 0..n-1 once."""
    text = (replica_groups or "").strip()
    groups = None
    m = re.fullmatch(r"mesh\[(.*)\]\s*\{(.*)\}", text)
    if m:
        axes = [a.strip() for a in m.group(1).split(",") if a.strip()]
        if not all(re.fullmatch(r"'[^']*'=\d+", a) for a in axes):
            return None
        names = [a.split("=")[0] for a in axes]
        sizes = [int(a.split("=")[1]) for a in axes]
        over = [g.strip() for g in m.group(2).split(",") if g.strip()]
        if not over or any(g not in names for g in over):
            return None
        ids = np.arange(math.prod(sizes)).reshape(sizes)
        kept = [names.index(g) for g in over]
        others = [k for k in range(len(names)) if k not in kept]
        size = math.prod(sizes[k] for k in kept)
        groups = ids.transpose(others + kept).reshape(-1, size).tolist()
    elif text.startswith("{{"):
        groups = [[int(d) for d in g.split(",") if d.strip()] for g in re.findall(r"\{([\d,\s]*)\}", text[1:-1])]
    else:
        m = re.fullmatch(r"\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text.replace(" ", ""))
        if m:
            ids = np.arange(math.prod(int(d) for d in m.group(3).split(","))).reshape(
                [int(d) for d in m.group(3).split(",")]
            )
            if m.group(4):
                ids = ids.transpose([int(p) for p in m.group(4).split(",")])
            groups = ids.reshape(int(m.group(1)), int(m.group(2))).tolist()
    if not groups or len({len(g) for g in groups}) != 1:
        return None
    members = sorted(d for g in groups for d in g)
    if members != list(range(len(members))):
        return None
    return groups


@dataclasses.dataclass
class Scope:
    """A computation as one caller sees it: the entry (no caller), or a fused computation with
    the caller's operand names per parameter number."""

    computation: _hlo.Computation
    caller: Scope | None = None
    arguments: tuple[str, ...] = ()
    fusion: str | None = None  # the calling fusion's name in the entry

    def __post_init__(self):
        self.by_name = self.computation.by_name()
        self.users: dict[str, list[_hlo.Instruction]] = {}
        for inst in self.computation.instructions:
            for o in dict.fromkeys(inst.operands):
                self.users.setdefault(o, []).append(inst)

    def parameter(self, number: int) -> _hlo.Instruction | None:
        for inst in self.computation.instructions:
            if inst.opcode == "parameter" and int(inst.literal) == number:
                return inst
        return None


def scope_of_fusion(module: _hlo.HloModuleText, entry: Scope, fusion: _hlo.Instruction) -> Scope:
    called = (fusion.attr("calls") or "").lstrip("%")
    return Scope(module.computation(called), entry, tuple(fusion.operands), fusion.name)


class OffsetEvaluator:
    """Integer scalars of a module evaluated for one device id (`device_id_op`'s value)."""

    def __init__(self, module: _hlo.HloModuleText, device_id_op: str = "partition-id"):
        self.module, self.device_id_op = module, device_id_op

    def value(self, scope: Scope, name: str, device: int) -> int | None:
        """The integer scalar `name` of `scope` on `device` (None: not an integer scalar this
        evaluator follows), wrapped to its element type as the hardware would."""
        inst = scope.by_name.get(name)
        specs = () if inst is None else inst.outputs
        if len(specs) != 1 or specs[0].elements != 1 or not re.fullmatch(r"[su]\d+|pred", specs[0].dtype):
            return None
        value = self._value(scope, inst, device)
        if value is None or specs[0].dtype == "pred":
            return None if value is None else int(bool(value))
        bits = int(specs[0].dtype[1:])
        value &= (1 << bits) - 1
        return value - (1 << bits) if specs[0].dtype[0] == "s" and value >> (bits - 1) else value

    def _value(self, scope: Scope, inst: _hlo.Instruction, device: int) -> int | None:
        op, specs = inst.opcode, inst.outputs
        if op == self.device_id_op:
            return device
        if op == "constant":
            literal = (inst.literal or "").strip()
            if literal in ("true", "false"):
                return int(literal == "true")
            numbers = re.findall(r"-?\d+", literal)
            return int(numbers[0]) if len(numbers) == 1 else None
        if op == "parameter":
            if scope.caller is None:
                return None
            return self.value(scope.caller, scope.arguments[int(inst.literal)], device)
        if op in ("convert", "bitcast", "reshape", "copy"):
            return self.value(scope, inst.operands[0], device)
        if op == "dynamic-slice":  # a lookup in a constant table
            return self._lookup(scope, inst, device)
        if op == "fusion" and scope.caller is None:
            inner = scope_of_fusion(self.module, scope, inst)
            return self.value(inner, inner.computation.root.name, device)
        values = [self.value(scope, o, device) for o in inst.operands]
        if not values or None in values:
            return None
        if op in _INTEGER_OPS and len(values) == 2:
            return _INTEGER_OPS[op](*values)
        if op == "compare" and len(values) == 2 and inst.attr("direction") in _COMPARE:
            return int(_COMPARE[inst.attr("direction")](*values))
        if op == "select" and len(values) == 3:
            return values[1] if values[0] else values[2]
        if op in ("negate", "not", "abs") and len(values) == 1:
            (a,) = values
            return -a if op == "negate" else abs(a) if op == "abs" else int(not a) if specs[0].dtype == "pred" else ~a
        return None

    def _lookup(self, scope: Scope, inst: _hlo.Instruction, device: int) -> int | None:
        table = scope.by_name.get(inst.operands[0])
        if table is None or table.opcode != "constant" or len(inst.operands) != 2:
            return None
        entries = [int(x) for x in re.findall(r"-?\d+", table.literal or "")]
        index = self.value(scope, inst.operands[1], device)
        if index is None or len(entries) != table.outputs[0].elements:
            return None
        return entries[min(max(index, 0), len(entries) - 1)]


@dataclasses.dataclass
class ScopeRead:
    """The reads of a value in one computation: `start` (the value itself, or the parameter it
    enters a fusion as), the elementwise ops between it and the slices (`between`, in program
    order), and the slices (`slices`)."""

    scope: Scope
    start: str
    between: list[str]
    slices: list[str]


@dataclasses.dataclass
class OwnBlockRead:
    """A value every device reads only as its own block along `axis` of N = `num_shards`."""

    axis: int
    num_shards: int
    dims: tuple[int, ...]
    scopes: list[ScopeRead]

    @property
    def block_dims(self) -> tuple[int, ...]:
        return tuple(d // self.num_shards if k == self.axis else d for k, d in enumerate(self.dims))


class NotOwnBlock(ValueError):
    """The value is read otherwise (the message says where)."""


def own_block_read(
    module: _hlo.HloModuleText, entry: Scope, name: str, groups: tuple[int, list[int]], device_id_op: str
) -> OwnBlockRead:
    """How the entry value `name` is read, if every read is the device's own block (`groups`:
    `group_positions` of the collective that produced it); raises NotOwnBlock otherwise."""
    dims = dims_of(entry.by_name[name])
    if not dims:
        raise NotOwnBlock(f"{name} is not one array with dimensions")
    evaluator = OffsetEvaluator(module, device_id_op)
    found = OwnBlockRead(-1, groups[0], dims, [])
    reads = [ScopeRead(entry, name, [], [])]
    calls = [i.attr("calls") for i in entry.computation.instructions if i.opcode == "fusion"]
    for user in entry.users.get(name, []):
        if user.opcode == "fusion":
            if calls.count(user.attr("calls")) > 1:
                raise NotOwnBlock(f"{user.name}'s fused computation is shared with another fusion")
            inner = scope_of_fusion(module, entry, user)
            for number, operand in enumerate(user.operands):
                if operand == name:
                    reads.append(ScopeRead(inner, inner.parameter(number).name, [], []))
    for read in reads:
        follow_reads(read, dims, found, evaluator, groups, skip_fusions=read.scope is entry)
        if read.slices:
            found.scopes.append(read)
        elif read.scope is not entry:
            raise NotOwnBlock(f"{read.scope.fusion} takes {name} and never slices it")
    if not found.scopes:
        raise NotOwnBlock(f"{name} is never sliced")
    return found


def follow_reads(read: ScopeRead, dims, found: OwnBlockRead, evaluator, groups, skip_fusions: bool) -> None:
    """Walk the users of `read.start` through pointwise ops of its shape to own-block slices."""
    scope, seen, stack = read.scope, {read.start}, [read.start]
    while stack:
        value = stack.pop()
        if scope.by_name[value].is_root:
            raise NotOwnBlock(f"{value} is the result of {scope.computation.name}")
        for user in scope.users.get(value, []):
            if user.opcode == "fusion" and skip_fusions and value == read.start:
                continue  # followed in the fused computation (`own_block_read`)
            if user.opcode == "dynamic-slice" and user.operands[0] == value and value not in user.operands[1:]:
                check_own_block_slice(scope, user, dims, found, evaluator, groups)
                read.slices.append(user.name)
            elif user.opcode in POINTWISE and dims_of(user) == dims:
                if user.name not in seen:
                    seen.add(user.name)
                    read.between.append(user.name)
                    stack.append(user.name)
            else:
                raise NotOwnBlock(f"{user.opcode} {user.name} reads {value} whole")
    order = {inst.name: k for k, inst in enumerate(scope.computation.instructions)}
    read.between.sort(key=order.__getitem__)


def check_own_block_slice(scope: Scope, inst: _hlo.Instruction, dims, found: OwnBlockRead, evaluator, groups) -> None:
    """`inst` (a dynamic-slice of a value of `dims`) takes each device's own block along one axis."""
    num_shards, positions = groups
    sizes = [int(s) for s in (inst.attr("dynamic_slice_sizes") or "").strip("{}").split(",") if s.strip()]
    split = [k for k, (d, s) in enumerate(zip(dims, sizes)) if s != d]
    if len(sizes) != len(dims) or len(split) != 1 or sizes[split[0]] * num_shards != dims[split[0]]:
        raise NotOwnBlock(f"{inst.name} is not one 1/{num_shards} block of {list(dims)} (sizes {sizes})")
    axis = split[0]
    if found.axis not in (-1, axis):
        raise NotOwnBlock(f"{inst.name} slices axis {axis}, another read axis {found.axis}")
    for device, position in enumerate(positions):
        for k, offset in enumerate(inst.operands[1:]):
            start = evaluator.value(scope, offset, device)
            if start is None:
                raise NotOwnBlock(f"{inst.name}: offset {offset} is not known per device")
            start = min(max(start, 0), dims[k] - sizes[k])  # dynamic-slice clamps its start
            if start != (position * sizes[k] if k == axis else 0):
                raise NotOwnBlock(f"{inst.name}: device {device} reads another block than its own")
    found.axis = axis
