"""Which experts go where, for one tensor-parallel rank: its share of each expert, their bytes, the plan.

Shared by serving (on header-only meta tensors, to size the host arena before loading; then on the real
tensors) and by the `plan` command, so the bytes planned are exactly the bytes placed. No vLLM imports.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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


def model_identity(summary: CheckpointSummary, tp_size: int, record_bytes: np.ndarray) -> ModelIdentity:
    layout = summary.layout
    return ModelIdentity.from_expert_bytes(layout.architecture, layout.num_layers, layout.moe_layers, tp_size, record_bytes)


def make_plan(
    options: OffloadOptions, record_bytes: np.ndarray, identity: ModelIdentity, gpu_bytes: int | None = None
) -> tuple[np.ndarray, str]:
    """GPU-tier mask [moe layers, experts] and a phrase saying where it came from (for the startup log). With
    `gpu_bytes`, the memory of this worker's GPU, a budget or plan that cannot fit it is refused by name."""
    layers, experts = record_bytes.shape
    if options.plan is not None:
        return load_plan(options.plan, identity, record_bytes, gpu_bytes), f"plan file {options.plan}"
    if options.gpu_budget_gib is not None:
        if gpu_bytes is not None and options.gpu_budget_gib * GIB > gpu_bytes:
            raise OffloadOptionError(f"--additional-config {OPTION_KEY}.gpu_budget_gib: {options.gpu_budget_gib:g} GiB "
                                     f"is more than this GPU's {gpu_bytes / GIB:.2f} GiB")
        counts = None if options.stats is None else RoutingCounts.load(options.stats, identity).counts
        plan = plan_placement(record_bytes, options.gpu_budget_gib * GIB, counts)
        stats = "" if counts is None else f" with statistics {options.stats}"
        return plan, f"gpu_budget_gib={options.gpu_budget_gib}{stats}"
    if options.host_fraction is not None:
        n_host = round(options.host_fraction * experts)
        plan = np.ones((layers, experts), dtype=bool)
        plan[:, experts - n_host :] = False
        return plan, f"host_fraction={options.host_fraction} (the last {n_host} experts of each layer)"
    return np.ones((layers, experts), dtype=bool), "no expert_offload option (all GPU)"
