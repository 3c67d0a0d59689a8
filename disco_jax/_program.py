"""A captured program: its graph IR, the compiler it was captured for, and what capture learned.

The graph (`disco_jax._graph.Graph`) knows nothing above it: ops, edges, gradients and XLA's own
plan as read. A `Program` is that graph with the compiler whose module it is (`backends.Backend`)
and what the capture learned compiling it (`rules_applied`). It travels where both are asked: the
strategy moves and their validity (can the compiler emit a fused group: `_strategy.emittable`), the
search, the simulator and the cost tables that depend on the compiler (which all-reduces run as
reduce-scatters: `cost.allreduce.transfer_bytes`), the rewriter and the compile. Functions that only
read the graph take the graph.

`Compiler` states what the layers below `disco_jax.backends` (the strategy and its edits) ask of a
program's compiler, so that they import nothing above them; `backends.Backend` is the one
implementation, where each field is documented.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

from disco_jax._graph import Graph, build_graph, per_graph

# A table over a program (it reads the compiler too), computed once per program and kept in its own
# `derived` slot: the same cache as `per_graph`'s.
per_program = per_graph


class Compiler(Protocol):
    """A program's compiler as the strategy layer sees it (`backends.Backend`)."""

    @property
    def fusible(self) -> frozenset[str]: ...

    @property
    def no_producer_fusion(self) -> frozenset[str]: ...

    @property
    def emits_fusions(self) -> bool: ...

    @property
    def emittable(self) -> Callable[[Graph, Any, list[list[int]]], bool]: ...

    @property
    def packs_buckets(self) -> bool: ...


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """graph: the module at the compiler's hook stage as graph IR, with XLA's own plan as read.
    backend: the compiler it is captured for and rewritten by (`backends.Backend`).
    rules_applied: the sharding rules the hook applied compiling it with XLA's plan (per
    application its rule, the instructions it matched and the one it made; `_compile`).
    derived: what the cost package computed over the program (`per_program`)."""

    graph: Graph
    backend: Compiler
    rules_applied: tuple = ()
    derived: dict[Callable[[Program], Any], Any] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )


def build_program(text: str, backend: Compiler, *, merge_duplicates: bool = True) -> Program:
    """A module captured at `backend`'s hook stage as a program: its graph (`build_graph` with the
    backend's fusible opcodes) and the backend. XLA's decisions read at a later stage and the
    hook's rules are the capture's to add (`_compile.capture_program`)."""
    return Program(build_graph(text, backend.fusible, merge_duplicates=merge_duplicates), backend)
