"""The host lane of a compiled program: what a call costs the host that runs it, and when the host
has issued each kernel (issue 47).

A GPU executes a kernel only after the host has launched it. XLA:GPU's runtime, per call of an
executable, first prepares the call (checks and hands over every argument buffer, allocates the
outputs), then walks the thunks in schedule order, each launch taking the host some microseconds
(a cuDNN convolution or a cuBLAS call more than a generated fusion), and the device runs each
kernel when both the host has issued it and the stream is free. On a step of many small kernels
the host, not the device, sets the pace: traced on an H200 machine (records of 2026-11-28), the
tiny Transformer's 341 kernels ran for 0.48 ms of a 6.3 ms call; the paper Transformer's 1,317
kernels kept the device busy 14.2 ms of 24.4 ms.

    HostLane(call_us, per_argument_us, per_result_us, issue_us={"fusion": .., "gemm": .., "conv": ..})
      -> prepare_us(arguments, results): the call's set-up and hand-over of its arrays
      -> issue(kind): the host's time to launch one kernel of that kind
    `cost.compiled.cost_program` walks both lanes when `SimulatorParams.host` is set.

`program_buffers(text)` counts what `prepare_us` is charged for: the entry computation's parameter
arrays and the arrays of its result. A result costs the host more than an argument (a new buffer,
and a new array handed back to Python): on the H200 machine a program taking a Transformer's 763
arrays and returning one ran in 2.8 ms, one taking 760 and returning them in 7.2 ms. The constants
are fitted to recorded GPU programs (`disco_jax.eval.gpu_fit`) and stored in the device profile
with their source.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from disco_jax import _hlo

KINDS = ("fusion", "gemm", "conv", "library", "op", "collective")
"""Kernel kinds the host is charged for, as `backends.compiled.CompiledKernel.kind` names them
(a collective's own name counts as "collective")."""


@dataclasses.dataclass(frozen=True)
class HostLane:
    """What a call costs the host (see the module docstring), in microseconds.

    call_us: fixed set-up per call. per_argument_us, per_result_us: per array handed in and
    handed back. issue_us: per kernel kind, the host's time to launch one; a kind not named costs
    `issue_us["fusion"]` (0 where that is missing too). source: where the figures come from."""

    call_us: float = 0.0
    per_argument_us: float = 0.0
    per_result_us: float = 0.0
    issue_us: Mapping[str, float] = dataclasses.field(default_factory=dict)
    source: str = ""

    def __post_init__(self):
        figures = {
            "call_us": self.call_us,
            "per_argument_us": self.per_argument_us,
            "per_result_us": self.per_result_us,
            **self.issue_us,
        }
        negative = [k for k, v in figures.items() if not v >= 0]
        if negative:
            raise ValueError(f"host lane figures must be >= 0 microseconds: {', '.join(negative)}")

    def prepare_us(self, arguments: int, results: int) -> float:
        """What the call costs the host beside issuing kernels: its set-up, and handing its
        arrays in and back (charged before the first kernel is issued)."""
        return self.call_us + self.per_argument_us * arguments + self.per_result_us * results

    def issue(self, kind: str) -> float:
        """The host's time to issue one kernel of `kind` (a collective's name counts as 'collective')."""
        key = kind if kind in KINDS else "collective"
        return float(self.issue_us.get(key, self.issue_us.get("fusion", 0.0)))

    def to_json(self) -> dict:
        return {
            "call_us": self.call_us,
            "per_argument_us": self.per_argument_us,
            "per_result_us": self.per_result_us,
            "issue_us": dict(self.issue_us),
            "source": self.source,
        }

    @classmethod
    def from_json(cls, data: Mapping) -> HostLane:
        return cls(
            float(data.get("call_us", 0.0)),
            float(data.get("per_argument_us", 0.0)),
            float(data.get("per_result_us", 0.0)),
            {str(k): float(v) for k, v in dict(data.get("issue_us", {})).items()},
            str(data.get("source", "")),
        )


def program_buffers(text: str) -> tuple[int, int]:
    """(arguments, results): the arrays a call of the compiled module takes (the entry
    computation's parameters, a tuple parameter counting each element) and returns."""
    entry = _hlo.parse_module(text).entry
    arguments = sum(len(_hlo.parse_shape(i.shape)) for i in entry.instructions if i.opcode == "parameter")
    return arguments, len(_hlo.parse_shape(entry.root.shape))


__all__ = ["KINDS", "HostLane", "program_buffers"]
