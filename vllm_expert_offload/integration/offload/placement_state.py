"""One process's expert placement: the plan, the host arena it implies, and routing statistics.

Made once per process at the first MoE layer's create_weights, from the checkpoint's headers, so the
arena is sized exactly before a single expert is loaded and each expert goes straight to its tier.
"""

from __future__ import annotations

import atexit
import logging
from pathlib import Path

import torch

from ...exl3.validate import CheckpointSummary
from ...memory.arena import HostArena
from ...placement import RoutingCounts
from ..startup.crash_line import install_crash_line
from .expert_plan import ExpertGeometry, make_plan, model_identity, record_bytes_matrix
from .options import OffloadOptions

logger = logging.getLogger("vllm.expert_offload")  # a child of vLLM's logger, so it shares its handlers


def _arena_numa_node(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    from ...memory.topology import numa_node_of_gpu

    return numa_node_of_gpu(device.index if device.index is not None else torch.cuda.current_device())


class ProcessPlacement:
    def __init__(
        self, options: OffloadOptions, summary: CheckpointSummary, geometry: ExpertGeometry, device: torch.device
    ) -> None:
        self.options = options
        self.geometry = geometry
        self.moe_layers = summary.layout.moe_layers
        self.record_bytes = record_bytes_matrix(summary, geometry)
        self.identity = model_identity(summary, geometry.tp_size, self.record_bytes)
        self.gpu_tier, source = make_plan(options, self.record_bytes, self.identity)
        host_bytes = int(self.record_bytes[~self.gpu_tier].sum())
        self.arena = HostArena(host_bytes, device=device, numa_node=_arena_numa_node(device)) if host_bytes else None
        self.counts = torch.zeros(self.gpu_tier.shape, dtype=torch.int64, device=device)
        if device.type == "cuda":
            install_crash_line(options.min_free_fraction, self.record_bytes[self.gpu_tier].tolist())
        self.recording = options.record_stats is not None
        if self.recording and geometry.tp_rank == 0:
            atexit.register(self.save_stats, options.record_stats)
        n_host = int((~self.gpu_tier).sum())
        logger.info(
            "expert placement (tp rank %d): %d of %d routed experts in the host tier (%.1f MiB arena%s), "
            "%.1f MiB of expert trellises in the GPU tier; plan from %s",
            geometry.tp_rank, n_host, self.gpu_tier.size, host_bytes / 2**20,
            "" if self.arena is None or self.arena.numa_node is None else f" on NUMA node {self.arena.numa_node}",
            self.record_bytes[self.gpu_tier].sum() / 2**20, source,
        )

    def row(self, layer: int) -> int:
        return self.moe_layers.index(layer)

    def in_gpu_tier(self, layer: int, expert: int) -> bool:
        return bool(self.gpu_tier[self.row(layer), expert])

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Count selections on the device (no host sync, so it is safe inside CUDA graphs)."""
        ids = topk_ids.reshape(-1).long()
        self.counts[self.row(layer)].index_add_(0, ids, torch.ones_like(ids))

    def save_stats(self, path: Path) -> None:
        counts = RoutingCounts(self.counts.cpu().numpy(), self.moe_layers, self.identity)
        counts.save(path)
        logger.info("routing statistics written to %s (%d selections)", path, int(counts.counts.sum()))
