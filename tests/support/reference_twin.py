"""Dense twins checked against the independent decoder, so the e2e reference does not share the package's decoder.

`build_dense_twin` writes the twin with the package's own `dequantize`; a decode bug would then be in the
engine's weights and in the reference's alike, and the e2e tests would pass on it. Here every quantized linear of
the twin is compared with tests/support/exl3_reference.py's decode of the raw checkpoint tensors (read with safetensors,
not through the package's parser), and every other tensor with the checkpoint's own. DeepSeek-V4's `wo_a`, stored
as one set per output group (`attn.wo_a.slice.{g}`), is compared as the slices' rows in group order, the release
layout.

The reference decodes per weight in pure Python (~45 µs), too slow for DeepSeek-V4's 22 M quantized weights, so the
check applies it in bulk: the reference's own scalar definitions (state windows from S(p), the tile permutation,
each codebook's 65536 values) are evaluated once into index and value tables, and numpy gathers through them
(`reference_weight_bits`, bit-exact against `exl3_reference.rotated_weight_bits`; `_dequantize_kn` against
`exl3_reference.dequantize_kn`, tests/exl3/test_reference_twin.py).
A passed check leaves a stamp in the content-keyed twin directory, named by the reference's and this module's
source: a changed checkpoint, package decoder or reference checks again.
"""

from __future__ import annotations

import functools
import hashlib
import re
import sys
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
# DeepSeek-V4's wo_a is stored as o_groups sets of o_lora_rank rows each; the twin joins them back (release layout).
WO_A_SLICE = re.compile(r"^(?P<wo_a>.+\.attn\.wo_a)\.slice\.(?P<group>\d+)$")


def _checkpoint_tensors(exl3_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(exl3_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            tensors |= {name: f.get_tensor(name) for name in f.keys()}
    return tensors


@functools.cache
def _window_index(k: float) -> np.ndarray:
    """(256, 16) ring-bit index of each bit of each state: bit m of state p is ring bit (S(p) - 16 + m) mod R."""
    r = ref.ring_length(k)
    return np.array([[(ref.position_end(p, k) - 16 + m) % r for m in range(16)] for p in range(256)])


@functools.cache
def _codebook_table(codebook: str) -> np.ndarray:
    """fp16 bits of every 16-bit state, from the reference's codebook definition."""
    return np.array([ref.codebook_bits(codebook, state) for state in range(1 << 16)], dtype=np.uint16)


@functools.cache
def _tile_positions() -> tuple[np.ndarray, np.ndarray]:
    rows, cols = zip(*(ref.perm_formula(p) for p in range(256)))
    return np.array(rows), np.array(cols)


def reference_weight_bits(trellis: np.ndarray, codebook: str) -> np.ndarray:
    """`exl3_reference.rotated_weight_bits` for a whole trellis at once: W_hat (16 tk, 16 tn) as fp16 bit patterns."""
    tk, tn, width = trellis.shape
    k = width / 16
    u16 = trellis.view(np.uint16).astype(np.uint32)
    words = u16[..., 0::2] | (u16[..., 1::2] << 16)  # word j = u16[2j] | u16[2j+1] << 16
    ring = np.arange(32 * words.shape[-1])
    bits = (words[..., ring // 32] >> (31 - ring % 32)) & 1  # ring bit b = bit 31 - b % 32 of word b // 32
    states = (bits[..., _window_index(k)] << (15 - np.arange(16))).sum(axis=-1)  # (tk, tn, 256)
    values = _codebook_table(codebook)[states]
    rows, cols = _tile_positions()
    out = np.zeros((tk, 16, tn, 16), dtype=np.uint16)
    out[:, rows, :, cols] = values.transpose(2, 0, 1)
    return out.reshape(16 * tk, 16 * tn)


_hadamard_128 = functools.cache(ref.hadamard_128)


def _dequantize_kn(w_hat_bits: np.ndarray, suh: np.ndarray, svh: np.ndarray) -> np.ndarray:
    """`exl3_reference.dequantize_kn`, W = diag(suh) · Hk · W_hat · Hn · diag(svh), with the block-diagonal Hadamards
    applied block by block instead of as dense (k, k) and (n, n) matrices."""
    h = _hadamard_128()
    k, n = w_hat_bits.shape
    w = ref.bits_to_float64(w_hat_bits)
    w = np.einsum("ij,bjn->bin", h, w.reshape(k // 128, 128, n)).reshape(k, n)
    w = np.einsum("kbj,ji->kbi", w.reshape(k, n // 128, 128), h).reshape(k, n)
    return np.asarray(suh, np.float64)[:, None] * w * np.asarray(svh, np.float64)[None, :]


def reference_weight(tensor_set: Mapping[str, torch.Tensor]) -> np.ndarray:
    """(out, in) float64 weight of one suffix -> tensor set (modern suh/svh form), padded, decoded by the
    independent reference."""
    trellis = tensor_set["trellis"].numpy()
    codebook = next((c for c in CODEBOOK_MARKERS if c in tensor_set), "3inst")
    bits = reference_weight_bits(trellis, codebook)
    return _dequantize_kn(bits, tensor_set["suh"].numpy(), tensor_set["svh"].numpy()).T


def relative_error(got: torch.Tensor, want: np.ndarray) -> float:
    """Largest deviation relative to the largest reference weight."""
    return float(np.abs(got.double().numpy() - want).max() / np.abs(want).max())


def _twin_weights(prefixes: set[str]) -> dict[str, list[str]]:
    """Twin tensor name -> the sets whose rows it holds, in order: one set each, or DeepSeek-V4's wo_a slices."""
    joined: dict[str, list[tuple[int, str]]] = {}
    for prefix in prefixes:
        match = WO_A_SLICE.match(prefix)
        name, group = (f"{match['wo_a']}.weight", int(match["group"])) if match else (f"{prefix}.weight", 0)
        joined.setdefault(name, []).append((group, prefix))
    return {name: [prefix for _, prefix in sorted(parts)] for name, parts in joined.items()}


def check_twin(exl3_dir: Path, twin_dir: Path) -> None:
    """Raise AssertionError naming the first twin tensor that is not the reference's decode or the checkpoint's copy."""
    tensors = _checkpoint_tensors(exl3_dir)
    twin = load_file(twin_dir / "model.safetensors")
    prefixes = {name.removesuffix(".trellis") for name in tensors if name.endswith(".trellis")}
    decoded = _twin_weights(prefixes)
    set_members = {f"{p}.{s}" for p in prefixes for s in SET_SUFFIXES}
    expected_names = set(decoded) | (set(tensors) - set_members)
    assert set(twin) == expected_names, f"twin tensors differ from the checkpoint's: {set(twin) ^ expected_names}"
    for name, got in twin.items():
        if name in decoded:
            parts = decoded[name]
            rows, in_features = got.shape[0] // len(parts), got.shape[1]
            want = np.concatenate([reference_weight({s: tensors[f"{p}.{s}"] for s in SET_SUFFIXES
                                                     if f"{p}.{s}" in tensors})[:rows, :in_features] for p in parts])
            err = relative_error(got, want)
            assert err < REL_TOLERANCE, f"{name}: twin differs from the reference decode by {err:.2e} (relative)"
        else:
            assert torch.equal(got, tensors[name].to(got.dtype)), f"{name}: twin differs from the checkpoint"


def checked_dense_twin(exl3_dir: str | Path) -> Path:
    """`build_dense_twin(exl3_dir)` (float32, cached), checked against the independent reference once."""
    exl3_dir = Path(exl3_dir)
    twin_dir = build_dense_twin(exl3_dir)
    sources = b"".join(Path(module.__file__).read_bytes() for module in (ref, sys.modules[__name__]))
    stamp = twin_dir / f".reference-checked-{hashlib.sha256(sources).hexdigest()[:16]}"
    if not stamp.exists():
        check_twin(exl3_dir, twin_dir)
        stamp.touch()
    return twin_dir
