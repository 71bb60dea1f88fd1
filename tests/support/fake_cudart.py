"""The libcudart calls memory/_cuda_host.py makes, without a GPU, with the runtime's per-thread last error modelled:
a failing call leaves its code pending, cudaGetLastError returns it and clears it, and `launch_check` is what torch
runs after every kernel launch (C10_CUDA_KERNEL_LAUNCH_CHECK: raise whatever cudaGetLastError holds)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from vllm_expert_offload.memory import _cuda_host

ERRORS = {1: ("cudaErrorInvalidValue", "invalid argument"),
          712: ("cudaErrorHostMemoryAlreadyRegistered", "part or all of the requested memory range is already mapped"),
          801: ("cudaErrorNotSupported", "operation not supported")}
ALIAS_OFFSET = 1 << 20  # the device alias cudaHostGetDevicePointer hands out: host address + 1 MiB


class StaleCudaError(RuntimeError):
    """What torch raises at the next kernel launch while an error is pending."""


class FakeCudart:
    """`refuse` maps a call's name to the cudaError it returns; every other call succeeds."""

    def __init__(self, refuse: dict[str, int] | None = None) -> None:
        self.refuse = dict(refuse or {})
        self.pending = 0  # the runtime's last error of this thread
        self.drains = 0  # cudaGetLastError calls
        self.calls: list[tuple] = []

    def _result(self, name: str, *args: object) -> int:
        self.calls.append((name, *args))
        code = self.refuse.get(name, 0)
        if code:
            self.pending = code
        return code

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:  # noqa: N802 (the C names)
        return self._result("cudaHostRegister", address, nbytes, flags)

    def cudaHostUnregister(self, address: int) -> int:  # noqa: N802
        return self._result("cudaHostUnregister", address)

    def cudaHostGetDevicePointer(self, device_ptr, address: int, flags: int) -> int:  # noqa: N802
        code = self._result("cudaHostGetDevicePointer", address, flags)
        if not code:
            device_ptr._obj.value = address + ALIAS_OFFSET  # byref(c_void_p): the out-parameter
        return code

    def cudaLaunchHostFunc(self, stream: int, function: int, user_data: int) -> int:  # noqa: N802
        return self._result("cudaLaunchHostFunc", stream, function, user_data)

    def cudaGetLastError(self) -> int:  # noqa: N802
        self.drains += 1
        code, self.pending = self.pending, 0
        return code

    def cudaGetErrorName(self, code: int) -> bytes:  # noqa: N802
        return ERRORS[code][0].encode()

    def cudaGetErrorString(self, code: int) -> bytes:  # noqa: N802
        return ERRORS[code][1].encode()

    def launch_check(self) -> None:
        """torch's check after a kernel launch: a pending error is raised as that kernel's failure (and cleared); not
        counted in `drains`, which counts ours."""
        code, self.pending = self.pending, 0
        if code:
            raise StaleCudaError(f"CUDA error: {ERRORS[code][1]} (a kernel launch found cudaError {code} pending)")


def install(monkeypatch: pytest.MonkeyPatch, refuse: dict[str, int] | None = None) -> FakeCudart:
    """Route _cuda_host's calls to a FakeCudart; torch's device switch and synchronize, which the calls wrap and
    which need a GPU, become no-ops."""
    fake = FakeCudart(refuse)
    monkeypatch.setattr(_cuda_host, "_cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "device", lambda device: nullcontext())
    return fake
