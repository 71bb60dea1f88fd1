"""Tensor-parallel slices of an EXL3 linear equal the matching slice of the whole dequantized weight."""

from __future__ import annotations

import pytest
import torch

from vllm_expert_offload.exl3.codebook import MUL1_MARKER
from vllm_expert_offload.exl3.decode import dequantize_kn
from vllm_expert_offload.exl3.errors import Exl3FormatError
from vllm_expert_offload.exl3.slicing import aligned_cover, cover_input, cover_output, slice_output
from vllm_expert_offload.exl3.tensors import parse_linear


@pytest.fixture(scope="module")
def layer():
    g = torch.Generator().manual_seed(3)
    tensors = {
        "trellis": torch.randint(-32768, 32767, (256 // 16, 384 // 16, 48), dtype=torch.int16, generator=g),
        "suh": torch.randn(256, generator=g).half(),
        "svh": torch.randn(384, generator=g).half(),
        "mul1": torch.tensor(MUL1_MARKER, dtype=torch.int32),
        "bias": torch.randn(384, generator=g).half(),
    }
    return parse_linear(tensors, "model.layers.0.mlp.down_proj")


@pytest.mark.parametrize(("start", "end"), [(0, 128), (128, 384), (96, 192), (200, 210)])
def test_output_share_equals_columns_of_whole(layer, start: int, end: int) -> None:
    whole = dequantize_kn(layer)
    part, offset = cover_output(layer, start, end)
    assert part.out_features % 128 == 0 and part.trellis.shape[1] * 16 == part.out_features
    torch.testing.assert_close(dequantize_kn(part)[:, offset : offset + end - start], whole[:, start:end])
    torch.testing.assert_close(part.bias[offset : offset + end - start], layer.bias[start:end])


def test_input_shares_sum_to_the_whole_product(layer) -> None:
    """Row-parallel: each rank multiplies its input slice; the all-reduce sum is the full product, also for a
    split through a Hadamard block (each rank keeps the whole block and zero-fills the rest)."""
    x = torch.randn(5, 256)
    whole = x @ dequantize_kn(layer)
    for bounds in ([(0, 128), (128, 256)], [(0, 96), (96, 256)]):
        total = torch.zeros_like(whole)
        for start, end in bounds:
            part, offset = cover_input(layer, start, end, keep_bias=False)
            w = dequantize_kn(part)[offset : offset + end - start]
            total += x[:, start:end] @ w
        torch.testing.assert_close(total, whole, rtol=1e-4, atol=1e-4)


def test_aligned_cover() -> None:
    assert aligned_cover(96, 192, 384) == (0, 256)
    assert aligned_cover(128, 256, 384) == (128, 256)
    assert aligned_cover(300, 310, 320) == (256, 320)


def test_unaligned_slice_refused_with_tensor_named(layer) -> None:
    with pytest.raises(Exl3FormatError, match=r"model\.layers\.0\.mlp\.down_proj\.trellis: .*not aligned to 128"):
        slice_output(layer, 64, 192)
