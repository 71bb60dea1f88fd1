"""Issue 20 item 4, engine-free, on a real GPU (skipped without CUDA): each backend's forward as vLLM's compiled model
calls it, one opaque op keyed by the layer's name (kernels/ops.py), under torch.compile with CUDA-graph capture
(mode="reduce-overhead", where vLLM's default compiles to), against the same forward run eagerly, on inputs that change
between calls, so a captured graph that froze one batch's routing or addresses fails.

Covered: the Triton backend's MoE and dense linear, and the exllamav3 backend's where its extension imports. Left out:
the torch reference, which reads routing on the host that no graph can capture (refused where vLLM would capture)."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from torch._dynamo.utils import counters

from vllm_expert_offload.kernels import ops
from vllm_expert_offload.kernels.contract import LinearLayer
from vllm_expert_offload.kernels.linear import LinearShard
from vllm_expert_offload.kernels.oracle import KernelChoice, build_linear_kernel, why_unavailable
from vllm_expert_offload.kernels.triton_linear import FusedTritonLinear
from vllm_expert_offload.kernels.triton_moe import fused_moe
from vllm_expert_offload.tools.random_layers import random_linear, random_moe

from support.moe_layers import FULL, HIDDEN, UNIFORM, placed_moe, routing

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)
CALLS = 4  # reduce-overhead warms up on the first call, records on the second, replays after
_names = itertools.count()


class Target:
    """What a vLLM layer hands the ops: its kernel's forward (router weights applied to the output)."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel

    def moe_forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return self.kernel.forward(x, topk_weights, topk_ids, False)

    def linear_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel.forward(x)


def _moe_op(kernel, hidden: int) -> Callable[..., torch.Tensor]:
    target, name = Target(kernel), f"test.layers.{next(_names)}.mlp.experts"
    ops.register_target(name, target)
    forward = lambda x, weights, ids: ops.exl3_moe(target, name, hidden, x, weights, ids)  # noqa: E731
    forward.target = target  # the registry holds it weakly
    return forward


def _linear_op(kernel) -> Callable[..., torch.Tensor]:
    target, name = Target(kernel), f"test.layers.{next(_names)}.self_attn.o_proj"
    ops.register_target(name, target)
    forward = lambda x: ops.exl3_linear(target, name, kernel.out_features, x)  # noqa: E731
    forward.target = target
    return forward


def compare_compiled(forward: Callable[..., torch.Tensor], inputs: Callable[[int], tuple], close) -> None:
    """forward compiled with CUDA-graph capture, called CALLS times on fresh inputs, against eager; and the graphs
    were captured, not skipped (a skip would silently run eager and prove nothing)."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(forward, mode="reduce-overhead", fullgraph=True)
    for call in range(CALLS):
        args = inputs(call)
        want = forward(*args)
        got = compiled(*args).clone()  # the next replay overwrites the graph's output buffer
        close(got, want)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


def _same_launches(got: torch.Tensor, want: torch.Tensor) -> None:
    """The op runs the same launches compiled or not: equal up to the kernels' own run-to-run order."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("tokens", [4])  # one launch class: each compiles its kernels (gpu_check_budget prices them)
def test_triton_moe_op_compiled_with_graphs_equals_eager(tokens: int) -> None:
    _, triton, _ = placed_moe(FULL, fused_moe, device=CUDA, rates=UNIFORM)  # what the backend builds
    compare_compiled(_moe_op(triton, HIDDEN), lambda call: routing(tokens, seed=call, device=CUDA), _same_launches)


def _rows(count: int, width: int, dtype: torch.dtype) -> Callable[[int], tuple]:
    return lambda call: (torch.randn(count, width, generator=torch.Generator().manual_seed(call)).to(CUDA, dtype),)


def test_triton_linear_op_compiled_with_graphs_equals_eager() -> None:
    layer = random_linear(torch.Generator().manual_seed(3), 512, 384, 4)
    linear = FusedTritonLinear([LinearShard(layer, 0, 384, 384, 0, 512)], torch.float32, CUDA, capture_rows=(8,))
    compare_compiled(_linear_op(linear), _rows(8, 512, torch.float32), _same_launches)


def _needs_exllamav3() -> None:
    why_not = why_unavailable("exllamav3", CUDA)
    if why_not is not None:
        pytest.skip(f"exllamav3 backend unavailable: {why_not}")


@pytest.mark.parametrize("tokens", [4, 32])
def test_exllamav3_moe_op_compiled_with_graphs_equals_eager(tokens: int) -> None:
    _needs_exllamav3()
    kernel = random_moe(512, 256, 16, 3, 0.5, "exllamav3", CUDA).kernel
    kernel.warm_up(4)  # exllamav3's barrier buffer and scratch exist before any capture, as in vLLM's profile run

    def inputs(call: int) -> tuple:
        gen = torch.Generator().manual_seed(call)
        ids = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(tokens)])
        x = torch.randn(tokens, 512, generator=gen).half()
        return x.to(CUDA), torch.rand(tokens, 4, generator=gen).to(CUDA), ids.to(CUDA)

    compare_compiled(_moe_op(kernel, 512), inputs, _same_launches)


def test_exllamav3_linear_op_compiled_with_graphs_equals_eager() -> None:
    _needs_exllamav3()
    layer = random_linear(torch.Generator().manual_seed(4), 512, 384, 4)
    shards = [LinearShard(layer, 0, 384, 384, 0, 512)]
    linear = build_linear_kernel(KernelChoice("exllamav3", "exllamav3", "test"), LinearLayer(shards, torch.float16, CUDA))
    linear.warm_up([8])  # exl3_gemm autotunes with stream syncs: before capture
    compare_compiled(_linear_op(linear), _rows(8, 512, torch.float16), _same_launches)
