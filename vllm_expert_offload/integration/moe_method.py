"""EXL3 routed experts in vLLM's RoutedExperts: per-expert loading, TP slicing, one kernel interface."""

from __future__ import annotations

import torch
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

from ..exl3.errors import Exl3FormatError
from ..exl3.slicing import aligned_cover, slice_input, slice_output
from ..exl3.tensors import parse_linear
from ..kernels.dequantized import dense_weight, moe_forward
from .collectors import TENSOR_SUFFIXES, collect, register_collectors, take_loaded

SHARD_PROJECTION = {"w1": "gate", "w3": "up", "w2": "down"}
STEM = {"gate": "w13", "up": "w13", "down": "w2"}
COLLECTORS = {f"{stem}_{suffix}": suffix for stem in ("w13", "w2") for suffix in (*TENSOR_SUFFIXES, "bias")}


class Exl3MoEMethod(FusedMoEMethodBase):
    """Receives each expert's tensor sets through collector parameters and computes the routed sum."""

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
        self.num_local_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size_per_partition = intermediate_size_per_partition
        self.params_dtype = params_dtype
        self._layer = layer
        register_collectors(layer, COLLECTORS, self._load)

    def _checkpoint_name(self, layer: torch.nn.Module, global_expert: int, projection: str) -> str:
        ckpt = {"gate": layer.ckpt_gate_proj_name, "up": layer.ckpt_up_proj_name, "down": layer.ckpt_down_proj_name}
        root = layer.layer_name.removesuffix(".routed_experts")
        return f"{root}.{global_expert}.{ckpt[projection]}"

    def _load(self, param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
        layer = self._layer
        local = layer._map_global_expert_id_to_local_expert_id(expert_id)
        if local == -1:
            return False if return_success else None
        projection = SHARD_PROJECTION[shard_id]
        where = self._checkpoint_name(layer, expert_id, projection)
        if param.exl3_suffix == "bias":
            raise Exl3FormatError(f"{where}.bias: expert biases are not supported yet")
        collect(layer, (local, projection), param.exl3_suffix, loaded_weight, where)
        return True if return_success else None

    def _local_to_global(self, layer: torch.nn.Module) -> list[int]:
        expert_map = layer.expert_map
        if expert_map is None:
            return list(range(self.num_local_experts))
        globals_ = [-1] * self.num_local_experts
        for global_id, local in enumerate(expert_map.tolist()):
            if local >= 0:
                globals_[local] = global_id
        return globals_

    def _expert_weight(self, layer, tensors, name: str, projection: str) -> torch.Tensor:
        parallel = layer.moe_config.moe_parallel_config
        inter, hidden = self.moe.intermediate_size, self.moe.hidden_dim_unpadded
        inter_pp = self.intermediate_size_per_partition
        start = parallel.tp_rank * inter_pp
        if projection == "down":
            lin = parse_linear(tensors, name, inter, hidden)
            lo, hi = aligned_cover(start, start + inter_pp, lin.in_features)
            w = dense_weight(slice_input(lin, lo, hi, keep_bias=True), lin.out_features, hi - lo, self.params_dtype)
            return w[:hidden, start - lo : start - lo + inter_pp]
        lin = parse_linear(tensors, name, hidden, inter)
        lo, hi = aligned_cover(start, start + inter_pp, lin.out_features)
        w = dense_weight(slice_output(lin, lo, hi), hi - lo, lin.in_features, self.params_dtype)
        return w[start - lo : start - lo + inter_pp, :hidden]

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        loaded = take_loaded(layer, list(COLLECTORS))
        del self._layer
        w13, w2 = [], []
        for local, global_id in enumerate(self._local_to_global(layer)):
            per_projection = {}
            for projection in ("gate", "up", "down"):
                name = self._checkpoint_name(layer, global_id, projection)
                tensors = loaded.get((local, projection))
                if tensors is None:
                    raise Exl3FormatError(f"{name}.trellis: missing from the checkpoint")
                per_projection[projection] = self._expert_weight(layer, tensors, name, projection)
            w13.append(torch.cat((per_projection["gate"], per_projection["up"]), dim=0))
            w2.append(per_projection["down"])
        layer.w13_dense = torch.nn.Parameter(torch.stack(w13), requires_grad=False)
        layer.w2_dense = torch.nn.Parameter(torch.stack(w2), requires_grad=False)

    def get_fused_moe_quant_config(self, layer: torch.nn.Module):
        return None

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input) -> torch.Tensor:
        expert_map = layer.expert_map
        if expert_map is not None:
            local = expert_map[topk_ids.long()]
            topk_weights = torch.where(local >= 0, topk_weights, torch.zeros_like(topk_weights))
            topk_ids = local.clamp(min=0)
        return moe_forward(
            x, layer.w13_dense, layer.w2_dense, topk_weights, topk_ids.long(), layer.apply_router_weight_on_input
        )
