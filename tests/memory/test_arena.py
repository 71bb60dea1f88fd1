"""HostArena: record layout, zero-copy views, bounds, resident memory, NUMA binding and (GPU) mapped registration."""

from __future__ import annotations

import ctypes
import errno
import gc
import os
from pathlib import Path

import pytest
import torch

from vllm_expert_offload.memory import ArenaFullError, HostArena
from vllm_expert_offload.memory import arena as arena_mod

from support.cuda_alias import device_alias

MIB = 1 << 20
PAGE = 4096


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_records_are_page_aligned_and_views_share_memory() -> None:
    arena = HostArena(64 * PAGE)
    offsets = [arena.reserve(n) for n in (1, 4095, 4096, 4097, 10_000, 2)]
    assert offsets == [0, 4096, 8192, 12288, 20480, 32768]
    assert arena.used_bytes == 36864 and arena.capacity_bytes == 64 * PAGE
    for offset in offsets:
        assert offset % PAGE == 0 and arena.device_address(offset) % PAGE == 0
    record = arena.view(offsets[4], (50, 100), torch.int16)
    assert record.data_ptr() == arena.device_address(offsets[4])  # CPU: the host address itself
    record.copy_(torch.arange(5000, dtype=torch.int16).view(50, 100))
    again = arena.view(offsets[4], (5000,), torch.int16)
    assert torch.equal(again, torch.arange(5000, dtype=torch.int16))
    again[7] = -1
    assert record[0, 7] == -1


def test_capacity_is_rounded_to_pages() -> None:
    assert HostArena(5000).capacity_bytes == 2 * PAGE


def test_contains() -> None:
    arena = HostArena(8 * PAGE)
    record = arena.view(arena.reserve(3 * PAGE), (3 * PAGE // 2,), torch.int16)
    last = arena.view(arena.reserve(5 * PAGE), (5 * PAGE,), torch.uint8)
    assert arena.contains(record) and arena.contains(record[10:20]) and arena.contains(last)
    assert arena.contains(record.view(96, 64)[:, ::2]) and arena.contains(record.view(96, 64)[-1, -4:])
    assert arena.offset_of(last[1:]) == 3 * PAGE + 1
    outside = torch.zeros(16, dtype=torch.int16)
    assert not arena.contains(outside) and not arena.contains(record.clone())
    with pytest.raises(ValueError, match="does not lie inside"):
        arena.offset_of(outside)


def test_exhaustion_and_bounds_are_refused() -> None:
    arena = HostArena(3 * PAGE)
    assert arena.reserve(2 * PAGE) == 0
    with pytest.raises(ArenaFullError, match=r"host arena full: a 4097-byte record needs 8192 aligned bytes, "
                                             r"but only 4096 of 12288 are free"):
        arena.reserve(PAGE + 1)
    assert arena.used_bytes == 2 * PAGE  # a refused reservation takes nothing
    assert arena.reserve(PAGE) == 2 * PAGE
    with pytest.raises(ValueError, match="outside the 12288 reserved bytes"):
        arena.view(2 * PAGE, (PAGE + 2,), torch.uint8)
    with pytest.raises(ValueError, match="not aligned"):
        arena.view(1, (4,), torch.int16)
    with pytest.raises(ValueError, match="positive"):
        arena.reserve(0)


def test_close_refuses_live_views() -> None:
    arena = HostArena(2 * PAGE)
    view = arena.view(arena.reserve(PAGE), (PAGE,), torch.uint8)
    sub = view[5:]
    with pytest.raises(RuntimeError, match="live views"):
        arena.close()
    del view, sub
    arena.close()
    arena.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        arena.reserve(PAGE)


def test_resident_memory_tracks_payload_not_capacity() -> None:
    capacity, payload, record = 1024 * MIB, 64 * MIB, MIB - 100
    gc.collect()
    before = rss_bytes()
    arena = HostArena(capacity)
    after_create = rss_bytes()
    for _ in range(payload // MIB):
        arena.view(arena.reserve(record), (record,), torch.uint8).fill_(0xA5)
    grown = rss_bytes() - before
    print(f"RSS: +{(after_create - before) / MIB:.1f} MiB after mmap of {capacity // MIB} MiB, "
          f"+{grown / MIB:.1f} MiB after writing {payload // MIB} MiB")
    assert after_create - before < 4 * MIB
    assert payload - 2 * MIB <= grown <= payload + 8 * MIB


@pytest.fixture
def fake_mbind(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    calls: list[tuple] = []

    def syscall(*args: object) -> int:
        calls.append(tuple(a.value if hasattr(a, "value") else list(a) for a in args))
        return 0

    monkeypatch.setattr(arena_mod, "_syscall", syscall)
    monkeypatch.setattr(arena_mod.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(arena_mod, "online_numa_nodes", lambda: (0, 1))
    return calls


def test_numa_binding_on_two_nodes(fake_mbind: list[tuple]) -> None:
    arena = HostArena(16 * PAGE, numa_node=1)
    assert arena.numa_node == 1
    assert fake_mbind == [(237, arena.device_address(0), 16 * PAGE, arena_mod.MPOL_BIND, [0b10], 65, 0)]


def test_numa_binding_high_node_mask(fake_mbind: list[tuple], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arena_mod, "online_numa_nodes", lambda: tuple(range(72)))
    HostArena(PAGE, numa_node=70)
    (_, _, _, _, mask, maxnode, _), = fake_mbind
    assert mask == [0, 1 << 6] and maxnode == 129


def test_numa_binding_failure_raises(fake_mbind: list[tuple], monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(*args: object) -> int:
        ctypes.set_errno(errno.EPERM)
        return -1

    monkeypatch.setattr(arena_mod, "_syscall", failing)
    with pytest.raises(OSError, match=r"mbind\(MPOL_BIND, node 0\).*Operation not permitted") as info:
        HostArena(PAGE, numa_node=0)
    assert info.value.errno == errno.EPERM
    with pytest.raises(ValueError, match="node 2 is not online"):
        HostArena(PAGE, numa_node=2)
    monkeypatch.setattr(arena_mod.platform, "machine", lambda: "riscv64")
    with pytest.raises(OSError, match="syscall number for riscv64 is unknown"):
        HostArena(PAGE, numa_node=1)


def test_numa_binding_skipped_on_one_node(
    fake_mbind: list[tuple], monkeypatch: pytest.MonkeyPatch, arena_log: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(arena_mod, "online_numa_nodes", lambda: (0,))
    arena = HostArena(PAGE, numa_node=0)
    assert arena.numa_node is None and fake_mbind == []
    assert "NUMA binding to node 0 skipped: the kernel reports one NUMA node" in arena_log.text


def memory_policy(address: int) -> str:
    """The kernel's NUMA policy for the mapping holding `address`, as /proc/self/numa_maps shows it
    ("default", "bind:0", ...): read back from the kernel, not from what the arena believes it asked for."""
    entries = [line.split()[:2] for line in Path("/proc/self/numa_maps").read_text().splitlines()]
    starts = [(int(start, 16), policy) for start, policy in entries if int(start, 16) <= address]
    return max(starts)[1]


def test_real_mbind_syscall() -> None:
    """The ctypes call itself, on whatever node 0 this machine has (containers may forbid mbind): the kernel must
    report the arena's pages bound to node 0 afterwards, and not before."""
    if not Path("/proc/self/numa_maps").exists():
        pytest.skip("this kernel has no /proc/self/numa_maps (built without NUMA)")
    arena = HostArena(4 * PAGE)
    assert memory_policy(arena.device_address(0)) == "default"
    try:
        arena_mod.bind_to_node(arena.device_address(0), arena.capacity_bytes, 0)
    except OSError as exc:
        if exc.errno == errno.EPERM:
            pytest.skip("mbind is not permitted in this container")
        raise
    assert memory_policy(arena.device_address(0)) == "bind:0"
    assert memory_policy(arena.device_address(arena.capacity_bytes - 1)) == "bind:0"


@pytest.mark.gpu
def test_cuda_mapped_arena_is_zero_copy() -> None:
    allocated = torch.cuda.memory_allocated()
    arena = HostArena(4 * MIB, device="cuda")
    offset = arena.reserve(2 * PAGE)
    host = arena.view(offset, (PAGE,), torch.int16)
    host.copy_(torch.arange(PAGE, dtype=torch.int16))
    gpu = device_alias(arena.device_address(offset), (PAGE,), torch.int16)
    assert gpu.device.type == "cuda"
    assert torch.equal(gpu.cpu(), host)  # a kernel read the host bytes through the mapped alias
    host.fill_(7)
    assert bool((gpu == 7).all())  # and reads them live: nothing was copied at registration
    assert torch.cuda.memory_allocated() - allocated < MIB  # only the tiny comparison results
    del host, gpu
    arena.close()
