"""Per-layer expert-read counters kept on the device: what `/metrics` reports (integration/startup/metrics.py).

Counted inside the forward with device ops only (no host sync, fixed shapes, so CUDA-graph safe); read on the
host only between engine steps, when the API server asks (a worker RPC), never inside a forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

COLUMNS = ("gpu_reads", "host_reads", "host_read_bytes", "fills", "evictions", "cpu_reads")
GPU_READS, HOST_READS, HOST_READ_BYTES, FILLS, EVICTIONS, CPU_READS = range(len(COLUMNS))


class TierCounters:
    """int64 (MoE layers, COLUMNS) on the device, rows in the model's MoE-layer order; and the CPU tier's busy
    seconds per layer, on the host (the tier's jobs run there and time themselves)."""

    def __init__(self, layers: int, device: torch.device | str) -> None:
        self.counts = torch.zeros(layers, len(COLUMNS), dtype=torch.int64, device=device)
        self._busy_s = np.zeros(layers)
        self._busy_sources: list[Callable[[], None]] = []

    @property
    def cpu_busy_s(self) -> np.ndarray:
        """Seconds per layer the CPU tier spent computing, the busy sources' latest time included."""
        for report in self._busy_sources:
            report()
        return self._busy_s

    def add_busy_source(self, report: Callable[[], None]) -> None:
        """A job that keeps its busy time where it runs and reports it through add_cpu_busy when asked: the CPU
        tier's host functions on a GPU, which a replayed CUDA graph runs with no Python around them."""
        self._busy_sources.append(report)

    def count_reads(self, row: int, ids: torch.Tensor, resident: torch.Tensor, expert_bytes: torch.Tensor) -> None:
        """One forward's token x expert reads of layer `row`, by tier (`resident`: bool (E,), in GPU memory now),
        and the trellis bytes of the distinct host-tier experts it reads (each crosses the link once per launch
        set; `expert_bytes`: int64 (E,)). An id of -1 (another expert-parallel rank's expert) is not counted here."""
        ids = ids.reshape(-1).long()
        local = ids >= 0
        safe = ids.clamp(min=0)
        on_gpu = resident[safe]
        read = torch.zeros(resident.shape, dtype=torch.int64, device=ids.device).scatter_add_(0, safe, local.long()) > 0
        host_bytes = torch.where(read & ~resident, expert_bytes, 0).sum()
        added = torch.stack([(on_gpu & local).sum(), (~on_gpu & local).sum(), host_bytes])
        self.counts[row, :FILLS] += added

    def count_cpu_reads(self, row: int, cpu_ids: torch.Tensor) -> None:
        """One forward's token x expert entries of layer `row` the CPU tier computes (-1: not the tier's)."""
        self.counts[row, CPU_READS] += (cpu_ids >= 0).sum()

    def add_cpu_busy(self, row: int, seconds: float) -> None:
        """Time the CPU tier spent on one job of layer `row` (added by the job itself, on the host)."""
        self._busy_s[row] += seconds

    def count_fills(self, row: int, fill_expert: torch.Tensor, evicted: torch.Tensor) -> None:
        """The fills and evictions of one cache step (-1 entries are no-ops)."""
        self.counts[row, FILLS:EVICTIONS + 1] += torch.stack([(fill_expert >= 0).sum(), (evicted >= 0).sum()])

    def snapshot(self) -> np.ndarray:
        """The counts on the host. Waits for the work queued on the device: call between engine steps only."""
        return self.counts.cpu().numpy()


def per_layer(snapshot: np.ndarray, layers: Sequence[int]) -> dict[int, dict[str, int]]:
    """{model layer: {column: count}} of a snapshot."""
    return {layer: dict(zip(COLUMNS, map(int, row))) for layer, row in zip(layers, snapshot)}
