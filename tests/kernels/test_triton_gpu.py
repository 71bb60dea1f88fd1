"""The Triton backend on a real GPU (skipped without CUDA): compiled kernels with host-tier experts read over
the mapped arena, and CUDA-graph capture and replay equal to eager execution.

Each compiled variant costs the lent machine's one bounded run seconds (scripts/gpu-check.sh prices every test here
from the compile census, vllm_expert_offload/tools/gpu_check_budget.py), so each test launches only what it is
about: the layer is of one rate unless the test is about mixed rates, the token counts are one per launch class
(a small decode, the dedup's decode, the decode-once prefill), and the every-rate check runs the one fold form this
device launches, in lanes gpu-check runs side by side. tests/tools/test_gpu_check.py holds the census's plan to
these."""

from __future__ import annotations

import pytest
import torch

from vllm_expert_offload.kernels.triton_exl3 import TRITON_MATMUL
from vllm_expert_offload.kernels.triton_moe import fused_moe

from support.moe_layers import (
    ALL_RATES,
    FULL,
    TWO_RATES,
    UNIFORM,
    assert_close_to_reference,
    assert_dequantize_every_rate,
    device_fold_form,
    placed_moe,
    routing,
)

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)
KERNELS = {"fused": fused_moe, "glue": TRITON_MATMUL}  # what the backend builds; the launcher the tests read W_hat by
# One token count per class of launch the census tells apart (tools/compile_census.py): a small decode; a decode
# of no power of two in the in-kernel dedup's class (17-64 tokens); the decode-once prefill (dequantize, grouped
# GEMMs). The graph tests replay the two decode classes, already compiled.
DECODE_TOKENS = (1, 33)
PREFILL_TOKENS = 300
GRAPH_TOKENS = (4, 33)
MIXED_TOKENS = 1
EVERY_RATE_DTYPE = torch.float16  # the serving dtype's rounding; the interpreter checks fp32 and fp16, every form
# The every-rate check's tables: lanes of two consecutive Ks, each with every codebook its Ks come in.
_KS = sorted({k for k, _ in ALL_RATES})
EVERY_RATE_LANES = {"k" + "-".join(f"{k:g}" for k in ks): [r for r in ALL_RATES if r[0] in ks]
                    for ks in (_KS[i:i + 2] for i in range(0, len(_KS), 2))}


@pytest.fixture(params=list(KERNELS))
def kernel(request):
    return KERNELS[request.param]


def _matches_reference(kernel, tokens: int, rates) -> None:
    reference, triton, _ = placed_moe(FULL, kernel, device=CUDA, rates=rates)
    x, weights, ids = routing(tokens, seed=tokens, device=CUDA)
    assert_close_to_reference(triton.forward(x, weights, ids, False), reference.forward(x, weights, ids, False))


@pytest.mark.parametrize("tokens", DECODE_TOKENS)
def test_compiled_moe_matches_reference_with_host_tier_over_pcie(kernel, tokens: int) -> None:
    _matches_reference(kernel, tokens, UNIFORM)


def test_compiled_prefill_matches_reference_with_host_tier_over_pcie(kernel) -> None:
    _matches_reference(kernel, PREFILL_TOKENS, UNIFORM)


def test_compiled_moe_of_mixed_rates_matches_reference() -> None:
    """Experts (and one expert's projections) of two rates and codebooks: the tables' present rates, each decoded."""
    _matches_reference(fused_moe, MIXED_TOKENS, TWO_RATES)


@pytest.mark.parametrize("lane", list(EVERY_RATE_LANES))
def test_compiled_dequantize_in_this_devices_fold_form(lane: str) -> None:
    """The decode-once kernel compiled in the fold form this device launches (derived as the runtime derives it):
    folded = H · W_hat over every K and codebook (the interpreter runs every form), in tables of two Ks and their
    codebooks (each compiles a decode per K and a branch per codebook it holds: side by side in gpu-check)."""
    assert_dequantize_every_rate(EVERY_RATE_DTYPE, CUDA, device_fold_form(CUDA), EVERY_RATE_LANES[lane])


@pytest.mark.parametrize("tokens", GRAPH_TOKENS)
def test_cuda_graph_replay_equals_eager(kernel, tokens: int) -> None:
    """Captured once, replayed on new routing: the tables' baked addresses (VRAM and host arena) and the
    shape-only block layouts (the fused kernels: the in-kernel dedup, the reserved workspaces) must give what
    eager execution gives."""
    _, triton, _ = placed_moe(FULL, kernel, device=CUDA, rates=UNIFORM)
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
