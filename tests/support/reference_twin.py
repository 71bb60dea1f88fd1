"""Dense twins checked against the independent decoder, so the e2e reference does not share the package's decoder.

`build_dense_twin` writes the twin with the package's own `dequantize`; a decode bug would then be in the
engine's weights and in the reference's alike, and the e2e tests would pass on it. Here every quantized linear of
the twin is compared with tests/support/exl3_reference.py's decode of the raw checkpoint tensors (read with safetensors,
not through the package's parser), and every other tensor with the checkpoint's own. The check is slow (pure
Python per weight, ~45 µs), so a passed check leaves a stamp in the content-keyed twin directory, named by the
reference decoder's source: a changed checkpoint, package decoder or reference decoder checks again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from vllm_expert_offload.testing.tiny_models import build_dense_twin

from . import exl3_reference as ref

CODEBOOK_MARKERS = ("mul1", "mcg")  # a set with neither marker is 3inst (exl3-format.md §1.3)
SET_SUFFIXES = ("trellis", "suh", "svh", *CODEBOOK_MARKERS)
# fp32 decode vs float64 formula: rounding of 128-term Hadamard sums, relative to the tensor's largest weight.
# Any decode error (a wrong bit, codebook, permutation, sign or scale) is of the order of the weights themselves.
REL_TOLERANCE = 2e-6


def _checkpoint_tensors(exl3_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(exl3_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            tensors |= {name: f.get_tensor(name) for name in f.keys()}
    return tensors


def reference_weight(tensor_set: Mapping[str, torch.Tensor]) -> np.ndarray:
    """(out, in) float64 weight of one suffix -> tensor set (modern suh/svh form), padded, decoded by the
    independent reference."""
    trellis = tensor_set["trellis"].numpy()
    codebook = next((c for c in CODEBOOK_MARKERS if c in tensor_set), "3inst")
    bits = ref.rotated_weight_bits(trellis, trellis.shape[2] / 16, codebook)
    return ref.dequantize_kn(bits, tensor_set["suh"].numpy(), tensor_set["svh"].numpy()).T


def relative_error(got: torch.Tensor, want: np.ndarray) -> float:
    """Largest deviation relative to the largest reference weight."""
    return float(np.abs(got.double().numpy() - want).max() / np.abs(want).max())


def check_twin(exl3_dir: Path, twin_dir: Path) -> None:
    """Raise AssertionError naming the first twin tensor that is not the reference's decode or the checkpoint's copy."""
    tensors = _checkpoint_tensors(exl3_dir)
    twin = load_file(twin_dir / "model.safetensors")
    prefixes = {name.removesuffix(".trellis") for name in tensors if name.endswith(".trellis")}
    set_members = {f"{p}.{s}" for p in prefixes for s in SET_SUFFIXES}
    expected_names = {f"{p}.weight" for p in prefixes} | (set(tensors) - set_members)
    assert set(twin) == expected_names, f"twin tensors differ from the checkpoint's: {set(twin) ^ expected_names}"
    for name, got in twin.items():
        prefix = name.removesuffix(".weight")
        if prefix in prefixes:
            out_features, in_features = got.shape
            tensor_set = {s: tensors[f"{prefix}.{s}"] for s in SET_SUFFIXES if f"{prefix}.{s}" in tensors}
            err = relative_error(got, reference_weight(tensor_set)[:out_features, :in_features])
            assert err < REL_TOLERANCE, f"{name}: twin differs from the reference decode by {err:.2e} (relative)"
        else:
            assert torch.equal(got, tensors[name].to(got.dtype)), f"{name}: twin differs from the checkpoint"


def checked_dense_twin(exl3_dir: str | Path) -> Path:
    """`build_dense_twin(exl3_dir)` (float32, cached), checked against the independent reference once."""
    exl3_dir = Path(exl3_dir)
    twin_dir = build_dense_twin(exl3_dir)
    stamp = twin_dir / f".reference-checked-{hashlib.sha256(Path(ref.__file__).read_bytes()).hexdigest()[:16]}"
    if not stamp.exists():
        check_twin(exl3_dir, twin_dir)
        stamp.touch()
    return twin_dir
