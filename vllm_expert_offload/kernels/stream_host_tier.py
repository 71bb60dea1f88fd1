"""The CPU expert tier's jobs in a GPU stream's order (issue 41): the forward never waits on the host, and a CUDA
graph captures the whole exchange.

Per forward, on a side stream forked from the current one (a stream wait, which capture turns into a graph edge):
the tier's inputs (x, router weights, the tier's top-k ids, -1 for the device's entries) are copied into pinned
staging buffers, the host job is queued with cudaLaunchHostFunc (memory/_cuda_host.py; its user data is the step's
token count, a shape, so fixed per captured graph), and the job's partial sums are copied back to the device. The
current stream meanwhile runs the device kernel on its own entries and joins the side stream only when it adds the
partial sum (`StreamPartial.result`). Each layer has its own buffers; consecutive steps of one layer are ordered by
the side stream, so a step's copies never overwrite what the previous step's job still reads.

The host job is a ctypes callback: CUDA's callback thread takes the GIL to run it, so the thread replaying a graph
must not hold the GIL while it waits on the device (torch's waits release it). A job that raises cannot report
through CUDA: its error is kept and raised by the layer's next forward, naming the layer.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Iterator, Protocol

import torch

from ..errors import ExpertOffloadError
from ..memory import _cuda_host

HOST_FUNC = ctypes.CFUNCTYPE(None, ctypes.c_void_p)  # cudaHostFn_t: void (*)(void *userData)


class CpuTierJobError(ExpertOffloadError, RuntimeError):
    """A CPU tier job failed on CUDA's callback thread; raised by the layer's next forward."""


class TierCompute(Protocol):
    """What a host job runs: the router-weighted sum over the tier's own entries (kernels/host_tier.py)."""

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, cpu_ids: torch.Tensor,
                apply_router_weight_on_input: bool) -> torch.Tensor: ...


class PendingPartial(Protocol):
    """One forward's CPU-tier partial sum, (tokens, hidden) in x's dtype, once `result` returns."""

    def result(self) -> torch.Tensor: ...


class CpuTierCompute(Protocol):
    """A layer's CPU tier as the forward drives it: start the job on the tier's ids (-1: not the tier's entry)."""

    def start(self, x: torch.Tensor, topk_weights: torch.Tensor, cpu_ids: torch.Tensor) -> PendingPartial: ...


class HostJob:
    """One layer's staging buffers on the host (pinned where a GPU copies into them) and the C-callable function
    that computes the tier's partial sums of the first `user_data` rows into `out`."""

    def __init__(self, name: str, tier: TierCompute, max_tokens: int, top_k: int, hidden: int, dtype: torch.dtype,
                 apply_router_weight_on_input: bool, busy: Callable[[float], None],
                 host: torch.device = torch.device("cpu")) -> None:
        pin = host.type == "cpu" and torch.cuda.is_available()

        def buffer(columns: int, kind: torch.dtype) -> torch.Tensor:
            return torch.zeros(max_tokens, columns, dtype=kind, device=host, pin_memory=pin)

        self.name, self.tier, self.busy = name, tier, busy
        self.on_input = apply_router_weight_on_input
        self.x, self.weights = buffer(hidden, dtype), buffer(top_k, torch.float32)
        self.ids, self.out = buffer(top_k, torch.int64), buffer(hidden, torch.float32)
        self.error: BaseException | None = None
        self.function = HOST_FUNC(self._run)  # kept alive here: CUDA holds only its address
        self.address = ctypes.cast(self.function, ctypes.c_void_p).value

    def _run(self, user_data: int | None) -> None:
        tokens = user_data or 0
        began = time.perf_counter()
        try:
            part = self.tier.forward(self.x[:tokens], self.weights[:tokens], self.ids[:tokens], self.on_input)
            self.out[:tokens].copy_(part)
        except BaseException as error:  # nothing may unwind into CUDA's thread; the next forward raises it
            self.out[:tokens].fill_(float("nan"))
            self.error = error
        self.busy(time.perf_counter() - began)

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise CpuTierJobError(f"{self.name}: the CPU tier's host job failed: {self.error!r}") from self.error


class StreamOrder(Protocol):
    """Where the staging copies and the host job run: a side stream on a GPU (CudaStreamOrder)."""

    def side(self) -> AbstractContextManager[None]: ...

    def launch(self, function: int, user_data: int) -> None: ...

    def join(self) -> None: ...


class CudaStreamOrder:
    """A side stream of `device`: forked from the current stream per forward, joined back before the add."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)

    @contextmanager
    def side(self) -> Iterator[None]:
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            yield

    def launch(self, function: int, user_data: int) -> None:
        _cuda_host.launch_host_func(self.stream.cuda_stream, function, user_data)

    def join(self) -> None:
        torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)


@dataclass(frozen=True)
class StreamPartial:
    """The tier's partial sum of one forward, valid once `result` has joined the side stream."""

    partial: torch.Tensor
    order: StreamOrder

    def result(self) -> torch.Tensor:
        self.order.join()
        return self.partial


@dataclass(frozen=True)
class StreamHostTier:
    """One layer's CPU tier on a GPU: staging copies, the host job and the copy back, all in stream order."""

    job: HostJob
    order: StreamOrder

    def start(self, x: torch.Tensor, topk_weights: torch.Tensor, cpu_ids: torch.Tensor) -> StreamPartial:
        """Queue the tier's work for this forward (nothing waits here); x's dtype partial sum via `result`."""
        self.job.raise_if_failed()
        tokens = x.shape[0]
        partial = torch.empty_like(x)  # on the current stream, before the fork: the join orders its use
        with self.order.side():
            self.job.x[:tokens].copy_(x, non_blocking=True)
            self.job.weights[:tokens].copy_(topk_weights, non_blocking=True)
            self.job.ids[:tokens].copy_(cpu_ids, non_blocking=True)
            self.order.launch(self.job.address, tokens)
            partial.copy_(self.job.out[:tokens], non_blocking=True)
        return StreamPartial(partial, self.order)
