"""One EXL3-quantized linear layer as a validated tensor set (exl3-format.md §1.3).

Every check names the offending tensor, because the user's only recourse is to look at that tensor
in their checkpoint; a bad set must be refused at load, not discovered as garbage tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..validation import refuse_unknown
from .bitrate import check_k_codebook, k_from_trellis_width
from .codebook import Codebook
from .errors import Exl3FormatError

PAD_MULTIPLE = 128
KNOWN_SUFFIXES = frozenset({"trellis", "suh", "svh", "su", "sv", "mcg", "mul1", "bias"})
MARKER_SUFFIXES = ("mcg", "mul1")


def padded(features: int) -> int:
    """Quantized dims are stored padded up to a multiple of 128 (zero weights in the padding)."""
    return -(-features // PAD_MULTIPLE) * PAD_MULTIPLE


@dataclass(frozen=True)
class Exl3Linear:
    """The tensors of one quantized linear, y = x @ W with W of shape (in_features, out_features), both padded."""

    name: str
    trellis: torch.Tensor  # int16 (in/16, out/16, 16K)
    suh: torch.Tensor  # fp16 (in,)
    svh: torch.Tensor  # fp16 (out,)
    codebook: Codebook
    k: float
    bias: torch.Tensor | None = None  # fp16 (out,)

    @property
    def in_features(self) -> int:
        return self.trellis.shape[0] * 16

    @property
    def out_features(self) -> int:
        return self.trellis.shape[1] * 16

    def tensors(self) -> dict[str, torch.Tensor]:
        """The suffix -> tensor map exllamav3 writes for this set (modern suh/svh form)."""
        out = {"trellis": self.trellis, "suh": self.suh, "svh": self.svh}
        if self.codebook.marker_suffix is not None:
            # On the CPU even when built under vLLM's `with torch.device("cuda")`: a marker is only ever read back
            # as a Python int, and thousands of tiny device tensors would each cost an allocation and a sync.
            out[self.codebook.marker_suffix] = torch.tensor(self.codebook.marker_value, dtype=torch.int32, device="cpu")
        if self.bias is not None:
            out["bias"] = self.bias
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


def _unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """Legacy su/sv: bit j of int16 word i is element 16i+j, bit 1 = -1.0."""
    bits = (packed.to(torch.int64)[:, None] >> torch.arange(16, device=packed.device)) & 1
    return (1 - 2 * bits).flatten().to(torch.float16)


def _scale_vector(tensors: Mapping[str, torch.Tensor], modern: str, legacy: str, length: int, name: str) -> torch.Tensor:
    if modern in tensors:
        t = tensors[modern]
        if t.dtype != torch.float16:
            raise Exl3FormatError(f"{name}.{modern}: dtype {t.dtype}, expected torch.float16")
        if tuple(t.shape) != (length,):
            raise Exl3FormatError(f"{name}.{modern}: shape {tuple(t.shape)}, expected ({length},) to match the trellis")
        return t
    if legacy in tensors:
        t = tensors[legacy]
        if t.dtype != torch.int16:
            raise Exl3FormatError(f"{name}.{legacy}: dtype {t.dtype}, expected torch.int16 (packed sign bits)")
        if tuple(t.shape) != (length // 16,):
            raise Exl3FormatError(f"{name}.{legacy}: shape {tuple(t.shape)}, expected ({length // 16},)")
        return _unpack_signs(t)
    raise Exl3FormatError(f"{name}.{modern}: missing (neither {modern} nor legacy {legacy} is present)")


def _codebook(tensors: Mapping[str, torch.Tensor], name: str) -> Codebook:
    present = [s for s in MARKER_SUFFIXES if s in tensors]
    if len(present) > 1:
        raise Exl3FormatError(f"{name}: both {name}.mcg and {name}.mul1 are present; a tensor set has one codebook")
    if not present:
        return Codebook.INST3
    suffix = present[0]
    codebook = Codebook(suffix)
    marker = tensors[suffix]
    if marker.dtype != torch.int32 or marker.numel() != 1:
        raise Exl3FormatError(
            f"{name}.{suffix}: marker must be one int32 value, got dtype {marker.dtype} shape {tuple(marker.shape)}"
        )
    value = int(marker.reshape(()).item())
    if value != codebook.marker_value:
        raise Exl3FormatError(
            f"{name}.{suffix}: marker value {value} ({value & 0xFFFFFFFF:#010x}), expected {codebook.marker_value} "
            f"({codebook.marker_value & 0xFFFFFFFF:#010x})"
        )
    return codebook


def parse_linear(
    tensors: Mapping[str, torch.Tensor],
    name: str = "linear",
    in_features: int | None = None,
    out_features: int | None = None,
) -> Exl3Linear:
    """Validate one layer's suffix -> tensor map; in/out_features (unpadded, as the model declares them) are checked
    against the trellis after padding to 128."""
    refuse_unknown(tensors, KNOWN_SUFFIXES, name, Exl3FormatError, "unexpected tensor in an EXL3 layer")
    if "trellis" not in tensors:
        raise Exl3FormatError(f"{name}.trellis: missing")
    trellis = tensors["trellis"]
    if trellis.dtype != torch.int16:
        raise Exl3FormatError(f"{name}.trellis: dtype {trellis.dtype}, expected torch.int16")
    if trellis.dim() != 3:
        raise Exl3FormatError(f"{name}.trellis: shape {tuple(trellis.shape)}, expected 3 dims (in/16, out/16, 16*K)")
    k = k_from_trellis_width(trellis.shape[-1], f"{name}.trellis")
    k_in, k_out = trellis.shape[0] * 16, trellis.shape[1] * 16
    for dim, size in (("in", k_in), ("out", k_out)):
        if size % PAD_MULTIPLE:
            raise Exl3FormatError(
                f"{name}.trellis: {dim}_features {size} is not a multiple of {PAD_MULTIPLE}; EXL3 pads both dims to 128"
            )
    for dim, declared, stored in (("in", in_features, k_in), ("out", out_features, k_out)):
        if declared is not None and padded(declared) != stored:
            raise Exl3FormatError(
                f"{name}.trellis: stores {dim}_features {stored}, but the layer has {declared} "
                f"(padded: {padded(declared)})"
            )
    codebook = _codebook(tensors, name)
    check_k_codebook(k, codebook, f"{name}.trellis")
    suh = _scale_vector(tensors, "suh", "su", k_in, name)
    svh = _scale_vector(tensors, "svh", "sv", k_out, name)
    bias = tensors.get("bias")
    if bias is not None:
        if bias.dtype not in (torch.float16, torch.float32, torch.bfloat16):
            raise Exl3FormatError(f"{name}.bias: dtype {bias.dtype}, expected a float dtype")
        if bias.numel() != k_out and (out_features is None or bias.numel() != out_features):
            raise Exl3FormatError(f"{name}.bias: {bias.numel()} elements, expected {k_out}")
        bias = torch.nn.functional.pad(bias.reshape(-1).half(), (0, k_out - bias.numel()))
    return Exl3Linear(name=name, trellis=trellis, suh=suh, svh=svh, codebook=codebook, k=k, bias=bias)
