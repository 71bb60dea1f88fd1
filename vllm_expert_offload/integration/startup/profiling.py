"""Know when vLLM is profiling memory, so the MoE path can show it its worst case.

vLLM sizes the KV cache from the peak memory of one `profile_run` at the maximum batched tokens. Its
dummy batch routes tokens wherever the random router sends them, so an expert path whose memory grows
with the number of distinct experts (decoded weights, host-tier reads) would be under-measured, and the
first real batch that touches more experts could run out of memory against a KV cache that already
took the rest. While the flag is up, the EXL3 MoE method spreads tokens over every local expert, host
tier included; serving statistics skip those passes.
"""

from __future__ import annotations

import functools

import torch

from ...offload.phase import PHASE


def flagged(profile_run):
    """A runner's `profile_run` with the profiling flag up while it runs (vllm_hooks.PROFILE_RUN)."""

    @functools.wraps(profile_run)
    def wrapper(*args, **kwargs):
        with PHASE.profiling_pass():
            return profile_run(*args, **kwargs)

    return wrapper


def spread_routing(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Worst-case routing of the same shape: consecutive token slots cycle through every expert, so each
    token still picks distinct experts (when top_k <= experts) and every expert receives tokens."""
    flat = torch.arange(topk_ids.numel(), device=topk_ids.device) % num_experts
    return flat.view(topk_ids.shape).to(topk_ids.dtype)
