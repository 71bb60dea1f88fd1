"""Bits per weight K and the per-position bit counts of the trellis ring (exl3-format.md §1.2, §2.4)."""

from __future__ import annotations

from functools import lru_cache

import torch

from .codebook import Codebook
from .errors import Exl3FormatError

INTEGER_K = (1, 2, 3, 4, 5, 6, 7, 8)
HALF_K = (1.5, 2.5, 3.5)
POSITIONS = 256  # 16x16 weights per tile


def k_from_trellis_width(width: int, tensor_name: str = "trellis") -> float:
    """K = last trellis dim / 16; only the rates the kernels instantiate are accepted."""
    k = width / 16
    if k in INTEGER_K:
        return int(k)
    if k in HALF_K:
        return k
    allowed = ", ".join(str(int(16 * v)) for v in sorted((*INTEGER_K, *HALF_K)))
    raise Exl3FormatError(
        f"{tensor_name}: last dimension {width} gives K={k:g} bits per weight; "
        f"EXL3 allows K in 1..8 or 1.5/2.5/3.5 (last dimension one of {allowed})"
    )


def check_k_codebook(k: float, codebook: Codebook, tensor_name: str) -> None:
    if k in HALF_K and codebook is not Codebook.MUL1:
        raise Exl3FormatError(
            f"{tensor_name}: half-integer K={k} needs the MUL1 codebook, but the tensor set uses {codebook.value}"
        )


@lru_cache(maxsize=None)
def position_bits(k: float) -> torch.Tensor:
    """D(p): bits that position p adds to the ring; K everywhere, or KA/KA+1 alternating for K = KA + 1/2."""
    if k in INTEGER_K:
        return torch.full((POSITIONS,), int(k), dtype=torch.int64)
    base = int(k)
    odd = torch.arange(POSITIONS) % 2  # bit (p mod 16) of 0xAAAA is set exactly for odd p
    return base + odd


@lru_cache(maxsize=None)
def position_ends(k: float) -> torch.Tensor:
    """S(p): ring bit index one past position p's own code (prefix sum of D)."""
    return torch.cumsum(position_bits(k), 0)


def ring_bits(k: float) -> int:
    return int(round(POSITIONS * k))
