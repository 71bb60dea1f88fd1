"""One EXL3 MoE layer while vLLM loads it: each expert's tensors collected, and the expert placed in its tier the
moment its last tensor arrives, so the checkpoint is never held whole in memory; `finish` then checks that every
expert arrived and builds the layer's `MoERuntime` (pointer tables, expert cache, the backend's kernel)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

from ...exl3.errors import Exl3FormatError
from ...exl3.naming import PROJECTIONS
from ...exl3.validate import CheckpointSummary
from ...kernels.contract import ExpertCrop, MoELayer
from ...kernels.expert_slots import ExpertSlots, expert_trellis_bytes
from ...kernels.oracle import KernelChoice, build_moe_kernel
from ...kernels.pointer_tables import build_pointer_tables, kernel_address, stack_scales
from ...offload.process import ProcessPlacement
from ...offload.rank_plan import ExpertGeometry
from ...offload.tiers import PlacedExpert, place_expert
from .collectors import TENSOR_SUFFIXES, collect, collected, register_collectors, take_loaded
from .cpu_tier_step import build_cpu_tier_step
from .moe_runtime import MoERuntime
from .rank_check import checking_ranks

SHARD_PROJECTION = {"w1": "gate", "w3": "up", "w2": "down"}
COLLECTORS = {f"{stem}_{suffix}": suffix for stem in ("w13", "w2") for suffix in (*TENSOR_SUFFIXES, "bias")}


@dataclass
class ExpertLoading:
    """What create_weights learned of the layer, and the experts placed so far (local id -> placed expert)."""

    layer: RoutedExperts  # vLLM's layer: its global -> local expert map, the collectors vLLM's loader fills
    op_name: str
    layer_index: int
    geometry: ExpertGeometry
    device: torch.device
    kernels: KernelChoice
    params_dtype: torch.dtype
    num_local_experts: int
    top_k: int
    swiglu_limit: float | None
    summary: CheckpointSummary  # the checkpoint's names and tensor sets of each expert
    placement: ProcessPlacement
    capture_rows: tuple[int, ...]
    placed: dict[int, PlacedExpert] = field(default_factory=dict)

    def register(self) -> None:
        """Give vLLM's layer the collector parameters its loader hands each expert tensor to."""
        register_collectors(self.layer, COLLECTORS, self.load)

    def _checkpoint_name(self, global_expert: int, projection: str) -> str:
        return self.summary.layout.expert_prefix(self.layer_index, global_expert, projection)

    def load(self, param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
        """vLLM's expert weight loader signature (FusedMoE.weight_loader)."""
        local = self.layer._map_global_expert_id_to_local_expert_id(expert_id)
        if local == -1:
            return False if return_success else None
        projection = SHARD_PROJECTION[shard_id]
        where = self._checkpoint_name(expert_id, projection)
        if param.exl3_suffix == "bias":
            raise Exl3FormatError(f"{where}.bias: expert biases are not supported yet")
        collect(self.layer, (local, projection), param.exl3_suffix, loaded_weight, where)
        self._place_if_complete(local, expert_id)
        return True if return_success else None

    def _place_if_complete(self, local: int, global_expert: int) -> None:
        store = collected(self.layer)
        expected = self.summary.suffixes
        names = {p: self._checkpoint_name(global_expert, p) for p in PROJECTIONS}
        if any(set(store.get((local, p), {})) != expected[names[p]] for p in PROJECTIONS):
            return
        sliced = {p: self.geometry.rank_slice(store.pop((local, p)), names[p], p) for p in PROJECTIONS}
        to_gpu = self.placement.loads_to_gpu(self.layer_index, global_expert)
        self.placed[local] = place_expert(sliced, to_gpu, self.placement.arena, self.device)

    def _local_to_global(self) -> list[int]:
        expert_map = self.layer.expert_map
        if expert_map is None:
            return list(range(self.num_local_experts))
        globals_ = [-1] * self.num_local_experts
        for global_id, local in enumerate(expert_map.tolist()):
            if local >= 0:
                globals_[local] = global_id
        return globals_

    def _check_delivered(self, leftovers: dict) -> None:
        """Every expert placed, or the first tensor the loader never delivered named."""
        expected = self.summary.suffixes
        for local, global_id in enumerate(self._local_to_global()):
            if local in self.placed:
                continue
            for projection in PROJECTIONS:
                name = self._checkpoint_name(global_id, projection)
                have = set(leftovers.get((local, projection), {}))
                if have != expected[name]:
                    missing = sorted(expected[name] - have) or sorted(have - expected[name])
                    raise Exl3FormatError(
                        f"{name}.{missing[0]}: not delivered by the loader (received {sorted(have) or 'nothing'})"
                    )

    def finish(self) -> MoERuntime:
        """The layer's runtime, once vLLM has delivered every tensor; the layer keeps no loader state."""
        layer = self.layer
        self._check_delivered(take_loaded(layer, list(COLLECTORS)))
        experts, scales = stack_scales([self.placed.pop(e) for e in range(self.num_local_experts)], self.device)
        placement, arena = self.placement, self.placement.arena
        tables = build_pointer_tables(experts, kernel_address(arena, self.device), self.device)
        crop = ExpertCrop(self.geometry.hidden, self.geometry.intermediate_per_rank, self.geometry.crop_offset)
        row = placement.row(self.layer_index)
        cache = None
        if placement.cache is not None:  # the plan's GPU experts of this layer start in its slots
            initial = [placement.in_gpu_tier(self.layer_index, g) for g in self._local_to_global()]
            cache = ExpertSlots(experts, tables, placement.cache, initial, placement.slot_bytes(self.layer_index),
                                self.device, placement.tier_counters, row)
        moe_layer = MoELayer(
            experts, tables, scales, arena, crop, self.params_dtype, self.device,
            swiglu_limit=self.swiglu_limit,  # DeepSeek-V4: gate <= limit, |up| <= limit, as SiluAndMulWithClamp
            top_k=self.top_k, capture_rows=self.capture_rows, cache=cache,
        )
        kernel = build_moe_kernel(self.kernels, moe_layer)
        expert_bytes = expert_trellis_bytes(experts, self.device)
        cpu_tier = build_cpu_tier_step(
            placement, moe_layer, expert_bytes, row, layer.apply_router_weight_on_input,
            lambda: kernel if cache is None else build_moe_kernel(self.kernels, replace(moe_layer, cache=None,
                                                                                        capture_rows=(1,))))
        placement.note_loading_peak(self.device)
        return MoERuntime(
            op_name=self.op_name, layer_index=self.layer_index, counter_row=row, geometry=self.geometry,
            tables=tables, expert_bytes=expert_bytes, kernel=kernel, cache=cache,
            placement=placement, expert_map=layer.expert_map, num_local_experts=self.num_local_experts,
            apply_router_weight_on_input=layer.apply_router_weight_on_input,
            check_ranks=cache is not None and checking_ranks(), cpu_tier=cpu_tier,
        )
