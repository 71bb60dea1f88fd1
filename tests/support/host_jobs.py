"""The CPU tier's host jobs without a GPU (kernels/stream_host_tier.py): a stream order that calls the job through
its C function pointer at once, and a layer's job whose buffers live on `meta` for the no-sync proof."""

from __future__ import annotations

import ctypes
from contextlib import contextmanager
from types import SimpleNamespace

import torch

from vllm_expert_offload.kernels.stream_host_tier import HostJob, StreamHostTier

from support.meta_proof import META
from support.moe_layers import CPU, HIDDEN

MAX_TOKENS = 8
HOST_FUNC = ctypes.CFUNCTYPE(None, ctypes.c_void_p)  # cudaHostFn_t: void (*)(void *userData)


class InlineOrder:
    """The stream order on the CPU: no side stream; the host job called at once through its C function pointer
    (what CUDA's callback thread does with the address and user data it was given)."""

    def __init__(self, call: bool = True) -> None:
        self.call, self.launches, self.joins = call, [], 0

    @contextmanager
    def side(self):
        yield

    def launch(self, function: int, user_data: int) -> None:
        self.launches.append((function, user_data))
        if self.call:
            HOST_FUNC(function)(user_data)

    def join(self) -> None:
        self.joins += 1


def job(kernel, busy: list[float] | None = None, host: torch.device = CPU,
        name: str = "model.layers.3.mlp.experts") -> HostJob:
    """A layer's job of up to MAX_TOKENS tokens, top-k 2, on `kernel` (a CpuMoE); `busy` collects the seconds
    each forward reports."""
    return HostJob(name, kernel, MAX_TOKENS, 2, HIDDEN, False, (busy if busy is not None else []).append, host)


def meta_tier() -> tuple[StreamHostTier, InlineOrder]:
    """A stream tier whose staging buffers are on meta, with the order that records its launches."""
    order = InlineOrder(call=False)  # on meta the job is queued, never run: its buffers hold no data
    return StreamHostTier(job(SimpleNamespace(handle=0), host=META), order), order
