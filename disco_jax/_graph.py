"""The graph IR: a captured HLO module as primitive ops, data edges and gradients.

`build_graph(text, fusible)` opens XLA's own loop fusions of the entry computation into their
instructions ("primitive ops"), merges the copies XLA made when it duplicated a producer into several
fusions (so a producer is one op, possibly fused into several groups), and records:

* `Op`: one primitive op, with its kind:
  - ``fusible``: an op the compiler's loop fusion can hold (`fusible`: `Backend.fusible`);
  - ``opaque``: a kernel we never fuse across (dots, custom fusions, control flow, custom calls,
    collectives other than the gradient all-reduces);
  - ``free``: no kernel of its own (parameter, constant, get-tuple-element, tuple, bitcast);
  - ``reduced``: the all-reduced value of one gradient (its operand is the gradient's producer).
* `Gradient`: one operand of an entry all-reduce: its producer op, bytes, and which gradients it
  may share a collective with (`compat`: same reduction, replica groups and dtype).
* `xla_groups` / `xla_buckets`: how XLA grouped the ops into fusions and gradients into
  all-reduces, which is the JAX-default strategy the search starts from.

Everything downstream (strategy, simulator, rewrite) works on op ids of one `Graph`, and asks the graph its
structural questions: `free_sources`, `consumers(op)`, `reduced_dependencies`, `xla_holders`,
`kernel_signature(kernel)`, `kernel_reads(kernel)`; each is computed once per graph and cached on it.

The IR is the bottom of the package: it imports only `_hlo`, and holds no backend and no cost. The
compiler a graph was captured for travels beside it in a `disco_jax._program.Program`; what an op
costs (work, transfer bytes, the other collectives) is `disco_jax.cost`'s knowledge: functions over a
graph, cached on it by `per_graph` (those that also read the compiler: over a program, `per_program`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
from collections.abc import Callable
from typing import Any

from disco_jax import _hlo

FREE = frozenset("parameter constant get-tuple-element tuple bitcast after-all".split())


@dataclasses.dataclass
class Op:
    """A primitive op. `inst` is its instruction; its operand names are rewritten at emission."""

    id: int
    name: str
    kind: str  # 'fusible' | 'opaque' | 'free' | 'reduced'
    inst: _hlo.Instruction
    operands: tuple[int, ...]
    xla_kernel: str  # entry instruction that computed it in XLA's module
    gradient: int | None = None  # for 'reduced' ops: the gradient id

    @property
    def opcode(self) -> str:
        return self.inst.opcode

    @property
    def output_bytes(self) -> int:
        return self.inst.output_bytes


@dataclasses.dataclass(frozen=True)
class Gradient:
    """One tensor carried by an entry all-reduce of the captured module."""

    id: int
    producer: int  # op id of the value that is reduced
    reduced: int  # op id of the 'reduced' op standing for the result
    nbytes: int
    compat: tuple  # gradients with equal compat may share one all-reduce
    source: str  # name of the all-reduce instruction that carried it in XLA's module
    result_name: str  # the name users referred to it by (get-tuple-element or the all-reduce)


_cache = functools.partial(dataclasses.field, default_factory=dict, init=False, repr=False, compare=False)


def per_graph[Record, Value](compute: Callable[[Record], Value]) -> Callable[[Record], Value]:
    """`compute(graph)`, computed once per graph and kept in its `derived` slot, keyed by the function:
    the cost model's tables (`cost.work.work_per_op`...) cost the search a dict lookup, and the
    graph knows nothing of how they are computed. Any record with a `derived` slot caches the same
    way: a `_program.Program` keeps the tables that read its compiler too (`_program.per_program`)."""

    @functools.wraps(compute)
    def cached(record: Record) -> Value:
        derived = record.derived  # type: ignore[attr-defined]
        found = derived.get(cached, record)  # the record itself: no value yet (None may be one)
        if found is record:
            found = derived[cached] = compute(record)
        return found

    return cached


@dataclasses.dataclass
class Graph:
    module: _hlo.HloModuleText
    ops: list[Op]
    gradients: list[Gradient]
    xla_groups: list[frozenset[int]]  # XLA's kernels over fusible ops (singletons included)
    xla_homes: dict[int, int]  # fusible op id -> index in xla_groups that exports it
    xla_buckets: list[tuple[int, ...]]  # gradient ids per XLA all-reduce
    xla_kernel_names: list[str]  # entry instruction name of each xla_groups entry
    xla_exports: list[list[int]]  # op ids each XLA kernel outputs, in its output order
    allreduce_templates: dict[tuple, _hlo.Instruction]  # compat -> an original all-reduce
    entry_values: dict[str, int]  # entry instruction name -> op id holding its value
    outputs: list[int]  # op ids of the module's output (several when ROOT was a multi-output fusion)
    fingerprint: str
    # XLA's kernels in schedule order (XLA:GPU: `gpu_schedule.ScheduledKernel`s); () when unscheduled.
    xla_schedule: tuple = ()
    # Caches of the queries below that take an argument (the others are cached properties).
    _signatures: dict[frozenset[int], str] = _cache()
    _consumers: dict[int, tuple[int, ...]] = _cache()
    _inputs: dict[frozenset[int], tuple[int, tuple[int, ...]]] = _cache()
    derived: dict[Callable[[Graph], Any], Any] = _cache()  # what layers above computed (`per_graph`)

    def __post_init__(self):
        users: list[list[int]] = [[] for _ in self.ops]
        for op in self.ops:
            for o in set(op.operands):
                users[o].append(op.id)
        self.users = [tuple(u) for u in users]
        self.output_set = frozenset(self.outputs)

    @functools.cached_property
    def fusible_ops(self) -> list[int]:
        return [op.id for op in self.ops if op.kind == "fusible"]

    @functools.cached_property
    def opaque_ops(self) -> list[int]:
        return [op.id for op in self.ops if op.kind == "opaque"]

    @functools.cached_property
    def opaque_kernels(self) -> list[frozenset[int]]:
        """One kernel per opaque op, in `opaque_ops` order (the same objects every time)."""
        return [frozenset([o]) for o in self.opaque_ops]

    @functools.cached_property
    def free_sources(self) -> list[tuple[int, ...]]:
        """For every op, the non-free ops its value comes from through chains of free ops."""
        sources: list[tuple[int, ...]] = []
        for op in self.ops:
            if op.kind != "free":
                sources.append((op.id,))
            else:
                found: list[int] = []
                for o in op.operands:
                    found.extend(sources[o])
                sources.append(tuple(dict.fromkeys(found)))
        return sources

    def consumers(self, o: int) -> tuple[int, ...]:
        """Non-free consumers of an op's value, looking through free ops; -1 for the module output."""
        found = self._consumers.get(o)
        if found is None:
            out, stack, seen = [], list(self.users[o]), set()
            while stack:
                u = stack.pop()
                if u in seen:
                    continue
                seen.add(u)
                if self.ops[u].kind == "free":
                    if u in self.output_set:
                        out.append(-1)
                    stack.extend(self.users[u])
                else:
                    out.append(u)
            if o in self.output_set:
                out.append(-1)
            found = self._consumers[o] = tuple(out)
        return found

    def kernel_reads(self, members: frozenset[int]) -> tuple[int, tuple[int, ...]]:
        """A kernel's last op, and the non-free ops outside it whose values it reads (through free ops)."""
        found = self._inputs.get(members)
        if found is None:
            sources, seen = self.free_sources, {}
            for o in sorted(members):
                for operand in self.ops[o].operands:
                    for src in sources[operand]:
                        if src not in members:
                            seen[src] = None
            found = self._inputs[members] = (max(members), tuple(seen))
        return found

    @functools.cached_property
    def loop_allreduces(self) -> tuple[tuple[str, str], ...]:
        """Loop bodies' all-reduces of several tensors (`_hlo.loop_body_allreduces`): what `packed_loops` packs."""
        return _hlo.loop_body_allreduces(self.module)

    @functools.cached_property
    def xla_holders(self) -> dict[int, frozenset[int]]:
        """Per fusible op, the indices of the `xla_groups` holding it (several where XLA duplicated it)."""
        holders: dict[int, frozenset[int]] = {}
        for gi, g in enumerate(self.xla_groups):
            holders.update((o, holders.get(o, frozenset()) | {gi}) for o in g)
        return holders

    @functools.cached_property
    def reduced_dependencies(self) -> list[int]:
        """Per gradient, a bitmask of the gradients whose all-reduced value its producer depends on
        (forward-pass all-reduces such as batch-norm statistics feed later gradients)."""
        masks: list[int] = []
        for op in self.ops:
            m = functools.reduce(int.__or__, (masks[v] for v in op.operands), 0)
            if op.kind == "reduced" and op.gradient is not None:
                m |= 1 << op.gradient
            masks.append(m)
        return [masks[g.producer] for g in self.gradients]

    def kernel_signature(self, members: frozenset[int]) -> str:
        """A name for a kernel that is equal for equal computations in any module: its ops in
        order with shapes and attributes, internal edges by position, inputs by shape."""
        sig = self._signatures.get(members)
        if sig is None:
            ordered = sorted(members)
            pos = {o: i for i, o in enumerate(ordered)}
            parts = []
            for o in ordered:
                refs = []
                for v in self.ops[o].operands:
                    refs.append(f"#{pos[v]}" if v in pos else "in:" + _strip_layout(self.ops[v].inst.shape))
                parts.append(self._op_signature(o) + "(" + ",".join(refs) + ")")
            sig = self._signatures[members] = hashlib.sha1("|".join(parts).encode()).hexdigest()[:20]
        return sig

    def _op_signature(self, o: int) -> str:
        inst = self.ops[o].inst
        attrs = inst.attrs_text(drop_metadata=True)
        attrs = re.sub(
            r"(calls|to_apply)=%?[\w.\-]+", lambda m: f"{m.group(1)}=" + self._called_body(m.group(0)), attrs
        )
        attrs = re.sub(r"channel_id=\d+, ?", "", attrs)
        return f"{inst.opcode}:{_strip_layout(inst.shape)}:{inst.literal or ''}:{attrs}"

    def _called_body(self, attr: str) -> str:
        name = attr.split("=", 1)[1].lstrip("%")
        try:
            comp = self.module.computation(name)
        except KeyError:
            return name
        return "[" + ";".join(f"{i.opcode}:{_strip_layout(i.shape)}" for i in comp.instructions) + "]"

    def summary(self) -> dict:
        kinds: dict[str, int] = {}
        for op in self.ops:
            kinds[op.kind] = kinds.get(op.kind, 0) + 1
        return {
            "ops": len(self.ops),
            **kinds,
            "gradients": len(self.gradients),
            "xla_fusions": sum(1 for g in self.xla_groups if len(g) > 1),
            "xla_allreduces": len(self.xla_buckets),
            "gradient_bytes": sum(g.nbytes for g in self.gradients),
        }


def _strip_layout(shape: str) -> str:
    """A shape without its layouts (`f32[4,8]{1,0}` -> `f32[4,8]`)."""
    return re.sub(r"{[^{}]*}", "", shape)


def _openable(inst: _hlo.Instruction, module: _hlo.HloModuleText, fusible: frozenset[str]) -> bool:
    """An XLA loop fusion whose instructions are all ones we can re-fuse freely (an async one,
    `fusion-start`, too: XLA:GPU's dynamic-slice fusions of a loop body's stacked parameters)."""
    if inst.opcode not in ("fusion", "fusion-start") or inst.attr("kind") not in ("kLoop", "kInput"):
        return False
    comp = module.computation(inst.attr("calls").lstrip("%"))
    for i in comp.instructions:
        if i.opcode in ("parameter", "constant") or (i.opcode == "tuple" and i.is_root):
            continue
        if i.opcode not in fusible or len(i.outputs) != 1:
            return False
    return True


IN_PLACE = frozenset({"scatter", "dynamic-update-slice", "select-and-scatter"})


def _in_place_operands(inst: _hlo.Instruction, module: _hlo.HloModuleText) -> list[int]:
    """Operand indexes an instruction may overwrite in place (XLA's copy insertion gave each a
    buffer of its own before our hook runs; merging them would share that buffer)."""
    if inst.opcode in IN_PLACE:
        return [0] if inst.opcode != "scatter" else list(range(max(1, (len(inst.operands) - 1) // 2)))
    if inst.attr("output_to_operand_aliasing") is not None:
        return list(range(len(inst.operands)))
    if inst.opcode == "fusion":
        comp = module.computation(inst.attr("calls").lstrip("%"))
        by_name = comp.by_name()
        roots = [by_name[o] for o in comp.root.operands] if comp.root.opcode == "tuple" else [comp.root]
        indexes = []
        for r in roots:
            if r.opcode in IN_PLACE and r.operands and by_name[r.operands[0]].opcode == "parameter":
                indexes.append(int(by_name[r.operands[0]].literal))
        return indexes
    return []


def _compat_key(inst: _hlo.Instruction, module: _hlo.HloModuleText, dtype: str) -> tuple:
    reducer = module.computation(inst.attr("to_apply").lstrip("%"))
    reducer_ops = tuple(i.opcode for i in reducer.instructions if i.opcode != "parameter")
    return (
        dtype,
        reducer_ops,
        _hlo.replica_groups_key(inst.attr("replica_groups")),
        inst.attr("use_global_device_ids"),
        inst.attr("channel_id") is not None,
    )


def build_graph(
    text: str, fusible: frozenset[str], *, merge_duplicates: bool = True, control_flow: bool = False
) -> Graph:
    """Parse a module captured at a compiler's hook stage into the graph IR, ops classified by what
    its loop emitter fuses (`fusible`: `Backend.fusible`; the graph keeps no backend).
    `merge_duplicates=False`: every fusion's ops its own (a compiled module, `cost.compiled`).
    `control_flow=True`: the ops of the computations the entry's control flow runs are read too
    (`_hlo.control_flow_computations`: loop bodies and conditions, branches, called computations), after
    the entry's, XLA's fusions there opened the same way and listed in `xla_groups`; each reads
    only its own computation's values (a loop body's parameter is a free op), its all-reduces are
    opaque ops (not gradients: the search regroups the entry's), and the `while` itself stays one
    opaque op of the entry. What `cost.compiled` costs a loop body's kernels on."""
    module = _hlo.parse_module(text)
    fingerprint = _hlo.module_fingerprint(module)  # before anything reads the parsed module
    entry = module.entry
    computations = [entry] + (_hlo.control_flow_computations(module) if control_flow else [])
    ops: list[Op] = []
    cse: dict[tuple, int] = {}
    value: dict[str, int] = {}  # entry value name -> op id
    tuple_values: dict[str, list[int]] = {}  # opened multi-output fusion -> element op ids
    gradients: list[Gradient] = []
    xla_groups: list[frozenset[int]] = []
    xla_kernel_names: list[str] = []
    xla_exports: list[list[int]] = []
    xla_buckets: list[tuple[int, ...]] = []
    templates: dict[tuple, _hlo.Instruction] = {}

    # Values some instruction overwrites in place: by name (unique in a module), and fusions that produce them.
    exclusive: set[str] = set()
    by_name: dict[str, _hlo.Instruction] = {}
    for comp in computations:
        for inst in comp.instructions:
            for i in _in_place_operands(inst, module):
                exclusive.add(inst.operands[i])
        by_name.update(comp.by_name())
    exclusive |= {
        by_name[n].operands[0] for n in list(exclusive) if n in by_name and by_name[n].opcode == "get-tuple-element"
    }

    def add(
        inst: _hlo.Instruction,
        kind: str,
        operands: tuple[int, ...],
        kernel: str,
        gradient: int | None = None,
        mergeable: bool = False,
    ) -> int:
        """Ops are merged only where XLA duplicated them into several fusions (`mergeable`):
        XLA's own CSE already merged the entry instructions it could, and kept copies apart
        on purpose (buffers that get overwritten in place)."""
        key = None
        if mergeable and (kind == "fusible" or (kind == "free" and inst.opcode == "constant")):
            # The layout is part of an op's meaning (a copy or transpose into another layout).
            key = (kind, inst.opcode, inst.shape, operands, inst.literal, inst.attrs_text(drop_metadata=True))
            if key in cse:
                return cse[key]
        op = Op(len(ops), inst.name, kind, inst, operands, kernel, gradient)
        ops.append(op)
        if key is not None:
            cse[key] = op.id
        return op.id

    def entry_kind(inst: _hlo.Instruction) -> str:
        if inst.opcode in FREE:
            return "free"
        if inst.opcode in fusible and len(inst.outputs) == 1 and not inst.attr("control-predecessors"):
            return "fusible"
        return "opaque"

    for comp in computations:
        for inst in comp.instructions:
            if inst.opcode == "all-reduce" and len(inst.operands) >= 1 and comp is entry:
                ar_kind = "gradient"
                specs = inst.outputs
                if any(len(ops[value[o]].inst.outputs) != 1 for o in inst.operands if o in value):
                    ar_kind = "opaque"
            else:
                ar_kind = None
            if ar_kind == "gradient":
                bucket = []
                element_shapes = (
                    _hlo.split_top_level(re.sub(r"/\*.*?\*/", "", inst.shape[1:-1]))
                    if inst.shape.startswith("(")
                    else [inst.shape]
                )
                for k, operand in enumerate(inst.operands):
                    gid = len(gradients)
                    producer = value[operand]
                    shape = element_shapes[k] if len(element_shapes) == len(inst.operands) else inst.shape
                    reduced = add(
                        dataclasses.replace(inst, shape=shape, operands=[operand]),
                        "reduced",
                        (producer,),
                        inst.name,
                        gradient=gid,
                    )
                    compat = _compat_key(inst, module, specs[k].dtype)
                    templates.setdefault(compat, inst)
                    # Users refer to a variadic all-reduce's results through get-tuple-elements.
                    result = inst.name if len(inst.operands) == 1 and not inst.shape.startswith("(") else None
                    gradients.append(
                        Gradient(
                            gid, producer, reduced, specs[k].bytes, compat, inst.name, result or f"{inst.name}.{k}"
                        )
                    )
                    bucket.append(gid)
                xla_buckets.append(tuple(bucket))
                if len(inst.operands) == 1 and not inst.shape.startswith("("):
                    value[inst.name] = gradients[bucket[0]].reduced
                else:
                    tuple_values[inst.name] = [gradients[g].reduced for g in bucket]
                continue
            if inst.opcode == "get-tuple-element" and inst.operands[0] in tuple_values:
                elements = tuple_values[inst.operands[0]]
                value[inst.name] = elements[int(inst.attr("index"))]
                src = ops[elements[int(inst.attr("index"))]]
                if src.kind == "reduced":  # remember the user-facing name of the gradient result
                    g = gradients[src.gradient]
                    if g.result_name.startswith(f"{g.source}."):
                        gradients[g.id] = dataclasses.replace(g, result_name=inst.name)
                continue
            if inst.opcode == "fusion-done" and inst.operands[0] in value:  # an async fusion's result
                value[inst.name] = value[inst.operands[0]]
                continue
            if _openable(inst, module, fusible):
                fused = module.computation(inst.attr("calls").lstrip("%"))
                inner: dict[str, int] = {}
                members: list[int] = []
                outputs = set(fused.root.operands) if fused.root.opcode == "tuple" else {fused.root.name}
                for i in fused.instructions:
                    if i.opcode == "parameter":
                        inner[i.name] = value[inst.operands[int(i.literal)]]
                    elif i.opcode == "tuple" and i.is_root:
                        tuple_values[inst.name] = [inner[o] for o in i.operands]
                    else:
                        kind = "free" if i.opcode == "constant" else "fusible"
                        mergeable = merge_duplicates and not (inst.name in exclusive and i.name in outputs)
                        oid = add(
                            dataclasses.replace(i, is_root=False),
                            kind,
                            tuple(inner[o] for o in i.operands),
                            inst.name,
                            mergeable=mergeable,
                        )
                        inner[i.name] = oid
                        if kind == "fusible":
                            members.append(oid)
                root = fused.root
                exports = tuple_values[inst.name] if root.opcode == "tuple" else [inner[root.name]]
                if root.opcode != "tuple":
                    value[inst.name] = inner[root.name]
                xla_groups.append(frozenset(members))
                xla_kernel_names.append(inst.name)
                xla_exports.append(exports)
                continue
            kind = entry_kind(inst)
            operands = tuple(value[o] for o in inst.operands)
            oid = add(inst, kind, operands, inst.name)
            value[inst.name] = oid
            if kind == "fusible":
                xla_groups.append(frozenset([oid]))
                xla_kernel_names.append(inst.name)
                xla_exports.append([oid])

    # Home of each fusible op: the XLA kernel that exported it, else the first that holds it.
    homes: dict[int, int] = {}
    for gi, exports in enumerate(xla_exports):
        for oid in exports:
            if ops[oid].kind == "fusible":
                homes.setdefault(oid, gi)
    for gi, members in enumerate(xla_groups):
        for oid in members:
            homes.setdefault(oid, gi)
    root = entry.root
    outputs = list(tuple_values[root.name]) if root.name in tuple_values else [value[root.name]]
    return Graph(
        module,
        ops,
        gradients,
        xla_groups,
        homes,
        xla_buckets,
        xla_kernel_names,
        xla_exports,
        templates,
        {i.name: value[i.name] for i in entry.instructions if i.name in value} if control_flow else value,
        outputs,
        fingerprint,
    )
