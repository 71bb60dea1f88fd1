"""Dense linears: decode each EXL3 linear once at load, then run plain torch matmuls.

The CPU build of vLLM has no EXL3 kernel, and decoding a trellis on every forward costs far more
than the matmul it feeds; on a CPU the dense copy is the fast path. The decode itself is the
reference decoder, so results are exactly those of the format definition.
"""

from __future__ import annotations

import torch

from ..exl3.decode import dequantize
from ..exl3.tensors import Exl3Linear


def dense_weight(layer: Exl3Linear, out_features: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """(out_features, in_features) weight, cropped from the 128-padded storage to the layer's logical size."""
    return dequantize(layer, torch.float32)[:out_features, :in_features].to(dtype).contiguous()
