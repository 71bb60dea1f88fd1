"""The one contract every EXL3 backend implements, and the layer descriptions it is built from.

A backend is one module that exports `BACKEND`, a `Backend` record: whether it can run on a device (and why
not), whether it refuses a particular layer (and why), and how it builds the kernel object of a MoE layer or a
dense linear. `kernels/oracle.py` walks the registry in priority order and is the only code that decides; layer
code (integration/methods) only describes the layer and calls the kernel it is handed.

Kernels compute; they never register ops, read vLLM state or Python flags of their own: the layer's forward is
one opaque op (kernels/ops.py) whose target calls `forward`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..memory.arena import HostArena
from ..offload.tiers import PlacedExpert
from .expert_slots import ExpertSlots
from .linear import LinearShard
from .pointer_tables import PointerTables, ScaleStacks


@dataclass(frozen=True)
class ExpertCrop:
    """Where this rank's intermediate channels sit inside each placed (128-aligned) projection."""

    hidden: int  # output width of the layer (unpadded hidden size)
    intermediate: int  # this rank's intermediate channels
    offset: int  # first of them inside the 128-aligned cover


@dataclass(frozen=True)
class MoELayer:
    """One MoE layer's routed experts as placed: what a backend builds its kernel from."""

    experts: Sequence[PlacedExpert]  # local experts, in local id order
    tables: PointerTables
    scales: ScaleStacks
    arena: HostArena | None
    crop: ExpertCrop
    dtype: torch.dtype  # the model's activation dtype
    device: torch.device
    swiglu_limit: float | None = None  # DeepSeek-V4: gate <= limit, |up| <= limit before SiLU
    top_k: int = 1  # experts per token (kernels size their decode grid and workspaces with it)
    capture_rows: tuple[int, ...] = ()  # batch sizes vLLM captures CUDA graphs for (workspaces reserved at build)
    cache: ExpertSlots | None = None  # the GPU tier as an expert cache (only for a backend that writes through)

    @property
    def name(self) -> str:
        return self.experts[0].projections["gate"].name


@dataclass(frozen=True)
class LinearLayer:
    """One vLLM linear's output shards on this rank."""

    shards: Sequence[LinearShard]
    dtype: torch.dtype
    device: torch.device
    capture_rows: tuple[int, ...] = ()  # batch sizes vLLM captures CUDA graphs for (kernels that tune per shape)

    @property
    def name(self) -> str:
        return self.shards[0].layer.name


class MoEKernel(Protocol):
    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, apply_router_weight_on_input: bool
    ) -> torch.Tensor:
        """Router-weighted sum over this rank's routed experts; topk_ids are local ids; (tokens, crop.hidden).

        An id of -1 marks a slot that is not this rank's (expert parallelism: another rank's expert) or not this
        kernel's: whatever its router weight, it contributes exactly zero, no expert's weights are read for it,
        it takes no expert's rows, and it is counted as no expert's read (the tier counters and the expert cache's
        policy skip it too). vLLM's own fused MoE kernels keep -1 the same way. Every backend honours it; layer
        code passes -1 through rather than mapping it to a real expert."""
        ...


class LinearKernel(Protocol):
    out_features: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W of every shard, concatenated (..., out_features), without bias."""
        ...


def refuses_nothing(layer: object) -> str | None:
    return None


@dataclass(frozen=True)
class Backend:
    name: str  # what expert_offload.kernel calls it
    description: str  # for the startup log: "the compiled CPU kernel"
    auto_on: tuple[str, ...]  # device types on which "auto" considers it
    graph_safe: bool  # its forwards make no host synchronisation (CUDA-graph capture can record them)
    unavailable: Callable[[torch.device], str | None]  # None when it can run on the device, else why not
    build_moe: Callable[[MoELayer], MoEKernel]
    build_linear: Callable[[LinearLayer], LinearKernel]
    moe_refusal: Callable[[MoELayer], str | None] = refuses_nothing  # None, or why it cannot compute that layer
    linear_refusal: Callable[[LinearLayer], str | None] = refuses_nothing
    # Its MoE kernels store a host-tier expert into its cache slot as they read it (the dynamic GPU tier,
    # kernels/expert_slots.py); a backend without it serves the static plan.
    write_through: bool = False

    @property
    def refuses_layers(self) -> bool:
        return self.moe_refusal is not refuses_nothing or self.linear_refusal is not refuses_nothing
