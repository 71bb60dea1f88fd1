"""One EXL3 MoE layer as its forward sees it: built once when the layer's weights are loaded, never changed after.

`MoERuntime` holds what the forward reads (geometry, pointer tables, the backend's kernel, the read counters'
inputs, the expert-parallel map) and runs the forward as a short sequence of named steps, in this order:

  profiling    while vLLM profiles memory: every slot on one of this rank's experts, then the kernel (worst case)
  _rows        under data parallelism this engine's own rows of the batch every engine's tokens were gathered into
  _record      routing statistics of those rows (never of a dummy batch)
  _to_local    global expert ids -> this rank's (expert parallelism; another rank's expert is -1, weight 0)
  _count_reads reads by tier for /metrics, before the cache's step moves experts
  _other_ranks_on_expert_zero   -1 -> 0 (weight 0) for backends that cannot take -1 yet
  kernel       the backend: every selected expert read in place, VRAM or host arena
  _check_ranks the rank-check debug mode: every TP rank's expert cache compared after the step

A new step is one method and one line in `forward`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm import forward_context

from ...kernels.contract import MoEKernel
from ...kernels.expert_slots import ExpertSlots
from ...kernels.pointer_tables import PointerTables
from ...offload.phase import dummy_batch, profiling
from ...offload.process import ProcessPlacement
from ...offload.rank_plan import ExpertGeometry
from ..startup.data_parallel import own_rows
from ..startup.profiling import spread_routing
from .rank_check import check_ranks_agree


@dataclass(frozen=True)
class MoERuntime:
    """A loaded layer's forward state. `placement` is the process's (shared by every MoE layer: its routing
    counts and read counters are per process, one row per layer); everything else belongs to this layer."""

    op_name: str  # the name the layer's op carries in vLLM's graph (op_targets.py)
    layer_index: int  # the model's layer number (routing statistics)
    counter_row: int  # this layer's row in the process's counters (its rank among the MoE layers)
    geometry: ExpertGeometry
    tables: PointerTables  # `tables.in_gpu_tier`: which local experts are in GPU memory now (a cache updates it)
    expert_bytes: torch.Tensor  # int64 (local experts,): trellis bytes a host read of each expert moves
    kernel: MoEKernel
    cache: ExpertSlots | None  # the GPU tier as slots (expert_offload.dynamic), else None
    placement: ProcessPlacement
    expert_map: torch.Tensor | None  # expert parallelism: global id -> local id, -1 for another rank's
    num_local_experts: int
    apply_router_weight_on_input: bool
    check_ranks: bool  # the rank-check debug mode (rank_check.py), only with a cache

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if profiling():
            return self._worst_case(x, topk_weights, topk_ids)
        self._record(self._rows(topk_ids))
        topk_weights, ids = self._to_local(topk_weights, topk_ids)
        self._count_reads(ids)
        ids = self._other_ranks_on_expert_zero(ids)
        out = self.kernel.forward(x, topk_weights, ids, self.apply_router_weight_on_input)
        self._check_ranks()
        return out

    def _worst_case(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """vLLM's profiling pass: every slot on one of this rank's own experts, each of them used (EP too), so the
        memory it measures holds for any routing; nothing is recorded or counted."""
        local = spread_routing(topk_ids, self.num_local_experts).long()
        return self.kernel.forward(x, topk_weights, local, self.apply_router_weight_on_input)

    def _rows(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """This engine's rows: under data parallelism (naive dispatch) the batch holds every engine's, in DP rank
        order, as many of each as the step's dp_metadata says (startup/data_parallel.py)."""
        placement = self.placement
        if not placement.recording or placement.dp_size == 1:
            return topk_ids
        metadata = forward_context.get_forward_context().dp_metadata
        sizes = None if metadata is None else metadata.get_chunk_sizes_across_dp_rank()
        return own_rows(topk_ids, sizes, placement.dp_rank, placement.dp_size)

    def _record(self, topk_ids: torch.Tensor) -> None:
        """Routing statistics, on the device; a DP engine's dummy batch carries no one's tokens."""
        if self.placement.recording and not dummy_batch():
            self.placement.record(self.layer_index, topk_ids)

    def _to_local(self, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, int64 local ids): under expert parallelism another rank's expert is -1 with weight 0 (it is
        read, and counted, on its own rank); without it the ids are already this rank's."""
        if self.expert_map is None:
            return topk_weights, topk_ids.long()
        local = self.expert_map[topk_ids.long()].long()
        return torch.where(local >= 0, topk_weights, torch.zeros_like(topk_weights)), local

    def _count_reads(self, local_ids: torch.Tensor) -> None:
        """This step's reads by tier (-1 not counted), before the cache's step moves experts between tiers."""
        self.placement.tier_counters.count_reads(self.counter_row, local_ids, self.tables.in_gpu_tier,
                                                 self.expert_bytes)

    def _other_ranks_on_expert_zero(self, local_ids: torch.Tensor) -> torch.Tensor:
        """Another rank's expert (-1) as local expert 0 with weight 0 (`_to_local`), for backends that index with
        the id unchecked; to go once every backend skips -1 itself (issue 38, item 6)."""
        return local_ids if self.expert_map is None else local_ids.clamp(min=0)

    def _check_ranks(self) -> None:
        """Debug mode: every TP rank's expert cache must hold the same experts after this step."""
        if self.check_ranks:
            check_ranks_agree(self.op_name, self.cache.state_digest())
