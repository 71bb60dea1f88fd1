"""The glue every trellis-reading backend shares: the rotated-basis form around one matmul launcher.

A backend (Triton on a GPU, the compiled CPU kernel) supplies only `launch(a, row_ids, block_matrix, table,
out)`: out[row] = a[row] @ W_hat[matrix of row's block], decoding the trellis in place. A backend that sets
`write_through` also takes `launch(..., out, fill)`: `fill` is int64 (matrices,), 0 = nothing, else an address
with the trellis's layout where every word of that matrix's trellis the launch reads is also stored, once per
launch; that is how an expert read from the host tier lands in its GPU cache slot for free (expert_slots.py).
Everything else is here, once: the Hadamard rotations with suh/svh (exl3-format.md §2.1), which rows each block
takes, the MoE's gathers, activation, TP crop, router weights and per-token sum, and the dense linear's shards.

Routed experts: gate, up and down are three launches per batch, each reading every trellis through the
layer's pointer tables (VRAM and host-arena addresses in the same launch). With an expert cache, one forward is:
the cache's step (which experts get which slots), the three launches reading through the old tables and writing
the fills, then the tables switch to the new assignment (a fill never targets a slot read in the same step:
the policy never evicts an expert the step reads). The glue is made of device ops
whose shapes depend on the batch shape alone: no host synchronisation, so vLLM can capture the forward in a
CUDA graph. The per-token sum runs over the slots in their fixed order, so results are deterministic.

Dense linears: each of the layer's shards through the launcher, cropped and concatenated. (What torch.compile
sees of either is one opaque op per layer: kernels/ops.py.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import InvalidValueError
from ..exl3.hadamard import hadamard_last
from ..exl3.naming import PROJECTIONS
from ..memory.arena import HostArena
from ..offload.tiers import PlacedExpert
from .activation import silu_and_mul
from .contract import ExpertCrop, LinearLayer, MoELayer
from .expert_blocks import grouped_blocks, per_row_blocks, single_matrix_blocks
from .expert_slots import ExpertSlots
from .linear import LinearShard
from .matrix_table import MatrixTable, matrix_table, own_addresses
from .pointer_tables import PointerTables, ScaleStacks


@dataclass(frozen=True)
class MatmulBackend:
    name: str
    launch: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, MatrixTable, torch.Tensor], None]
    block_m: int  # rows per block
    per_slot_max_tokens: int  # up to this many tokens each MoE slot gets its own block (decode); above, grouped
    dot_dtype: Callable[[torch.dtype], torch.dtype]  # activation dtype -> what the launcher multiplies in
    write_through: bool = False  # launch takes a sixth argument, the fill table (module docstring)


def exl3_matmul(
    x: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, row_ids: torch.Tensor, block_matrix: torch.Tensor,
    table: MatrixTable, backend: MatmulBackend, activation_dtype: torch.dtype, fill: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ W for the matrix of each row's block, in fp32: had(x ⊙ suh) through the launcher, then
    had(·) ⊙ svh. x: (rows, in_features); suh/svh: one row per x row, or one for all. The input is rounded to
    the backend's dot dtype after its rotation, as exllamav3's kernels round it to fp16. `fill`: the
    write-through table (module docstring), for a backend that takes one."""
    rotated = hadamard_last(x.float() * suh.float()).to(backend.dot_dtype(activation_dtype))
    acc = torch.zeros(x.shape[0], table.out_features, dtype=torch.float32, device=x.device)
    backend.launch(rotated, row_ids, block_matrix, table, acc, *(() if fill is None else (fill,)))
    return hadamard_last(acc) * svh.float()


class RotatedMoE:
    def __init__(
        self,
        experts: Sequence[PlacedExpert],
        tables: PointerTables,
        scales: ScaleStacks,
        arena: HostArena | None,
        crop: ExpertCrop,
        device: torch.device,
        backend: MatmulBackend,
        swiglu_limit: float | None = None,
        cache: ExpertSlots | None = None,
    ) -> None:
        if cache is not None and not backend.write_through:
            raise InvalidValueError(f"the {backend.name} launcher cannot write an expert through into a cache slot")
        self.backend = backend
        self.cache = cache
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

    def _project(self, projection: str, x: torch.Tensor, ids: torch.Tensor, blocks, dtype,
                 fills: dict[str, torch.Tensor]) -> torch.Tensor:
        suh = self.scales[(projection, "suh")][ids]
        svh = self.scales[(projection, "svh")][ids]
        return exl3_matmul(x, suh, svh, *blocks, self.tables[projection], self.backend, dtype, fills.get(projection))

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, apply_router_weight_on_input: bool
    ) -> torch.Tensor:
        """Router-weighted sum over this rank's slice of the routed experts; topk_ids are local ids."""
        tokens, top_k = topk_ids.shape
        ids = topk_ids.reshape(-1)
        route = topk_weights.reshape(-1, 1).float()
        padded = self.tables["gate"].in_features
        slots = F.pad(x.float(), (0, padded - x.shape[1])).repeat_interleave(top_k, dim=0)
        if apply_router_weight_on_input:
            slots = slots * route
        if tokens <= self.backend.per_slot_max_tokens:
            blocks = per_row_blocks(ids, self.backend.block_m)
        else:
            blocks = grouped_blocks(ids, self.num_experts, self.backend.block_m)
        fills = {} if self.cache is None else self.cache.begin(topk_ids)  # decide, then read with the old tables
        gate = self._project("gate", slots, ids, blocks, x.dtype, fills)
        up = self._project("up", slots, ids, blocks, x.dtype, fills)
        act = silu_and_mul(gate, up, self.swiglu_limit) * self.keep_channels
        down = self._project("down", act, ids, blocks, x.dtype, fills)[:, : self.hidden]
        if self.cache is not None:
            self.cache.finish()  # every launch of this forward is queued: the tables switch now
        if not apply_router_weight_on_input:
            down = down * route
        return down.reshape(tokens, top_k, self.hidden).sum(dim=1).to(x.dtype)


class RotatedLinear:
    """Dense shards through a launcher (`backend`), or through a subclass's own `shard_product` (backend None)."""

    def __init__(self, shards: Sequence[LinearShard], device: torch.device, backend: MatmulBackend | None) -> None:
        self.backend = backend
        self.shards = [shard.to(device) for shard in shards]
        self.tables = [matrix_table([s.layer], own_addresses([s.layer]), device) for s in self.shards]
        self.out_features = sum(s.out_rows for s in self.shards)

    def shard_product(self, cover: torch.Tensor, shard: LinearShard, table: MatrixTable) -> torch.Tensor:
        """cover @ W of one shard, in fp32 (the part a backend with its own dense kernel replaces)."""
        blocks = single_matrix_blocks(cover.shape[0], self.backend.block_m, cover.device)
        return exl3_matmul(cover, shard.layer.suh, shard.layer.svh, *blocks, table, self.backend, cover.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W of every shard, concatenated, without bias."""
        rows = x.reshape(-1, x.shape[-1])
        outputs = []
        for shard, table in zip(self.shards, self.tables):
            cover = F.pad(rows, (shard.in_offset, table.in_features - shard.in_offset - shard.in_size))
            y = self.shard_product(cover, shard, table)[:, shard.out_offset : shard.out_offset + shard.out_valid]
            outputs.append(F.pad(y, (0, shard.out_rows - shard.out_valid)))
        return torch.cat(outputs, dim=-1).to(x.dtype).reshape(*x.shape[:-1], -1)


def rotated_moe(layer: MoELayer, backend: MatmulBackend) -> RotatedMoE:
    return RotatedMoE(layer.experts, layer.tables, layer.scales, layer.arena, layer.crop, layer.device, backend,
                      layer.swiglu_limit, layer.cache)


def rotated_linear(layer: LinearLayer, backend: MatmulBackend) -> RotatedLinear:
    return RotatedLinear(layer.shards, layer.device, backend)
