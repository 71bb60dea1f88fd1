"""CPU kernels: decode each EXL3 linear once at load, then run dense torch matmuls.

The CPU build of vLLM has no EXL3 kernel, and decoding a trellis on every forward costs far more
than the matmul it feeds; on a CPU the dense copy is the fast path. The decode itself is the
reference decoder, so results are exactly those of the format definition.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..exl3.decode import dequantize
from ..exl3.tensors import Exl3Linear


def dense_weight(layer: Exl3Linear, out_features: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """(out_features, in_features) weight, cropped from the 128-padded storage to the layer's logical size."""
    return dequantize(layer, torch.float32)[:out_features, :in_features].to(dtype).contiguous()


def moe_forward(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    apply_router_weight_on_input: bool = False,
) -> torch.Tensor:
    """Router-weighted sum of SiLU-gated expert MLPs for this rank's slice (not all-reduced).

    w13: (experts, 2*I, H) with gate rows first; w2: (experts, H, I); topk_ids are local expert ids.
    """
    out = torch.zeros_like(x)
    weights = topk_weights.to(x.dtype)
    for expert in torch.unique(topk_ids).tolist():
        tokens, slots = torch.nonzero(topk_ids == expert, as_tuple=True)
        route_w = weights[tokens, slots, None]
        xe = x[tokens] * route_w if apply_router_weight_on_input else x[tokens]
        gate, up = F.linear(xe, w13[expert]).chunk(2, dim=-1)
        ye = F.linear(F.silu(gate) * up, w2[expert])
        out.index_add_(0, tokens, ye if apply_router_weight_on_input else ye * route_w)
    return out
