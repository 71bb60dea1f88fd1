"""Which experts go where, for one rank: its share of each expert (TP) or its whole experts (EP), their bytes, the plan.

Shared by serving (on header-only meta tensors, to size the host arena before loading; then on the real
tensors) and by the `plan` command, so the bytes planned are exactly the bytes placed. No vLLM imports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidValueError
from ..exl3.naming import PROJECTIONS
from ..exl3.slicing import cover_input, cover_output
from ..exl3.tensors import Exl3Linear, parse_linear
from ..exl3.validate import CheckpointSummary
from ..placement import ModelIdentity, RoutingCounts, load_plan, plan_placement
from ..units import GIB
from .options import OPTION_KEY, OffloadOptionError, OffloadOptions
from .tiers import host_record_bytes


@dataclass(frozen=True)
class ExpertGeometry:
    hidden: int  # unpadded
    intermediate: int  # unpadded, whole expert
    intermediate_per_rank: int
    tp_rank: int
    tp_size: int

    @property
    def rank_start(self) -> int:
        return self.tp_rank * self.intermediate_per_rank

    def shape(self, projection: str) -> tuple[int, int]:
        """(in_features, out_features) of the whole, unpadded projection."""
        return (self.intermediate, self.hidden) if projection == "down" else (self.hidden, self.intermediate)

    @property
    def crop_offset(self) -> int:
        """Where this rank's first intermediate channel sits inside its sliced (128-aligned) projections."""
        return self.rank_start % 128

    def rank_slice(self, tensors: dict, name: str, projection: str) -> Exl3Linear:
        """Validated tensor set sliced to this rank's share; a share that cuts through a 128-block keeps the
        whole block (the kernel crops at `crop_offset`)."""
        lin = parse_linear(tensors, name, *self.shape(projection))
        start, end = self.rank_start, self.rank_start + self.intermediate_per_rank
        if projection == "down":
            part, offset = cover_input(lin, start, end, keep_bias=self.tp_rank == 0)
        else:
            part, offset = cover_output(lin, start, end)
        assert offset == self.crop_offset
        return part


@dataclass(frozen=True)
class RankExperts:
    """The routed experts one rank holds in every MoE layer: all of them (each a TP slice, `ExpertGeometry`) or,
    under expert parallelism, the whole experts vLLM's expert map gives it. Plans, arenas, the startup log and the
    crash line count these experts only, so each EP rank spends its own GPU budget and pins only its own host tier.
    Statistics stay global (every rank sees the global ids the router picks)."""

    num_experts: int
    local: tuple[int, ...]  # global expert ids, in local (vLLM's) order
    ep_rank: int = 0
    ep_size: int = 1

    @classmethod
    def every(cls, num_experts: int) -> RankExperts:
        return cls(num_experts, tuple(range(num_experts)))

    @classmethod
    def from_expert_map(cls, expert_map: Sequence[int], ep_rank: int, ep_size: int) -> RankExperts:
        """From vLLM's expert map under EP: [global id] -> local id, or -1 for another rank's expert."""
        local = sorted((int(slot), expert) for expert, slot in enumerate(expert_map) if slot >= 0)
        if [slot for slot, _ in local] != list(range(len(local))):
            raise InvalidValueError(f"expert_map {list(expert_map)} does not number this rank's experts 0..n-1")
        return cls(len(expert_map), tuple(expert for _, expert in local), ep_rank, ep_size)

    @classmethod
    def linear(cls, num_experts: int, ep_rank: int, ep_size: int) -> RankExperts:
        """The experts vLLM's default ("linear") expert placement gives `ep_rank`: contiguous runs, the first
        `num_experts % ep_size` ranks one more (vLLM's determine_expert_map; tests compare the two). What `plan`
        uses offline; serving reads vLLM's own map instead."""
        if not 0 <= ep_rank < ep_size or ep_size > num_experts:
            raise InvalidValueError(f"ep rank {ep_rank} of {ep_size} for {num_experts} routed experts")
        base, extra = divmod(num_experts, ep_size)
        start = ep_rank * base + min(ep_rank, extra)
        count = base + (ep_rank < extra)
        return cls(num_experts, tuple(range(start, start + count)), ep_rank, ep_size)

    @property
    def mask(self) -> np.ndarray:
        """[experts] bool: True for this rank's experts."""
        owned = np.zeros(self.num_experts, dtype=bool)
        owned[list(self.local)] = True
        return owned

    def label(self) -> str:
        """How log lines name this rank's share: 'ep rank 1 of 2, experts 4-7' (or the ids when not a range)."""
        if self.ep_size == 1:
            return ""
        ids = self.local
        span = f"{ids[0]}-{ids[-1]}" if ids == tuple(range(ids[0], ids[-1] + 1)) else ",".join(map(str, ids))
        return f"ep rank {self.ep_rank} of {self.ep_size}, experts {span}"


def record_bytes_matrix(summary: CheckpointSummary, geometry: ExpertGeometry) -> np.ndarray:
    """[moe layers, experts] bytes of each expert's trellis record on this rank (what the host tier holds)."""
    layout = summary.layout
    sizes = np.zeros((len(layout.moe_layers), layout.num_experts), dtype=np.int64)
    for row, layer in enumerate(layout.moe_layers):
        for expert in range(layout.num_experts):
            sets = {}
            for projection in PROJECTIONS:
                prefix = layout.expert_prefix(layer, expert, projection)
                sets[projection] = geometry.rank_slice(summary.linears[prefix].tensors(), prefix, projection)
            sizes[row, expert] = host_record_bytes(sets)
    return sizes


def model_identity(summary: CheckpointSummary, tp_size: int, record_bytes: np.ndarray, ep_size: int = 1
                   ) -> ModelIdentity:
    layout = summary.layout
    return ModelIdentity.from_expert_bytes(layout.architecture, layout.num_layers, layout.moe_layers, tp_size,
                                           record_bytes, ep_size)


def make_plan(
    options: OffloadOptions, record_bytes: np.ndarray, identity: ModelIdentity, gpu_bytes: int | None = None,
    rank: RankExperts | None = None,
) -> tuple[np.ndarray, str]:
    """GPU-tier mask [moe layers, experts] of `rank`'s experts (False for every other rank's) and a phrase saying
    where it came from (for the startup log). Each rank plans its own experts against its own GPU: a budget is per
    GPU, a host fraction per rank and layer, and a plan file's budget is checked against the rank's share. With
    `gpu_bytes`, the memory of this worker's GPU, a budget or plan that cannot fit it is refused by name."""
    layers, experts = record_bytes.shape
    rank = RankExperts.every(experts) if rank is None else rank
    owned, local = rank.mask, list(rank.local)
    plan = np.zeros((layers, experts), dtype=bool)
    if options.plan is not None:
        mine = np.where(owned, record_bytes, 0)  # the budget check counts this rank's GPU-tier experts only
        return load_plan(options.plan, identity, mine, gpu_bytes) & owned, f"plan file {options.plan}"
    if options.gpu_budget_gib is not None:
        if gpu_bytes is not None and options.gpu_budget_gib * GIB > gpu_bytes:
            raise OffloadOptionError(f"--additional-config {OPTION_KEY}.gpu_budget_gib: {options.gpu_budget_gib:g} GiB "
                                     f"is more than this GPU's {gpu_bytes / GIB:.2f} GiB")
        counts = None if options.stats is None else RoutingCounts.load(options.stats, identity).counts[:, local]
        plan[:, local] = plan_placement(record_bytes[:, local], options.gpu_budget_gib * GIB, counts)
        stats = "" if counts is None else f" with statistics {options.stats}"
        return plan, f"gpu_budget_gib={options.gpu_budget_gib}{stats}"
    if options.host_fraction is not None:
        n_host = round(options.host_fraction * len(local))
        plan[:, local[: len(local) - n_host]] = True
        which = "experts of each layer" if rank.ep_size == 1 else "local experts of each layer"
        return plan, f"host_fraction={options.host_fraction} (the last {n_host} {which})"
    plan[:, local] = True
    return plan, "no expert_offload option (all GPU)"
