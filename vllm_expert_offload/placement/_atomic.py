"""Whole-file writes that a concurrent reader can never catch half done."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_atomically(path: str | Path, text: str) -> None:
    """Replace `path` by `text` so that readers see the old file or the new one, never a part of either.

    Statistics are written while serving and read by whoever wants them at any moment (a planner, a cron job),
    so the text goes to a temporary file in the same directory (the same filesystem, where a rename is atomic),
    reaches the disk, and is then renamed over `path`. The file gets mode 0644 (mkstemp's 0600 would hide it
    from the user who reads it when the server runs as another user)."""
    path = Path(path)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
            os.fchmod(file.fileno(), 0o644)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
