"""The twin check that makes the e2e reference independent of the package decoder must itself reject bad twins."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from vllm_expert_offload.exl3 import dequantize

from support import exl3_reference as ref
from support.reference_twin import check_twin

PREFIX = "model.layers.0.mlp.experts.0.up_proj"
OUT, IN = 120, 128  # the twin crops the padded 128 outputs to the model's 120


def _checkpoint(exl3_dir: Path) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(7)
    tensors = {
        f"{PREFIX}.trellis": torch.from_numpy(ref.random_trellis(rng, IN // 16, 128 // 16, 2)),
        f"{PREFIX}.suh": torch.from_numpy(rng.uniform(0.5, 1.5, IN).astype(np.float16)),
        f"{PREFIX}.svh": torch.from_numpy(rng.choice([-1.0, 1.0], 128).astype(np.float16)),
        f"{PREFIX}.mul1": torch.tensor(ref.MUL1_MARKER_INT32, dtype=torch.int32),
        "model.norm.weight": torch.ones(IN, dtype=torch.float16),
    }
    exl3_dir.mkdir()
    save_file(tensors, exl3_dir / "model.safetensors")
    return tensors


def _package_weight(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The weight as write_dense_twin writes it: the package's decode, cropped."""
    return dequantize({s: tensors[f"{PREFIX}.{s}"] for s in ("trellis", "suh", "svh", "mul1")})[:OUT].contiguous()


def _twin(twin_dir: Path, weight: torch.Tensor, **overrides: torch.Tensor) -> None:
    twin = {f"{PREFIX}.weight": weight, "model.norm.weight": torch.ones(IN)}
    twin_dir.mkdir(exist_ok=True)
    save_file(twin | overrides, twin_dir / "model.safetensors")


def test_twin_decoded_by_the_package_passes(tmp_path: Path) -> None:
    tensors = _checkpoint(tmp_path / "exl3")
    _twin(tmp_path / "twin", _package_weight(tensors))
    check_twin(tmp_path / "exl3", tmp_path / "twin")


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda w: {f"{PREFIX}.weight": w * (1 + 1e-4)}, "differs from the reference decode"),
        (lambda w: {f"{PREFIX}.weight": torch.cat((w[:, 1:], w[:, :1]), dim=1)}, "differs from the reference"),
        (lambda w: {"model.norm.weight": torch.full((IN,), 2.0)}, "model.norm.weight: twin differs"),
        (lambda w: {"extra.weight": w.clone()}, "twin tensors differ"),
    ],
)
def test_corrupted_twin_is_refused(tmp_path: Path, corrupt, message: str) -> None:
    tensors = _checkpoint(tmp_path / "exl3")
    weight = _package_weight(tensors)
    _twin(tmp_path / "twin", weight, **corrupt(weight))
    with pytest.raises(AssertionError, match=message):
        check_twin(tmp_path / "exl3", tmp_path / "twin")


@pytest.mark.parametrize(("k", "codebook"), [(1, "3inst"), (2, "mcg"), (3, "mul1"), (1.5, "mul1"), (2.5, "mul1"),
                                             (3.5, "mul1"), (5, "3inst"), (8, "mcg")])
def test_bulk_reference_decode_is_the_scalar_reference_bit_for_bit(k: float, codebook: str) -> None:
    """The check's bulk decode only evaluates the reference's own definitions in bulk: equal bit for bit."""
    from support.reference_twin import reference_weight_bits

    trellis = ref.random_trellis(np.random.default_rng(int(10 * k)), 2, 3, k)
    np.testing.assert_array_equal(reference_weight_bits(trellis, codebook), ref.rotated_weight_bits(trellis, k, codebook))


def _sliced_checkpoint(exl3_dir: Path) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """DeepSeek-V4's wo_a stored as two sets (output groups) of 128 rows; returns the tensors and each slice's decode."""
    rng = np.random.default_rng(11)
    tensors, slices = {}, []
    for group in range(2):
        prefix = f"layers.0.attn.wo_a.slice.{group}"
        parts = {"trellis": torch.from_numpy(ref.random_trellis(rng, IN // 16, 128 // 16, 3)),
                 "suh": torch.from_numpy(rng.uniform(0.5, 1.5, IN).astype(np.float16)),
                 "svh": torch.from_numpy(rng.choice([-1.0, 1.0], 128).astype(np.float16)),
                 "mul1": torch.tensor(ref.MUL1_MARKER_INT32, dtype=torch.int32)}
        tensors |= {f"{prefix}.{s}": t for s, t in parts.items()}
        slices.append(dequantize(parts))
    exl3_dir.mkdir()
    save_file(tensors, exl3_dir / "model.safetensors")
    return tensors, slices


@pytest.mark.parametrize(("order", "passes"), [((0, 1), True), ((1, 0), False)])
def test_joined_slices_are_checked_in_group_order(tmp_path: Path, order: tuple[int, int], passes: bool) -> None:
    _, slices = _sliced_checkpoint(tmp_path / "exl3")
    (tmp_path / "twin").mkdir()
    save_file({"layers.0.attn.wo_a.weight": torch.cat([slices[g] for g in order]).contiguous()},
              tmp_path / "twin" / "model.safetensors")
    if passes:
        check_twin(tmp_path / "exl3", tmp_path / "twin")
    else:
        with pytest.raises(AssertionError, match="layers.0.attn.wo_a.weight: twin differs from the reference"):
            check_twin(tmp_path / "exl3", tmp_path / "twin")


def test_blockwise_rotation_is_the_references_dense_one() -> None:
    from support.reference_twin import _dequantize_kn

    rng = np.random.default_rng(3)
    bits = ref.rotated_weight_bits(ref.random_trellis(rng, 16, 8, 2), 2, "mul1")
    suh, svh = rng.uniform(-2, 2, 256), rng.uniform(-2, 2, 128)
    np.testing.assert_allclose(_dequantize_kn(bits, suh, svh), ref.dequantize_kn(bits, suh, svh), rtol=1e-12, atol=1e-12)
