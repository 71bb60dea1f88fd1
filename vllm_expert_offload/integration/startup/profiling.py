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
import sys

import torch

from ...offload.phase import profiling_pass
from ..patching import SENTINEL, HookError, require_checked_version

# (module, class) of the model runners whose profile_run sizes the KV cache: V1 (CPU runs it too) and V2.
RUNNERS = (("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"), ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner"))


def _flagged(profile_run):
    @functools.wraps(profile_run)
    def wrapper(*args, **kwargs):
        with profiling_pass():
            return profile_run(*args, **kwargs)

    setattr(wrapper, SENTINEL, True)
    return wrapper


def install_profile_flag() -> int:
    """Wrap `profile_run` of each runner class already imported in this process (call from a worker, where
    the runner module is loaded before the model is built). Returns how many classes were wrapped now."""
    require_checked_version("the profile_run hook")
    wrapped = 0
    for module_name, class_name in RUNNERS:
        module = sys.modules.get(module_name)
        if module is None:
            continue  # that runner is not used in this process
        runner = getattr(module, class_name, None)
        method = getattr(runner, "profile_run", None)
        if method is None:
            raise HookError(f"{module_name}.{class_name}.profile_run does not exist in this vLLM")
        if not getattr(method, SENTINEL, False):
            runner.profile_run = _flagged(method)
            wrapped += 1
    return wrapped


def spread_routing(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Worst-case routing of the same shape: consecutive token slots cycle through every expert, so each
    token still picks distinct experts (when top_k <= experts) and every expert receives tokens."""
    flat = torch.arange(topk_ids.numel(), device=topk_ids.device) % num_experts
    return flat.view(topk_ids.shape).to(topk_ids.dtype)
