"""Gathering a sharded parameter again for each use (`regather`), applied at the hook to programs
whose layout asks for it (`update.Layout.regather`: FSDP's "reshard after forward").

With parameters sharded (`sharding.params`) the step all-gathers each parameter once, and that
value (on XLA:GPU also its one `convert` to the compute dtype) feeds the forward and the backward
dots, so it lives from the forward pass to the backward one. Here every reader of it beyond the
first gets its own all-gather of the shard (and its own convert): each gathered copy can die after
its one reader, at the price of another all-gather. It is the proven `all_gather_before_use`
applied to each use (an all-gather is a function of its operand, so two of them are equal); the
compiler's scheduler decides when each runs. It trades time for memory, so it is a choice the
weight-update planner makes, never a rule every program gets (`hook_backend`).
"""

from __future__ import annotations

from disco_jax import _hlo
from disco_jax.sharding.hlo_edit import ModuleEditor

RULE = "all_gather_before_use"


def regather(editor: ModuleEditor) -> list[dict]:
    """Give every reader but the first of each gathered entry parameter (an all-gather of a
    `parameter`, or its only reader when that is a `convert`) its own all-gather (and convert);
    returns the applications (rule, the all-gather, the copies made)."""
    entry = editor.module.entry
    by_name = {i.name: i for i in entry.instructions}
    readers: dict[str, list[_hlo.Instruction]] = {}
    for inst in entry.instructions:
        for o in dict.fromkeys(inst.operands):
            readers.setdefault(o, []).append(inst)
    applications, before = [], {}
    for gather in [i for i in entry.instructions if i.opcode == "all-gather"]:
        if len(gather.operands) != 1 or by_name.get(gather.operands[0], gather).opcode != "parameter":
            continue
        chain = [gather]
        first = readers.get(gather.name, [])
        if len(first) == 1 and first[0].opcode == "convert":
            chain.append(first[0])
        uses = [r for r in readers.get(chain[-1].name, []) if not r.is_root]
        copies = []
        for reader in uses[1:]:
            made, operand = [], gather.operands[0]
            for inst in chain:
                attrs = inst.attrs
                if inst.opcode == "all-gather":
                    editor.channel += 1
                    attrs = [(k, str(editor.channel) if k == "channel_id" else v) for k, v in attrs]
                made.append(editor.inst(inst.name + ".regather", inst.shape, inst.opcode, [operand], attrs))
                operand = made[-1].name
            reader.operands[:] = [operand if o == chain[-1].name else o for o in reader.operands]
            before.setdefault(reader.name, []).extend(made)
            copies.append(made[0].name)
        if copies:
            applications.append({"rule": RULE, "at": [gather.name], "result": copies})
    if before:  # each copy right before its reader
        entry.instructions = [new for inst in entry.instructions for new in (*before.get(inst.name, []), inst)]
    return applications
