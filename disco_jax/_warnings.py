"""Warnings that point at the user's line.

`warn` attributes a warning to the first frame outside disco-jax and JAX (the user's call of the
decorated step, or of a disco-jax function), wherever in the package it is raised: a hand-counted
`stacklevel` goes stale whenever a call is added between the user and the warning, and some
warnings are raised from hooks that XLA calls inside a compile the user started.
"""

from __future__ import annotations

import os
import warnings

import jax

_SKIPPED = (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    os.path.dirname(os.path.abspath(jax.__file__)) + os.sep,
)


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """`warnings.warn(message, category)` attributed to the user's frame (see the module)."""
    warnings.warn(message, category, skip_file_prefixes=_SKIPPED)
