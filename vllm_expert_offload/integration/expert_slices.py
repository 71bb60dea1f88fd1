"""This rank's share of one routed expert: gate/up split on their outputs, down on its input.

Shared by planning (on header-only meta tensors, to size the host arena before loading) and by
placement (on the real tensors), so the bytes planned are exactly the bytes placed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..exl3.slicing import aligned_cover, slice_input, slice_output
from ..exl3.tensors import Exl3Linear, parse_linear


@dataclass(frozen=True)
class ExpertGeometry:
    hidden: int  # unpadded
    intermediate: int  # unpadded, whole expert
    intermediate_per_rank: int
    tp_rank: int
    tp_size: int

    @property
    def rank_start(self) -> int:
        return self.tp_rank * self.intermediate_per_rank

    def shape(self, projection: str) -> tuple[int, int]:
        """(in_features, out_features) of the whole, unpadded projection."""
        return (self.intermediate, self.hidden) if projection == "down" else (self.hidden, self.intermediate)

    def rank_slice(self, tensors: dict, name: str, projection: str) -> tuple[Exl3Linear, int]:
        """Validated, sliced tensor set and the offset of this rank's first intermediate channel inside it.

        A share that cuts through a 128-block keeps the whole block (aligned_cover); the kernel crops."""
        lin = parse_linear(tensors, name, *self.shape(projection))
        start, end = self.rank_start, self.rank_start + self.intermediate_per_rank
        if projection == "down":
            lo, hi = aligned_cover(start, end, lin.in_features)
            return slice_input(lin, lo, hi, keep_bias=self.tp_rank == 0), start - lo
        lo, hi = aligned_cover(start, end, lin.out_features)
        return slice_output(lin, lo, hi), start - lo
