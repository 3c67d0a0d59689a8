"""Editing a parsed HLO module in place, for the rule rewrites at the hook (`sharding.apply`):
fresh instruction names and channel ids, shapes written with layouts, new fused computations, and
the clean-up XLA needs before it takes the module back (no fused instruction without users, no
fusion parameter nothing reads, every instruction after its operands)."""

from __future__ import annotations

import dataclasses
import re

from disco_jax import _hlo


def layout(shape: str) -> str:
    """The layout of a one-array shape text (`{1,0}`), or ''."""
    m = re.search(r"\{[^{}]*\}\s*$", shape)
    return m.group(0) if m else ""


def default_layout(rank: int) -> str:
    """Row-major: the last dimension minor-most."""
    return "{" + ",".join(str(k) for k in reversed(range(rank))) + "}"


def array(dtype: str, dims, minor_to_major: str | None = None) -> str:
    """A one-array shape text with a layout (row-major unless given)."""
    dims = list(dims)
    return f"{dtype}[{','.join(map(str, dims))}]{minor_to_major or default_layout(len(dims))}"


def is_default_layout(shape: str, rank: int) -> bool:
    return layout(shape) in ("", default_layout(rank))


def tuple_shapes(shape: str) -> list[str]:
    """The element shapes of a tuple shape text (the shape itself when it is one array)."""
    if not shape.startswith("("):
        return [shape]
    return [re.sub(r"/\*.*?\*/", "", s).strip() for s in _hlo.split_top_level(shape[1:-1])]


def dimensions_attr(order) -> tuple[str, str]:
    """The `dimensions={...}` attribute of a transpose, concatenate or collective."""
    return ("dimensions", "{" + ",".join(map(str, order)) + "}")


def header(name: str, params: list[_hlo.Instruction], root: _hlo.Instruction) -> str:
    """A computation's header line, from its parameters and root (shapes with layouts)."""
    params = sorted(params, key=lambda p: int(p.literal))
    return f"%{name} ({', '.join(f'{p.name}: {p.shape}' for p in params)}) -> {root.shape} {{"


def rename_uses(comp: _hlo.Computation, old: str, new: str) -> None:
    """Every operand `old` in `comp` read as `new` instead."""
    for inst in comp.instructions:
        if old in inst.operands:
            inst.operands = [new if o == old else o for o in inst.operands]


def drop_unused(comp: _hlo.Computation, removable) -> None:
    """Remove the instructions nothing reads that `removable(inst)` allows (never the root or a
    parameter), repeatedly."""
    while True:
        used = {o for i in comp.instructions for o in i.operands}
        dead = {
            i.name
            for i in comp.instructions
            if i.name not in used and not i.is_root and i.opcode != "parameter" and removable(i)
        }
        if not dead:
            return
        comp.instructions = [i for i in comp.instructions if i.name not in dead]


def topological(insts: list[_hlo.Instruction]) -> list[_hlo.Instruction]:
    """`insts` reordered so that every instruction comes after its operands (stable otherwise)."""
    by_name = {i.name: i for i in insts}
    placed: set[str] = set()
    started: set[str] = set()  # on the stack: a cycle is left as it is, not followed forever
    out: list[_hlo.Instruction] = []

    def inputs(inst: _hlo.Instruction):
        preds = (inst.attr("control-predecessors") or "").strip("{}")
        return iter([*inst.operands, *(p.strip().lstrip("%") for p in preds.split(",") if p.strip())])

    def place(inst: _hlo.Instruction) -> None:
        started.add(inst.name)
        stack = [(inst, inputs(inst))]
        while stack:
            current, pending = stack[-1]
            nxt = next((by_name[o] for o in pending if o in by_name and o not in placed | started), None)
            if nxt is not None:
                started.add(nxt.name)
                stack.append((nxt, inputs(nxt)))
                continue
            stack.pop()
            if current.name not in placed:
                placed.add(current.name)
                out.append(current)

    for inst in insts:
        place(inst)
    return out


class ModuleEditor:
    """A parsed module being rewritten: fresh names and channel ids, the computations it adds, the
    fused computations it touched (cleaned by `finish`)."""

    def __init__(self, module: _hlo.HloModuleText, text: str):
        self.module = module
        self.names = {i.name for c in module.computations for i in c.instructions} | {
            c.name for c in module.computations
        }
        self.channel = max((int(c) for c in re.findall(r"channel_id=(\d+)", text)), default=0)
        self.counter = 0
        self.touched: set[str] = set()  # fused computations whose parameters may now be unused

    def fresh(self, stem: str) -> str:
        while True:
            self.counter += 1
            name = f"{stem}.{self.counter}"
            if name not in self.names:
                self.names.add(name)
                return name

    def inst(self, stem, shape, opcode, operands, attrs=(), literal=None, name=None) -> _hlo.Instruction:
        """A new instruction, named `name` or freshly from `stem`."""
        return _hlo.Instruction(name or self.fresh(stem), shape, opcode, list(operands), literal, list(attrs))

    def collective_attrs(self, like: _hlo.Instruction, kept: tuple[str, ...]) -> list[tuple[str, str]]:
        """A new collective's attributes: a fresh channel id, `like`'s `kept` ones (replica groups,
        ...), and `dimensions={0}` (it scatters or gathers along the first axis)."""
        self.channel += 1
        attrs = [("channel_id", str(self.channel))]
        attrs += [(k, v) for k, v in like.attrs if k in kept]
        return [*attrs, dimensions_attr([0])]

    def add_computation(self, stem: str, params: list[tuple[str, str]], body: list[_hlo.Instruction]) -> str:
        """A fused computation of `body` (its last instruction the root) over `params` (name,
        shape); returns its name. New computations go before the entry."""
        name = self.fresh(stem)
        insts = [self.inst("", shape, "parameter", [], literal=str(k), name=p) for k, (p, shape) in enumerate(params)]
        body[-1] = dataclasses.replace(body[-1], is_root=True)
        comp = _hlo.Computation(name, header(name, insts, body[-1]), insts + body)
        self.module.computations.insert(self.module.computations.index(self.module.entry), comp)
        return name

    def finish(self) -> None:
        """Drop what the rewrites left unused inside the fusions they touched (XLA rejects fused
        instructions without users) and the fusion parameters nothing reads."""
        entry = self.module.entry
        for name in sorted(self.touched):
            comp = self.module.computation(name)
            drop_unused(comp, lambda i: True)
            params = sorted((i for i in comp.instructions if i.opcode == "parameter"), key=lambda i: int(i.literal))
            used = {o for i in comp.instructions for o in i.operands}
            keep = [p for p in params if p.name in used]
            if len(keep) == len(params):
                comp.header = header(comp.name, params, comp.root)
                continue
            numbers = {p.name: k for k, p in enumerate(keep)}
            comp.instructions = [
                dataclasses.replace(i, literal=str(numbers[i.name])) if i.name in numbers else i
                for i in comp.instructions
                if i.opcode != "parameter" or i.name in numbers
            ]
            comp.header = header(comp.name, [i for i in comp.instructions if i.opcode == "parameter"], comp.root)
            for k, inst in enumerate(entry.instructions):
                if inst.opcode == "fusion" and (inst.attr("calls") or "").lstrip("%") == name:
                    operands = [inst.operands[int(p.literal)] for p in keep]
                    entry.instructions[k] = dataclasses.replace(inst, operands=operands)
        drop_unused(entry, lambda i: i.opcode in ("get-tuple-element", "bitcast"))
        for comp in [entry, *(self.module.computation(name) for name in self.touched)]:
            comp.instructions = topological(comp.instructions)
