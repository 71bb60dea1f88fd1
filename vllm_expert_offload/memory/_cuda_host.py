"""ctypes bindings for the CUDA runtime calls that map host memory into the GPU's address space, and for
cudaLaunchHostFunc, which runs a host function in a stream's order (the CPU expert tier's jobs).

torch exposes `cudaHostRegister` (`torch.cuda.cudart()`) but not `cudaHostGetDevicePointer`, and
`Tensor.pin_memory()` goes through the caching host allocator, which rounds every block up to a power of
two (vLLM #56410: ~1.9x host memory). Registering our own mmap'd range once avoids both. Nothing here
runs on a CPU-only machine; the module is kept this thin so the untested surface stays small.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from pathlib import Path

import torch

from ..errors import ExpertOffloadError

CUDA_HOST_REGISTER_PORTABLE = 0x01  # the mapping is valid in every CUDA context, not just the current one
CUDA_HOST_REGISTER_MAPPED = 0x02  # the range gets a device alias that kernels can dereference (zero-copy)


class CudaError(ExpertOffloadError, RuntimeError):
    """A CUDA runtime call failed; the message names the call and its cudaError code."""


def _loaded_cudart() -> str | None:
    """The libcudart torch already loaded: using the same copy keeps one runtime state in the process."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return None
    for line in maps.read_text().splitlines():
        path = line.split(maxsplit=5)[-1]
        if "libcudart" in Path(path).name:
            return path
    return None


def _bundled_cudart() -> str | None:
    """libcudart shipped next to torch's own libraries (older wheels bundle a hashed copy there)."""
    lib_dir = Path(torch.__file__).parent / "lib"
    candidates = sorted(lib_dir.glob("libcudart*.so*"))
    return str(candidates[0]) if candidates else None


@functools.cache
def _cudart() -> ctypes.CDLL:
    path = _loaded_cudart() or _bundled_cudart() or ctypes.util.find_library("cudart")
    if path is None:
        raise CudaError("libcudart not found: not loaded by torch, not in torch's lib dir, not on the linker path")
    lib = ctypes.CDLL(path)
    lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
    lib.cudaHostGetDevicePointer.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_uint]
    lib.cudaLaunchHostFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.cudaGetLastError.argtypes = []
    lib.cudaGetErrorName.restype = ctypes.c_char_p
    lib.cudaGetErrorString.restype = ctypes.c_char_p
    return lib


def _check(call: str, code: int) -> None:
    """Raise CudaError for a failed call, after taking its code off the runtime's per-thread last error.

    The runtime keeps every failing call's code there until cudaGetLastError reads it, and torch checks each kernel
    launch with cudaGetLastError (C10_CUDA_KERNEL_LAUNCH_CHECK): left pending, an error our caller catches and
    handles (a refused cudaHostRegister falling back to torch pinned memory) would be raised again as the failure
    of the next, unrelated torch kernel (pytorch#167414, vLLM #50070). Read through the same handle as the call, so
    it is the same runtime's slot; on success nothing is read (another library's pending error is not ours to take).
    """
    if code != 0:
        lib = _cudart()
        lib.cudaGetLastError()
        name = lib.cudaGetErrorName(code).decode()
        text = lib.cudaGetErrorString(code).decode()
        raise CudaError(f"{call} failed: cudaError {code} ({name}: {text})")


def host_register_mapped(address: int, nbytes: int) -> None:
    """Page-lock [address, address+nbytes) and map it into every context's device address space."""
    flags = CUDA_HOST_REGISTER_MAPPED | CUDA_HOST_REGISTER_PORTABLE
    _check(f"cudaHostRegister({address:#x}, {nbytes}, {flags:#x})", _cudart().cudaHostRegister(address, nbytes, flags))


def host_unregister(address: int) -> None:
    """Undo host_register_mapped, once every kernel queued on the device (which may read the range) has finished."""
    torch.cuda.synchronize()
    _check(f"cudaHostUnregister({address:#x})", _cudart().cudaHostUnregister(address))


def host_device_pointer(address: int, device: torch.device) -> int:
    """The device alias of a registered host address on `device` (equals it on Linux with UVA)."""
    device_ptr = ctypes.c_void_p()
    with torch.cuda.device(device):
        code = _cudart().cudaHostGetDevicePointer(ctypes.byref(device_ptr), address, 0)
    _check(f"cudaHostGetDevicePointer(host={address:#x}, device={device})", code)
    return int(device_ptr.value or 0)


def launch_host_func(stream: int, function: int, user_data: int) -> None:
    """Queue the C function at address `function` on the CUDA stream handle `stream`: it runs on CUDA's callback
    thread with `user_data` once the work queued before it has finished, and the stream's later work waits for it.
    Under graph capture it becomes a host node of the graph, `user_data` fixed at capture."""
    code = _cudart().cudaLaunchHostFunc(stream, function, user_data)
    _check(f"cudaLaunchHostFunc(stream={stream:#x}, fn={function:#x}, user_data={user_data:#x})", code)
