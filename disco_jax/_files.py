"""Writing files other processes may read at the same time."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write so that readers see the old file or the new one, never a partial one: a temp file
    in the same directory, fsync, then os.replace. The file is readable by all (0644): plans,
    profiles and weights are shared between users of a machine or cluster."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_json_atomic(path: str | os.PathLike, data: Any) -> None:
    """`write_bytes_atomic` of indented, key-sorted JSON (NaN refused)."""
    text = json.dumps(data, indent=1, sort_keys=True, allow_nan=False) + "\n"
    write_bytes_atomic(path, text.encode())
