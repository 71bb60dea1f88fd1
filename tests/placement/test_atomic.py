"""The atomic writer (placement/_atomic.py): temporary file beside the target, file and directory synced, the
process umask respected and an existing file's mode kept, anything but a regular file refused untouched."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_expert_offload.placement import _atomic
from vllm_expert_offload.placement.errors import PlacementError


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _fd_target(fd: int) -> Path:
    return Path(os.readlink(f"/proc/self/fd/{fd}"))


def test_file_synced_renamed_from_its_own_directory_then_directory_synced(tmp_path, monkeypatch) -> None:
    """What each fsync reached is read from /proc/self/fd at the call, so the check holds however the file is
    opened: the temporary file (in the target's directory) before the rename, the directory after it."""
    events: list[tuple[str, Path, Path | None]] = []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(fd: int) -> None:
        events.append(("fsync", _fd_target(fd), None))
        fsync(fd)

    def recording_replace(src, dst) -> None:
        events.append(("replace", Path(src), Path(dst)))
        replace(src, dst)

    monkeypatch.setattr(_atomic.os, "fsync", recording_fsync)
    monkeypatch.setattr(_atomic.os, "replace", recording_replace)
    target = tmp_path / "stats.json"
    _atomic.write_atomically(target, "{}\n")
    (_, synced_file, _), (_, temporary, renamed_to), (_, synced_dir, _) = events
    assert [e[0] for e in events] == ["fsync", "replace", "fsync"]
    assert synced_file == temporary and temporary.parent == tmp_path and renamed_to == target
    assert synced_dir == tmp_path
    assert target.read_text() == "{}\n" and os.listdir(tmp_path) == ["stats.json"]


def test_a_rename_across_directories_is_never_attempted(tmp_path, monkeypatch) -> None:
    """os.replace as if every directory were its own filesystem (EXDEV otherwise), which holds anywhere: a file
    staged in the temporary directory fails the write when the target lies on another filesystem."""
    replace = os.replace

    def per_directory_replace(src, dst) -> None:
        if Path(src).parent != Path(dst).parent:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        replace(src, dst)

    monkeypatch.setattr(_atomic.os, "replace", per_directory_replace)
    _atomic.write_atomically(tmp_path / "stats.json", "1")
    assert (tmp_path / "stats.json").read_text() == "1"


@pytest.mark.skipif(os.stat("/dev/shm").st_dev == os.stat(tempfile.gettempdir()).st_dev,
                    reason="/dev/shm and the temporary directory are one filesystem here")
def test_target_on_another_filesystem_than_the_temporary_directory() -> None:
    """A real cross-device target: a writer that staged its file in the temporary directory fails with EXDEV."""
    directory = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        _atomic.write_atomically(directory / "stats.json", "2")
        assert (directory / "stats.json").read_text() == "2"
    finally:
        for child in directory.iterdir():
            child.unlink()
        directory.rmdir()


@pytest.mark.parametrize(("mask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_new_file_gets_the_process_umask(tmp_path, mask: int, mode: int) -> None:
    with umask(mask):
        _atomic.write_atomically(tmp_path / "stats.json", "x")
    assert stat.S_IMODE(os.stat(tmp_path / "stats.json").st_mode) == mode


def test_replaced_file_keeps_its_mode(tmp_path) -> None:
    target = tmp_path / "stats.json"
    target.write_text("old")
    target.chmod(0o640)
    with umask(0o022):
        _atomic.write_atomically(target, "new")
    assert target.read_text() == "new" and stat.S_IMODE(os.stat(target).st_mode) == 0o640


def _special_files(tmp_path: Path) -> dict[str, Path]:
    """One of each kind of non-regular entry lstat can find (a block device only where mknod is allowed)."""
    regular = tmp_path / "regular.json"
    regular.write_text("{}")
    paths = {"a FIFO": tmp_path / "fifo", "a symbolic link": tmp_path / "link", "a socket": tmp_path / "sock",
             "a directory": tmp_path / "dir", "a character device": Path("/dev/null")}
    os.mkfifo(paths["a FIFO"])
    paths["a symbolic link"].symlink_to(regular)
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(paths["a socket"]))
    server.close()
    paths["a directory"].mkdir()
    with contextlib.suppress(PermissionError, OSError):
        os.mknod(tmp_path / "block", stat.S_IFBLK | 0o600, os.makedev(7, 200))
        paths["a block device"] = tmp_path / "block"
    return paths


def test_anything_but_a_regular_file_is_refused_untouched(tmp_path, monkeypatch) -> None:
    paths = _special_files(tmp_path)
    before = {kind: os.lstat(path) for kind, path in paths.items()}
    opened: list[str] = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: opened.append(str(path)) or real_open(path, *a, **k))
    for kind, path in paths.items():
        assert _atomic.replace_refusal(path) == kind
        with pytest.raises(PlacementError, match=f"refusing to replace {path}: it is {kind}, not a regular file"):
            _atomic.write_atomically(path, "x")
        after = os.lstat(path)
        assert (after.st_mode, after.st_ino, after.st_mtime_ns) == (
            before[kind].st_mode, before[kind].st_ino, before[kind].st_mtime_ns), kind
    assert not opened
    assert sorted(os.listdir(tmp_path)) == sorted([p.name for p in paths.values() if p.parent == tmp_path]
                                                  + ["regular.json"])  # no temporary file left either
    assert _atomic.replace_refusal(tmp_path / "regular.json") is None
    assert _atomic.replace_refusal(tmp_path / "absent.json") is None
