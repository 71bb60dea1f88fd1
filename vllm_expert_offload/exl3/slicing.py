"""Tensor-parallel slices of an EXL3 linear, always on 128-element boundaries (exl3-format.md §1.3).

Each 128-block of the Hadamard mixes every channel inside the block, so a slice that cuts through a
block is not separable: such a split is refused instead of silently computing the wrong thing.
"""

from __future__ import annotations

from dataclasses import replace

from .errors import Exl3FormatError
from .hadamard import HADAMARD_BLOCK
from .tensors import Exl3Linear


def _check_bounds(layer: Exl3Linear, dim: str, start: int, end: int, size: int) -> None:
    if start % HADAMARD_BLOCK or end % HADAMARD_BLOCK or not 0 <= start < end <= size:
        raise Exl3FormatError(
            f"{layer.name}.trellis: tensor-parallel slice [{start}, {end}) of {dim}_features {size} is not aligned "
            f"to {HADAMARD_BLOCK}; EXL3 can only be split on {HADAMARD_BLOCK}-element Hadamard blocks "
            f"(choose a tensor-parallel size that divides {dim}_features into multiples of {HADAMARD_BLOCK})"
        )


def slice_output(layer: Exl3Linear, start: int, end: int) -> Exl3Linear:
    """Columns [start, end) of W: trellis dim 1, svh and bias; suh stays whole (column-parallel)."""
    _check_bounds(layer, "out", start, end, layer.out_features)
    return replace(
        layer,
        trellis=layer.trellis[:, start // 16 : end // 16],
        svh=layer.svh[start:end],
        bias=None if layer.bias is None else layer.bias[start:end],
    )


def slice_input(layer: Exl3Linear, start: int, end: int, keep_bias: bool) -> Exl3Linear:
    """Rows [start, end) of W: trellis dim 0 and suh; svh stays whole (row-parallel).

    The bias is added once after the all-reduce, so only one rank keeps it.
    """
    _check_bounds(layer, "in", start, end, layer.in_features)
    return replace(
        layer,
        trellis=layer.trellis[start // 16 : end // 16],
        suh=layer.suh[start:end],
        bias=layer.bias if keep_bias else None,
    )


def aligned_cover(start: int, end: int, size: int) -> tuple[int, int]:
    """The smallest 128-aligned range holding [start, end); a rank whose share cuts through a Hadamard
    block keeps the whole block and crops (outputs) or zero-fills (inputs) the rest, which is exact."""
    lo = start // HADAMARD_BLOCK * HADAMARD_BLOCK
    hi = min(-(-end // HADAMARD_BLOCK) * HADAMARD_BLOCK, size)
    return lo, hi


def cover_output(layer: Exl3Linear, start: int, end: int) -> tuple[Exl3Linear, int]:
    """Output columns [start, end) kept inside their 128-aligned cover: (sliced set, offset of `start` in it)."""
    lo, hi = aligned_cover(start, end, layer.out_features)
    return slice_output(layer, lo, hi), start - lo


def cover_input(layer: Exl3Linear, start: int, end: int, keep_bias: bool) -> tuple[Exl3Linear, int]:
    """Input rows [start, end) kept inside their 128-aligned cover: (sliced set, offset of `start` in it)."""
    lo, hi = aligned_cover(start, end, layer.in_features)
    return slice_input(layer, lo, hi, keep_bias), start - lo


def partition(size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """This rank's [start, end) of an evenly split dimension."""
    if size % tp_size:
        raise Exl3FormatError(f"dimension {size} does not split evenly over tensor-parallel size {tp_size}")
    per_rank = size // tp_size
    return tp_rank * per_rank, (tp_rank + 1) * per_rank
