"""The HLO module bindings the pass hook and the library use, and the printer option that keeps
a module's text parseable. Run: `python docs/checks/hlo_bindings.py`."""

import os

os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _common import fact, finish  # noqa: E402
from jax._src.lib import xla_client  # noqa: E402

hlo = xla_client.hlo
try:
    from jaxlib import _hlo

    same = _hlo.HloModule is hlo.HloModule
except ImportError:
    same = False
fact(
    same, "jax._src.lib.xla_client.hlo is jaxlib._hlo (0.11.2 and 0.12)", "same HloModule class" if same else "differs"
)
for name in ("HloModule", "HloPrintOptions", "hlo_module_from_text", "HloSchedule", "HloInstruction"):
    fact(hasattr(hlo, name), f"xla_client.hlo.{name} exists", hasattr(hlo, name))
fact(
    hasattr(hlo.HloModule, "from_serialized_hlo_module_proto")
    and hasattr(hlo.HloModule, "as_serialized_hlo_module_proto"),
    "HloModule converts from and to a serialized HloModuleProto (what the pass hook passes)",
    "both methods present",
)

# A module with a large constant: the default printer elides it, and `{...}` parses back as a
# different program; print_large_constants keeps it exact.
table = jnp.arange(64, dtype=jnp.float32)
text = jax.jit(lambda x: x + table).lower(jnp.ones(64)).as_text(dialect="hlo")
module = hlo.hlo_module_from_text(text)
default_text = module.to_string()
options = hlo.HloPrintOptions()
options.print_large_constants = True
full_text = module.to_string(options)
fact(
    "{...}" in default_text and "{...}" not in full_text,
    "the default printer elides large constants as {...}; print_large_constants prints them",
    f"elided by default: {'{...}' in default_text}",
)
again = hlo.HloModule.from_serialized_hlo_module_proto(
    hlo.hlo_module_from_text(full_text).as_serialized_hlo_module_proto()
).to_string(options)
fact(
    again == full_text, "text -> module -> proto -> module -> text round-trips exactly", f"{len(full_text)} characters"
)
finish()
