"""The Triton backend on a real GPU (skipped without CUDA): compiled kernels with host-tier experts read over
the mapped arena, and CUDA-graph capture and replay equal to eager execution."""

from __future__ import annotations

import pytest
import torch

from vllm_expert_offload.kernels.triton_exl3 import TRITON_MATMUL
from vllm_expert_offload.kernels.triton_moe import fused_moe

from support.moe_layers import FULL, assert_close_to_reference, assert_dequantize_every_rate, placed_moe, routing

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)
KERNELS = {"fused": fused_moe, "glue": TRITON_MATMUL}  # what the backend builds; the launcher the tests read W_hat by


@pytest.fixture(params=list(KERNELS))
def kernel(request):
    return KERNELS[request.param]


@pytest.mark.parametrize("tokens", [1, 8, 9, 64, 300])
def test_compiled_moe_matches_reference_with_host_tier_over_pcie(kernel, tokens: int) -> None:
    reference, triton, _ = placed_moe(FULL, kernel, device=CUDA)
    x, weights, ids = routing(tokens, seed=tokens, device=CUDA)
    assert_close_to_reference(triton.forward(x, weights, ids, False), reference.forward(x, weights, ids, False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_compiled_dequantize_in_both_fold_forms(dtype: torch.dtype) -> None:
    """The decode-once kernel compiled, the fold's split and whole forms alike (one of which this GPU launches):
    folded = H · W_hat, plain bit-exact, over every K and codebook (the interpreter runs the fp32 products only)."""
    assert_dequantize_every_rate(dtype, CUDA)


@pytest.mark.parametrize("tokens", [4, 32])
def test_cuda_graph_replay_equals_eager(kernel, tokens: int) -> None:
    """Captured once, replayed on new routing: the tables' baked addresses (VRAM and host arena) and the
    shape-only block layouts (the fused kernels: the in-kernel dedup, the reserved workspaces) must give what
    eager execution gives."""
    _, triton, _ = placed_moe(FULL, kernel, device=CUDA)
    x, weights, ids = routing(tokens, seed=0, device=CUDA)
    triton.forward(x, weights, ids, False)  # compile the kernel before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = triton.forward(x, weights, ids, False)
    for seed in (1, 2):
        new_x, new_weights, new_ids = routing(tokens, seed=seed, device=CUDA)
        x.copy_(new_x), weights.copy_(new_weights), ids.copy_(new_ids)
        graph.replay()
        torch.testing.assert_close(captured, triton.forward(new_x, new_weights, new_ids, False), rtol=0, atol=0)
