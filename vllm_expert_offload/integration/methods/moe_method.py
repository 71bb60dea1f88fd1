"""EXL3 routed experts in vLLM's RoutedExperts: the quant method vLLM asks for each MoE layer.

create_weights checks the layer, takes the process's backends and placement and starts the layer's loading
(expert_loading.py: each expert straight into its tier); process_weights_after_loading turns the loading into the
layer's frozen runtime (moe_runtime.py). `apply` is one opaque op (kernels/ops.py) naming this layer, so
torch.compile never traces the routing glue or the backend; the op calls `moe_forward`, the runtime's steps."""

from __future__ import annotations

import logging
import re

import torch
from vllm.config import get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

from ...exl3.errors import Exl3FormatError
from ...kernels import ops
from ...kernels.oracle import BackendUnavailable, KernelChoice, backend
from ...offload.cache_policy import CacheSettings
from ...offload.process import ProcessPlacement
from ...offload.rank_plan import ExpertGeometry, RankExperts
from ..vllm_hooks import install_crash_line, install_profile_flag, install_replay_padding
from .expert_loading import ExpertLoading
from .gathered_rows import gathered_capture_rows
from .moe_runtime import MoERuntime
from .op_targets import register_op_target

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
    """The quant config lives once per process, so its process state carries the process's placement (made at the
    first MoE layer, from the options parsed with the kernels); on CUDA the crash line is checked once the KV cache
    is allocated, against this rank's own GPU-tier experts."""
    process = quant_config.process
    if process.placement is None:
        gpu_bytes = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
        cache = _cache_settings(process.options, kernels, parallel.use_ep)
        first_in_engine = parallel.dp_size == 1 or get_tensor_model_parallel_rank() == 0  # reports under DP
        placement = ProcessPlacement(process.options, quant_config.summary, geometry, top_k, device, gpu_bytes,
                                     rank, parallel.dp_rank, parallel.dp_size, cache, first_in_engine)
        if device.type == "cuda":
            install_crash_line(placement.options.min_free_fraction, placement.gpu_tier_sizes())
            install_replay_padding()
        process.placement = placement
    elif rank is not None and process.placement.rank != rank:
        raise Exl3FormatError(f"expert map of this MoE layer ({rank.label()}) differs from the first layer's "
                              f"({process.placement.rank.label()}); one plan per process needs one map")
    return process.placement


def _rank_experts(layer: torch.nn.Module, parallel) -> RankExperts | None:
    """This rank's routed experts, read from vLLM's own expert map. Expert parallelism places whole experts; vLLM
    never splits an expert under EP (its MoE TP size is 1 there), and a configuration that did is refused by name
    rather than served with experts both split and placed per rank. Prefill context parallelism is refused by
    name too: vLLM all-gathers its ranks' tokens into the MoE batch while the padding mask covers this rank's rows
    only, a gather the forward has not been built or tested for."""
    if parallel.pcp_size > 1:
        raise Exl3FormatError(
            f"{layer.layer_name}: --prefill-context-parallel-size {parallel.pcp_size} is not supported with EXL3 "
            "routed experts (vLLM gathers every context-parallel rank's tokens into the MoE batch, and only this "
            "rank's rows have a padding mask); start without it"
        )
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


class Exl3MoEMethod(FusedMoEMethodBase):
    """vLLM's quant method of one EXL3 MoE layer, in two phases held by two objects, both declared here:
    `loading` from create_weights until process_weights_after_loading (experts placed as they arrive,
    expert_loading.py), then `runtime`, the frozen forward state (moe_runtime.py)."""

    requires_device_loading = False

    def __init__(self, moe, quant_config) -> None:
        super().__init__(moe)
        self.quant_config = quant_config
        self.loading: ExpertLoading | None = None
        self.runtime: MoERuntime | None = None

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
        summary = self.quant_config.summary
        if summary.layout is None:
            from ...exl3.naming import SUPPORTED_ARCHITECTURES

            raise Exl3FormatError(
                f"{layer.layer_name}: EXL3 routed experts are supported for {list(SUPPORTED_ARCHITECTURES)} only"
            )
        match = LAYER_INDEX.search(layer.layer_name)
        if match is None:
            raise Exl3FormatError(f"{layer.layer_name}: cannot tell which model layer this MoE block is")
        parallel = layer.moe_config.moe_parallel_config
        geometry = ExpertGeometry(
            hidden=self.moe.hidden_dim_unpadded, intermediate=self.moe.intermediate_size,
            intermediate_per_rank=intermediate_size_per_partition, tp_rank=parallel.tp_rank, tp_size=parallel.tp_size,
        )
        device = torch.empty(0).device  # vLLM builds layers under `with torch.device(target)`
        kernels = self.quant_config.kernel_choice(device)
        _require_eager_if_not_graph_safe(kernels, device)
        top_k = self.moe.experts_per_token
        placement = _process_placement(self.quant_config, geometry, _rank_experts(layer, parallel), parallel, top_k,
                                       device, kernels)
        install_profile_flag()
        self.loading = ExpertLoading(
            layer=layer, op_name=register_op_target(layer.layer_name, self), layer_index=int(match.group(1)),
            geometry=geometry, device=device, kernels=kernels, params_dtype=params_dtype,
            num_local_experts=num_experts, top_k=top_k, swiglu_limit=self.moe.swiglu_limit, summary=summary,
            placement=placement, capture_rows=gathered_capture_rows(self.quant_config.capture_sizes(), parallel),
        )
        self.loading.register()

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self.runtime = self.loading.finish()
        self.loading = None

    def get_fused_moe_quant_config(self, layer: torch.nn.Module):
        return None

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input) -> torch.Tensor:
        return ops.exl3_moe(self, self.runtime.op_name, self.runtime.geometry.hidden, x, topk_weights, topk_ids)

    def moe_forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """What the op runs, eagerly: the layer's runtime steps (moe_runtime.py)."""
        return self.runtime.forward(x, topk_weights, topk_ids)
