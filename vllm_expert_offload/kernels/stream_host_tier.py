"""The CPU expert tier's jobs in a GPU stream's order (issue 41): the forward never waits on the host, and a CUDA
graph captures the whole exchange.

Per forward, on a side stream forked from the current one (a stream wait, which capture turns into a graph edge):
the tier's inputs (x, router weights, the tier's top-k ids, -1 for the device's entries) are copied into pinned
staging buffers, the host job is queued with cudaLaunchHostFunc (memory/_cuda_host.py; its user data is the job struct of the
step's size, so fixed per captured graph), and the job's partial sums are copied back to the device. The
current stream meanwhile runs the device kernel on its own entries and joins the side stream only when it adds the
partial sum (`StreamPartial.result`). Each layer has its own buffers; consecutive steps of one layer are ordered by
the side stream, so a step's copies never overwrite what the previous step's job still reads.

The host job is the compiled CPU kernel's own pair of C host functions (cpu_moe.py `host_abi`), run on CUDA's
callback thread with no Python and no GIL: a submit that hands the job to the layer's pinned pool of worker threads
and a wait, queued as two host nodes, on a job struct whose row count is fixed per captured graph (one struct per
step size). The tier's busy time is read from those structs when the counters are read. A failed job stops the
process with the layer named (csrc/exl3_cpu.cpp): a host function cannot report to CUDA, and a replayed graph runs
no Python that could look.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Iterator, Protocol

import torch

from ..memory import _cuda_host
from .cpu_moe import Exl3MoeHostJob, Exl3MoeJob, host_abi

class HandleOwner(Protocol):
    """What a host job computes with: the compiled CPU MoE kernel (cpu_moe.CpuMoE) of the layer."""

    @property
    def handle(self) -> int: ...


class PendingPartial(Protocol):
    """One forward's CPU-tier partial sum, (tokens, hidden) in x's dtype, once `result` returns."""

    def result(self) -> torch.Tensor: ...


class CpuTierCompute(Protocol):
    """A layer's CPU tier as the forward drives it: start the job on the tier's ids (-1: not the tier's entry)."""

    def start(self, x: torch.Tensor, topk_weights: torch.Tensor, cpu_ids: torch.Tensor) -> PendingPartial: ...


class HostJob:
    """One layer's staging buffers on the host (pinned where a GPU copies into them: fp32 rows, int32 ids, as the
    C ABI takes them) and, per step size, the job struct its two host functions run (kept alive here: CUDA and a
    captured graph hold only its address)."""

    def __init__(self, name: str, kernel: HandleOwner, max_tokens: int, top_k: int, hidden: int,
                 apply_router_weight_on_input: bool, busy: Callable[[float], None],
                 host: torch.device = torch.device("cpu")) -> None:
        pin = host.type == "cpu" and torch.cuda.is_available()

        def buffer(columns: int, kind: torch.dtype) -> torch.Tensor:
            return torch.zeros(max_tokens, columns, dtype=kind, device=host, pin_memory=pin)

        self.name, self.kernel, self.busy, self.hidden = name, kernel, busy, hidden
        self.on_input = apply_router_weight_on_input
        self.x, self.weights = buffer(hidden, torch.float32), buffer(top_k, torch.float32)
        self.ids, self.out = buffer(top_k, torch.int32), buffer(hidden, torch.float32)
        self.submit, self.wait = host_abi()
        self._jobs: dict[int, Exl3MoeHostJob] = {}
        self._busy_reported_ns = 0

    def address(self, tokens: int) -> int:
        """The job struct of a step of `tokens` rows (made at its first step: at capture for a graph)."""
        host_job = self._jobs.get(tokens)
        if host_job is None:
            job = Exl3MoeJob(self.kernel.handle, self.x.data_ptr(), self.x.stride(0), self.ids.data_ptr(),
                             self.weights.data_ptr(), tokens, self.ids.shape[1], int(self.on_input),
                             self.out.data_ptr(), self.out.stride(0))
            host_job = self._jobs[tokens] = Exl3MoeHostJob(job, 0, 0, self.name.encode()[:119])
        return ctypes.addressof(host_job)

    def report_busy(self) -> None:
        """Tell `busy` the seconds the pool spent on this layer's jobs since the last report (host memory that the
        host functions write: no device synchronisation). Called when the counters are read (TierCounters
        `add_busy_source`): a replayed graph runs no Python that could report it."""
        total = sum(host_job.busy_ns for host_job in self._jobs.values())
        if total > self._busy_reported_ns:
            self.busy((total - self._busy_reported_ns) / 1e9)
            self._busy_reported_ns = total


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
    """The tier's fp32 partial sum of one forward, valid once `result` has joined the side stream."""

    partial: torch.Tensor
    order: StreamOrder
    dtype: torch.dtype
    inputs: tuple[torch.Tensor, ...]  # what the side stream reads, alive until the join

    def result(self) -> torch.Tensor:
        self.order.join()
        return self.partial.to(self.dtype)


@dataclass(frozen=True)
class StreamHostTier:
    """One layer's CPU tier on a GPU: staging copies, the host job and the copy back, all in stream order."""

    job: HostJob
    order: StreamOrder
    where: str = "in the GPU stream's order"  # for the start-up log

    def start(self, x: torch.Tensor, topk_weights: torch.Tensor, cpu_ids: torch.Tensor) -> StreamPartial:
        """Queue the tier's work for this forward (nothing waits here); x's dtype partial sum via `result`.
        The rows are converted on the current stream before the fork (a copy that also converts would stage
        through pageable memory and wait for the device), and the converted tensors are held by the result until
        the join: the caller's `cpu_ids` dies when it returns, and a block freed while the side stream still reads
        it would go to the current stream's next allocation."""
        tokens, job = x.shape[0], self.job
        rows = (x[:, :job.hidden].float(), topk_weights.float(), cpu_ids.to(torch.int32))
        partial = torch.empty(tokens, job.hidden, dtype=torch.float32, device=x.device)
        with self.order.side():
            for staging, converted in zip((job.x, job.weights, job.ids), rows):
                staging[:tokens].copy_(converted, non_blocking=True)
            address = job.address(tokens)
            self.order.launch(job.submit, address)
            self.order.launch(job.wait, address)
            partial.copy_(job.out[:tokens], non_blocking=True)
        return StreamPartial(partial, self.order, x.dtype, rows)
