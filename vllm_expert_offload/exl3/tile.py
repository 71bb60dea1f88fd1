"""Where each ring position sits inside its 16x16 tile: tensor-core fragment order (exl3-format.md §2.7)."""

from __future__ import annotations

from functools import lru_cache

import torch

from .bitrate import POSITIONS


@lru_cache(maxsize=None)
def tile_permutation(device: torch.device | str = "cpu") -> torch.Tensor:
    """perm[p] = 16*r + c: ring position p holds tile element (row r = input feature, column c = output feature).
    Cached per device, like every constant of the reference decoder."""
    if torch.device(device) != torch.device("cpu"):
        return tile_permutation().to(device)
    p = torch.arange(POSITIONS)
    t, j = p // 8, p % 8
    r = 2 * (t % 4) + (j & 1) + 8 * ((j >> 1) & 1)
    c = t // 4 + 8 * ((j >> 2) & 1)
    return r * 16 + c


@lru_cache(maxsize=None)
def tile_permutation_inverse(device: torch.device | str = "cpu") -> torch.Tensor:
    """inv[16*r + c] = p."""
    return torch.argsort(tile_permutation(device))


def positions_to_tiles(values: torch.Tensor) -> torch.Tensor:
    """(tk, tn, 256) values in ring order -> (16*tk, 16*tn) matrix, rows = input features."""
    tk, tn, _ = values.shape
    tiles = values[..., tile_permutation_inverse(values.device)].reshape(tk, tn, 16, 16)
    return tiles.permute(0, 2, 1, 3).reshape(16 * tk, 16 * tn)


def tiles_to_positions(matrix: torch.Tensor) -> torch.Tensor:
    """(16*tk, 16*tn) matrix -> (tk, tn, 256) values in ring order; inverse of positions_to_tiles."""
    k, n = matrix.shape
    tiles = matrix.reshape(k // 16, 16, n // 16, 16).permute(0, 2, 1, 3).reshape(k // 16, n // 16, 256)
    return tiles[..., tile_permutation(matrix.device)]
