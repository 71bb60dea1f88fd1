"""Debug mode: every forward, compare the expert caches of all tensor-parallel ranks and fail loudly if they differ.

The caches agree without communication because each rank's policy is a deterministic function of the router's
top-k ids, which are identical on every rank (offload/cache_policy.py). This check proves it on a running engine:
with `VLLM_EXPERT_OFFLOAD_CHECK_RANKS=1` in the environment of `vllm serve` (workers inherit it), each MoE layer
all-gathers its cache's `state_digest()` over vLLM's TP group after its forward and compares. That is a collective
and a host read per layer per forward: slow, and not capturable in a CUDA graph (use --enforce-eager on a GPU).
"""

from __future__ import annotations

import os

import torch

from ...errors import ExpertOffloadError

CHECK_RANKS_ENV = "VLLM_EXPERT_OFFLOAD_CHECK_RANKS"


class RanksDisagree(ExpertOffloadError, RuntimeError):
    """Two TP ranks' expert caches hold different experts: their pointer tables no longer describe one model."""


def checking_ranks() -> bool:
    """Whether this process runs the rank check (read when a layer finishes loading)."""
    return os.environ.get(CHECK_RANKS_ENV, "0") not in ("", "0")


def _tp_all_gather(digest: torch.Tensor) -> torch.Tensor:
    """Every rank's int64 digest, (world, n). Sent as float32 holding its 16-bit pieces (exact): vLLM's CPU
    shared-memory all-gather takes no int64."""
    from vllm.distributed import get_tp_group

    pieces = digest.contiguous().view(torch.int16).float()
    every = get_tp_group().all_gather(pieces[None], dim=0)
    return every.to(torch.int16).contiguous().view(torch.int64)


def check_ranks_agree(layer: str, digest: torch.Tensor, gather=_tp_all_gather) -> None:
    """Raise RanksDisagree naming `layer` and every rank's digest unless all ranks hold the same cache state."""
    every = gather(digest)
    if not bool((every == every[0]).all()):
        raise RanksDisagree(f"{CHECK_RANKS_ENV}: the expert caches of {layer} differ across tensor-parallel ranks "
                            f"(state digests by rank: {every.tolist()})")
