"""The expert MLP's gated activation, shared by every backend so they cannot drift apart."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor, swiglu_limit: float | None = None) -> torch.Tensor:
    """SiLU(gate) · up; with `swiglu_limit` (DeepSeek-V4) gate is clamped from above and up to ±limit first,
    as vLLM's SiluAndMulWithClamp does."""
    if swiglu_limit is not None:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(-swiglu_limit, swiglu_limit)
    return F.silu(gate) * up
