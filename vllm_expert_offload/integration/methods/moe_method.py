"""EXL3 routed experts in vLLM's RoutedExperts: per-expert loading straight into each expert's tier,
TP slicing, pointer tables, and one kernel interface.

`apply` is one opaque op (kernels/ops.py) naming this layer, so torch.compile never traces the routing glue or
the backend; the op calls `moe_forward`, which holds everything that depends on Python state at run time (the
profiling pass's worst-case routing, routing statistics, the expert-parallel map)."""

from __future__ import annotations

import logging
import re

import torch
from vllm.config import get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

from ...exl3.errors import Exl3FormatError
from ...exl3.naming import PROJECTIONS
from ...kernels import ops
from ...kernels.contract import ExpertCrop, MoELayer
from ...kernels.expert_slots import ExpertSlots, expert_trellis_bytes
from ...kernels.oracle import BackendUnavailable, KernelChoice, backend, build_moe_kernel
from ...kernels.pointer_tables import build_pointer_tables, kernel_address, stack_scales
from ...offload.cache_policy import CacheSettings
from ...offload.phase import dummy_batch, profiling
from ...offload.process import ProcessPlacement
from ...offload.rank_plan import ExpertGeometry, RankExperts
from ...offload.tiers import place_expert
from ..startup.crash_line import install_crash_line
from ..startup.data_parallel import install_dummy_batch_flag, own_rows
from ..startup.profiling import install_profile_flag, spread_routing
from .collectors import TENSOR_SUFFIXES, collect, collected, register_collectors, take_loaded
from .cpu_tier_step import build_cpu_tier_step
from .op_targets import register_op_target
from .rank_check import check_ranks_agree, checking_ranks

SHARD_PROJECTION = {"w1": "gate", "w3": "up", "w2": "down"}
COLLECTORS = {f"{stem}_{suffix}": suffix for stem in ("w13", "w2") for suffix in (*TENSOR_SUFFIXES, "bias")}
LAYER_INDEX = re.compile(r"layers\.(\d+)\.")
logger = logging.getLogger("vllm.expert_offload")


def _cache_settings(options, kernels: KernelChoice, expert_parallel: bool) -> CacheSettings | None:
    """The expert cache's settings where `dynamic` asks for one and the routed experts' backend writes through;
    None (the static plan, said once in the log) where it cannot."""
    if not options.caches:
        return None
    if expert_parallel:
        raise BackendUnavailable("--additional-config expert_offload.dynamic: the expert cache decides from every "
                                 "rank's identical top-k ids, which expert parallelism does not give; serve without "
                                 "--enable-expert-parallel or without dynamic")
    if not backend(kernels.moe).write_through or kernels.fallback is not None:
        logger.warning(
            "expert_offload.dynamic: routed experts run the %s backend, which cannot store an expert into a GPU slot "
            "as it reads it (write-through: the cpu and triton backends do); serving the static plan", kernels.moe)
        return None
    return options.dynamic


def _process_placement(quant_config, geometry: ExpertGeometry, rank: RankExperts | None, parallel, top_k: int,
                       device: torch.device, kernels: KernelChoice) -> ProcessPlacement:
    """The quant config lives once per process, so it carries the process's placement (made at the first MoE
    layer, from the options it parsed); on CUDA the crash line is checked once the KV cache is allocated, against
    this rank's own GPU-tier experts."""
    if quant_config.placement is None:
        gpu_bytes = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
        cache = _cache_settings(quant_config.options, kernels, parallel.use_ep)
        first_in_engine = parallel.dp_size == 1 or get_tensor_model_parallel_rank() == 0  # reports under DP
        placement = ProcessPlacement(quant_config.options, quant_config.summary, geometry, top_k, device, gpu_bytes,
                                     rank, parallel.dp_rank, parallel.dp_size, cache, first_in_engine)
        if device.type == "cuda":
            install_crash_line(placement.options.min_free_fraction, placement.gpu_tier_sizes())
        quant_config.placement = placement
    elif rank is not None and quant_config.placement.rank != rank:
        raise Exl3FormatError(f"expert map of this MoE layer ({rank.label()}) differs from the first layer's "
                              f"({quant_config.placement.rank.label()}); one plan per process needs one map")
    return quant_config.placement


def _rank_experts(layer: torch.nn.Module, parallel) -> RankExperts | None:
    """This rank's routed experts, read from vLLM's own expert map. Expert parallelism places whole experts; vLLM
    never splits an expert under EP (its MoE TP size is 1 there), and a configuration that did is refused by name
    rather than served with experts both split and placed per rank."""
    if parallel.use_ep and parallel.tp_size > 1:
        raise Exl3FormatError(
            f"{layer.layer_name}: --enable-expert-parallel with an MoE tensor-parallel size of {parallel.tp_size} "
            "would split each EXL3 expert as well as place it per rank; vllm-expert-offload places whole experts "
            "under expert parallelism"
        )
    if layer.expert_map is None:
        return None  # every expert, each a TP slice
    return RankExperts.from_expert_map(layer.expert_map.tolist(), parallel.ep_rank, parallel.ep_size)


def _require_eager_if_not_graph_safe(kernels: KernelChoice, device: torch.device) -> None:
    """The torch reference decides per batch which experts to decode (host syncs, data-dependent shapes), which
    CUDA-graph capture cannot record; refuse it up front where vLLM will capture graphs (CUDA, a cudagraph mode
    other than NONE) instead of failing inside capture. torch.compile alone is fine: the op is opaque."""
    if device.type != "cuda" or kernels.graph_safe:
        return
    from vllm.config import CUDAGraphMode

    if get_current_vllm_config().compilation_config.cudagraph_mode != CUDAGraphMode.NONE:
        raise BackendUnavailable(
            f"vllm-expert-offload: EXL3 routed experts run the {kernels.moe!r} backend ({kernels.reason}), which "
            "cannot be captured in CUDA graphs; start vLLM with --enforce-eager, or use "
            "--additional-config '{\"expert_offload\": {\"kernel\": \"triton\"}}'"
        )


def _host_share() -> tuple[int, int]:
    """(this worker's index, workers) among vLLM's workers on this host: each takes its share of the CPU tier's
    automatic core list."""
    from vllm.distributed.parallel_state import get_world_group

    return get_world_group().local_rank, get_current_vllm_config().parallel_config.local_world_size


class Exl3MoEMethod(FusedMoEMethodBase):
    """Receives each expert's tensor sets through collector parameters and places every expert in its tier
    as soon as its last tensor arrives, so the checkpoint is never held whole in memory."""

    requires_device_loading = False

    def __init__(self, moe, quant_config) -> None:
        super().__init__(moe)
        self.quant_config = quant_config

    def create_weights(
        self,
        layer: torch.nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        activation = getattr(layer.activation, "value", layer.activation)
        if activation != "silu":
            raise Exl3FormatError(f"{layer.layer_name}: activation {activation!r} is not supported (EXL3 MoE: silu)")
        if self.quant_config.summary.layout is None:
            from ...exl3.naming import SUPPORTED_ARCHITECTURES

            raise Exl3FormatError(
                f"{layer.layer_name}: EXL3 routed experts are supported for {list(SUPPORTED_ARCHITECTURES)} only"
            )
        match = LAYER_INDEX.search(layer.layer_name)
        if match is None:
            raise Exl3FormatError(f"{layer.layer_name}: cannot tell which model layer this MoE block is")
        self.layer_index = int(match.group(1))
        parallel = layer.moe_config.moe_parallel_config
        self.geometry = ExpertGeometry(
            hidden=self.moe.hidden_dim_unpadded, intermediate=self.moe.intermediate_size,
            intermediate_per_rank=intermediate_size_per_partition, tp_rank=parallel.tp_rank, tp_size=parallel.tp_size,
        )
        self.device = torch.empty(0).device  # vLLM builds layers under `with torch.device(target)`
        self.kernels = self.quant_config.kernel_choice(self.device)
        _require_eager_if_not_graph_safe(self.kernels, self.device)
        self.params_dtype = params_dtype
        self.num_local_experts = num_experts
        top_k = self.moe.experts_per_token
        rank = _rank_experts(layer, parallel)
        self.placement = _process_placement(self.quant_config, self.geometry, rank, parallel, top_k, self.device,
                                            self.kernels)
        self.placed: dict[int, object] = {}
        self._layer = layer
        register_collectors(layer, COLLECTORS, self._load)
        install_profile_flag()
        if self.placement.recording and parallel.dp_size > 1:
            install_dummy_batch_flag()
        self.op_name = register_op_target(layer.layer_name, self)

    def _checkpoint_name(self, global_expert: int, projection: str) -> str:
        return self.quant_config.summary.layout.expert_prefix(self.layer_index, global_expert, projection)

    def _load(self, param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
        layer = self._layer
        local = layer._map_global_expert_id_to_local_expert_id(expert_id)
        if local == -1:
            return False if return_success else None
        projection = SHARD_PROJECTION[shard_id]
        where = self._checkpoint_name(expert_id, projection)
        if param.exl3_suffix == "bias":
            raise Exl3FormatError(f"{where}.bias: expert biases are not supported yet")
        collect(layer, (local, projection), param.exl3_suffix, loaded_weight, where)
        self._place_if_complete(local, expert_id)
        return True if return_success else None

    def _place_if_complete(self, local: int, global_expert: int) -> None:
        store = collected(self._layer)
        expected = self.quant_config.summary.suffixes
        names = {p: self._checkpoint_name(global_expert, p) for p in PROJECTIONS}
        if any(set(store.get((local, p), {})) != expected[names[p]] for p in PROJECTIONS):
            return
        sliced = {p: self.geometry.rank_slice(store.pop((local, p)), names[p], p) for p in PROJECTIONS}
        to_gpu = self.placement.loads_to_gpu(self.layer_index, global_expert)
        self.placed[local] = place_expert(sliced, to_gpu, self.placement.arena, self.device)

    def _local_to_global(self, layer: torch.nn.Module) -> list[int]:
        expert_map = layer.expert_map
        if expert_map is None:
            return list(range(self.num_local_experts))
        globals_ = [-1] * self.num_local_experts
        for global_id, local in enumerate(expert_map.tolist()):
            if local >= 0:
                globals_[local] = global_id
        return globals_

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        leftovers = take_loaded(layer, list(COLLECTORS))
        del self._layer
        expected = self.quant_config.summary.suffixes
        for local, global_id in enumerate(self._local_to_global(layer)):
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
        experts, scales = stack_scales([self.placed.pop(e) for e in range(self.num_local_experts)], self.device)
        arena = self.placement.arena
        tables = build_pointer_tables(experts, kernel_address(arena, self.device), self.device)
        crop = ExpertCrop(self.geometry.hidden, self.geometry.intermediate_per_rank, self.geometry.crop_offset)
        self.row = self.placement.row(self.layer_index)
        self.cache = None
        if self.placement.cache is not None:  # the plan's GPU experts of this layer start in its slots
            initial = [self.placement.in_gpu_tier(self.layer_index, g) for g in self._local_to_global(layer)]
            self.cache = ExpertSlots(experts, tables, self.placement.cache, initial,
                                     self.placement.slot_bytes(self.layer_index), self.device,
                                     self.placement.tier_counters, self.row)
        moe_layer = MoELayer(
            experts, tables, scales, arena, crop, self.params_dtype, self.device,
            swiglu_limit=self.moe.swiglu_limit,  # DeepSeek-V4: gate <= limit, |up| <= limit, as SiluAndMulWithClamp
            top_k=self.moe.experts_per_token, capture_rows=self.quant_config.capture_sizes(),
            cache=self.cache,
        )
        self.kernel = build_moe_kernel(self.kernels, moe_layer)
        # What the read counters need each forward: which experts are in GPU memory now, and their sizes.
        self.in_gpu_tier = tables.in_gpu_tier
        self.expert_bytes = expert_trellis_bytes(experts, self.device)
        self.cpu_tier = build_cpu_tier_step(self.placement, moe_layer, self.kernel, self.expert_bytes, self.row,
                                            _host_share)
        self.check_ranks = self.cache is not None and checking_ranks()
        del self.placed
        self.placement.note_loading_peak(self.device)
        # What moe_forward needs of the layer, kept so the op's target holds no reference back to it.
        self.expert_map = layer.expert_map
        self.apply_router_weight_on_input = layer.apply_router_weight_on_input

    def get_fused_moe_quant_config(self, layer: torch.nn.Module):
        return None

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input) -> torch.Tensor:
        return ops.exl3_moe(self, self.op_name, self.geometry.hidden, x, topk_weights, topk_ids)

    def moe_forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """What the op runs, eagerly: worst-case routing while vLLM profiles, statistics while recording (under data
        parallelism this engine's own tokens only), global ids mapped to this rank's (EP), reads counted by tier
        (before the cache's step moves experts), then the backend; in the rank-check debug mode, the caches of all
        TP ranks compared after it."""
        if profiling():  # this rank's worst case: every slot on one of its own experts, each of them used (EP too)
            local = spread_routing(topk_ids, self.num_local_experts).long()
            return self.kernel.forward(x, topk_weights, local, self.apply_router_weight_on_input)
        if self.placement.recording and not dummy_batch():  # a DP engine's dummy batch carries no one's tokens
            dp_rank, dp_size = self.placement.dp_rank, self.placement.dp_size
            self.placement.record(self.layer_index, topk_ids if dp_size == 1 else own_rows(topk_ids, dp_rank, dp_size))
        # -1: another rank's expert, read (and counted) there
        local = topk_ids.long() if self.expert_map is None else self.expert_map[topk_ids.long()].long()
        if self.cpu_tier is not None and self.cpu_tier.active(x.shape[0]):
            out = self.cpu_tier.forward(x, topk_weights, local, self.apply_router_weight_on_input)
        else:
            self.placement.tier_counters.count_reads(self.row, local, self.in_gpu_tier, self.expert_bytes)
            topk_weights = torch.where(local >= 0, topk_weights, torch.zeros_like(topk_weights))
            out = self.kernel.forward(x, topk_weights, local.clamp(min=0), self.apply_router_weight_on_input)
        if self.check_ranks:
            check_ranks_agree(self.op_name, self.cache.state_digest())
        return out
