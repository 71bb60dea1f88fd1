"""The 128-block Hadamard rotation EXL3 applies on both sides of every weight (exl3-format.md §2.1)."""

from __future__ import annotations

from functools import lru_cache

import torch

HADAMARD_BLOCK = 128
HADAMARD_SCALE = 0.088388347648  # 1/sqrt(128), the constant the kernels multiply by


@lru_cache(maxsize=None)
def hadamard_128(dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """Natural-order Sylvester matrix H[i][j] = (-1)^popcount(i & j) / sqrt(128); symmetric and orthonormal.

    Cached per device: a forward pass must not copy it host-to-device each call (a CUDA graph cannot)."""
    if torch.device(device) != torch.device("cpu"):
        return hadamard_128(dtype).to(device)
    i = torch.arange(HADAMARD_BLOCK)
    and_bits = i[:, None] & i[None, :]
    parity = torch.zeros_like(and_bits)
    for bit in range(7):
        parity ^= (and_bits >> bit) & 1
    return ((1 - 2 * parity).to(torch.float64) / HADAMARD_BLOCK**0.5).to(dtype)


def hadamard_rows(x: torch.Tensor) -> torch.Tensor:
    """Blockwise H @ x along dim 0 (x has a multiple of 128 rows)."""
    h = hadamard_128(x.dtype, x.device)
    blocks = x.reshape(x.shape[0] // HADAMARD_BLOCK, HADAMARD_BLOCK, -1)
    return torch.matmul(h, blocks).reshape(x.shape)


def hadamard_last(x: torch.Tensor) -> torch.Tensor:
    """Blockwise x @ H along the last dim (a multiple of 128)."""
    h = hadamard_128(x.dtype, x.device)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // HADAMARD_BLOCK, HADAMARD_BLOCK)
    return torch.matmul(blocks, h).reshape(x.shape)
