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
from vllm_expert_offload.memory._cuda_host import CudaError

from support.fake_cudart import ALIAS_OFFSET, FakeCudart, install
from support.process_maps import is_mapped

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
    assert not is_mapped(base)
    assert arena_log.text.count("host arena released: 0.0 MiB unmapped") == 1
    with pytest.raises(RuntimeError, match="closed"):
        arena.reserve(PAGE)


def test_collected_arena_is_released() -> None:
    arena = HostArena(4 * PAGE)
    base = arena.device_address(0)
    assert is_mapped(base)
    del arena
    gc.collect()
    assert not is_mapped(base)


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


FORKED_EXIT = """
import logging, multiprocessing, os, sys
import torch
logging.basicConfig(level=logging.INFO, format="%(process)d %(message)s", stream=sys.stderr)
from vllm_expert_offload.memory import HostArena

def worker():
    arena = HostArena(1 << 20)
    arena.view(arena.reserve(4096), (4096,), torch.uint8).fill_(1)
    globals()["held"] = arena  # held until the worker process ends, as a model holds its arena

if __name__ == "__main__":
    parent = HostArena(2 << 20)
    child = multiprocessing.get_context("fork").Process(target=worker)
    child.start()
    child.join()
    print(f"child {child.pid} exit {child.exitcode}", file=sys.stderr)
"""


def test_a_forked_worker_releases_its_arena_when_it_ends(tmp_path) -> None:
    """vLLM forks its workers on GPU machines, and a forked child ends with os._exit: no atexit handler runs there.
    Each process releases exactly its own arena, once (the child inherits none of the parent's finalizers)."""
    script = tmp_path / "forked.py"
    script.write_text(FORKED_EXIT)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    child = int(result.stderr.split("child ")[1].split()[0])
    released = [line for line in result.stderr.splitlines() if "host arena released" in line]
    assert sorted(released) == sorted([f"{child} host arena released: 1.0 MiB unmapped",
                                       f"{result.stderr.split()[0]} host arena released: 2.0 MiB unmapped"]), released
    assert f"child {child} exit 0" in result.stderr


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
    """libcudart faked on the CPU (device alias = host address + 1 MiB), its calls recorded."""
    return install(monkeypatch)


def test_registered_arena_unregistered_and_unmapped_once(fake_cuda, arena_log) -> None:
    arena = HostArena(4 * PAGE, device="cuda")
    base = arena.device_address(0) - ALIAS_OFFSET
    assert [c[:2] for c in fake_cuda.calls] == [("cudaHostRegister", base), ("cudaHostGetDevicePointer", base)]
    arena.close()
    arena.release("after close")
    del arena
    gc.collect()
    assert [c[:2] for c in fake_cuda.calls[2:]] == [("cudaHostUnregister", base)] and not is_mapped(base)
    assert arena_log.text.count("host arena released: 0.0 MiB unregistered and unmapped") == 1
    assert fake_cuda.drains == 0


def test_a_failing_device_pointer_after_registration_is_undone(fake_cuda, arena_log) -> None:
    fake_cuda.refuse["cudaHostGetDevicePointer"] = 1
    with pytest.raises(CudaError, match=r"cudaHostGetDevicePointer\(host=0x[0-9a-f]+, device=cuda\) failed: cudaError 1 "
                       r"\(cudaErrorInvalidValue"):
        HostArena(4 * PAGE, device="cuda")
    base = fake_cuda.calls[0][1]
    calls = [("cudaHostRegister", base), ("cudaHostGetDevicePointer", base), ("cudaHostUnregister", base)]
    assert [c[:2] for c in fake_cuda.calls] == calls and not is_mapped(base)
    assert fake_cuda.drains == 1 and fake_cuda.pending == 0  # the failure read off the runtime, once
    assert arena_log.text.count("host arena released: ") == 1
    assert "host arena released: 0.0 MiB unregistered and unmapped (set-up failed: CudaError: " in arena_log.text
    gc.collect()
    assert [c[:2] for c in fake_cuda.calls] == calls  # nothing ends it a second time


def test_a_failing_numa_bind_unmaps_before_the_error(two_nodes, monkeypatch, arena_log) -> None:
    monkeypatch.setattr(arena_mod, "node_free_bytes", lambda node: 64 * GIB)
    monkeypatch.setattr(arena_mod, "_syscall", lambda *args: -1)
    with pytest.raises(OSError, match="mbind"):
        HostArena(16 * PAGE, numa_node=1)
    assert arena_log.text.count("host arena released: 0.1 MiB unmapped (set-up failed: ") == 1
    assert "mbind(MPOL_BIND, node 1) of 65536 bytes" in arena_log.text


def test_release_with_live_views_frees_the_pages_and_unmaps_with_the_last_view(arena_log) -> None:
    """A load that failed midway: a view still alive somewhere reads zeros, never unmapped memory."""
    arena = HostArena(4 * PAGE)
    base = arena.device_address(0)
    view = arena.view(arena.reserve(PAGE), (PAGE,), torch.uint8).fill_(7)
    arena.release("the model load failed: test")
    assert int(view.sum()) == 0 and is_mapped(base)
    assert ("host arena released: 0.0 MiB its pages freed (live views read zeros; unmapped with the last) "
            "(the model load failed: test)") in arena_log.text
    with pytest.raises(RuntimeError, match="closed"):
        arena.reserve(PAGE)
    arena.close()
    del arena
    gc.collect()
    assert is_mapped(base)  # the view still maps it
    del view
    gc.collect()
    assert not is_mapped(base) and arena_log.text.count("host arena released: ") == 1


def test_release_without_views_unmaps_at_once(arena_log) -> None:
    arena = HostArena(4 * PAGE)
    base = arena.device_address(0)
    arena.release("the model load failed: test")
    assert not is_mapped(base)
    assert "host arena released: 0.0 MiB unmapped (the model load failed: test)" in arena_log.text
