"""One EXL3 MoE layer as its forward sees it: built once when the layer's weights are loaded, never changed after.

`MoERuntime` holds what the forward reads (geometry, pointer tables, the backend's kernel, the read counters'
inputs, the expert-parallel map) and runs the forward as a short sequence of named steps, in this order:

  profiling    while vLLM profiles memory: every slot on one of this rank's experts, then the kernel (worst case)
  _padding     which of this engine's rows are padding (vLLM's forward_context.is_padding)
  _rows        under data parallelism this engine's own rows of the batch every engine's tokens were gathered into
  _record      routing statistics of those rows, padding rows weighted 0
  _to_local    global expert ids -> this rank's (expert parallelism; another rank's expert is -1, weight 0)
  _batch_padding  which rows of the MoE batch are padding: this engine's mask, under data parallelism every
               engine's, all-gathered as vLLM gathers the tokens
  _drop_padding  padding rows' ids -> -1: nothing reads, counts or caches for them
  _start_cpu_tier  the CPU tier (expert_offload.cpu_tier): host-resident misses split off and computed by host
               cores; their entries are -1 for the device (cpu_tier_step.py)
  _count_reads reads by tier for /metrics, before the cache's step moves experts
  kernel       the backend: every selected expert read in place, VRAM or host arena (-1 entries skipped)
  _add_cpu_tier  the CPU tier's partial sum added to the device's, the device's first
  _check_ranks the rank-check debug mode: every TP rank's expert cache compared after the step

A new step is one method and one line in `forward`.

Every step is device work: vLLM captures this forward in CUDA graphs and replays it for padded batches and for a
data-parallel engine's dummy batches, so whether a row is real is read from the device, from the model runner's
persistent `is_padding` buffer (vLLM 0.32/0.33, V1 and V2 runners: filled before every step, all True in dummy runs
and captures, read only under VLLM_MOE_SKIP_PADDING as vLLM's routers read it), never from a Python flag the capture
would freeze. Under data parallelism vLLM gathers every engine's tokens into the batch but not their masks, so the
masks are all-gathered the same way (one byte per row, captured with the rest): another engine's padding rows, its
captured size's tail or an idle engine's whole dummy batch, reach no kernel, read counter or cache step either,
identically on every rank. A batch gathered otherwise (sequence-parallel MoE: rows not in DP rank order) keeps the
other engines' rows as they are, with a warning at the first such forward.

The masks are the same for every MoE layer of a forward, so they are gathered once per forward context
(gathered_rows.py `step_padding`, which says why every engine decides alike). Mask collectives per step on each
DP engine and pipeline stage, eager or replayed, busy or idle (dummy batch): 1 (the stage's first MoE layer; it was
one per MoE layer), plus 1 on a DeepSeek-V4.1 step that runs its later layers on a replay batch (a context and a
mask of their own, replay_padding.py), plus 1 per further micro-batch; 0 without data parallelism, with
VLLM_MOE_SKIP_PADDING=0, in vLLM's profiling pass, or for a batch not gathered as the engines' shares. While a
graph is captured, layers run eagerly inside it (DeepSeek-V4.1's replay layers in the main graph's break) gather
again for themselves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from vllm import envs, forward_context
from vllm.distributed.parallel_state import get_dp_group

from ...kernels.contract import MoEKernel
from ...kernels.expert_slots import ExpertSlots
from ...kernels.pointer_tables import PointerTables
from ...offload.phase import PHASE
from ...offload.process import ProcessPlacement
from ...offload.rank_plan import ExpertGeometry
from .gathered_rows import GatheredBatchError, own_rows, splits_into_shares, step_padding
from ..startup.profiling import spread_routing
from ...kernels.stream_host_tier import PendingPartial
from .cpu_tier_step import CpuTierStep
from .rank_check import check_ranks_agree

logger = logging.getLogger("vllm.expert_offload")
_UNMASKED: set[str] = set()  # layers warned about: a batch whose other engines' padding cannot be told


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
    cpu_tier: CpuTierStep | None = None  # expert_offload.cpu_tier, in a layer with a host-resident expert

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if PHASE.profiling:
            return self._worst_case(x, topk_weights, topk_ids)
        padding = self._padding()
        self._record(self._rows(topk_ids), padding)
        topk_weights, ids = self._to_local(topk_weights, topk_ids)
        ids = self._drop_padding(ids, self._batch_padding(padding, ids.shape[0]))
        ids, cpu_partial = self._start_cpu_tier(x, topk_weights, ids)
        self._count_reads(ids)
        out = self.kernel.forward(x, topk_weights, ids, self.apply_router_weight_on_input)
        out = self._add_cpu_tier(out, cpu_partial)
        self._check_ranks()
        return out

    def _worst_case(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """vLLM's profiling pass: every slot on one of this rank's own experts, each of them used (EP too), so the
        memory it measures holds for any routing; nothing is recorded or counted."""
        local = spread_routing(topk_ids, self.num_local_experts).long()
        return self.kernel.forward(x, topk_weights, local, self.apply_router_weight_on_input)

    def _rows(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """This engine's rows: under data parallelism (naive dispatch) the batch holds every engine's, in DP rank
        order, as many of each as the step's dp_metadata says (gathered_rows.py)."""
        placement = self.placement
        if not placement.recording or placement.dp_size == 1:
            return topk_ids
        return own_rows(topk_ids, self._dp_sizes(), placement.dp_rank, placement.dp_size)

    @staticmethod
    def _dp_sizes() -> list[int] | None:
        """Each DP engine's rows of this step's gathered batch (vLLM's dp_metadata), None where there is none."""
        metadata = forward_context.get_forward_context().dp_metadata
        return None if metadata is None else metadata.get_chunk_sizes_across_dp_rank()

    @staticmethod
    def _padding() -> torch.Tensor | None:
        """bool (this engine's rows,): True on padding rows (a captured size's tail, every row of a dummy batch),
        read from the device by a replayed graph; None outside a vLLM step (tests, benchmarks: every row is real)
        and with VLLM_MOE_SKIP_PADDING=0, where vLLM's V2 runner stops filling the mask for real steps (its rows
        still say what the last dummy batch wrote: every row padding) and vLLM's own routers ignore it too."""
        if not envs.VLLM_MOE_SKIP_PADDING or not forward_context.is_forward_context_available():
            return None
        return forward_context.get_forward_context().is_padding

    def _record(self, topk_ids: torch.Tensor, padding: torch.Tensor | None) -> None:
        """Routing statistics of this engine's real rows, on the device (padding rows add 0)."""
        if not self.placement.recording:
            return
        if padding is not None and padding.shape[0] != topk_ids.shape[0]:
            raise GatheredBatchError(f"{self.op_name}: vLLM's is_padding covers {padding.shape[0]} rows, this "
                                     f"engine's share of the batch is {topk_ids.shape[0]}")
        self.placement.record(self.layer_index, topk_ids, None if padding is None else ~padding)

    def _batch_padding(self, padding: torch.Tensor | None, rows: int) -> torch.Tensor | None:
        """The padding mask of the whole MoE batch of `rows` rows: this engine's own, or under data parallelism
        every engine's, all-gathered over the DP group in DP rank order with the step's sizes, as vLLM's naive
        dispatch gathers the tokens (None: no mask, or a batch gathered otherwise, module docstring)."""
        if padding is None or self.placement.dp_size == 1:
            return padding
        sizes = self._dp_sizes()
        # Decided from what every engine sees alike (the step's sizes, the batch's rows): one engine skipping the
        # collective while the others enter it would hang them all.
        if not splits_into_shares(sizes, rows, self.placement.dp_size):
            if self.op_name not in _UNMASKED:
                _UNMASKED.add(self.op_name)
                logger.warning("%s: the MoE batch of %d rows is not the data-parallel engines' shares %s in rank "
                               "order (sequence-parallel MoE or context parallelism); other engines' padding rows "
                               "are computed, counted and cached as real ones", self.op_name, rows, sizes)
            return None
        if sizes[self.placement.dp_rank] != padding.shape[0]:
            raise GatheredBatchError(f"{self.op_name}: vLLM's is_padding covers {padding.shape[0]} rows, this "
                                     f"engine's share of the gathered batch is {sizes[self.placement.dp_rank]}")
        # Once per forward (gathered_rows.step_padding): the masks are the same for every MoE layer of a step.
        return step_padding(forward_context.get_forward_context(), padding, sizes, lambda: get_dp_group().all_gatherv(
            padding.to(torch.uint8), dim=0, sizes=list(sizes)).bool())

    def _drop_padding(self, local_ids: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
        """Padding rows' ids are -1 (what the kernel skips and no counter or cache sees); every TP rank has the
        same mask."""
        if padding is None:
            return local_ids
        if padding.shape[0] != local_ids.shape[0]:
            raise GatheredBatchError(f"{self.op_name}: vLLM's is_padding covers {padding.shape[0]} rows, the MoE batch "
                                     f"has {local_ids.shape[0]} (a gather other than data parallelism's)")
        return torch.where(padding[:, None], -1, local_ids)

    def _to_local(self, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, int64 local ids): under expert parallelism another rank's expert is -1 with weight 0 (it is
        read, and counted, on its own rank); without it the ids are already this rank's."""
        if self.expert_map is None:
            return topk_weights, topk_ids.long()
        local = self.expert_map[topk_ids.long()].long()
        return torch.where(local >= 0, topk_weights, torch.zeros_like(topk_weights)), local

    def _start_cpu_tier(self, x: torch.Tensor, topk_weights: torch.Tensor, local_ids: torch.Tensor
                        ) -> tuple[torch.Tensor, PendingPartial | None]:
        """(the device's ids, the CPU tier's partial sum to come, or None): without the tier, or in a step above
        its max_tokens, every entry stays on the device. The tier's job runs while the kernel does."""
        if self.cpu_tier is None:
            return local_ids, None
        return self.cpu_tier.start(x, topk_weights, local_ids)

    def _add_cpu_tier(self, out: torch.Tensor, cpu_partial: PendingPartial | None) -> torch.Tensor:
        """Both tiers' sum, the device's partial first: a fixed order, so a given split is deterministic."""
        return out if cpu_partial is None else out + cpu_partial.result()

    def _count_reads(self, local_ids: torch.Tensor) -> None:
        """This step's reads by tier (-1 not counted), before the cache's step moves experts between tiers."""
        self.placement.tier_counters.count_reads(self.counter_row, local_ids, self.tables.in_gpu_tier,
                                                 self.expert_bytes)

    def _check_ranks(self) -> None:
        """Debug mode: every TP rank's expert cache must hold the same experts after this step."""
        if self.check_ranks:
            check_ranks_agree(self.op_name, self.cache.state_digest())
