"""Operator parallelism on a two-axis mesh: meshes data x model built from the step's devices, and
per layer group a layout (data parallel, FSDP, Megatron tensor parallel, with sequence parallelism,
FSDP x TP), found from the step's structure: the parameter tree and the dots that read each
parameter (`constrain.dots_reading_parameters`). This module says *what* each leaf and activation
holds on which axis; `sharding.mesh_step` enacts it.

**Roles** (Megatron-LM, Shoeybi et al. 2019). Within a layer (a parameter's first path key: one
unrolled block, or a scan's stack), the forward dots that read parameters are taken in order; each
new activation they read starts a stage (the query, key and value projections of one input are one
stage), and stages alternate: a *column* dot (its kernel split on its output dimension, the model
axis' devices each computing some heads or some MLP columns, no communication) then a *row* dot
(its kernel split on its contracting dimension: partial sums, all-reduced over the model axis; with
sequence parallelism reduce-scattered onto the sequence instead, and all-gathered before the next
column dot). A layer with one stage (the tied embedding read by the output head) is column: the
vocabulary is split. A column kernel's bias (the sibling leaf `...['bias']`) splits with it.

**Choices** per layer group (parameters' first path key without its number: every `Block_i` is one
group, a scan's stack one): `CHOICES`. FSDP puts the data axis on the leaf's largest divisible
dimension left (never the layer axis of a stack); leaves no dot reads follow FSDP when the plan has
any, else stay replicated. Where a dimension does not divide, it stays whole (the plan records it).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from disco_jax.sharding.constrain import ParameterDot

DATA, MODEL = "data", "model"
# Per layer group: what its parameters and activations hold.
CHOICES = ("replicated", "fsdp", "tp", "tp_sp", "fsdp_tp", "fsdp_tp_sp")


def uses_tp(choice: str) -> bool:
    return "tp" in choice


def uses_fsdp(choice: str) -> bool:
    return choice.startswith("fsdp")


def uses_sp(choice: str) -> bool:
    return choice.endswith("_sp")


def mesh_shapes(num_devices: int, devices_per_node: int) -> list[tuple[int, int]]:
    """(data, model) shapes of `num_devices`: the model axis a divisor of the node's devices
    (tensor parallelism's all-reduces stay on NVLink), data parallel first (8 -> 8x1, 4x2, 2x4, 1x8)."""
    return [
        (num_devices // m, m)
        for m in range(1, devices_per_node + 1)
        if devices_per_node % m == 0 and num_devices % m == 0
    ]


def build_mesh(devices, data: int, model: int) -> Mesh:
    """The mesh (data, model) over `devices` (in the order the step's mesh has them: a process's,
    a node's, devices consecutive), model the faster axis so that its groups are neighbours."""
    grid = np.asarray(list(devices), dtype=object).reshape(data, model)
    return Mesh(grid, (DATA, MODEL), axis_types=(AxisType.Auto, AxisType.Auto))


@dataclasses.dataclass(frozen=True)
class Role:
    """A parameter read by a forward dot: `kind` "column" or "row", the leaf's dimensions that
    dot contracts and leaves free, and the leaf's layer (first path key) and stage in it."""

    kind: str
    contracted: frozenset[int]
    free: tuple[int, ...]
    layer: str
    stage: int

    def split_dimension(self) -> int:
        """The leaf dimension the model axis splits: a column's output, a row's contraction."""
        return self.free[-1] if self.kind == "column" else min(self.contracted)


def first_key(path: str) -> str:
    """The first key of a parameter path after the train state's `.params` (`['Block_0']`)."""
    keys = re.findall(r"\['([^']*)'\]", path)
    return keys[0] if keys else path


def group_of(path: str) -> str:
    """A parameter's layer group: its first key without a trailing number (`Block_3` -> `Block`)."""
    return re.sub(r"_\d+$", "", first_key(path))


def parameter_roles(dots: list[ParameterDot], parameters: dict[int, str]) -> dict[int, Role]:
    """Per parameter leaf (index -> path) that a dot reads, its role (see the module docstring):
    its first dot is its forward one; stages by the activation each forward dot reads."""
    first: dict[int, ParameterDot] = {}
    for d in dots:
        if d.parameter in parameters and d.parameter not in first:
            first[d.parameter] = d
    stages: dict[tuple, list] = {}
    roles = {}
    for p, d in sorted(first.items(), key=lambda item: item[1].order):
        layer = (first_key(parameters[p]), d.scope)
        roots = stages.setdefault(layer, [])
        if not roots or roots[-1] is not d.other_root:
            roots.append(d.other_root)
        stage = len(roots) - 1
        roles[p] = Role("column" if stage % 2 == 0 else "row", d.contracted, d.free, layer[0], stage)
    return roles


def _largest_free(shape, taken: set[int], n: int, stacked: bool) -> int | None:
    dims = [d for d in range(1 if stacked else 0, len(shape)) if d not in taken and shape[d] % n == 0 and shape[d] >= n]
    return max(dims, key=lambda d: (shape[d], -d)) if dims else None


@dataclasses.dataclass(frozen=True)
class OperatorPlan:
    """A mesh shape and a choice per layer group (`CHOICES`; groups not named are replicated,
    or FSDP where the plan has FSDP anywhere), and the rematerialization of the scanned layer
    groups' loops (`sharding.remat` policy; "" keeps what the step stacks)."""

    data: int
    model: int
    choices: dict[str, str]
    remat: str = ""

    def choice(self, group: str) -> str:
        if group in self.choices:
            return self.choices[group]
        return "fsdp" if any(uses_fsdp(c) for c in self.choices.values()) and self.data > 1 else "replicated"

    @property
    def label(self) -> str:
        groups = ", ".join(f"{g}: {c}" for g, c in sorted(self.choices.items()))
        return f"{self.data}x{self.model} {groups}" + (f", loops rematerialized ({self.remat})" if self.remat else "")

    def to_json(self) -> dict:
        return {
            "mesh": {DATA: self.data, MODEL: self.model},
            "choices": dict(self.choices),
            **({"remat": self.remat} if self.remat else {}),
        }


def parameter_specs(
    plan: OperatorPlan, parameters: dict[int, str], shapes: dict[int, tuple], roles: dict[int, Role], stacked: set[int]
) -> tuple[dict[int, P], dict[str, str]]:
    """(index -> spec of every parameter leaf, path -> why a split was not made) for `plan`."""
    specs, kept = {}, {}
    column_kernels = {parameters[p] for p, r in roles.items() if r.kind == "column"}
    for p, path in parameters.items():
        shape, choice = shapes[p], plan.choice(group_of(path))
        entries = [None] * len(shape)
        taken: set[int] = set()
        if p in stacked:
            taken.add(0)
        if uses_tp(choice) and plan.model > 1:
            role = roles.get(p)
            split = None
            if role is not None:
                split = role.split_dimension()
            elif path.endswith("['bias']") and path[: -len("['bias']")] + "['kernel']" in column_kernels:
                split = len(shape) - 1  # a column kernel's bias splits with its output
            if split is not None:
                if shape[split] % plan.model == 0:
                    entries[split] = MODEL
                    taken.add(split)
                else:
                    kept[path] = f"dimension {split} of {shape} is not divisible by the model axis ({plan.model})"
        if uses_fsdp(choice) and plan.data > 1:
            d = _largest_free(shape, taken, plan.data, p in stacked)
            if d is not None:
                entries[d] = DATA
            elif shape:
                kept.setdefault(path, f"no dimension of {shape} left that the data axis ({plan.data}) divides")
        specs[p] = P(*entries)
    return specs, kept


def activation_spec(dot: ParameterDot, plan: OperatorPlan, role: Role | None, choice: str, spec: P):
    """The spec of a forward dot's output (None: no constraint): the batch on the data axis; a
    column dot's output split as its kernel; a row dot's output replicated over the model axis
    (its all-reduce), or with sequence parallelism split on the sequence (a reduce-scatter)."""
    if role is None or dot.contracted != role.contracted:
        return None  # not a forward (or recomputed forward) use of the parameter
    entries = [None] * len(dot.out_shape)
    batch = dot.other_free_positions[0] if dot.other_free_positions else None
    if batch is not None and plan.data > 1 and dot.out_shape[batch] % plan.data == 0:
        entries[batch] = DATA
    if uses_tp(choice) and plan.model > 1:
        if role.kind == "column":
            split = role.split_dimension()
            position = dot.parameter_positions.get(split)
            if position is not None and split < len(spec) and spec[split] == MODEL:
                entries[position] = MODEL
        elif uses_sp(choice) and len(dot.other_free_positions) > 1:
            sequence = dot.other_free_positions[1]
            if dot.out_shape[sequence] % plan.model == 0:
                entries[sequence] = MODEL
    return P(*entries)
