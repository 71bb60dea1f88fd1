"""Reference decoding of an EXL3 linear: the definition every kernel is tested against (exl3-format.md §2)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .codebook import codebook_values
from .hadamard import hadamard_last, hadamard_rows
from .ring import unpack_states
from .tensors import Exl3Linear, parse_linear
from .tile import positions_to_tiles


def _as_linear(layer: Exl3Linear | Mapping[str, torch.Tensor]) -> Exl3Linear:
    return layer if isinstance(layer, Exl3Linear) else parse_linear(layer)


def rotated_weight(layer: Exl3Linear | Mapping[str, torch.Tensor]) -> torch.Tensor:
    """W_hat (in, out) fp16: the decoded trellis, bit-exact with exllamav3's `reconstruct`."""
    layer = _as_linear(layer)
    states = unpack_states(layer.trellis, layer.k)
    return positions_to_tiles(codebook_values(layer.codebook, states))


def dequantize_kn(layer: Exl3Linear | Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W = diag(suh) Hk W_hat Hn diag(svh), shape (in, out), computed in fp32."""
    layer = _as_linear(layer)
    w = rotated_weight(layer).float()
    w = hadamard_rows(w) * layer.suh.float()[:, None]
    w = hadamard_last(w) * layer.svh.float()[None, :]
    return w.to(dtype)


def dequantize(tensors: Exl3Linear | Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense weight in torch.nn.Linear orientation (out_features, in_features), stored (padded) dims."""
    return dequantize_kn(tensors, dtype).t().contiguous()


def linear(
    x: torch.Tensor, tensors: Exl3Linear | Mapping[str, torch.Tensor], compute_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """y = x @ W + bias in the activation-side form the kernels use; x's last dim is in_features (padded).

    Works on any device: the trellis is decoded where it lives. Computes in fp32 unless told otherwise.
    """
    layer = _as_linear(tensors)
    dtype = compute_dtype or torch.float32
    w_hat = rotated_weight(layer).to(device=x.device, dtype=dtype)
    xh = hadamard_last(x.to(dtype) * layer.suh.to(x.device, dtype))
    y = hadamard_last(xh @ w_hat) * layer.svh.to(x.device, dtype)
    if layer.bias is not None:
        y = y + layer.bias.to(x.device, dtype)
    return y.to(x.dtype)
