"""The XLA pass hook: capture a step's module and compile it with a rewrite applied.

One Python pass is registered with XLA (`jax.extend.xla.register_hlo_module_transformation`) the
first time it is needed. It does nothing unless one of our own compiles is in progress, and then
only touches the module it was armed for (by name). JAX's in-memory and persistent caches do not
key on registered passes (a cached executable would come back without our pass having run), so
every compile of ours passes an XLA debug option that changes nothing in code generation but
changes both cache keys: `xla_debug_buffer_assignment_show_max` (only read when printing a buffer
assignment). `xla_dump_max_hlo_modules`, used before, is one of the dump options JAX leaves out
of the persistent cache's key: with `jax_compilation_cache_dir` set, a capture was served the
step's cached executable and never saw the module. Capture uses a value no process used before,
and writes nothing to the persistent cache (the executable is never looked up again); enactment
uses a value derived from the plan, so a plan compiles once and a persistent-cache hit is the same
plan.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
import secrets
import threading
from collections.abc import Callable
from typing import Any

import jax
from jax._src.lib import xla_client
from jax.extend import xla as jax_xla

_lock = threading.RLock()
_registered_for: set[tuple[str, str]] = set()
_active: dict[str, Any] = {}
_fresh = itertools.count(1)
CACHE_KEY_OPTION = "xla_debug_buffer_assignment_show_max"
_NO_PERSISTENT_WRITE = "jax_persistent_cache_min_compile_time_secs"


def module_text(module) -> str:
    """Full text of an HloModule. The default printer elides large constants as `{...}`, which
    would parse back as a different program: print them."""
    options = xla_client.hlo.HloPrintOptions()
    options.print_large_constants = True
    return module.to_string(options)


def _dispatch(stage: str, serialized: bytes) -> bytes | None:
    handler = _active.get("handlers", {}).get(stage)
    if handler is None:
        return None
    module = xla_client.hlo.HloModule.from_serialized_hlo_module_proto(serialized)
    text = module_text(module)
    name = text.split(None, 2)[1].rstrip(",")
    if name != _active.get("module_name"):
        return None
    new_text = handler(text)
    if new_text is None:
        return None
    return xla_client.hlo.hlo_module_from_text(new_text).as_serialized_hlo_module_proto()


def _ensure_registered(platform: str, stage: str) -> None:
    if (platform, stage) not in _registered_for:
        jax_xla.register_hlo_module_transformation(
            functools.partial(_dispatch, stage),
            name=f"disco_jax_{platform}_{stage.lower()}",
            stage=getattr(jax_xla.PipelineStage, stage),
            platforms=platform,
        )
        _registered_for.add((platform, stage))


def _plugin_platform() -> str:
    """The hook's name of the default backend: its PJRT plugin's (JAX says "gpu" for CUDA devices,
    the hook needs "cuda"), as the backend registry maps it."""
    from disco_jax import backends  # the backends build on this module

    platform = jax.default_backend()
    backend = backends.for_platform(platform)
    return backend.platform if backend is not None else platform


def module_name(lowered: jax.stages.Lowered) -> str:
    """Name XLA gives the module at the hook (the HloModule line of the lowered text)."""
    text = lowered.as_text(dialect="hlo")
    return text.split(None, 2)[1].rstrip(",")


def cache_key_value(tag: str) -> int:
    """A value for CACHE_KEY_OPTION derived from a tag (plan fingerprint)."""
    return 1_000_000 + int(hashlib.sha256(tag.encode()).hexdigest()[:8], 16) % 1_000_000_000


def compile_with_hook(
    lowered: jax.stages.Lowered,
    handler: Callable[[str], str | None],
    *,
    cache_tag: str | None = None,
    compiler_options: dict | None = None,
    platform: str | None = None,
    stage: str = "PRE_SCHEDULER",
):
    """Compile `lowered` with `handler(module_text) -> new text | None` applied at the hook
    (`stage`: a `jax.extend.xla.PipelineStage` member name; a backend's `hook_stage`).

    Returns the `jax.stages.Compiled`. Raises RuntimeError if the hook never saw the module."""
    return compile_with_hooks(
        lowered, {stage: handler}, cache_tag=cache_tag, compiler_options=compiler_options, platform=platform
    )


def compile_with_hooks(
    lowered: jax.stages.Lowered,
    handlers: dict[str, Callable[[str], str | None]],
    *,
    cache_tag: str | None = None,
    compiler_options: dict | None = None,
    platform: str | None = None,
):
    """`compile_with_hook` with one handler per stage, all in one compile (XLA:GPU: edit the
    module at PRE_SCHEDULER and read what XLA made of it at POST_SCHEDULER)."""
    platform = platform or _plugin_platform()
    for stage in handlers:
        _ensure_registered(platform, stage)
    seen: list[str] = []

    def wrap(stage: str, handler: Callable[[str], str | None]) -> Callable[[str], str | None]:
        def wrapped(text: str) -> str | None:
            seen.append(stage)
            return handler(text)

        return wrapped

    # A fresh tag must be fresh across processes too: another run's entry in the persistent cache
    # would be served without the hook running.
    tag = cache_tag if cache_tag is not None else f"fresh-{next(_fresh)}-{secrets.token_hex(8)}"
    options = dict(compiler_options or {})
    options[CACHE_KEY_OPTION] = cache_key_value(tag)
    with _lock:
        _active["handlers"] = {stage: wrap(stage, h) for stage, h in handlers.items()}
        _active["module_name"] = module_name(lowered)
        min_compile_s = getattr(jax.config, _NO_PERSISTENT_WRITE)
        if cache_tag is None:  # nothing will look this entry up again: keep it out of the cache
            jax.config.update(_NO_PERSISTENT_WRITE, math.inf)
        try:
            compiled = lowered.compile(compiler_options=options)
        finally:
            _active.clear()
            if cache_tag is None:
                jax.config.update(_NO_PERSISTENT_WRITE, min_compile_s)
    if not seen and cache_tag is None:
        raise RuntimeError("the XLA pass hook did not see the step's module; is this jax >= 0.11.2?")
    return compiled


def capture(
    lowered: jax.stages.Lowered,
    compiler_options: dict | None = None,
    *,
    platform: str | None = None,
    stage: str = "PRE_SCHEDULER",
) -> tuple[str, Any]:
    """The module text at the hook stage, and the compiled (unmodified) executable."""
    texts, compiled = capture_stages(lowered, (stage,), compiler_options, platform=platform)
    return texts[stage], compiled


def capture_stages(
    lowered: jax.stages.Lowered,
    stages: tuple[str, ...],
    compiler_options: dict | None = None,
    *,
    platform: str | None = None,
    rewrites: dict[str, Callable[[str], str | None]] | None = None,
) -> tuple[dict[str, str], Any]:
    """The module text at each of `stages` (the last one XLA handed over at each), and the
    compiled executable, from one compile: unmodified, but for `rewrites` (per stage, a
    function of the recorded text whose result, when not None, XLA compiles on with). Raises
    RuntimeError when a stage never saw the module."""
    texts: dict[str, str] = {}

    def recorder(stage: str) -> Callable[[str], str | None]:
        def record(text: str) -> str | None:
            texts[stage] = text
            rewrite = (rewrites or {}).get(stage)
            return None if rewrite is None else rewrite(text)

        return record

    compiled = compile_with_hooks(
        lowered, {s: recorder(s) for s in stages}, compiler_options=compiler_options, platform=platform
    )
    missing = [s for s in stages if s not in texts]
    if missing:
        raise RuntimeError(f"the XLA pass hook did not see the step's module at {', '.join(missing)}")
    return texts, compiled
