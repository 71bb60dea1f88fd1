"""Routed experts on the Triton EXL3 kernel: gate, up and down are three launches per batch, each reading
every trellis through the layer's pointer tables (VRAM and host-arena addresses in the same launch).

The glue around the launches (gathers, Hadamard rotations, activation, router weights, the sum over a
token's slots) is made of device ops whose shapes depend on the batch shape alone: no host
synchronisation, so vLLM can capture the forward in a CUDA graph. The per-token sum runs over the slots in
their fixed order, so results are deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..exl3.naming import PROJECTIONS
from .activation import silu_and_mul
from .expert_blocks import grouped_blocks, per_row_blocks
from ..memory.arena import HostArena
from .matrix_table import dot_dtype_for, matrix_table
from .pointer_tables import PlacedExpert, PointerTables, ScaleStacks
from .table_moe import ExpertCrop
from .triton_exl3 import BLOCK_M, exl3_matmul

DECODE_MAX_TOKENS = 8  # up to here each (token, expert) slot gets its own program; above, slots group by expert


class TritonMoE:
    def __init__(
        self,
        experts: Sequence[PlacedExpert],
        tables: PointerTables,
        scales: ScaleStacks,
        arena: HostArena | None,
        crop: ExpertCrop,
        device: torch.device,
        swiglu_limit: float | None = None,
    ) -> None:
        # The tables hold only raw addresses: own what they point to (GPU-tier tensors, the host arena).
        self.experts = list(experts)
        self.arena = arena
        self.tables = {
            p: matrix_table([e.projections[p] for e in experts], tables.table(p, "trellis"), device) for p in PROJECTIONS
        }
        self.scales = scales
        self.num_experts = len(experts)
        self.hidden = crop.hidden
        self.swiglu_limit = swiglu_limit
        # This rank's intermediate channels inside the 128-aligned cover the projections were sliced to.
        keep = torch.zeros(self.tables["gate"].out_features, device=device)
        keep[crop.offset : crop.offset + crop.intermediate] = 1.0
        self.keep_channels = keep

    def _project(self, projection: str, x: torch.Tensor, ids: torch.Tensor, blocks, dot_dtype) -> torch.Tensor:
        suh = self.scales[(projection, "suh")][ids]
        svh = self.scales[(projection, "svh")][ids]
        return exl3_matmul(x, suh, svh, *blocks, self.tables[projection], dot_dtype)

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, apply_router_weight_on_input: bool
    ) -> torch.Tensor:
        """Router-weighted sum over this rank's slice of the routed experts; topk_ids are local ids."""
        tokens, top_k = topk_ids.shape
        ids = topk_ids.reshape(-1)
        route = topk_weights.reshape(-1, 1).float()
        padded = self.tables["gate"].in_features
        slots = torch.nn.functional.pad(x.float(), (0, padded - x.shape[1])).repeat_interleave(top_k, dim=0)
        if apply_router_weight_on_input:
            slots = slots * route
        if tokens <= DECODE_MAX_TOKENS:
            blocks = per_row_blocks(ids, BLOCK_M)
        else:
            blocks = grouped_blocks(ids, self.num_experts, BLOCK_M)
        dot = dot_dtype_for(x.dtype)
        gate = self._project("gate", slots, ids, blocks, dot)
        up = self._project("up", slots, ids, blocks, dot)
        act = silu_and_mul(gate, up, self.swiglu_limit) * self.keep_channels
        down = self._project("down", act, ids, blocks, dot)[:, : self.hidden]
        if not apply_router_weight_on_input:
            down = down * route
        return down.reshape(tokens, top_k, self.hidden).sum(dim=1).to(x.dtype)
