"""The host arena's NUMA policy when its node is short of memory, and its release: once, logged, unmapped."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch

from vllm_expert_offload.memory import HostArena
from vllm_expert_offload.memory import arena as arena_mod

PAGE = 4096
GIB = 1 << 30


@pytest.fixture
def two_nodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Two online nodes and a recording mbind; returns the policy modes passed to it."""
    modes: list[int] = []

    def syscall(*args: object) -> int:
        modes.append(args[3].value)
        return 0

    monkeypatch.setattr(arena_mod, "_syscall", syscall)
    monkeypatch.setattr(arena_mod.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(arena_mod, "online_numa_nodes", lambda: (0, 1))
    return modes


def test_strict_bind_when_the_node_has_room(two_nodes: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arena_mod, "node_free_bytes", lambda node: 64 * GIB)
    HostArena(16 * PAGE, numa_node=1)
    assert two_nodes == [arena_mod.MPOL_BIND]


def test_preferred_with_numbers_when_the_node_is_short(
    two_nodes: list[int], monkeypatch: pytest.MonkeyPatch, arena_log: pytest.LogCaptureFixture
) -> None:
    """A strict bind here would let the kernel OOM-kill the worker while registration faults the pages in."""
    monkeypatch.setattr(arena_mod, "node_free_bytes", lambda node: 8 * PAGE)
    arena = HostArena(16 * PAGE, numa_node=1)
    assert two_nodes == [arena_mod.MPOL_PREFERRED] and arena.numa_node == 1
    assert "NUMA node 1 has 0.00 GiB free but the arena needs 0.00 GiB; preferring the node" in arena_log.text


def test_node_free_bytes_reads_meminfo(tmp_path) -> None:
    from vllm_expert_offload.memory.topology import node_free_bytes

    node = tmp_path / "sys/devices/system/node/node1"
    node.mkdir(parents=True)
    (node / "meminfo").write_text("Node 1 MemTotal:       1000 kB\nNode 1 MemFree:         250 kB\n")
    assert node_free_bytes(1, tmp_path) == 250 * 1024
    assert node_free_bytes(2, tmp_path) is None


def _mapped(address: int) -> bool:
    for line in open("/proc/self/maps"):
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        if start <= address < end:
            return True
    return False


def test_close_unmaps_once_and_refuses_under_live_views(arena_log: pytest.LogCaptureFixture) -> None:
    arena = HostArena(4 * PAGE)
    base = arena.device_address(0)
    assert f"host arena mapped: 0.0 MiB at {base:#x}-{base + 4 * PAGE:#x} in pid {os.getpid()}" in arena_log.text
    view = arena.view(arena.reserve(PAGE), (PAGE,), torch.uint8)
    with pytest.raises(RuntimeError, match="live views"):
        arena.close()
    del view
    arena.close()
    arena.close()
    assert not _mapped(base)
    assert arena_log.text.count("host arena released: 0.0 MiB unmapped") == 1
    with pytest.raises(RuntimeError, match="closed"):
        arena.reserve(PAGE)


def test_collected_arena_is_released() -> None:
    arena = HostArena(4 * PAGE)
    base = arena.device_address(0)
    assert _mapped(base)
    del arena
    gc.collect()
    assert not _mapped(base)


def test_released_at_process_exit() -> None:
    """Engine shutdown: the worker process exits holding its arena; the finalizer still releases it, logged."""
    code = (
        "import logging; logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
        "from vllm_expert_offload.memory import HostArena\n"
        "arena = HostArena(1 << 20); arena.view(arena.reserve(4096), (4096,), __import__('torch').uint8).fill_(1)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "host arena released: 1.0 MiB unmapped" in result.stderr
