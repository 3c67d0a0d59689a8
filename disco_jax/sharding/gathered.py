"""`own_block_of_all_gather` applied at the hook: a fusion that reads only each device's own block of
an all-gather reads the all-gather's operand instead.

With parameters sharded too (`sharding.params`) the step all-gathers each parameter at its start
and the user's update computes the new parameter from the gathered value; the partitioner then
takes each device's own block of that value (a `dynamic-slice` at `partition-id` times the block
size) inside the update's fusion. That block is the shard the step took: reading it keeps the
gathered parameter alive until the update, after the backward pass, beside the gradients and
their reduce-scatter buffer. Where a fusion reads the all-gather only through such slices (none
behind other ops, the fusion's computation its own), the fusion takes the all-gather's operand
and its slices go; the all-gather stays for its other users (the dots), and XLA's buffer
assignment can free it after the last of them. Before fusion (XLA:GPU's hook stage) the slice is
an entry `dynamic-slice` of the all-gather, replaced by the shard the same way. XLA:GPU keeps the
slices of the gathered value itself (8 `dynamic-slice`s in the deviceless H100 compile of the zoo's
tiny MLP); the hook applies the rule where the backend wants the hook's rules (`Backend.hook_rules`).
"""

from __future__ import annotations

import dataclasses

from disco_jax import _hlo
from disco_jax.sharding.hlo_edit import ModuleEditor, rename_uses
from disco_jax.sharding.slices import (
    NotOwnBlock,
    OffsetEvaluator,
    OwnBlockRead,
    Scope,
    ScopeRead,
    check_own_block_slice,
    dims_of,
    follow_reads,
    group_positions,
    scope_of_fusion,
)

RULE = "own_block_of_all_gather"


def read_shards(editor: ModuleEditor) -> list[dict]:
    """Make every fusion that reads only its own block of an entry all-gather read the gathered
    operand; returns the applications (rule, the all-gather and the fusions, the operand read)."""
    comp = editor.module.entry
    calls = [i.attr("calls") for i in comp.instructions if i.opcode == "fusion"]
    applications = []
    for gather in [i for i in comp.instructions if i.opcode == "all-gather" and len(i.operands) == 1]:
        # Anew per gather: a rewrite below replaces a fusion, and one fusion may read the own
        # blocks of two gathers (the second rewrite must start from the first's operands).
        entry = Scope(comp)
        groups = group_positions(gather.attr("replica_groups"))
        dims, shard = dims_of(gather), entry.by_name.get(gather.operands[0])
        axis = (gather.attr("dimensions") or "").strip("{}")
        if groups is None or gather.attr("channel_id") is None or dims is None or shard is None:
            continue
        if not axis.isdigit() or dims_of(shard) is None:
            continue
        fused = []
        for user in list(entry.users.get(gather.name, [])):
            if user.opcode == "dynamic-slice" and _slice_is_shard(editor, entry, user, shard, int(axis), dims, groups):
                fused.append(user.name)  # before fusion (XLA:GPU's hook stage): the slice is the shard
            elif user.opcode != "fusion" or calls.count(user.attr("calls")) > 1:
                continue
            elif _read_shard(editor, entry, user, gather, shard, int(axis), dims, groups):
                fused.append(user.name)
        if fused:
            applications.append({"rule": RULE, "at": [gather.name, *fused], "result": shard.name})
    return applications


def _slice_is_shard(editor, entry: Scope, inst, shard, axis: int, dims, groups) -> bool:
    """Replace the entry's `inst` (a dynamic-slice of an all-gather) by `shard` where it takes each
    device's own block along `axis`; False (nothing changed) otherwise."""
    found = OwnBlockRead(-1, groups[0], dims, [])
    try:
        check_own_block_slice(entry, inst, dims, found, OffsetEvaluator(editor.module), groups)
    except NotOwnBlock:
        return False
    if found.axis != axis or inst.shape != shard.shape or inst.is_root:
        return False
    comp = editor.module.entry
    rename_uses(comp, inst.name, shard.name)
    comp.instructions = [i for i in comp.instructions if i.name != inst.name]
    return True


def _read_shard(editor, entry: Scope, fusion, gather, shard, axis: int, dims, groups) -> bool:
    """Rewrite `fusion` to read `shard` where it reads `gather` only as its own block along
    `axis`; False (nothing changed) where it reads it otherwise."""
    inner = scope_of_fusion(editor.module, entry, fusion)
    numbers = [k for k, o in enumerate(fusion.operands) if o == gather.name]
    reads = []
    for number in numbers:
        read = ScopeRead(inner, inner.parameter(number).name, [], [])
        found = OwnBlockRead(-1, groups[0], dims, [])
        try:
            follow_reads(read, dims, found, OffsetEvaluator(editor.module), groups, skip_fusions=False)
        except NotOwnBlock:
            return False
        block = found.block_dims if found.axis >= 0 else None
        if read.between or not read.slices or found.axis != axis or block != dims_of(shard):
            return False
        if any(inner.by_name[s].is_root or inner.by_name[s].shape != shard.shape for s in read.slices):
            return False
        reads.append(read)
    comp: _hlo.Computation = inner.computation
    for read in reads:
        param = inner.by_name[read.start]
        comp.instructions = [dataclasses.replace(i, shape=shard.shape) if i is param else i for i in comp.instructions]
        for s in read.slices:
            rename_uses(comp, s, read.start)
        comp.instructions = [i for i in comp.instructions if i.name not in read.slices]
    operands = [shard.name if o == gather.name else o for o in fusion.operands]
    editor.module.entry.instructions = [
        dataclasses.replace(i, operands=operands) if i.name == fusion.name else i
        for i in editor.module.entry.instructions
    ]
    editor.touched.add(comp.name)
    return True
