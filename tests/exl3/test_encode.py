"""The no-Hessian EXL3 encoder: its output must be a valid tensor set whose decode is close to the input.

Thresholds sit 17-33 % above the errors measured in exl3-format.md §3.3 (Gaussian rate-distortion bound 2^-2K).
The torch Viterbi costs 40-150 ms per 16x16 tile on 2 shared cores (the compiled one, used when it builds, about
3 ms), so layers are encoded once per module, most cases skip the scale search, and the other codebooks are
measured on a few tiles.
"""

from __future__ import annotations

import pytest
import torch

from vllm_expert_offload.exl3 import (
    Codebook,
    Exl3FormatError,
    Exl3Linear,
    codebook_table,
    dequantize,
    pack_states,
    parse_linear,
    rotated_weight,
    unpack_states,
)
from vllm_expert_offload.exl3.encode import DEFAULT_SCALE, ROW_TARGET_RMS, encode_linear, encode_tiles
from vllm_expert_offload.exl3.tile import positions_to_tiles
from vllm_expert_offload.kernels import cpu_exl3  # noqa: F401  (offers the compiled Viterbi to the encoder)

MUL1_MAX_ERROR = {2: 0.08, 3: 0.022, 4: 0.006}


def _gaussian(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def _relative_error(layer: Exl3Linear, weight: torch.Tensor) -> float:
    """||W - W_q||^2 / ||W||^2 against the zero-padded original, so padding noise would count too."""
    decoded = dequantize(layer)
    target = torch.zeros_like(decoded)
    target[: weight.shape[0], : weight.shape[1]] = weight
    return float((decoded - target).pow(2).sum() / target.pow(2).sum())


@pytest.fixture(scope="module")
def gaussian() -> torch.Tensor:
    return _gaussian(128, 128)


@pytest.fixture(scope="module")
def mul1_layers(gaussian: torch.Tensor) -> dict[int, Exl3Linear]:
    """Full encode_linear at the default global scale, shared by the quality and determinism tests."""
    return {k: encode_linear(gaussian, k, scale_search=False) for k in MUL1_MAX_ERROR}


@pytest.mark.parametrize("k", sorted(MUL1_MAX_ERROR))
def test_mul1_error_per_k(mul1_layers: dict[int, Exl3Linear], gaussian: torch.Tensor, k: int) -> None:
    assert _relative_error(mul1_layers[k], gaussian) <= MUL1_MAX_ERROR[k]


def test_encoded_set_is_valid_exl3(mul1_layers: dict[int, Exl3Linear]) -> None:
    layer = mul1_layers[3]
    parsed = parse_linear(layer.tensors(), in_features=128, out_features=128)
    assert parsed.trellis.dtype == torch.int16 and tuple(parsed.trellis.shape) == (8, 8, 48)
    assert parsed.suh.dtype == torch.float16 and parsed.svh.dtype == torch.float16
    assert parsed.codebook is Codebook.MUL1 and parsed.k == 3


def test_half_integer_k_lies_between_neighbours(mul1_layers: dict[int, Exl3Linear], gaussian: torch.Tensor) -> None:
    layer = encode_linear(gaussian, 2.5, scale_search=False)
    assert layer.trellis.shape[-1] == 40
    error = _relative_error(layer, gaussian)
    assert _relative_error(mul1_layers[3], gaussian) < error < _relative_error(mul1_layers[2], gaussian)


def test_scale_search_is_no_worse_than_default(mul1_layers: dict[int, Exl3Linear], gaussian: torch.Tensor) -> None:
    searched = _relative_error(encode_linear(gaussian, 4), gaussian)
    assert searched <= MUL1_MAX_ERROR[4]
    assert searched <= 1.05 * _relative_error(mul1_layers[4], gaussian)


@pytest.mark.parametrize("codebook", [Codebook.INST3, Codebook.MCG])
def test_other_codebooks_at_k3(codebook: Codebook) -> None:
    """Rotated weights are near-iid Gaussian, so iid Gaussian tiles at the encoder's row scale stand in for them."""
    targets = _gaussian(16, 256, seed=4)
    scale = ROW_TARGET_RMS * DEFAULT_SCALE[codebook]
    decoded = codebook_table(codebook).float()[encode_tiles(targets * scale, 3, codebook)] / scale
    assert float((decoded - targets).pow(2).sum() / targets.pow(2).sum()) <= MUL1_MAX_ERROR[3]


def test_unaligned_shape_pads_with_exact_zeros() -> None:
    weight = _gaussian(96, 200, seed=1)  # nn.Linear(200, 96): in=200 -> 256, out=96 -> 128
    bias = torch.randn(96)
    done: list[int] = []
    layer = encode_linear(weight, 4, bias=bias, scale_search=False, progress=done.append)
    assert tuple(layer.trellis.shape) == (16, 8, 64)
    assert done[-1] == 16 * 8 and done == sorted(done)
    decoded = dequantize(layer)
    assert decoded[96:].abs().max() == 0 and decoded[:, 200:].abs().max() == 0
    assert _relative_error(layer, weight) <= MUL1_MAX_ERROR[4]
    assert torch.equal(layer.bias[:96], bias.half()) and layer.bias[96:].abs().max() == 0


@pytest.mark.parametrize(
    ("k", "codebook"),
    [(k, Codebook.MUL1) for k in (1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8)]
    + [(2, Codebook.INST3), (2, Codebook.MCG)],
)
def test_viterbi_states_close_the_ring_and_decode_exactly(k: float, codebook: Codebook) -> None:
    targets = _gaussian(3, 256, seed=2)
    states = encode_tiles(targets, k, codebook)
    trellis = pack_states(states, k)
    assert torch.equal(unpack_states(trellis, k), states)
    ones = torch.ones(16, dtype=torch.float16)
    layer = Exl3Linear("tiles", trellis[None], ones, ones.repeat(3), codebook, k)
    chosen = codebook_table(codebook)[states]
    assert torch.equal(rotated_weight(layer), positions_to_tiles(chosen[None]))


def test_same_seed_gives_identical_tensors(mul1_layers: dict[int, Exl3Linear], gaussian: torch.Tensor) -> None:
    again = encode_linear(gaussian, 4, scale_search=False)
    for suffix, tensor in mul1_layers[4].tensors().items():
        assert torch.equal(again.tensors()[suffix], tensor), suffix


@pytest.mark.parametrize("codebook", [Codebook.INST3, Codebook.MCG])
def test_half_integer_k_needs_mul1(codebook: Codebook) -> None:
    with pytest.raises(Exl3FormatError, match="half-integer"):
        encode_linear(torch.zeros(16, 16), 2.5, codebook)


@pytest.mark.parametrize("k", [0, 2.7, 4.5, 9])
def test_unsupported_k_refused(k: float) -> None:
    with pytest.raises(Exl3FormatError, match="K="):
        encode_linear(torch.zeros(16, 16), k)


def test_non_finite_weight_refused() -> None:
    weight = torch.zeros(16, 16)
    weight[3, 4] = float("nan")
    with pytest.raises(Exl3FormatError, match="non-finite"):
        encode_linear(weight, 2, name="experts.0.w1")
