"""Issue 20 item 4, engine-free, on a real GPU (skipped without CUDA): each backend's forward under torch.compile with
CUDA-graph capture (mode="reduce-overhead", what vLLM's default compiles towards) against the same forward run
eagerly, on inputs that change between calls, so a captured graph that froze one batch's routing or addresses fails.

The forwards compiled are the ones this branch has: RotatedMoE.forward and RotatedLinear.forward over the Triton
launcher, and the exllamav3 backend's Exllamav3MoE.forward and Exllamav3Linear.forward where its extension imports.
When every backend forward sits behind one custom op keyed by the layer's name (kernels/ops.py), the calls below become
calls of that op. The torch reference is left out: it reads routing on the host, which no graph can capture (it is
refused where vLLM would capture)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch._dynamo.utils import counters

from vllm_expert_offload.kernels.linear import LinearShard
from vllm_expert_offload.kernels.oracle import KernelChoice, build_linear_kernel, exllamav3_unavailable
from vllm_expert_offload.kernels.rotated import RotatedLinear
from vllm_expert_offload.kernels.triton_exl3 import TRITON_MATMUL
from vllm_expert_offload.testing.random_layers import random_linear, random_moe

from support.moe_layers import FULL, placed_moe, routing

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)
CALLS = 4  # reduce-overhead warms up on the first call, records on the second, replays after


def _needs_exllamav3() -> None:
    why_not = exllamav3_unavailable(CUDA)
    if why_not is not None:
        pytest.skip(f"exllamav3 backend unavailable: {why_not}")


def compare_compiled(forward: Callable[..., torch.Tensor], inputs: Callable[[int], tuple], close) -> None:
    """forward compiled with CUDA-graph capture, called CALLS times on fresh inputs, against eager; and the graphs
    were captured, not skipped (a skip would silently run eager and prove nothing)."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(forward, mode="reduce-overhead")
    for call in range(CALLS):
        args = inputs(call)
        want = forward(*args)
        got = compiled(*args).clone()  # the next replay overwrites the graph's output buffer
        close(got, want)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


def _exact_enough(got: torch.Tensor, want: torch.Tensor) -> None:
    """The kernels are the same launches either way; the torch glue around them may be fused differently."""
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


@pytest.mark.parametrize("tokens", [4, 32])
def test_triton_moe_compiled_with_graphs_equals_eager(tokens: int) -> None:
    _, triton, _ = placed_moe(FULL, TRITON_MATMUL, device=CUDA)
    compare_compiled(triton.forward, lambda call: (*routing(tokens, seed=call, device=CUDA), False), _exact_enough)


def _linear_inputs(rows: int, width: int) -> Callable[[int], tuple]:
    return lambda call: (torch.randn(rows, width, generator=torch.Generator().manual_seed(call)).to(CUDA),)


def test_triton_linear_compiled_with_graphs_equals_eager() -> None:
    layer = random_linear(torch.Generator().manual_seed(3), 512, 384, 4)
    linear = RotatedLinear([LinearShard(layer, 0, 384, 384, 0, 512)], CUDA, TRITON_MATMUL)
    compare_compiled(linear.forward, _linear_inputs(8, 512), _exact_enough)


def _half_close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * float(want.abs().max()))


@pytest.mark.parametrize("tokens", [4, 32])
def test_exllamav3_moe_compiled_with_graphs_equals_eager(tokens: int) -> None:
    _needs_exllamav3()
    kernel = random_moe(512, 256, 16, 3, 0.5, "exllamav3", CUDA).kernel
    kernel.warm_up(4)  # exllamav3's barrier buffer and scratch exist before any capture, as in vLLM's profile run

    def inputs(call: int) -> tuple:
        gen = torch.Generator().manual_seed(call)
        ids = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(tokens)])
        x = torch.randn(tokens, 512, generator=gen).half()
        return x.to(CUDA), torch.rand(tokens, 4, generator=gen).to(CUDA), ids.to(CUDA), False

    compare_compiled(kernel.forward, inputs, _half_close)


def test_exllamav3_linear_compiled_with_graphs_equals_eager() -> None:
    _needs_exllamav3()
    layer = random_linear(torch.Generator().manual_seed(4), 512, 384, 4)
    shards = [LinearShard(layer, 0, 384, 384, 0, 512)]
    linear = build_linear_kernel(KernelChoice("exllamav3", "exllamav3", "test"), shards, torch.float16, CUDA)
    linear.warm_up([8])  # exl3_gemm autotunes with stream syncs: before capture
    compare_compiled(linear.forward, lambda call: (_linear_inputs(8, 512)(call)[0].half(),), _half_close)
