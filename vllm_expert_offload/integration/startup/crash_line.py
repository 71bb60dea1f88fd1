"""The crash line: after the KV cache is allocated, the GPU must keep a margin of free memory.

Anything a CUDA kernel, NCCL or the allocator needs after startup comes out of that margin; a server
that starts with less dies on an ordinary long prefill rather than at startup, where it belongs.

Right after the KV cache is allocated, the memory vLLM set aside for activations (the peak its profiling
forward measured, plus its CUDA-graph estimate when applied) is still free, but the first full batch takes
it; so the margin is what stays free beyond that headroom.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from ...errors import ExpertOffloadError
from ...units import GIB


class CrashLineError(ExpertOffloadError, RuntimeError):
    pass


def check_crash_line(
    free_bytes: int,
    total_bytes: int,
    min_free_fraction: float,
    gpu_memory_utilization: float,
    gpu_expert_sizes: list[int],
    activation_headroom: int = 0,
    kv_cache_memory_bytes: int | None = None,
) -> None:
    """Refuse with what to change unless free - activation_headroom >= min_free_fraction * total.

    Two ways out, both stated with numbers: a smaller KV cache (vLLM sizes it as utilization x total minus
    weights, activations and graphs, so lowering --gpu-memory-utilization by shortfall/total shrinks it by the
    shortfall; with --kv-cache-memory-bytes the size is given directly), or that many more experts in the host tier
    (largest GPU-tier experts first)."""
    need = int(min_free_fraction * total_bytes)
    margin = free_bytes - activation_headroom
    short = need - margin
    if short <= 0:
        return
    if kv_cache_memory_bytes is not None:
        kv_advice = f"Lower --kv-cache-memory-bytes to {max(0, kv_cache_memory_bytes - short)} or less"
    else:
        utilization = max(0.0, gpu_memory_utilization - short / total_bytes)
        kv_advice = f"Lower --gpu-memory-utilization to {utilization:.3f} or less"
    moved, experts = 0, 0
    for size in sorted(gpu_expert_sizes, reverse=True):
        if moved >= short:
            break
        moved, experts = moved + size, experts + 1
    experts_advice = (
        f"or move at least {experts} more experts to the host tier (expert_offload gpu_budget_gib or plan)"
        if moved >= short
        else "moving every GPU-tier expert to host would not free enough"
    )
    headroom = (
        f", of which {activation_headroom / GIB:.2f} GiB is vLLM's activation headroom, leaving {margin / GIB:.2f} GiB"
        if activation_headroom else ""
    )
    raise CrashLineError(
        f"after the KV cache, {free_bytes / GIB:.2f} GiB of {total_bytes / GIB:.2f} GiB GPU memory is free{headroom}, "
        f"below the {min_free_fraction:.0%} crash line ({need / GIB:.2f} GiB); the first long prefill would run out "
        f"of memory. {kv_advice}, {experts_advice}"
    )


def wrap_initialize_from_config(original: Callable, min_free_fraction: float, gpu_expert_sizes: list[int]) -> Callable:
    """The GPU worker's KV-cache allocation, then the line checked (CUDA only: a CPU engine's "device" memory is
    the host's, which vLLM sizes from VLLM_CPU_KVCACHE_SPACE)."""

    @functools.wraps(original)
    def initialize_from_config(self, kv_cache_config):
        result = original(self, kv_cache_config)
        import torch

        if torch.cuda.is_available() and self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            check_crash_line(
                free, total, min_free_fraction, self.cache_config.gpu_memory_utilization, gpu_expert_sizes,
                activation_headroom=int(getattr(self, "peak_activation_memory", 0)),
                kv_cache_memory_bytes=self.cache_config.kv_cache_memory_bytes,
            )
        return result

    return initialize_from_config

