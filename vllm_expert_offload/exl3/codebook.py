"""The three EXL3 codebooks: a 16-bit trellis state -> one fp16 weight in the rotated basis.

Each table is computed once per process with exact integer arithmetic, so decoded weights are
bit-identical to exllamav3's reconstruct kernel (exl3-format.md §2.6).
"""

from __future__ import annotations

import enum
from functools import lru_cache

import torch

MUL1_MULTIPLIER = 0x83DCD12D
MCG_MULTIPLIER = 0xCBAC1FED
INST3_MULTIPLIER = 89226354
INST3_ADDEND = 64248484

# The codebook markers are stored as int32 scalars holding the multiplier's bit pattern.
MUL1_MARKER = MUL1_MULTIPLIER - (1 << 32)  # -2082680531
MCG_MARKER = MCG_MULTIPLIER - (1 << 32)  # -877912083

_MASK32 = 0xFFFFFFFF


class Codebook(str, enum.Enum):
    """Which state -> value map a tensor set uses; chosen by its marker tensor (none = 3INST)."""

    INST3 = "3inst"
    MCG = "mcg"
    MUL1 = "mul1"

    @property
    def marker_suffix(self) -> str | None:
        return {Codebook.INST3: None, Codebook.MCG: "mcg", Codebook.MUL1: "mul1"}[self]

    @property
    def marker_value(self) -> int | None:
        return {Codebook.INST3: None, Codebook.MCG: MCG_MARKER, Codebook.MUL1: MUL1_MARKER}[self]


def _u16_to_fp16(bits: torch.Tensor) -> torch.Tensor:
    """Reinterpret integers in [0, 65536) as fp16 bit patterns."""
    signed = torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16)
    return signed.view(torch.float16)


def _lop3_halves(x: torch.Tensor) -> torch.Tensor:
    """3INST/MCG: mask and XOR the 32-bit word, then add its two fp16 halves with one rounding."""
    x = (x & 0x8FFF8FFF) ^ 0x3B603B60
    lo = _u16_to_fp16(x & 0xFFFF).float()
    hi = _u16_to_fp16((x >> 16) & 0xFFFF).float()
    # Both halves lie in ±[0.125, 2): their fp32 sum is exact, so one .half() equals __hadd.
    return (lo + hi).half()


def _mul1_values(x: torch.Tensor) -> torch.Tensor:
    bytesum = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + ((x >> 24) & 0xFF)
    # __hfma(1024 + bs, fp16(0x1EEE), fp16(0xC931)): the numerator is an integer below 2^20, exact in fp32.
    numerator = (1024 + bytesum) * 1774 - 2721792
    return (numerator.float() * 2.0**-18).half()


@lru_cache(maxsize=None)
def codebook_table(codebook: Codebook, device: torch.device | str = "cpu") -> torch.Tensor:
    """fp16 value of every 16-bit state, shape (65536,), cached per device (never copied per call)."""
    if torch.device(device) != torch.device("cpu"):
        return codebook_table(codebook).to(device)
    state = torch.arange(65536, dtype=torch.int64)
    if codebook is Codebook.INST3:
        return _lop3_halves((state * INST3_MULTIPLIER + INST3_ADDEND) & _MASK32)
    if codebook is Codebook.MCG:
        return _lop3_halves((state * MCG_MULTIPLIER) & _MASK32)
    return _mul1_values((state * MUL1_MULTIPLIER) & _MASK32)


def codebook_values(codebook: Codebook, states: torch.Tensor) -> torch.Tensor:
    """Decode integer states (any shape, any device) to fp16."""
    table = codebook_table(codebook, states.device)
    return table[states.long()]
