"""Reference MoE kernel over per-expert pointer tables (any device torch runs on).

It reads every trellis through its table entry, exactly as exllamav3's expert kernels do on a GPU. It is what
every backend is tested against, and what the oracle falls back to where no compiled kernel can run (oracle.py; on
a CPU the compiled kernel, cpu_exl3.py, is the serving path). The tiers keep their meaning: GPU-tier experts are read
through the table once at load and kept decoded (fast memory), host-tier experts are read through the
table and decoded on every use, just as on a GPU each use costs a PCIe read. On CUDA nothing is kept
decoded: that would hold dense weights in exactly the memory placement is meant to free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch
import torch.nn.functional as F

from ..exl3.decode import dequantize
from ..exl3.tensors import Exl3Linear
from ..memory.arena import HostArena
from ..offload.tiers import PlacedExpert
from .activation import silu_and_mul
from .contract import Backend, ExpertCrop, LinearLayer, MoELayer
from .linear import DequantizedLinear
from .pointer_tables import PointerTables, gpu_tier_registry, read_trellis


class TableMoE:
    def __init__(
        self,
        experts: Sequence[PlacedExpert],
        tables: PointerTables,
        arena: HostArena | None,
        crop: ExpertCrop,
        dtype: torch.dtype,
        device: torch.device,
        swiglu_limit: float | None = None,
    ) -> None:
        self.experts = list(experts)
        self.tables = tables
        self.arena = arena
        self.registry = gpu_tier_registry(self.experts)
        self.crop = crop
        self.dtype = dtype
        self.swiglu_limit = swiglu_limit
        self.resident = {
            e: self._weights(e, device)
            for e in range(len(self.experts))
            if device.type == "cpu" and bool(self.tables.in_gpu_tier[e])
        }

    def _linear(self, expert: int, projection: str, device: torch.device) -> Exl3Linear:
        """The expert's projection with its trellis read through the table, on `device` (for a host-tier
        expert on CUDA this is the PCIe read; suh/svh already live there)."""
        placed = self.experts[expert].projections[projection]
        address = int(self.tables.table(projection, "trellis")[expert])
        source: HostArena | Mapping[int, torch.Tensor] = (
            self.registry if bool(self.tables.in_gpu_tier[expert]) else self.arena
        )
        return replace(placed, trellis=read_trellis(address, placed.trellis.shape, source).to(device))

    def _weights(self, expert: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.crop
        rows = slice(c.offset, c.offset + c.intermediate)
        gate = dequantize(self._linear(expert, "gate", device))[rows, : c.hidden]
        up = dequantize(self._linear(expert, "up", device))[rows, : c.hidden]
        down = dequantize(self._linear(expert, "down", device))[: c.hidden, rows]
        w13 = torch.cat((gate, up)).to(device, self.dtype)
        return w13, down.to(device, self.dtype)

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, apply_router_weight_on_input: bool
    ) -> torch.Tensor:
        """Router-weighted sum over this rank's slice of the routed experts; topk_ids are local ids, -1 for a slot
        that is not this rank's (it adds nothing and no expert is read for it)."""
        out = torch.zeros_like(x)
        weights = topk_weights.to(x.dtype)
        for expert in torch.unique(topk_ids).tolist():
            if expert < 0:  # not this rank's: `self.experts[-1]` would read the last expert
                continue
            tokens, slots = torch.nonzero(topk_ids == expert, as_tuple=True)
            w13, w2 = self.resident[expert] if expert in self.resident else self._weights(expert, x.device)
            route = weights[tokens, slots, None]
            xe = x[tokens] * route if apply_router_weight_on_input else x[tokens]
            gate, up = F.linear(xe, w13).chunk(2, dim=-1)
            ye = F.linear(silu_and_mul(gate, up, self.swiglu_limit), w2)
            out.index_add_(0, tokens, ye if apply_router_weight_on_input else ye * route)
        return out


def _table_moe(layer: MoELayer) -> TableMoE:
    return TableMoE(layer.experts, layer.tables, layer.arena, layer.crop, layer.dtype, layer.device, layer.swiglu_limit)


def _dequantized(layer: LinearLayer) -> DequantizedLinear:
    return DequantizedLinear(layer.shards, layer.dtype, layer.device)


BACKEND = Backend(
    name="torch", description="the torch reference", auto_on=("cpu", "cuda"), graph_safe=False,
    unavailable=lambda device: None, build_moe=_table_moe, build_linear=_dequantized,
)
