"""Backends: everything disco-jax knows about one XLA compiler, in one object.

A `Backend` says at which pass-hook stage the module is captured and rewritten, which ops the
compiler's loop emitter fuses (the graph IR's "fusible" ops), which fused groups it can emit, how
a strategy is written back into the module (`Rewriter`), how XLA itself combines all-reduces, and
which compile options enact DisCo's baselines. The rest of the library asks the backend and never
compares platform names.

Adding a backend is one file in this package defining a `Backend`, plus one `register` call at
the bottom of this file. `for_platform(jax.default_backend())` is how the pipeline finds one.
"""

from __future__ import annotations

from disco_jax.backends.base import Backend, Rewriter
from disco_jax.backends.cpu import CPU
from disco_jax.backends.gpu import GPU

__all__ = ["Backend", "Rewriter", "CPU", "GPU", "register", "for_platform", "supported_platforms"]

_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend, *aliases: str) -> Backend:
    """Make `backend` the one `for_platform` returns for `backend.platform` and for `aliases`
    (the names JAX reports devices and its default backend by, where they differ)."""
    for name in (backend.platform, *aliases):
        _REGISTRY[name] = backend
    return backend


def for_platform(platform: str) -> Backend | None:
    """The backend for a JAX platform name, or None when disco-jax does not support it."""
    return _REGISTRY.get(platform)


def supported_platforms(*, decorator: bool = False) -> tuple[str, ...]:
    """Platforms with a backend (`decorator`: only those `@optimize_distributed` searches and
    enacts plans on, `Backend.decorator_ready`)."""
    return tuple(sorted({b.platform for b in _REGISTRY.values() if b.decorator_ready or not decorator}))


register(CPU)
register(GPU, "gpu")  # JAX calls CUDA devices and their backend "gpu"; XLA's plugin, "cuda"
