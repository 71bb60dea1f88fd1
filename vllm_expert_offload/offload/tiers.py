"""The two tiers an expert can be placed in: GPU memory, or a record in the pinned host arena.

Placing copies one expert's tensor sets straight into its tier the moment the checkpoint has delivered them, so
neither GPU nor host ever holds the whole checkpoint: trellises into an arena record (host tier) or onto the
device (GPU tier); the tiny suh/svh scales onto the device either way. An arena record's size is computed here
too, so the arena can be sized exactly from header-only shapes before anything is loaded (rank_plan.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from ..errors import InvalidValueError
from ..exl3.tensors import Exl3Linear
from ..memory.arena import HostArena, align_up


@dataclass(frozen=True)
class PlacedExpert:
    """One routed expert's projections (gate/up/down) after placement into its tier."""

    projections: Mapping[str, Exl3Linear]
    in_gpu_tier: bool


def record_layout(linear_sets: Mapping[str, Exl3Linear]) -> tuple[dict[str, int], int]:
    """Offset of each projection's trellis inside one expert's host record (each page-aligned), and its size; a
    GPU expert-cache slot (kernels/expert_slots.py) has the same layout, so a slot costs what a record does."""
    offsets, size = {}, 0
    for projection, layer in linear_sets.items():
        offsets[projection] = size
        size += align_up(layer.trellis.numel() * layer.trellis.element_size())
    return offsets, size


def host_record_bytes(linear_sets: Mapping[str, Exl3Linear]) -> int:
    """Arena bytes one host-tier expert takes; an arena sized to the sum over its experts fits them exactly."""
    return record_layout(linear_sets)[1]


def _copy_to(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    # copy=True even when already on `device`: a placed tensor must never alias the checkpoint's buffers.
    return None if tensor is None else tensor.to(device, copy=True)


def place_expert(
    linear_sets: Mapping[str, Exl3Linear],
    in_gpu_tier: bool,
    arena: HostArena | None,
    device: torch.device | str,
) -> PlacedExpert:
    """Copy one expert straight into its tier: trellises into an arena record (host tier) or onto `device`;
    suh/svh/bias onto `device` either way. Host-tier trellises never pass through GPU memory."""
    device = torch.device(device)
    if in_gpu_tier:
        trellises = {p: _copy_to(layer.trellis, device) for p, layer in linear_sets.items()}
    else:
        if arena is None:
            raise InvalidValueError("a host-tier expert needs a host arena to be placed into")
        offsets, size = record_layout(linear_sets)
        record = arena.reserve(size)
        trellises = {}
        for projection, layer in linear_sets.items():
            view = arena.view(record + offsets[projection], layer.trellis.shape, layer.trellis.dtype)
            trellises[projection] = view.copy_(layer.trellis)
    placed = {
        p: replace(
            layer,
            trellis=trellises[p],
            suh=_copy_to(layer.suh, device),
            svh=_copy_to(layer.svh, device),
            bias=_copy_to(layer.bias, device),
        )
        for p, layer in linear_sets.items()
    }
    return PlacedExpert(placed, in_gpu_tier)
