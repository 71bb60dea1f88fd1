"""Dense EXL3 linears: one vLLM layer's output shards on this rank, computed by one backend.

A vLLM linear may fuse several checkpoint tensor sets (q/k/v, gate/up); each is a `LinearShard`: the
128-aligned cover of this rank's slice (EXL3 cannot be cut inside a Hadamard block) and where the rank's
part sits in it. Backends:
- `DequantizedLinear` decodes every shard once at load and runs a plain matmul (the CPU path, and the
  explicit `dequantize_linears` opt-in on a GPU, at about 5x the quantized size in memory);
- `RotatedLinear` (rotated.py) reads the trellis in place on every call (Triton or the CPU kernel) and keeps
  nothing decoded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ..exl3.decode import dequantize
from ..exl3.tensors import Exl3Linear


@dataclass(frozen=True)
class LinearShard:
    layer: Exl3Linear  # the covered tensor set on the layer's device
    out_offset: int  # first output of this rank's part inside the cover
    out_valid: int  # outputs that are real
    out_rows: int  # outputs vLLM expects for this shard (real + zero padding, e.g. a padded vocabulary)
    in_offset: int  # first input of this rank's part inside the cover
    in_size: int  # inputs this rank receives

    def to(self, device: torch.device) -> "LinearShard":
        """On `device`, with a contiguous trellis: a TP slice of the output dim is a strided view, and kernels
        address tiles as one dense (in/16, out/16) grid."""
        layer = self.layer
        moved = replace(layer, trellis=layer.trellis.to(device).contiguous(), suh=layer.suh.to(device),
                        svh=layer.svh.to(device))
        return replace(self, layer=moved)


class DequantizedLinear:
    def __init__(self, shards: Sequence[LinearShard], dtype: torch.dtype, device: torch.device) -> None:
        weights = []
        for s in shards:
            w = dequantize(s.layer, torch.float32)
            w = w[s.out_offset : s.out_offset + s.out_valid, s.in_offset : s.in_offset + s.in_size]
            weights.append(F.pad(w, (0, 0, 0, s.out_rows - s.out_valid)))
        self.weight = torch.cat(weights).to(device, dtype)
        self.out_features = self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

