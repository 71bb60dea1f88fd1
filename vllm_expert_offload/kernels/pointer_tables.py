"""Per-layer expert pointer tables: the form in which exllamav3's MoE kernels take their weights.

Its kernels (`exl3_moe`, `exl3_moe_coop`, `exl3_mgemm`; exl3-format.md §4) read `table[e]` on the device: one
int64 raw pointer per expert for each of gate/up/down x trellis/suh/svh. Any address the GPU can load from
works, so an expert's tier is nothing but where its table entry points: VRAM for the GPU tier, the host
arena's device alias for the host tier. suh/svh are tiny next to a trellis (2*(in+out) bytes against
in*out*K/8) and read by every token, so they always stay in VRAM; only host-tier trellises live in the arena.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from ..errors import InvalidValueError
from ..exl3.codebook import Codebook
from ..exl3.naming import PROJECTIONS
from ..memory.arena import HostArena
from ..offload.tiers import PlacedExpert

PARTS = ("trellis", "suh", "svh")


def kernel_address(arena: HostArena | None, device: torch.device | str) -> Callable[[torch.Tensor], int]:
    """Tensor -> the address a kernel on `device` dereferences: the arena's device alias for arena records,
    data_ptr otherwise. A plain host tensor is refused for a CUDA kernel: it would fault on the GPU."""
    device = torch.device(device)

    def address(tensor: torch.Tensor) -> int:
        if arena is not None and arena.contains(tensor):
            return arena.device_address(arena.offset_of(tensor))
        if tensor.device.type != device.type:
            raise InvalidValueError(
                f"a {tensor.device} tensor outside the host arena has no address a {device} kernel can read"
            )
        return tensor.data_ptr()

    return address


ScaleStacks = Mapping[tuple[str, str], torch.Tensor]  # (projection, "suh"|"svh") -> (experts, features)


def stack_scales(experts: Sequence[PlacedExpert], device: torch.device | str) -> tuple[list[PlacedExpert], ScaleStacks]:
    """One (experts, features) tensor per projection and side, and the experts re-pointed at its rows.

    Kernels that gather scales by expert id read the stacks; table entries and the torch reference read the
    rows; either way each scale exists once in device memory (the per-expert copies die with the old list)."""
    stacks = {
        (p, part): torch.stack([getattr(expert.projections[p], part) for expert in experts]).to(device)
        for p in PROJECTIONS
        for part in ("suh", "svh")
    }
    restacked = [
        PlacedExpert(
            {p: replace(layer, suh=stacks[(p, "suh")][e], svh=stacks[(p, "svh")][e]) for p, layer in expert.projections.items()},
            expert.in_gpu_tier,
        )
        for e, expert in enumerate(experts)
    ]
    return restacked, stacks


@dataclass(frozen=True)
class PointerTables:
    """One MoE layer's tables; entry e of every tensor describes local expert e."""

    pointers: Mapping[tuple[str, str], torch.Tensor]  # (projection, part) -> int64 (experts,)
    k: Mapping[str, torch.Tensor]  # projection -> float32 (experts,) bits per weight
    codebooks: Mapping[str, tuple[Codebook, ...]]  # projection -> one codebook per expert
    in_gpu_tier: torch.Tensor  # bool (experts,)

    def table(self, projection: str, part: str) -> torch.Tensor:
        return self.pointers[(projection, part)]


def build_pointer_tables(
    experts: Sequence[PlacedExpert],
    addresses: Callable[[torch.Tensor], int],
    device: torch.device | str = "cpu",
) -> PointerTables:
    """Tables on `device` (where the kernel reads them). Addresses are baked in: rebuild after any re-placement."""
    for e, expert in enumerate(experts):
        missing = [p for p in PROJECTIONS if p not in expert.projections]
        if missing:
            raise InvalidValueError(
                f"expert {e} lacks projection(s) {missing}; pointer tables need {list(PROJECTIONS)}"
            )
    pointers = {
        (p, part): torch.tensor(
            [addresses(getattr(expert.projections[p], part)) for expert in experts], dtype=torch.int64, device=device
        )
        for p in PROJECTIONS
        for part in PARTS
    }
    k = {
        p: torch.tensor([expert.projections[p].k for expert in experts], dtype=torch.float32, device=device)
        for p in PROJECTIONS
    }
    codebooks = {p: tuple(expert.projections[p].codebook for expert in experts) for p in PROJECTIONS}
    in_gpu_tier = torch.tensor([expert.in_gpu_tier for expert in experts], dtype=torch.bool, device=device)
    return PointerTables(pointers, k, codebooks, in_gpu_tier)


def gpu_tier_registry(experts: Sequence[PlacedExpert]) -> dict[int, torch.Tensor]:
    """Address -> trellis for GPU-tier experts, so read_trellis can resolve their table entries."""
    return {
        layer.trellis.data_ptr(): layer.trellis
        for expert in experts
        if expert.in_gpu_tier
        for layer in expert.projections.values()
    }


def read_trellis(
    address: int, shape: tuple[int, ...] | torch.Size, arena_or_registry: HostArena | Mapping[int, torch.Tensor]
) -> torch.Tensor:
    """A trellis table entry back as an int16 tensor, so CPU reference kernels read weights through the table
    exactly as the GPU kernels do (a wrong entry then shows up as wrong output, not as a silent detour)."""
    if isinstance(arena_or_registry, HostArena):
        return arena_or_registry.view(address - arena_or_registry.device_address(0), shape, torch.int16)
    tensor = arena_or_registry.get(address)
    if tensor is None:
        raise KeyError(f"no registered trellis at address {address:#x}")
    if tuple(tensor.shape) != tuple(shape) or tensor.dtype != torch.int16:
        raise InvalidValueError(
            f"trellis at {address:#x} is {tensor.dtype} {tuple(tensor.shape)}, expected torch.int16 {tuple(shape)}"
        )
    return tensor
