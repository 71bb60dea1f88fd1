"""Every CUDA runtime call _cuda_host makes: a failure raises CudaError naming the call and the buffer, and leaves no
error pending in the runtime, where torch's next kernel launch check would raise it as that kernel's failure (the
probe's fallback to torch pinned memory after a refused cudaHostRegister died that way). No GPU: a fake libcudart
with the runtime's per-thread last error."""

from __future__ import annotations

import gc

import pytest
import torch

from vllm_expert_offload.memory import HostArena, _cuda_host

from support.fake_cudart import ALIAS_OFFSET, StaleCudaError, install
from support.process_maps import is_mapped

PAGE = 4096
CUDA = torch.device("cuda", 0)
CALLS = {  # call -> (how to make it, what its error message must name)
    "cudaHostRegister": (lambda: _cuda_host.host_register_mapped(0x7F0000000000, 3 * PAGE),
                         "cudaHostRegister(0x7f0000000000, 12288, 0x3) failed: cudaError 801 (cudaErrorNotSupported: "
                         "operation not supported)"),
    "cudaHostUnregister": (lambda: _cuda_host.host_unregister(0x7F0000001000),
                           "cudaHostUnregister(0x7f0000001000) failed: cudaError 801"),
    "cudaHostGetDevicePointer": (lambda: _cuda_host.host_device_pointer(0x7F0000002000, CUDA),
                                 "cudaHostGetDevicePointer(host=0x7f0000002000, device=cuda:0) failed: cudaError 801"),
    "cudaLaunchHostFunc": (lambda: _cuda_host.launch_host_func(0x10, 0x20, 0x30),
                           "cudaLaunchHostFunc(stream=0x10, fn=0x20, user_data=0x30) failed: cudaError 801"),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_a_failed_call_raises_naming_it_and_leaves_no_error_for_the_next_kernel(monkeypatch, call: str) -> None:
    fake = install(monkeypatch, {call: 801})
    make, message = CALLS[call]
    with pytest.raises(_cuda_host.CudaError) as raised:
        make()
    assert message in str(raised.value)
    assert [c[0] for c in fake.calls] == [call]
    assert fake.drains == 1 and fake.pending == 0
    fake.launch_check()  # torch's next kernel launch finds nothing pending


@pytest.mark.parametrize("call", list(CALLS))
def test_a_successful_call_reads_no_error(monkeypatch, call: str) -> None:
    """cudaGetLastError only after our own failure: read after a success it would take (and hide) an error another
    library left pending for its own check."""
    fake = install(monkeypatch)
    fake.pending = 1  # someone else's
    CALLS[call][0]()
    assert fake.drains == 0
    with pytest.raises(StaleCudaError, match="cudaError 1 pending"):
        fake.launch_check()


def test_the_device_pointer_is_the_runtimes_out_parameter(monkeypatch) -> None:
    install(monkeypatch)
    assert _cuda_host.host_device_pointer(0x7F0000002000, CUDA) == 0x7F0000002000 + ALIAS_OFFSET


def test_a_refused_arena_registration_raises_once_drained_and_unmaps(monkeypatch, arena_log) -> None:
    """HostArena(device="cuda") on a runtime that refuses cudaHostRegister (801): the error propagates, read off the
    runtime exactly once, nothing to unregister, the mmap gone."""
    fake = install(monkeypatch, {"cudaHostRegister": 801})
    with pytest.raises(_cuda_host.CudaError, match=r"cudaHostRegister\(0x[0-9a-f]+, 4096, 0x3\) failed: cudaError 801"):
        HostArena(PAGE, device="cuda")
    (name, base, nbytes, flags), = fake.calls
    assert (name, nbytes, flags) == ("cudaHostRegister", PAGE, 0x3)
    assert fake.drains == 1 and fake.pending == 0
    gc.collect()
    assert not is_mapped(base)
    assert "host arena released: 0.0 MiB unmapped (set-up failed: CudaError: cudaHostRegister(" in arena_log.text
