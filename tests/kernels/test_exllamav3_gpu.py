"""The exllamav3 backend on a real GPU (skipped without CUDA or without exllamav3 1.6.5's compiled extension):
exllamav3's kernels over our pointer tables, host-tier experts read over the mapped arena, against the torch
reference and the Triton kernel on the same layer, and CUDA-graph capture and replay equal to eager."""

from __future__ import annotations

import pytest
import torch

from vllm_expert_offload.kernels.contract import LinearLayer
from vllm_expert_offload.kernels.exllamav3_backend import exllamav3_unavailable
from vllm_expert_offload.kernels.linear import DequantizedLinear, LinearShard
from vllm_expert_offload.kernels.oracle import KernelChoice, build_linear_kernel
from vllm_expert_offload.tools.random_layers import random_linear, random_moe

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)
HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 512, 256, 16, 4


@pytest.fixture(scope="module", autouse=True)
def needs_exllamav3() -> None:
    why_not = exllamav3_unavailable(CUDA) if torch.cuda.is_available() else "no CUDA"
    if why_not is not None:
        pytest.skip(f"exllamav3 backend unavailable: {why_not}")


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """exllamav3 multiplies fp16 activations (as on any half-precision model); the references run fp32."""
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * float(want.abs().max()))


def _routing(tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen).half()
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])
    return x.to(CUDA), torch.rand(tokens, TOP_K, generator=gen).to(CUDA), ids.to(CUDA)


def _layer(backend: str, host_share: float = 0.5):
    return random_moe(HIDDEN, INTERMEDIATE, EXPERTS, 3, host_share, backend, CUDA).kernel


TRITON_TOKENS = (1,)  # the Triton cross-check compiles its kernels per launch class: one (gpu_check_budget)


@pytest.mark.parametrize("tokens", [1, 8, 9, 64, 300])
def test_exllamav3_moe_matches_reference_and_triton_with_host_tier_over_pcie(tokens: int) -> None:
    x, weights, ids = _routing(tokens, seed=tokens)
    got = _layer("exllamav3").forward(x, weights, ids, False)
    _close(got, _layer("torch").forward(x, weights, ids, False))
    if tokens in TRITON_TOKENS:
        _close(got, _layer("triton").forward(x, weights, ids, False))


@pytest.mark.parametrize("tokens", [4, 32])
def test_exllamav3_cuda_graph_replay_equals_eager(tokens: int) -> None:
    kernel = _layer("exllamav3")
    x, weights, ids = _routing(tokens, seed=0)
    kernel.forward(x, weights, ids, False)  # allocates exllamav3's barrier buffer and scratch before capture
    kernel.warm_up(TOP_K)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = kernel.forward(x, weights, ids, False)
    for seed in (1, 2):
        new_x, new_weights, new_ids = _routing(tokens, seed=seed)
        x.copy_(new_x), weights.copy_(new_weights), ids.copy_(new_ids)
        graph.replay()
        torch.testing.assert_close(captured, kernel.forward(new_x, new_weights, new_ids, False), rtol=0, atol=0)


@pytest.mark.parametrize("rows", [1, 8, 33, 200])
def test_exllamav3_linear_matches_dequantized(rows: int) -> None:
    layer = random_linear(torch.Generator().manual_seed(rows), 512, 384, 4)
    shards = [LinearShard(layer, 0, 384, 384, 0, 512)]
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(0)).half().to(CUDA)
    layer_spec = LinearLayer(shards, torch.float16, CUDA)
    got = build_linear_kernel(KernelChoice("exllamav3", "exllamav3", "test"), layer_spec).forward(x)
    _close(got, DequantizedLinear(shards, torch.float32, CUDA).forward(x.float()))


def test_a_rate_the_extension_lacks_is_refused_by_name_before_any_launch() -> None:
    """The trimmed build (scripts/build-exllamav3-ext.sh) holds the rates the GPU tests use; any other is refused by its
    op wrapper with the rates it has, not launched as a null kernel. A full exllamav3 build has every rate."""
    import exllamav3_ext

    manifest = getattr(exllamav3_ext, "MANIFEST", None)
    if manifest is None:
        pytest.skip("a full exllamav3_ext: every rate is built")
    missing = next(k for k in range(1, 9) if k not in manifest["moe_k"])
    kernel = random_moe(HIDDEN, INTERMEDIATE, EXPERTS, missing, 0.5, "exllamav3", CUDA).kernel
    with pytest.raises(RuntimeError, match=rf"trimmed exllamav3_ext: exl3_moe_coop at K={missing} .* is not built"):
        kernel.forward(*_routing(2, seed=0), False)
    torch.cuda.synchronize()  # and the device is still healthy
    x, weights, ids = _routing(4, seed=1)
    torch.testing.assert_close(_layer("exllamav3").forward(x, weights, ids, False).float(),
                               _layer("exllamav3").forward(x, weights, ids, False).float(), rtol=0, atol=0)
