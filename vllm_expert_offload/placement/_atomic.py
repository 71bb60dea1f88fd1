"""Whole-file writes that a concurrent reader can never catch half done, to paths that hold regular files only."""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

from .errors import PlacementError

# What lstat can find at a path besides a regular file, in words for the refusal.
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
_NAME_ATTEMPTS = 100  # random temporary names tried before giving up (each collision is a 2^-64 event)


def replace_refusal(path: Path) -> str | None:
    """None when a write may replace `path`: nothing is there, or a regular file; else what is there ("a FIFO").

    A rename replaces whatever entry it lands on: a device node (/dev/null when served as root) or a FIFO would
    become a regular file, a symbolic link would be replaced instead of followed. Only lstat: nothing at `path` is
    opened or followed."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISREG(mode):
        return None
    return next((kind for test, kind in _KINDS if test(mode)), f"a file of type {stat.S_IFMT(mode):#o}")


def _create_temporary(directory: Path, name: str) -> tuple[int, Path]:
    """A new file beside the target, created by the kernel with mode 0666 minus the process umask."""
    for _ in range(_NAME_ATTEMPTS):
        temporary = directory / f".{name}.{secrets.token_hex(8)}.tmp"
        try:
            return os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), temporary
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name in {directory} after {_NAME_ATTEMPTS} attempts")


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: str | Path, text: str) -> None:
    """Replace `path` by `text` so that readers see the old file or the new one, never a part of either.

    Statistics are written while serving and read by whoever wants them at any moment (a planner, a cron job),
    so the text goes to a temporary file in the target's directory (the same filesystem: a rename across
    filesystems fails with EXDEV), reaches the disk, is renamed over `path`, and the directory entry is synced
    too, so a crash right after the call cannot bring the old file back. A new file gets the mode the process
    umask gives (0644 under the usual 022); a file being replaced keeps its mode. Anything at `path` other than a
    regular file is refused, untouched (`replace_refusal`)."""
    path = Path(path)
    refusal = replace_refusal(path)
    if refusal is not None:
        raise PlacementError(f"refusing to replace {path}: it is {refusal}, not a regular file")
    try:
        kept_mode = stat.S_IMODE(os.lstat(path).st_mode)
    except FileNotFoundError:
        kept_mode = None
    fd, temporary = _create_temporary(path.parent, path.name)
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text)
            file.flush()
            if kept_mode is not None:
                os.fchmod(file.fileno(), kept_mode)
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    _fsync_directory(path.parent)
