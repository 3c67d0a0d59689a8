"""`Layout`: where a sharded weight update keeps what (the data axis, and per leaf it shards the
`PartitionSpec`), the layout's units (state groups, their parameters, layers), the subsets the
choice takes, and the shardings a program lowered with it gives its leaves (`sharding`, on
`step_mesh`). `update.find_layout` reads one from a step's jaxpr; `update.relower` lowers the step
with it."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from disco_jax.sharding.params import Parameter
from disco_jax.sharding.remat import POLICIES

# How a layout's sharded parameters are gathered: the flags `Layout.subset` takes, as plans record them.
GATHERING = ("regather", "at_use", "prefetch", "split_carries", "remat")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the sharded update keeps what: the data axis, its size, and per input leaf (index
    into the call's dynamic leaves) and per output leaf the `PartitionSpec` of the leaves it
    shards. `paths` names the input leaves (`jax.tree_util.keystr`) for the plan."""

    mesh: Any
    axis: str
    num_shards: int
    inputs: dict[int, P]
    outputs: dict[int, P]
    paths: dict[int, str]
    # The choice's units (`weight_update="search"`): input leaves that are updated together (they
    # meet in some output, as a parameter's Adam moments do), and per sharded output the inputs
    # it is computed from. Sharding a union of groups keeps every such output's inputs alike.
    groups: tuple[tuple[int, ...], ...] = ()
    sources: dict[int, frozenset] = dataclasses.field(default_factory=dict)
    # Parameters and state sharded (ZeRO-3; `sharding.params`): per parameter leaf whose new value
    # is computed elementwise from it and one group's state only, that group, its spec and its new
    # value's output. A parameter is sharded (and all-gathered before use) only when in `inputs`.
    parameters: dict[int, Parameter] = dataclasses.field(default_factory=dict)
    # Leaves of the update (parameters, state) kept replicated, by path, and why.
    kept_whole: dict[str, str] = dataclasses.field(default_factory=dict)
    # The sharded parameters gathered again for each use (`sharding.regather`, applied at the hook:
    # `hook_backend`), not once for the step: less memory, more all-gathers.
    regather: bool = False
    # `mesh` with the data axis as its prime factors (`leaves.factored_mesh`), which the specs of
    # leaves split over several dimensions name; None where the axes are Explicit or N is prime
    # (no leaf is split so then). A program with such a leaf runs wholly on it (`step_mesh`).
    split_mesh: Any = None
    # Input leaves stacked on a leading layer axis (`leaves.stacked_leaves`: what a scan runs its
    # layers over, and the state updated with it), split after that axis. With `regather` such a
    # parameter is not gathered before the step: it enters the loop split, and each iteration
    # gathers its own layer (XLA's partitioner puts the all-gathers in the loop bodies).
    stacked: frozenset[int] = frozenset()
    # FSDP as users write it: the sharded parameters enter the user's function sharded, with no
    # replicated constraint anywhere, so XLA's partitioner gathers each where a dot reads it (in a
    # loop, per iteration) and frees it after; `regather` is then moot (no entry-level gather).
    at_use: bool = False
    # With `at_use`: every scan that reads a layer of a sharded stacked parameter rotated to
    # gather the next layer one iteration early and carry it (`sharding.prefetch`, the rule
    # `loop_rotation`): the next layer's all-gather runs beside the current layer's compute.
    prefetch: bool = False
    # With `at_use`: every scan's per-example carries (activations) kept split over the data axis,
    # as data parallelism has them (`sharding.prefetch`; implied by `prefetch`). Left free, XLA's
    # partitioner may split a wide model's activations on their features instead and gather them
    # for each dot inside the loop bodies (docs/scanned-layers.md).
    split_carries: bool = False
    # With `at_use`: the loops' residuals recomputed in the backward loops under this policy
    # (`sharding.remat`: "dots" keeps the dots' outputs, "full" only each layer's input), where the
    # user's step stacks every layer's activations; "" keeps them.
    remat: str = ""

    @functools.cached_property  # a frozen dataclass's own `__dict__` holds it; `replace` makes a new one
    def step_mesh(self) -> Any:
        """The mesh of the program lowered with this layout: `split_mesh` where a sharded leaf is
        split over several dimensions (so that the partitioner sees one mesh, and "data" as the
        factors it is made of: on two meshes it takes them for unrelated axes and replicates
        what they meet in), else `mesh`."""
        axes = set(self.mesh.axis_names)
        for spec in self.inputs.values():
            if any(n not in axes for entry in spec for n in (entry if isinstance(entry, tuple) else (entry,)) if n):
                return self.split_mesh
        return self.mesh

    def sharding(self, spec: P) -> NamedSharding:
        """The sharding of a leaf with `spec` in the program lowered with this layout."""
        mesh = self.step_mesh
        if mesh is self.mesh:
            return NamedSharding(mesh, spec)
        factors = tuple(n for n in mesh.axis_names if n not in self.mesh.axis_names)

        def expand(entry):  # the data axis as its factors
            if entry is None:
                return None
            names = tuple(n for x in _flat(entry) for n in (factors if x == self.axis else (x,)))
            return names[0] if len(names) == 1 else names

        return NamedSharding(mesh, P(*map(expand, spec)))

    def on_step_mesh(self, sharding: Any) -> Any:
        """`sharding` (one of the unmodified step's) as the program lowered with this layout has it."""
        if self.step_mesh is self.mesh or not isinstance(sharding, NamedSharding) or sharding.mesh != self.mesh:
            return sharding
        return self.sharding(sharding.spec)

    def gathering(self) -> dict[str, bool]:
        """How its sharded parameters are gathered (`GATHERING`), as `subset` takes it."""
        return {k: getattr(self, k) for k in GATHERING}

    def gathering_label(self) -> str:
        """How its parameters are gathered, as candidates' labels say it (", gathered where used, ...")."""
        again = ", gathered again for each use" if self.regather else ""
        again += ", gathered where used" if self.at_use else ""
        again += ", next layer prefetched" if self.prefetch else ""
        again += ", loop state split over the batch" if self.split_carries and not self.prefetch else ""
        again += f", loops rematerialized ({self.remat})" if self.remat else ""
        return again + (", some split over several dimensions" if self.step_mesh is not self.mesh else "")

    def subset(
        self,
        leaves,
        regather: bool = False,
        at_use: bool = False,
        prefetch: bool = False,
        split_carries: bool = False,
        remat: str | bool = "",
    ) -> Layout:
        """This layout with only the input leaves `leaves` sharded: a union of `groups`, plus the
        parameters (`parameters`) of some of those groups for parameters and state sharded,
        gathered again for each use with `regather`, gathered only where used with `at_use`, and
        with `prefetch` (at use only) each loop's next layer gathered one iteration early; with
        `remat` (at use only; a policy of `sharding.remat`) the loops' residuals recomputed."""
        if remat and remat not in POLICIES:
            raise ValueError(f"unknown remat policy {remat!r}; expected one of {POLICIES}")
        if remat and prefetch:  # two rewrites of the same loops, never combined nor checked together
            raise ValueError("a layout with prefetch is not rematerialized: choose one")
        keep = set(leaves)
        for p in keep & self.parameters.keys():
            if not set(self.parameters[p].group) <= keep:
                raise ValueError(f"parameter {self.parameters[p].path} sharded without its state")
        specs = {**self.inputs, **{p: q.spec for p, q in self.parameters.items()}}
        outputs = {**self.outputs, **{q.output: q.spec for q in self.parameters.values()}}
        sources = {**self.sources, **{q.output: frozenset({p, *q.group}) for p, q in self.parameters.items()}}
        paths = {**self.paths, **{p: q.path for p, q in self.parameters.items()}}
        pick = lambda d: {i: v for i, v in d.items() if i in keep}  # noqa: E731
        return dataclasses.replace(
            self,
            inputs=pick(specs),
            outputs={j: spec for j, spec in outputs.items() if sources.get(j, frozenset()) <= keep},
            paths=pick(paths),
            groups=tuple(g for g in self.groups if set(g) <= keep),
            regather=regather and not at_use,
            at_use=at_use,
            prefetch=prefetch and at_use,
            split_carries=(split_carries or prefetch) and at_use,
            remat=remat if at_use and remat else "",
        )

    def all_leaves(self, parameters: bool = True) -> tuple[int, ...]:
        """Every leaf this layout can shard: the groups' state, and with `parameters` their
        parameters (the fully sharded step: ZeRO-3)."""
        state = [i for g in self.groups for i in g]
        return tuple(sorted(state + (list(self.parameters) if parameters else [])))

    @property
    def gathered(self) -> tuple[int, ...]:
        """The sharded parameter leaves: all-gathered before use inside the step."""
        return tuple(sorted(set(self.inputs) & self.parameters.keys()))

    @property
    def gathered_before_step(self) -> tuple[int, ...]:
        """The sharded parameters `params.gathering` all-gathers before the user's function runs:
        all of them, but with `regather` not the stacked ones (gathered layer by layer in the loop),
        and with `at_use` none (XLA gathers each where it is used)."""
        if self.at_use:
            return ()
        return tuple(i for i in self.gathered if not (self.regather and i in self.stacked))

    def all_paths(self) -> dict[str, int]:
        """Path -> index of every leaf this layout can shard (state and parameters)."""
        return {path: i for i, path in {**self.paths, **{p: q.path for p, q in self.parameters.items()}}.items()}

    def state_bytes(self, avals: dict[int, Any]) -> int:
        """Per-device bytes of the sharded optimizer-state leaves (`avals`: index -> aval of every
        input leaf)."""
        return self._bytes(avals, [i for i in self.inputs if i not in self.parameters])

    def _bytes(self, avals: dict[int, Any], leaves) -> int:
        return sum(math.prod(avals[i].shape) * avals[i].dtype.itemsize // self.num_shards for i in leaves)

    @property
    def parameter_of(self) -> dict[tuple[int, ...], int]:
        """State group -> the parameter leaf it updates (groups without one are absent)."""
        return {q.group: p for p, q in self.parameters.items()}

    def group_names(self) -> dict[str, tuple[int, ...]]:
        """Name -> state group: a group is named by its parameter's path where it has one, else by
        its first leaf's path (the names `choices` and `leaves_for` use)."""
        param_of = self.parameter_of
        return {
            self.parameters[param_of[g]].path if g in param_of else self.paths.get(g[0], str(g)): g for g in self.groups
        }

    def layers(self) -> dict[str, tuple[str, ...]]:
        """Layer -> names of its groups, in the order of the groups: a layer is a parameter's path
        without its last key (`['Dense_0']['kernel']` and `['Dense_0']['bias']` form `['Dense_0']`),
        so that a layer's parameters are sharded together."""
        out: dict[str, list[str]] = {}
        for name in self.group_names():
            layer = name[: name.rfind("[")] if name.endswith("]") and "[" in name else name
            out.setdefault(layer, []).append(name)
        return {k: tuple(v) for k, v in out.items()}

    def leaves_for(self, choices: dict[str, str]) -> tuple[int, ...]:
        """The leaves to shard for a choice per group (name -> 'replicated', 'state' or 'params';
        a group not named stays replicated): what `subset` takes."""
        names, leaves, param_of = self.group_names(), [], self.parameter_of
        for name, choice in choices.items():
            if choice not in ("replicated", "state", "params"):
                raise ValueError(f"choice for {name} must be 'replicated', 'state' or 'params', got {choice!r}")
            if name not in names:
                raise ValueError(f"no parameter group {name!r}; groups: {', '.join(names)}")
            group = names[name]
            if choice == "params" and group not in param_of:
                raise ValueError(f"group {name} has no parameter that can be sharded")
            leaves += [] if choice == "replicated" else [*group, *([param_of[group]] if choice == "params" else [])]
        return tuple(sorted(leaves))

    def choices(self) -> dict[str, str]:
        """Per sharded group (named by its parameter's path where it has one, else its first
        leaf's), its choice: 'state' (optimizer state sharded) or 'params' (parameter and state)."""
        param_of = self.parameter_of
        return {name: "params" if param_of.get(g) in self.inputs else "state" for name, g in self.group_names().items()}

    def to_json(self) -> dict:
        return {
            "axis": self.axis,
            "num_shards": self.num_shards,
            "leaves": {  # per dimension its axis, or the data axis's factors split on it (a list)
                self.paths[i]: [list(d) if isinstance(d, tuple) else d for d in spec]
                for i, spec in sorted(self.inputs.items())
            },
            "parameters": sorted(self.paths[i] for i in self.gathered),
            "choices": self.choices(),
            "kept_whole": dict(self.kept_whole),
            **({"regather": True} if self.regather and self.gathered else {}),
            **({"at_use": True} if self.at_use and self.gathered else {}),
            **({"prefetch": True} if self.prefetch and self.gathered else {}),
            **({"split_carries": True} if self.split_carries and self.gathered else {}),
            **({"remat": self.remat} if self.remat and self.gathered else {}),
            **({"stacked": sorted(self.paths[i] for i in self.stacked if i in self.inputs)} if self.stacked else {}),
        }

    def reshard(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The call's dynamic arguments with the sharded leaves moved to their sharding (a no-op
        for leaves that have it already)."""
        leaves, tree = jax.tree.flatten((args, kwargs))
        for i, spec in self.inputs.items():
            leaves[i] = put(leaves[i], self.sharding(spec))
        return jax.tree.unflatten(tree, leaves)


def put(x, sharding):
    """`x` with `sharding`: moved (an array that has another), or restated (an abstract call's
    `ShapeDtypeStruct`, deviceless lowering); anything else as it is."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    if isinstance(x, jax.Array) and x.sharding != sharding:
        return jax.device_put(x, sharding)
    return x


def _flat(entry) -> tuple:
    return entry if isinstance(entry, tuple) else (entry,)
