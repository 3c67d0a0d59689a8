"""What the fact checks share: a hook that records the step's module at both stages, counts of
what a module text holds, and a verdict printer. Each check script runs on its own:
`python docs/checks/<name>.py`, exit status 0 when every fact it states still holds."""

from __future__ import annotations

import re
import sys

from jax._src.lib import xla_client
from jax.extend import xla as jax_xla

STAGES = {"PRE_SCHEDULER": jax_xla.PipelineStage.PRE_SCHEDULER, "POST_SCHEDULER": jax_xla.PipelineStage.POST_SCHEDULER}


class Recorder:
    """Registers one pass per stage for `platform`; records (and optionally edits) the modules
    whose name contains `module_substring`."""

    def __init__(self, platform: str, module_substring: str = "jit_step"):
        self.substring = module_substring
        self.texts: dict[str, list[str]] = {s: [] for s in STAGES}
        self.edit = None  # (stage, fn(text) -> text) or None
        for stage, enum in STAGES.items():
            jax_xla.register_hlo_module_transformation(
                self._callback(stage), name=f"check_{stage}_{platform}", stage=enum, platforms=platform
            )

    def _callback(self, stage):
        def cb(serialized: bytes):
            module = xla_client.hlo.HloModule.from_serialized_hlo_module_proto(serialized)
            options = xla_client.hlo.HloPrintOptions()
            options.print_large_constants = True
            text = module.to_string(options)
            if self.substring not in text.split("\n", 1)[0]:
                return None
            self.texts[stage].append(text)
            if self.edit and self.edit[0] == stage:
                return xla_client.hlo.hlo_module_from_text(self.edit[1](text)).as_serialized_hlo_module_proto()
            return None

        return cb

    def reset(self, edit=None):
        for v in self.texts.values():
            v.clear()
        self.edit = edit


def entry(text: str) -> str:
    """The entry computation's text."""
    return text[text.index("\nENTRY") :].split("\n}\n", 1)[0]


def count(text: str, opcode: str) -> int:
    """Instructions with `opcode` in the entry computation."""
    return len(re.findall(rf"[\s)] ?{re.escape(opcode)}\(%", entry(text)))


def operand_counts(text: str, opcode: str) -> list[int]:
    """Operand count of each `opcode` instruction in the entry computation."""
    return sorted(
        len(re.findall(r"%[\w.\-]+", m.group(1))) for m in re.finditer(rf" {re.escape(opcode)}\(([^)]*)\)", entry(text))
    )


_failures: list[str] = []


def fact(ok: bool, statement: str, observed) -> None:
    """Print one fact with what was observed; remember it if it does not hold."""
    print(f"[{'holds' if ok else 'FAILS'}] {statement}  (observed: {observed})")
    if not ok:
        _failures.append(statement)


def finish() -> None:
    import jax
    import jaxlib

    print(
        f"jax {jax.__version__}, jaxlib {jaxlib.__version__}: "
        f"{'all facts hold' if not _failures else f'{len(_failures)} fact(s) no longer hold'}"
    )
    sys.exit(1 if _failures else 0)
