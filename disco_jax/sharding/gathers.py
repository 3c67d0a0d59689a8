"""The grouped all-gather (`grouped_all_gather`) applied at the hook: the all-gathers that wait for
reduce-scatters (the sharded update's new parameters), grouped by the reduce-scatters they wait for
(the gradient buckets), and those of the step's outputs that wait for none (new parameters
updated without a reduce-scatter, e.g. embedding tables whose rows the partitioner routes itself),
become one all-gather each group: the blocks viewed as [1, k] and
concatenated, one all-gather along axis 0 into [N, sum k], and per parameter a kLoop fusion, named
as the all-gather it replaces, that takes its columns back into its shape. A group never holds an
all-gather whose operand depends on another member (the grouped one would wait for itself)."""

from __future__ import annotations

from disco_jax import _hlo
from disco_jax.sharding.hlo_edit import ModuleEditor, array, dimensions_attr, topological
from disco_jax.sharding.slices import Scope, dims_of, group_positions

RULE = "grouped_all_gather"


def group_all_gathers(editor: ModuleEditor) -> list[dict]:
    """Group the entry's all-gathers that wait for the same reduce-scatters into one each;
    returns the applications (rule, the all-gathers grouped, the one that replaces them)."""
    comp = editor.module.entry
    entry = Scope(comp)
    candidates = [
        inst
        for inst in comp.instructions
        if inst.opcode == "all-gather"
        and len(inst.operands) == 1
        and inst.attr("channel_id") is not None
        and _gathered_axis(entry, inst) is not None
    ]
    scatters = _ancestors(comp, {i.name for i in comp.instructions if i.opcode == "reduce-scatter"})
    gathers = _ancestors(comp, {i.name for i in candidates})
    groups: dict[tuple, list[list[_hlo.Instruction]]] = {}
    root = comp.root
    for inst in candidates:
        waits = scatters[inst.operands[0]]
        outputs_only = root.opcode == "tuple" and all(u is root for u in entry.users.get(inst.name, []))
        if not waits and not outputs_only:
            continue  # neither a bucket's new parameter nor a step output: left where it is
        key = (inst.attr("replica_groups"), inst.attr("use_global_device_ids"), inst.outputs[0].dtype, waits)
        subgroups = groups.setdefault(key, [])
        group = next((g for g in subgroups if _independent(inst, g, gathers)), None)
        if group is None:
            subgroups.append([inst])
        else:
            group.append(inst)
    return [_all_gather(editor, entry, g) for subgroups in groups.values() for g in subgroups if len(g) > 1]


def _all_gather(editor: ModuleEditor, entry: Scope, members: list[_hlo.Instruction]) -> dict:
    n = group_positions(members[0].attr("replica_groups"))[0]
    dtype = members[0].outputs[0].dtype
    blocks = [entry.by_name[m.operands[0]] for m in members]
    widths = [b.outputs[0].elements for b in blocks]
    total = sum(widths)
    params = [(editor.fresh("disco_gather_param"), b.shape) for b in blocks]
    body = [editor.inst("disco_row", array(dtype, (1, w)), "reshape", [p]) for (p, _), w in zip(params, widths)]
    rows = [b.name for b in body]
    body.append(editor.inst("disco_concat", array(dtype, (1, total)), "concatenate", rows, [("dimensions", "{1}")]))
    pack = editor.add_computation("disco_gather_pack_computation", params, body)
    calls = [("kind", "kLoop"), ("calls", "%" + pack)]
    packed = editor.inst("disco_gather_pack", array(dtype, (1, total)), "fusion", [b.name for b in blocks], calls)
    attrs = editor.collective_attrs(members[0], ("replica_groups", "use_global_device_ids"))
    gathered = editor.inst("disco_all-gather", array(dtype, (n, total)), "all-gather", [packed.name], attrs)
    new, offset = [packed, gathered], 0
    for member, block, width in zip(members, blocks, widths):
        new.append(_unpack(editor, member, gathered, block, n, offset, width))
        offset += width
    names = {m.name for m in members}
    comp = editor.module.entry
    comp.instructions = [i for i in comp.instructions if i.name not in names] + new
    return {"rule": RULE, "at": [m.name for m in members], "result": gathered.name}


def _unpack(editor: ModuleEditor, member, gathered, block, n: int, offset: int, width: int) -> _hlo.Instruction:
    """A fusion, named as the all-gather `member` it replaces, that takes its columns of the
    [N, K] gathered buffer back into its shape: [N, k] -> [N, *block] -> device axis moved next
    to the gathered axis a -> the whole parameter."""
    dtype = member.outputs[0].dtype
    a = int(member.attr("dimensions").strip("{}"))
    dims = list(block.outputs[0].dims)
    param = editor.fresh("disco_gathered")
    columns = [("slice", f"{{[0:{n}], [{offset}:{offset + width}]}}")]
    body = [editor.inst("disco_columns", array(dtype, (n, width)), "slice", [param], columns)]
    if a > 0:
        body.append(editor.inst("disco_blocks", array(dtype, (n, *dims)), "reshape", [body[-1].name]))
        order = [*range(1, a + 1), 0, *range(a + 1, len(dims) + 1)]
        moved = array(dtype, [(n, *dims)[k] for k in order])
        body.append(editor.inst("disco_order", moved, "transpose", [body[-1].name], [dimensions_attr(order)]))
    body.append(editor.inst("disco_whole", member.shape, "reshape", [body[-1].name]))
    comp = editor.add_computation("disco_gather_unpack_computation", [(param, gathered.shape)], body)
    calls = [("kind", "kLoop"), ("calls", "%" + comp)]
    return editor.inst("", member.shape, "fusion", [gathered.name], calls, name=member.name)


def _independent(inst: _hlo.Instruction, group: list[_hlo.Instruction], gathers: dict) -> bool:
    """Neither `inst` nor any all-gather of `group` depends on the other (`gathers`: per value, the
    candidate all-gathers it depends on)."""
    return not any(m.name in gathers[inst.operands[0]] or inst.name in gathers[m.operands[0]] for m in group)


def _ancestors(comp: _hlo.Computation, among: set[str]) -> dict[str, frozenset[str]]:
    """Per entry value, the instructions of `among` it depends on (itself included)."""
    out: dict[str, frozenset[str]] = {}
    for inst in topological(comp.instructions):
        found = frozenset().union(*(out.get(o, frozenset()) for o in inst.operands))
        out[inst.name] = found | {inst.name} if inst.name in among else found
    return out


def _gathered_axis(entry: Scope, inst: _hlo.Instruction) -> int | None:
    """The axis an all-gather of one array gathers along, when its output is its operand with
    that axis N times longer (N its group size)."""
    groups = group_positions(inst.attr("replica_groups"))
    operand = entry.by_name.get(inst.operands[0])
    block, whole = (None if operand is None else dims_of(operand)), dims_of(inst)
    axis = (inst.attr("dimensions") or "").strip("{}")
    if groups is None or block is None or whole is None or not axis.isdigit() or len(block) != len(whole):
        return None
    a = int(axis)
    expected = tuple(d * groups[0] if k == a else d for k, d in enumerate(block))
    return a if expected == whole else None
