"""Whole-layer decoding (exl3-format.md §2.1, §2.8) against the naive reference in tests/support/exl3_reference.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_expert_offload.exl3 import dequantize, dequantize_kn, linear, parse_linear, rotated_weight

from support import exl3_reference as ref
from support.layers import make_layer

NAME = "model.layers.0.mlp.experts.3.down_proj"
CASES = [(2, "3inst"), (2, "mcg"), (2, "mul1"), (3, "3inst"), (3, "mcg"), (3, "mul1"), (2.5, "mul1")]


def fp16_bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().astype(np.int64) & 0xFFFF


_REF_CACHE: dict = {}


def reference_w_hat(k, codebook, in_features, out_features, seed) -> np.ndarray:
    key = (k, codebook, in_features, out_features, seed)
    if key not in _REF_CACHE:
        tensors = make_layer(k, codebook, in_features, out_features, seed)
        _REF_CACHE[key] = ref.rotated_weight_bits(tensors["trellis"].numpy(), k, codebook).astype(np.int64)
    return _REF_CACHE[key]


# Non-square on purpose (in=256, out=128 or the reverse) so a transposed orientation cannot pass.
def shape_for(k) -> tuple[int, int]:
    return (256, 128) if k != 3 else (128, 256)


@pytest.mark.parametrize("k, codebook", CASES)
def test_rotated_weight_bit_exact(k, codebook):
    fin, fout = shape_for(k)
    tensors = make_layer(k, codebook, fin, fout, seed=int(10 * k))
    w_hat = rotated_weight(tensors)
    assert w_hat.dtype == torch.float16 and w_hat.shape == (fin, fout)
    np.testing.assert_array_equal(fp16_bits(w_hat), reference_w_hat(k, codebook, fin, fout, int(10 * k)))


def test_rotated_weight_wrong_codebook_differs():
    """Negative control: the same trellis under another codebook decodes differently."""
    tensors = make_layer(2, "mul1", 256, 128, seed=20)
    del tensors["mul1"]
    tensors["mcg"] = torch.tensor(ref.MCG_MARKER_INT32, dtype=torch.int32)
    assert (fp16_bits(rotated_weight(tensors)) != reference_w_hat(2, "mul1", 256, 128, 20)).mean() > 0.9


@pytest.mark.parametrize("k, codebook", CASES)
def test_dequantize_equals_float64_formula(k, codebook):
    fin, fout = shape_for(k)
    seed = int(10 * k)
    tensors = make_layer(k, codebook, fin, fout, seed)
    w_ref = ref.dequantize_kn(reference_w_hat(k, codebook, fin, fout, seed), tensors["suh"].numpy(),
                              tensors["svh"].numpy())
    w = dequantize(tensors)
    assert w.dtype == torch.float32
    assert w.shape == (fout, fin)  # torch.nn.Linear orientation
    scale = np.abs(w_ref).max()
    err = np.abs(w.double().numpy() - w_ref.T).max() / scale
    assert err < 2e-6, err  # fp32 rounding of 128-term sums
    kn = dequantize_kn(tensors)
    assert kn.shape == (fin, fout) and torch.equal(kn, w.T)
    assert dequantize(tensors, torch.float64).dtype == torch.float64


def test_dequantize_negative_controls():
    """Swapped scale sides, a missing Hadamard side or the transposed weight all fail the comparison."""
    tensors = make_layer(2, "mul1", 128, 128, seed=5)
    w_hat = ref.rotated_weight_bits(tensors["trellis"].numpy(), 2, "mul1")
    suh, svh = tensors["suh"].numpy(), tensors["svh"].numpy()
    w = dequantize(tensors).double().numpy().T  # (in, out)
    good = ref.dequantize_kn(w_hat, suh, svh)
    assert np.abs(w - good).max() < 1e-5
    h = ref.block_hadamard(128)
    swapped = ref.dequantize_kn(w_hat, svh, suh)
    one_side = np.diag(suh.astype(np.float64)) @ h @ ref.bits_to_float64(w_hat) @ np.diag(svh.astype(np.float64))
    for wrong in (swapped, one_side, good.T):
        assert np.abs(w - wrong).max() > 0.1


@pytest.mark.parametrize("k, codebook", [(2, "mul1"), (3, "3inst"), (2.5, "mul1")])
def test_linear_matches_dense(k, codebook):
    fin, fout = shape_for(k)
    tensors = make_layer(k, codebook, fin, fout, seed=int(10 * k) + 1, bias=True)
    x = torch.randn(2, 3, fin, generator=torch.Generator().manual_seed(0))
    y = linear(x, tensors)
    assert y.shape == (2, 3, fout) and y.dtype == torch.float32
    dense = x @ dequantize(tensors).T + tensors["bias"].float()
    rel = ((y - dense).norm() / dense.norm()).item()
    assert rel < 1e-4, rel
    # Against the float64 reference too.
    w_ref = ref.dequantize_kn(ref.rotated_weight_bits(tensors["trellis"].numpy(), k, codebook),
                              tensors["suh"].numpy(), tensors["svh"].numpy())
    y_ref = x.double().numpy() @ w_ref + tensors["bias"].double().numpy()
    assert np.linalg.norm(y.double().numpy() - y_ref) / np.linalg.norm(y_ref) < 1e-4
    # Negative control: forgetting the bias is visible.
    assert ((y - (dense - tensors["bias"].float())).norm() / dense.norm()).item() > 1e-2
    # A parsed layer gives the same result as the raw tensor map.
    assert torch.equal(linear(x, parse_linear(tensors, NAME)), y)


def test_linear_fp16_input_returns_fp16():
    tensors = make_layer(2, "mul1", 128, 128, seed=9)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(1))
    y16 = linear(x.half(), tensors)
    assert y16.dtype == torch.float16
    y = x.half().float() @ dequantize(tensors).T
    assert ((y16.float() - y).norm() / y.norm()).item() < 2e-3


def test_legacy_su_sv_equal_to_pm1_suh_svh():
    rng = np.random.default_rng(42)
    fin, fout = 256, 128
    trellis = torch.from_numpy(ref.random_trellis(rng, fin // 16, fout // 16, 3))
    su = rng.choice([-1.0, 1.0], size=fin)
    sv = rng.choice([-1.0, 1.0], size=fout)
    marker = torch.tensor(ref.MUL1_MARKER_INT32, dtype=torch.int32)
    modern = {"trellis": trellis, "suh": torch.tensor(su, dtype=torch.float16),
              "svh": torch.tensor(sv, dtype=torch.float16), "mul1": marker}
    legacy = {"trellis": trellis, "su": torch.from_numpy(ref.pack_sign_bits(su)),
              "sv": torch.from_numpy(ref.pack_sign_bits(sv)), "mul1": marker}
    parsed = parse_linear(legacy, NAME)
    assert parsed.suh.dtype == torch.float16 and parsed.suh.tolist() == su.tolist()
    assert parsed.svh.tolist() == sv.tolist()
    assert torch.equal(dequantize(legacy), dequantize(modern))
    # Negative control: bit order reversed within each word (bit 15 − j) decodes to different signs.
    flipped_su = su.reshape(-1, 16)[:, ::-1].ravel()
    wrong = dict(legacy, su=torch.from_numpy(ref.pack_sign_bits(flipped_su)))
    assert not torch.equal(dequantize(wrong), dequantize(modern))


def test_legacy_sign_bits_known_pattern():
    """Word 0 = 0b...0101 -> elements 0 and 2 negative; word 1 = 0x8000 (as int16 −32768) -> element 31 negative."""
    su = torch.tensor([0b101, -32768, 0, 0, 0, 0, 0, 0], dtype=torch.int16)
    tensors = {"trellis": torch.zeros(8, 8, 32, dtype=torch.int16), "su": su, "svh": torch.ones(128, dtype=torch.float16)}
    signs = parse_linear(tensors, NAME).suh.tolist()
    negative = [i for i, s in enumerate(signs) if s < 0]
    assert negative == [0, 2, 31]
