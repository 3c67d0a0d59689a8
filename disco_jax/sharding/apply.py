"""The proven sharding rules applied to a module at the hook: `apply_rules(text) -> Applied`.

What a compiler that has no reduce-scatter creator and no all-gather combiner (XLA:CPU) leaves of
a sharded weight update: one all-reduce of the gradients, each device slicing its own block of
them inside the update's fusions, and one all-gather per split parameter. Three rewrites, each
made only where the rules that justify it are proven (`rules.require`), and recorded:

1. **Reduce-scatter** (`own_block_of_all_reduce`; `own_block_through_elementwise[2]` where the
   slice sits behind elementwise ops; `grouped_reduce_scatter` for several gradients). The
   operands of an all-reduce that every device reads only as its own block (`slices.own_block_read`)
   leave it: each is viewed as [N, k] (row i: block i, flattened), the views are concatenated
   along axis 1 in one kLoop fusion, and one `reduce-scatter` along axis 0 gives each device its
   [1, sum k] row. Every fusion that sliced the gradient reads that row instead: its slice becomes
   a `slice` + `reshape` of the row, and the elementwise ops between the gradient and the slice
   run on the block (their other operands sliced the same way). The other operands stay in the
   all-reduce.
2. **The shard, not the gathered parameter** (`own_block_of_all_gather`, `sharding.gathered`): a
   fusion that reads only its own block of an all-gather reads the all-gather's operand.
3. **Grouped all-gather** (`grouped_all_gather`, `sharding.gathers`). The all-gathers whose
   results are only the step's outputs (the updated parameters), grouped by the reduce-scatters
   they depend on (so they follow the gradients' buckets), become one all-gather each group.
4. **Gathered again for each use** (`all_gather_before_use` per use, `sharding.regather`): only
   where a program's layout chooses it (`update.hook_backend` adds `REGATHER_RULE` to the
   backend's rules for that program), since it trades an all-gather for memory.

The rewrites leave the module's parameters, outputs and every other instruction as they were;
`Applied.applications` lists each application: the rule, the instructions it matched (`at`) and
the instruction it made (`result`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

from disco_jax import _hlo
from disco_jax.sharding import gathered, gathers, regather, rules
from disco_jax.sharding.hlo_edit import (
    ModuleEditor,
    array,
    dimensions_attr,
    is_default_layout,
    layout,
    rename_uses,
    tuple_shapes,
)
from disco_jax.sharding.slices import NotOwnBlock, OwnBlockRead, Scope, group_positions, own_block_read

REDUCE_SCATTER_RULE = "own_block_of_all_reduce"
ELEMENTWISE_RULES = ("own_block_through_elementwise", "own_block_through_elementwise2")
GROUPED_REDUCE_SCATTER_RULE = "grouped_reduce_scatter"
GROUPED_ALL_GATHER_RULE = gathers.RULE
OWN_BLOCK_OF_ALL_GATHER_RULE = gathered.RULE
RULES = (
    REDUCE_SCATTER_RULE,
    *ELEMENTWISE_RULES,
    GROUPED_REDUCE_SCATTER_RULE,
    GROUPED_ALL_GATHER_RULE,
    OWN_BLOCK_OF_ALL_GATHER_RULE,
)
# Applied only to programs whose layout chooses it (`update.hook_backend`): it trades time for memory.
REGATHER_RULE = regather.RULE


@dataclasses.dataclass(frozen=True)
class Applied:
    """The module text after the rewrites, and what was applied where."""

    text: str
    applications: tuple[dict, ...] = ()

    def counts(self) -> dict[str, int]:
        """Applications per rule."""
        out: dict[str, int] = {}
        for a in self.applications:
            out[a["rule"]] = out.get(a["rule"], 0) + 1
        return out


@functools.cache
def proven() -> frozenset[str]:
    """The rules of this module that z3 proved and the numeric check passed (once per process)."""
    found = set()
    for name in (*RULES, REGATHER_RULE):
        try:
            rules.require(name)
            found.add(name)
        except rules.RuleNotProven:
            pass
    return frozenset(found)


def apply_rules(text: str, allowed: frozenset[str] | None = None) -> Applied:
    """`text` with the reduce-scatter and grouped all-gather rewrites applied where they match
    (`allowed`: the rules that may be applied; default: every proven one)."""
    allowed = proven() if allowed is None else allowed & proven()
    scatters = REDUCE_SCATTER_RULE in allowed and "partition-id(" in text  # own blocks need device ids
    shards = OWN_BLOCK_OF_ALL_GATHER_RULE in allowed and "partition-id(" in text and " all-gather(" in text
    gathers_again = REGATHER_RULE in allowed and " all-gather(" in text
    grouped = GROUPED_ALL_GATHER_RULE in allowed and " all-gather(" in text
    if not scatters and not shards and not gathers_again and not grouped:
        return Applied(text)
    module = _hlo.parse_module(text)
    writer = _Writer(module, text, allowed)
    if scatters:
        for inst in list(module.entry.instructions):
            if inst.opcode == "all-reduce":
                writer.scatter(inst)
    if shards:  # before grouping: the gathers it reads through are the step's first ones
        writer.applications += gathered.read_shards(writer)
    if gathers_again:  # after the shard reads: the update's slices are no longer readers
        writer.applications += regather.regather(writer)
    if GROUPED_ALL_GATHER_RULE in allowed:
        writer.applications += gathers.group_all_gathers(writer)
    if not writer.applications:
        return Applied(text)
    writer.finish()
    return Applied(module.to_text(), tuple(writer.applications))


def scatterable(module: _hlo.HloModuleText) -> dict[str, OwnBlockRead]:
    """Per entry all-reduce result that every device reads only as its own block (by the name
    it is read by: a get-tuple-element of a variadic all-reduce, else the all-reduce), how it
    is read: what `apply_rules` turns into reduce-scatters."""
    if REDUCE_SCATTER_RULE not in proven():
        return {}
    entry, out = Scope(module.entry), {}
    elementwise = set(ELEMENTWISE_RULES) <= proven()
    for inst in module.entry.instructions:
        if inst.opcode == "all-reduce":
            for result, read in _scattered(module, entry, inst, elementwise).values():
                out[result] = read
    return out


def _is_sum(module: _hlo.HloModuleText, inst: _hlo.Instruction) -> bool:
    try:
        root = module.computation((inst.attr("to_apply") or "").lstrip("%")).root
    except KeyError:
        return False
    return root.opcode == "add"


def _results(entry: Scope, inst: _hlo.Instruction) -> dict[int, list[str]] | None:
    """Per operand of an all-reduce, the names its result is read by (get-tuple-elements of a
    variadic one); None when the tuple is read otherwise."""
    if not inst.shape.startswith("("):
        return {0: [inst.name]}
    out: dict[int, list[str]] = {}
    for user in entry.users.get(inst.name, []):
        if user.opcode != "get-tuple-element":
            return None
        out.setdefault(int(user.attr("index")), []).append(user.name)
    return out


def _scattered(module, entry: Scope, inst: _hlo.Instruction, elementwise: bool = True) -> dict:
    """operand index -> (result name, OwnBlockRead) for an all-reduce's operands read as blocks."""
    groups = group_positions(inst.attr("replica_groups"))
    results = _results(entry, inst)
    if groups is None or groups[0] < 2 or results is None or inst.attr("channel_id") is None:
        return {}
    if not _is_sum(module, inst):
        return {}
    out, claimed = {}, set()  # (computation, instruction) pairs an earlier operand's read rewrites
    for operand, names in results.items():
        if len(names) != 1:
            continue
        try:
            read = own_block_read(module, entry, names[0], groups, "partition-id")
        except NotOwnBlock:
            continue
        if not elementwise and any(r.between for r in read.scopes):
            continue
        if any(len(r.scope.by_name[b].operands) > 2 for r in read.scopes for b in r.between):
            continue  # the rules cover unary and binary elementwise ops
        touched = {(r.scope.computation.name, name) for r in read.scopes for name in r.between + r.slices}
        if touched & claimed:
            continue  # an op reading two gradients: each read would rewrite it
        claimed |= touched
        out[operand] = (names[0], read)
    return out


class _Writer(ModuleEditor):
    """The reduce-scatter rewrite of one module (`apply_rules`): the rules it may apply and the
    applications it made."""

    def __init__(self, module: _hlo.HloModuleText, text: str, allowed: frozenset[str]):
        super().__init__(module, text)
        self.allowed = allowed
        self.applications: list[dict] = []

    def scatter(self, inst: _hlo.Instruction) -> None:
        """Turn the operands of the all-reduce `inst` that are read as own blocks into one
        reduce-scatter per element type (one per operand without `grouped_reduce_scatter`)."""
        entry = Scope(self.module.entry)
        elementwise = set(ELEMENTWISE_RULES) <= self.allowed
        found = _scattered(self.module, entry, inst, elementwise)
        if not found:
            return
        shapes = tuple_shapes(inst.shape)
        packs: dict[str, list[int]] = {}
        for operand in found:
            key = _hlo.parse_shape(shapes[operand])[0].dtype
            if GROUPED_REDUCE_SCATTER_RULE not in self.allowed:
                key = f"{key}:{operand}"
            packs.setdefault(key, []).append(operand)
        for members in packs.values():
            self._reduce_scatter(entry, inst, members, {m: found[m] for m in members}, shapes)
        self._keep_all_reduce(entry, inst, [k for k in range(len(shapes)) if k not in found], shapes)

    def _reduce_scatter(self, entry: Scope, inst, members: list[int], found: dict, shapes: list[str]) -> None:
        n = next(iter(found.values()))[1].num_shards
        dtype = _hlo.parse_shape(shapes[members[0]])[0].dtype
        widths = [math.prod(found[m][1].dims) // n for m in members]
        total = sum(widths)
        packed = self._pack(entry, [inst.operands[m] for m in members], [found[m][1] for m in members], shapes, members)
        attrs = self.collective_attrs(inst, ("replica_groups", "use_global_device_ids", "to_apply"))
        scattered = self.inst("disco_reduce-scatter", array(dtype, (1, total)), "reduce-scatter", [packed], attrs)
        self.module.entry.instructions.append(scattered)
        offset, between = 0, {rule: [] for rule in ELEMENTWISE_RULES}
        for m, width in zip(members, widths):
            _, read = found[m]
            for scope_read in read.scopes:
                for name in scope_read.between:  # by arity: f(x) or u(x, y)
                    arity = len(scope_read.scope.by_name[name].operands)
                    between[ELEMENTWISE_RULES[arity - 1]].append(name)
                self._read_block(entry, scope_read, read, scattered.name, offset, width, dtype)
            offset += width
        at = [inst.name, *(found[m][0] for m in members)]
        self.applications.append({"rule": REDUCE_SCATTER_RULE, "at": at, "result": scattered.name})
        if len(members) > 1:
            self.applications.append(
                {
                    "rule": GROUPED_REDUCE_SCATTER_RULE,
                    "at": [inst.operands[m] for m in members],
                    "result": scattered.name,
                }
            )
        for rule, names in between.items():
            if names:
                self.applications.append({"rule": rule, "at": names, "result": scattered.name})

    def _pack(self, entry: Scope, operands: list[str], reads: list[OwnBlockRead], shapes, members) -> str:
        """The [N, sum k] view of the gradients (row i: every gradient's block i, flattened)."""
        n, dtype = reads[0].num_shards, _hlo.parse_shape(shapes[members[0]])[0].dtype
        widths = [math.prod(r.dims) // n for r in reads]
        only = reads[0]
        if len(reads) == 1 and only.axis == 0 and is_default_layout(shapes[members[0]], len(only.dims)):
            view = self.inst("disco_view", array(dtype, (n, widths[0])), "bitcast", operands)
            self.module.entry.instructions.append(view)
            return view.name
        params = [(self.fresh("disco_pack_param"), shapes[m]) for m in members]
        body, views = [], []
        for (param, _), read, width in zip(params, reads, widths):
            a, dims = read.axis, list(read.dims)
            split = [*dims[:a], n, dims[a] // n, *dims[a + 1 :]]
            value = param
            if a > 0:
                body.append(self.inst("disco_split", array(dtype, split), "reshape", [value]))
                order = [a, *range(a), *range(a + 1, len(split))]
                moved = array(dtype, [split[k] for k in order])
                body.append(self.inst("disco_order", moved, "transpose", [body[-1].name], [dimensions_attr(order)]))
                value = body[-1].name
            body.append(self.inst("disco_rows", array(dtype, (n, width)), "reshape", [value]))
            views.append(body[-1].name)
        if len(views) > 1:
            body.append(
                self.inst("disco_concat", array(dtype, (n, sum(widths))), "concatenate", views, [("dimensions", "{1}")])
            )
        comp = self.add_computation("disco_pack_computation", params, body)
        fusion = self.inst(
            "disco_pack",
            array(dtype, (n, sum(widths))),
            "fusion",
            operands,
            [("kind", "kLoop"), ("calls", "%" + comp)],
        )
        self.module.entry.instructions.append(fusion)
        return fusion.name

    def _read_block(self, entry: Scope, read, block: OwnBlockRead, row: str, offset: int, width: int, dtype) -> None:
        """Make the reads in `read.scope` take the device's block from `row` (the [1, K]
        reduce-scatter result): the start becomes a slice + reshape of the row, the ops between
        it and the slices run on the block, and the slices are dropped."""
        scope, comp = read.scope, read.scope.computation
        if scope.caller is None:
            source = row
        else:  # the row enters the fusion as a new parameter
            fusion = entry.by_name[scope.fusion]
            source = self._fusion_input(comp, fusion, row)
        start = scope.by_name[read.start]
        piece = self.inst(
            "disco_block_slice",
            array(dtype, (1, width)),
            "slice",
            [source],
            [("slice", f"{{[0:1], [{offset}:{offset + width}]}}")],
        )
        reshaped = self.inst(
            "disco_block",
            array(start.outputs[0].dtype, block.block_dims, layout(start.shape)),
            "reshape",
            [piece.name],
        )
        narrowed = {read.start: reshaped.name}
        new: list[_hlo.Instruction] = [piece, reshaped]
        offsets = scope.by_name[read.slices[0]].operands[1:]
        for name in read.between:
            old = scope.by_name[name]
            operands = []
            for o in old.operands:
                if o in narrowed:
                    operands.append(narrowed[o])
                elif o in read.between:
                    operands.append(o)
                else:
                    operands.append(self._operand_block(scope, o, offsets, block, new))
            shape = array(old.outputs[0].dtype, block.block_dims, layout(old.shape))
            new.append(dataclasses.replace(old, shape=shape, operands=operands, is_root=False))
        for sliced in read.slices:
            inst = scope.by_name[sliced]
            value = narrowed.get(inst.operands[0], inst.operands[0])
            rename_uses(comp, sliced, value)
            if inst.is_root:
                new = [dataclasses.replace(i, is_root=i.name == value) for i in new]
        drop = set(read.slices) | set(read.between)
        comp.instructions = [i for i in comp.instructions if i.name not in drop] + new
        self.touched.add(comp.name)

    def _fusion_input(self, comp: _hlo.Computation, fusion: _hlo.Instruction, row: str) -> str:
        """The parameter of `comp` that `fusion` passes `row` as (added when missing)."""
        entry = self.module.entry
        current = entry.by_name()[fusion.name]
        for number, operand in enumerate(current.operands):
            if operand == row:
                return next(i.name for i in comp.instructions if i.opcode == "parameter" and int(i.literal) == number)
        shape = entry.by_name()[row].shape
        param = self.inst("disco_row", shape, "parameter", [], literal=str(len(current.operands)))
        comp.instructions.insert(0, param)
        updated = dataclasses.replace(current, operands=[*current.operands, row])
        entry.instructions = [updated if i.name == fusion.name else i for i in entry.instructions]
        self.touched.add(comp.name)
        return param.name

    def _operand_block(self, scope: Scope, name: str, offsets, block: OwnBlockRead, new: list) -> str:
        """The device's block of an operand of an elementwise op being narrowed: a scalar
        broadcast again at the block's shape, anything else sliced by the same offsets."""
        inst = scope.by_name[name]
        shape = array(inst.outputs[0].dtype, block.block_dims, layout(inst.shape))
        if inst.opcode == "broadcast" and all(not s.dims for s in scope.by_name[inst.operands[0]].outputs):
            new.append(self.inst("disco_broadcast", shape, "broadcast", inst.operands, [("dimensions", "{}")]))
        else:
            sizes = "{" + ",".join(map(str, block.block_dims)) + "}"
            new.append(
                self.inst("disco_slice", shape, "dynamic-slice", [name, *offsets], [("dynamic_slice_sizes", sizes)])
            )
        return new[-1].name

    def _keep_all_reduce(self, entry: Scope, inst: _hlo.Instruction, kept: list[int], shapes: list[str]) -> None:
        """The all-reduce of the operands that stay (none: removed; one: no tuple)."""
        comp = self.module.entry
        users = [u for u in entry.users.get(inst.name, []) if u.opcode == "get-tuple-element"]
        index = {k: [u for u in users if int(u.attr("index")) == k] for k in range(len(shapes))}
        attrs = inst.attrs
        if not kept:
            replacement = []
        elif len(kept) == 1 and inst.shape.startswith("("):
            (k,) = kept
            names = [u.name for u in index[k]]
            single = dataclasses.replace(
                inst, name=names[0] if names else inst.name, shape=shapes[k], operands=[inst.operands[k]], attrs=attrs
            )
            replacement = [single]
            for other in names[1:]:
                rename_uses(comp, other, single.name)
        else:
            shape = "(" + ", ".join(shapes[k] for k in kept) + ")"
            replacement = [dataclasses.replace(inst, shape=shape, operands=[inst.operands[k] for k in kept])]
            for position, k in enumerate(kept):
                for u in index[k]:
                    u.attrs = [(a, str(position) if a == "index" else v) for a, v in u.attrs]
        removed = {inst.name} | {u.name for k, us in index.items() if k not in kept or len(kept) == 1 for u in us}
        position = next(k for k, i in enumerate(comp.instructions) if i.name == inst.name)
        rest = [i for i in comp.instructions if i.name not in removed]
        rest[position:position] = replacement
        comp.instructions = rest
