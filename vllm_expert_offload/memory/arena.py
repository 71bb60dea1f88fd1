"""One host buffer for every host-tier expert, mapped into the GPU's address space once.

Why one arena instead of per-tensor `pin_memory()`: torch's pinned allocator rounds each block up to a power
of two (vLLM #56410, ~1.9x host RAM), and thousands of small registrations cost driver time and IOMMU
entries. One anonymous mmap, registered once with cudaHostRegister(MAPPED|PORTABLE), holds exact-size,
4 KiB-aligned records; GPU kernels read them through the device alias with no copy.

Order of operations matters: mmap (no pages yet) -> mbind to the GPU's NUMA node -> cudaHostRegister, which
faults in and locks every page, so the pages land on the bound node. Consequently a registered arena is
resident for its full capacity: size it to the records it will hold (sum of `align_up(record_bytes)`).
A strict bind on a node with less free memory than the arena would let the kernel OOM-kill the worker while
registration faults the pages in, so then the node is only preferred (the rest spills to other nodes), with
a warning that gives the numbers.

Release: unregister, then unmap, exactly once, logged ("host arena released: ..."), whichever comes first of:
`close()`; `release(why)` for a load that failed midway (the pages are given back at once even while views
remain: those read zeros from then on, and the range is unmapped with the last of them); a set-up that fails
halfway (a failing cudaHostGetDevicePointer after cudaHostRegister undoes the registration before the error
propagates); and a multiprocessing finalizer when the arena is collected or the process exits, which, unlike
`weakref.finalize`'s atexit hook, also runs in a worker forked by vLLM (offload/process.py `at_process_exit`).

On a CPU-only machine the same code runs minus the CUDA registration, and `device_address` returns the host
address: the layout, alignment, bounds and NUMA bookkeeping are what CPU tests check, and an unregistered
arena is resident only for the pages actually written.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import mmap
import multiprocessing.util
import os
import platform

import torch

from ..errors import ExpertOffloadError, InvalidStateError, InvalidValueError
from . import _cuda_host
from .topology import format_cpulist, node_free_bytes, online_numa_nodes

# A child of vLLM's logger, as in the rest of the package: its handlers are the only ones a vLLM process has, so the
# mapping and release lines reach the server log.
logger = logging.getLogger("vllm.expert_offload.arena")

RECORD_ALIGNMENT = 4096  # page size: records never share a page, and every record suits any vector load
MPOL_PREFERRED = 1
MPOL_BIND = 2
_MODE_NAMES = {MPOL_PREFERRED: "MPOL_PREFERRED", MPOL_BIND: "MPOL_BIND"}
SYS_MBIND = {"x86_64": 237, "aarch64": 235, "ppc64le": 259, "s390x": 235}
_ULONG_BITS = ctypes.sizeof(ctypes.c_ulong) * 8


class ArenaFullError(ExpertOffloadError, MemoryError):
    """A reservation does not fit in the arena's remaining capacity."""


def align_up(nbytes: int, alignment: int = RECORD_ALIGNMENT) -> int:
    return -(-nbytes // alignment) * alignment


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _syscall(*args: object) -> int:
    """Raw syscall(2); module-level so tests can replace it."""
    return _libc().syscall(*args)


def bind_to_node(address: int, length: int, node: int, mode: int = MPOL_BIND) -> None:
    """mbind the range to one node (strictly, or preferred) before any page is touched (first touch decides).

    Through the raw syscall because glibc has no mbind wrapper (it lives in libnuma, which may be absent).
    """
    machine = platform.machine()
    if machine not in SYS_MBIND:
        raise OSError(f"NUMA binding to node {node} requested, but the mbind syscall number for {machine} is unknown")
    mask = (ctypes.c_ulong * (node // _ULONG_BITS + 1))()
    mask[node // _ULONG_BITS] = 1 << (node % _ULONG_BITS)
    maxnode = len(mask) * _ULONG_BITS + 1  # the kernel reads maxnode - 1 bits
    ret = _syscall(
        ctypes.c_long(SYS_MBIND[machine]),
        ctypes.c_void_p(address),
        ctypes.c_ulong(length),
        ctypes.c_int(mode),
        mask,
        ctypes.c_ulong(maxnode),
        ctypes.c_uint(0),
    )
    if ret != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mbind({_MODE_NAMES[mode]}, node {node}) of {length} bytes at {address:#x} failed: "
                      f"{os.strerror(errno)}")


class _Mapping:
    """The arena's memory and its CUDA registration: what close(), release(), a failed set-up and the finalizer
    end, once between them (no reference to the arena, so the finalizer can hold it)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.mapping = mmap.mmap(-1, capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        # A fork would otherwise copy every pinned page into the child eagerly (pinned pages cannot be CoW-shared).
        self.mapping.madvise(mmap.MADV_DONTFORK)
        self.host_base = 0
        self.registered = False
        self.released = False

    def end(self, unmap: bool = True, why: str = "") -> None:
        """Unregister (after the device has finished every kernel that may read the mapping), then unmap, or with
        `unmap` False give the pages back and leave the range to the views that still map it."""
        if self.released:
            return
        self.released = True
        try:
            if self.registered:
                _cuda_host.host_unregister(self.host_base)
        finally:  # the memory goes back even when the driver refuses to unregister (that error propagates)
            if unmap:
                self.mapping.close()
            else:
                self.mapping.madvise(mmap.MADV_DONTNEED)
        logger.info("host arena released: %.1f MiB %s%s%s", self.capacity / 2**20,
                    "unregistered and " if self.registered else "",
                    "unmapped" if unmap else "its pages freed (live views read zeros; unmapped with the last)",
                    f" ({why})" if why else "")


class HostArena:
    """Bump allocator over one host buffer; see the module docstring for why it exists and how it is backed."""

    def __init__(self, capacity_bytes: int, *, device: torch.device | str = "cpu", numa_node: int | None = None):
        if capacity_bytes <= 0:
            raise InvalidValueError(f"arena capacity must be positive, got {capacity_bytes}")
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise InvalidValueError(f"arena device must be cpu or cuda, got {self.device}")
        self._capacity = align_up(capacity_bytes)
        self._used = 0
        self._state = _Mapping(self._capacity)
        try:
            self._buffer = torch.frombuffer(self._state.mapping, dtype=torch.uint8)
            self._host_base = self._state.host_base = self._buffer.data_ptr()
            self.numa_node = self._bind(numa_node)
            self._device_base = self._host_base
            if self.device.type == "cuda":
                _cuda_host.host_register_mapped(self._host_base, self._capacity)
                self._state.registered = True
                self._device_base = _cuda_host.host_device_pointer(self._host_base, self.device)
        except BaseException as exc:
            self._buffer = None
            self._state.end(why=f"set-up failed: {type(exc).__name__}: {exc}")
            raise
        self._base_uses = self._storage_uses()
        # Runs when the arena is collected or the process exits, forked workers included; after the statistics'
        # exit save (priority 10), and at most once with close() and release().
        multiprocessing.util.Finalize(self, self._state.end, exitpriority=0)
        # Where to look in /proc/<pid>/maps: with the release line, the evidence that shutdown unmapped it.
        logger.info("host arena mapped: %.1f MiB at %#x-%#x in pid %d", self._capacity / 2**20, self._host_base,
                    self._host_base + self._capacity, os.getpid())

    def _bind(self, node: int | None) -> int | None:
        """The node the buffer is bound to, or None when binding was not requested or is moot."""
        if node is None:
            return None
        nodes = online_numa_nodes()
        if nodes and node not in nodes:
            raise InvalidValueError(f"arena NUMA node {node} is not online (online nodes: {format_cpulist(nodes)})")
        if len(nodes) <= 1:
            logger.info("arena: NUMA binding to node %d skipped: the kernel reports %s", node,
                        "one NUMA node" if nodes else "no NUMA nodes")
            return None
        free = node_free_bytes(node)
        mode = MPOL_BIND
        if free is not None and free < self._capacity:
            mode = MPOL_PREFERRED
            logger.warning(
                "arena: NUMA node %d has %.2f GiB free but the arena needs %.2f GiB; preferring the node instead of "
                "binding strictly (the rest lands on other nodes rather than the kernel killing this worker)",
                node, free / 2**30, self._capacity / 2**30,
            )
        bind_to_node(self._host_base, self._capacity, node, mode)
        return node

    def _storage_uses(self) -> int:
        # torch.frombuffer does not hold a buffer export on the mmap, so mmap.close() would unmap memory under
        # live views; the storage's use count is the only record of them.
        return torch._C._storage_Use_Count(self._buffer.untyped_storage()._cdata)

    def _require_open(self) -> None:
        if self._state.released:
            raise InvalidStateError("the host arena is closed")

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    def reserve(self, nbytes: int) -> int:
        """Offset of a new record of nbytes, 4096-aligned; records are never freed (the arena lives as long as
        the model)."""
        self._require_open()
        if nbytes <= 0:
            raise InvalidValueError(f"record size must be positive, got {nbytes}")
        end = self._used + align_up(nbytes)
        if end > self._capacity:
            raise ArenaFullError(
                f"host arena full: a {nbytes}-byte record needs {align_up(nbytes)} aligned bytes, but only "
                f"{self._capacity - self._used} of {self._capacity} are free; size the arena to the sum of "
                f"align_up(record bytes) over its records"
            )
        offset, self._used = self._used, end
        return offset

    def view(self, offset: int, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """Host tensor aliasing reserved bytes [offset, offset + nbytes); zero-copy."""
        self._require_open()
        nbytes = math.prod(shape) * dtype.itemsize
        if offset % dtype.itemsize:
            raise InvalidValueError(f"offset {offset} is not aligned to {dtype} ({dtype.itemsize} bytes)")
        if offset < 0 or offset + nbytes > self._used:
            raise InvalidValueError(f"bytes [{offset}, {offset + nbytes}) are outside the {self._used} reserved bytes")
        return self._buffer[offset : offset + nbytes].view(dtype).view(shape)

    def device_address(self, offset: int) -> int:
        """The address a GPU kernel dereferences for this offset: the mapped device alias under CUDA, the host
        address otherwise."""
        if not 0 <= offset < self._capacity:
            raise InvalidValueError(f"offset {offset} is outside the arena's {self._capacity} bytes")
        return self._device_base + offset

    def _offset(self, tensor: torch.Tensor) -> int | None:
        start = tensor.data_ptr()
        last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
        extent = (last + 1) * tensor.element_size() if tensor.numel() else 0
        for base in (self._host_base, self._device_base):
            if base <= start and start + extent <= base + self._capacity:
                return start - base
        return None

    def contains(self, tensor: torch.Tensor) -> bool:
        """Whether every byte of tensor lies inside the arena (through the host or the device alias)."""
        return self._offset(tensor) is not None

    def offset_of(self, tensor: torch.Tensor) -> int:
        offset = self._offset(tensor)
        if offset is None:
            raise InvalidValueError(f"tensor at {tensor.data_ptr():#x} does not lie inside the host arena")
        return offset

    def close(self) -> None:
        """Unregister and unmap now. Refused while views are alive: unmapping would leave them dangling."""
        if self._state.released:
            return
        if self._storage_uses() > self._base_uses:
            raise InvalidStateError("host arena still has live views; drop every tensor viewing it before close()")
        del self._buffer
        self._state.end()

    def release(self, why: str) -> None:
        """Unregister and give the memory back now, views or not: the load that filled the arena failed (`why`,
        logged), so nothing will read it again. Views that are still alive (in a traceback's frames, say) read
        zeros from then on instead of dangling; the address range is unmapped with the last of them."""
        if self._state.released:
            return
        views = self._storage_uses() > self._base_uses
        del self._buffer
        self._state.end(unmap=not views, why=why)
