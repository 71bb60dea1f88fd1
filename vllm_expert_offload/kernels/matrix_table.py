"""The per-matrix facts a compiled EXL3 kernel needs, as device tensors: trellis address, K, codebook.

Built once at load for every set of matrices one launch may read (one MoE projection's experts, or one
dense linear), so a forward pass never builds a tensor from Python values: that would be a host-to-device
copy inside a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import InvalidValueError
from ..exl3.codebook import Codebook
from ..exl3.tensors import Exl3Linear

CODEBOOK_IDS = {Codebook.INST3: 0, Codebook.MCG: 1, Codebook.MUL1: 2}
CODEBOOK_IDS_BY_NAME = {codebook.value: cid for codebook, cid in CODEBOOK_IDS.items()}  # "3inst", "mcg", "mul1"
MIXED_CODEBOOKS = -1
MIXED_RATES = 0


@dataclass(frozen=True)
class MatrixTable:
    trellis: torch.Tensor  # int64 (matrices,): address of each trellis, as the kernel dereferences it
    twice_k: torch.Tensor  # int32 (matrices,): 2K, so 1.5/2.5/3.5 bits stay integers
    codebook: torch.Tensor  # int32 (matrices,): CODEBOOK_IDS
    uniform_codebook: int  # the common codebook id, or MIXED_CODEBOOKS (the kernel then reads `codebook`)
    in_features: int  # padded, common to every matrix
    out_features: int
    uniform_twice_k: int = MIXED_RATES  # the common 2K, or MIXED_RATES (the kernel then reads `twice_k`)


def matrix_table(
    layers: Sequence[Exl3Linear], trellis_addresses: torch.Tensor | Sequence[int], device: torch.device | str
) -> MatrixTable:
    """Table over `layers` (same padded shape; K and codebook may differ) whose trellises the kernel reads at
    `trellis_addresses` (an int64 pointer table already on `device`, or addresses to build one from)."""
    shapes = {(layer.in_features, layer.out_features) for layer in layers}
    if len(shapes) != 1:
        names = [layer.name for layer in layers[:3]]
        raise InvalidValueError(f"one launch reads matrices of one shape; {names}... have shapes {sorted(shapes)}")
    (in_features, out_features), = shapes
    strided = [layer.name for layer in layers if not layer.trellis.is_contiguous()]
    if strided:
        raise InvalidValueError(f"{strided[0]}.trellis is a strided view; kernels read tiles as one dense grid")
    ids = [CODEBOOK_IDS[layer.codebook] for layer in layers]
    twice_k = [int(2 * layer.k) for layer in layers]
    return MatrixTable(
        trellis=torch.as_tensor(trellis_addresses, dtype=torch.int64, device=device),
        twice_k=torch.tensor(twice_k, dtype=torch.int32, device=device),
        codebook=torch.tensor(ids, dtype=torch.int32, device=device),
        uniform_codebook=ids[0] if len(set(ids)) == 1 else MIXED_CODEBOOKS,
        in_features=in_features,
        out_features=out_features,
        uniform_twice_k=twice_k[0] if len(set(twice_k)) == 1 else MIXED_RATES,
    )


def own_addresses(layers: Sequence[Exl3Linear]) -> list[int]:
    """Each trellis's own data_ptr: for tensors already where the kernel runs (VRAM, or the CPU interpreter)."""
    return [layer.trellis.data_ptr() for layer in layers]
