"""The per-matrix facts a compiled EXL3 kernel needs, as device tensors: trellis address, K, codebook.

Built once at load for every set of matrices one launch may read (one MoE projection's experts, or one
dense linear), so a forward pass never builds a tensor from Python values: that would be a host-to-device
copy inside a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ..errors import InvalidValueError
from ..exl3.codebook import Codebook
from ..exl3.tensors import Exl3Linear

CODEBOOK_IDS = {Codebook.INST3: 0, Codebook.MCG: 1, Codebook.MUL1: 2}
CODEBOOK_IDS_BY_NAME = {codebook.value: cid for codebook, cid in CODEBOOK_IDS.items()}  # "3inst", "mcg", "mul1"


def present_key(values: Iterable[int]) -> int:
    """A launch's constexpr for a per-matrix value (2K, or a codebook id) over the matrices it may read: the common
    value (>= 0) where they share one, else minus the bit mask of the values present (bit v set for value v; at
    least two bits, so <= -3). Why: the kernels branch per matrix on a mixed table's value at run time, and each
    branch of the decode is compiled at every call site; with every rate's branch (11) a mixed-K gate/up variant
    took 2,558 s to compile for sm_90, ~50x a uniform one's. The mask lets the decode compile only the branches
    of the values the table holds (`triton_decode.decode_block`)."""
    present = sorted(set(values))
    if not present or present[0] < 0:
        raise InvalidValueError(f"a table's 2K / codebook ids must be non-negative and present, got {present}")
    if len(present) == 1:
        return present[0]
    return -sum(1 << v for v in present)


def present_values(key: int) -> tuple[int, ...]:
    """The values a `present_key` stands for, ascending."""
    if key >= 0:
        return (key,)
    return tuple(v for v in range((-key).bit_length()) if (-key) >> v & 1)


@dataclass(frozen=True)
class MatrixTable:
    trellis: torch.Tensor  # int64 (matrices,): address of each trellis, as the kernel dereferences it
    twice_k: torch.Tensor  # int32 (matrices,): 2K, so 1.5/2.5/3.5 bits stay integers
    codebook: torch.Tensor  # int32 (matrices,): CODEBOOK_IDS
    # present_key of the codebook ids: the common id, or (a mixed table) the ids present, whose branches alone the
    # kernel compiles (it then reads `codebook`)
    uniform_codebook: int
    in_features: int  # padded, common to every matrix
    out_features: int
    # present_key of the 2K values: the common 2K, or (a mixed table) the rates present, whose decode branches alone
    # the kernel compiles (it then reads `twice_k`)
    uniform_twice_k: int


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
        uniform_codebook=present_key(ids),
        in_features=in_features,
        out_features=out_features,
        uniform_twice_k=present_key(twice_k),
    )


def own_addresses(layers: Sequence[Exl3Linear]) -> list[int]:
    """Each trellis's own data_ptr: for tensors already where the kernel runs (VRAM, or the CPU interpreter)."""
    return [layer.trellis.data_ptr() for layer in layers]
