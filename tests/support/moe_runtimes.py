"""A layer's MoERuntime over a recording stand-in kernel and a stand-in placement, for tests of the forward's
steps (the engine tests cover the served path)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vllm_expert_offload.integration.methods.moe_runtime import MoERuntime
from vllm_expert_offload.offload.counters import TierCounters


class RecordingKernel:
    """The backend's forward, keeping what it was handed and returning x."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, x, weights, ids, on_input):
        self.calls.append((weights.clone(), ids.clone()))
        return x


def runtime(in_gpu_tier: torch.Tensor, expert_map: torch.Tensor | None = None, layer_index: int = 0,
            **placement) -> MoERuntime:
    """Local experts as many as `in_gpu_tier`, each 100 bytes; `placement`: the stand-in placement's fields
    (recording=False unless given) beside counters of one layer."""
    tables = SimpleNamespace(in_gpu_tier=in_gpu_tier)
    process = SimpleNamespace(**({"recording": False} | placement),
                              tier_counters=TierCounters(1, torch.device("cpu")))
    return MoERuntime(
        op_name=f"model.layers.{layer_index}.mlp.experts.exl3", layer_index=layer_index, counter_row=0, geometry=None,
        tables=tables, expert_bytes=torch.full(in_gpu_tier.shape, 100), kernel=RecordingKernel(), cache=None,
        placement=process, expert_map=expert_map, num_local_experts=in_gpu_tier.numel(),
        apply_router_weight_on_input=False, check_ranks=False,
    )
