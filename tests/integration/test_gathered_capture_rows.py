"""Under data parallelism a MoE layer's topk_ids holds every engine's rows (vLLM's naive dispatch all-gathers them),
so its workspaces are reserved for the gathered rows of each captured batch size, not this engine's (issue #38
item 4: capturing a large batch at DP 2 raised at startup)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig

from vllm_expert_offload.integration.methods import moe_method
from vllm_expert_offload.integration.methods.gathered_rows import gathered_capture_rows
from vllm_expert_offload.kernels.triton_moe import workspace_floats, workspace_shapes

ALONE = FusedMoEParallelConfig.make_no_parallel()


def _parallel(**changes) -> FusedMoEParallelConfig:
    return dataclasses.replace(ALONE, **changes)


@pytest.mark.parametrize(("parallel", "want"), [
    (ALONE, (1, 2, 5, 8, 512)),
    (_parallel(dp_size=2, dp_rank=1), (2, 4, 10, 16, 1024)),
    (_parallel(dp_size=3), (3, 6, 15, 24, 1536)),  # not a power of two
    (_parallel(pcp_size=2), (2, 4, 10, 16, 1024)),
    # sequence-parallel MoE: each of 2 TP ranks holds ceil(n / 2) rows (1 -> 1, 5 -> 3), gathered with the other DP
    # engine's: 4 shares
    (_parallel(dp_size=2, sp_size=2, use_ep=True, ep_size=4), (4, 12, 16, 1024)),
])
def test_gathered_rows_stack_every_engines_share(parallel: FusedMoEParallelConfig, want: tuple[int, ...]) -> None:
    assert gathered_capture_rows((8, 1, 2, 5, 512, 8), parallel) == want


def test_the_method_reserves_for_the_gathered_rows(monkeypatch) -> None:
    """create_weights hands the layer's loading the gathered rows at DP 2, not this engine's capture sizes."""
    handed = {}

    class Loading:
        def __init__(self, **fields) -> None:
            handed.update(fields)

        def register(self) -> None:
            pass

    monkeypatch.setattr(moe_method, "ExpertLoading", Loading)
    monkeypatch.setattr(moe_method, "_process_placement", lambda *a: SimpleNamespace(recording=False))
    monkeypatch.setattr(moe_method, "install_profile_flag", lambda: None)
    monkeypatch.setattr(moe_method, "register_op_target", lambda name, method: name)
    parallel = _parallel(dp_size=2, dp_rank=1)
    moe = SimpleNamespace(hidden_dim_unpadded=256, intermediate_size=256, experts_per_token=8, swiglu_limit=None)
    quant_config = SimpleNamespace(summary=SimpleNamespace(layout=object()), capture_sizes=lambda: (1, 2, 4, 512),
                                   kernel_choice=lambda device: SimpleNamespace(graph_safe=True))
    method = moe_method.Exl3MoEMethod(moe, quant_config)
    layer = SimpleNamespace(activation="silu", layer_name="model.layers.3.mlp.experts", expert_map=None,
                            moe_config=SimpleNamespace(moe_parallel_config=parallel))
    method.create_weights(layer, 4, 256, 256, torch.float16)
    assert handed["capture_rows"] == (2, 4, 8, 1024)
    # What the reservation then covers: the 1,024 gathered rows of a 512-token capture (Qwen3-30B-A3B's widths).
    reserved = workspace_floats(8, handed["capture_rows"], (1, 1), 768, 2048)
    needed = workspace_shapes(1024, 8, (1, 1), 768, 2048)
    assert all(reserved[p] >= torch.Size(shape).numel() for p, shape in needed.items())
    assert workspace_floats(8, (1, 2, 4, 512), (1, 1), 768, 2048)["moe_out"] < torch.Size(needed["moe_out"]).numel()
