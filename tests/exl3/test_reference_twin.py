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
