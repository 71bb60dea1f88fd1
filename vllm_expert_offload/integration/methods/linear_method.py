"""EXL3 dense linears in vLLM: fused QKV / gate_up, o_proj, dense MLPs, shared experts, lm_head.

`apply` is one opaque op naming this layer (kernels/ops.py); the op calls `linear_forward`, the backend's kernel."""

from __future__ import annotations

import torch
from vllm.model_executor.layers.linear import LinearMethodBase, QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

from ...exl3.errors import Exl3FormatError
from ...exl3.slicing import cover_input, cover_output
from ...exl3.tensors import parse_linear
from ...kernels import ops
from ...kernels.contract import LinearLayer
from ...kernels.linear import LinearShard
from ...kernels.oracle import build_linear_kernel
from .collectors import TENSOR_SUFFIXES, collect, register_collectors, take_loaded
from .op_targets import register_op_target

_QKV_SHARDS = {"q": 0, "k": 1, "v": 2}


class Exl3LinearMethod(LinearMethodBase):
    """One instance per layer: it remembers the layer's checkpoint name and tensor-parallel geometry."""

    requires_device_loading = False

    def __init__(self, quant_config, prefix: str) -> None:
        self.quant_config = quant_config
        self.prefix = prefix
        self.shard_names = quant_config.shard_prefixes(prefix)

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        if len(output_partition_sizes) != len(self.shard_names):
            raise Exl3FormatError(
                f"{self.prefix}: vLLM builds {len(output_partition_sizes)} output shards but the checkpoint has "
                f"{len(self.shard_names)} ({self.shard_names}); pre-fused EXL3 modules are not supported"
            )
        self.input_size_per_partition = input_size_per_partition
        self.output_partition_sizes = list(output_partition_sizes)
        self.input_size = input_size
        self.params_dtype = params_dtype
        self.device = torch.empty(0).device  # vLLM builds layers under `with torch.device(target)`
        self.kernels = self.quant_config.kernel_choice(self.device)
        self._layer = layer
        register_collectors(layer, {s: s for s in TENSOR_SUFFIXES}, self._load)
        self.op_name = register_op_target(self.prefix, self)

    def _load(self, param: torch.nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id=None) -> None:
        layer_shard = 0 if loaded_shard_id is None else _QKV_SHARDS.get(loaded_shard_id, loaded_shard_id)
        if not isinstance(layer_shard, int) or not 0 <= layer_shard < len(self.shard_names):
            raise Exl3FormatError(f"{self.prefix}.{param.exl3_suffix}: unknown shard id {loaded_shard_id!r}")
        collect(self._layer, layer_shard, param.exl3_suffix, loaded_weight, self.shard_names[layer_shard])

    def _output_range(self, layer: torch.nn.Module, shard: int) -> tuple[int, int, int]:
        """(start, valid rows, rows this rank holds) of shard `shard` in the checkpoint's output dim."""
        size = self.output_partition_sizes[shard]
        if isinstance(layer, ParallelLMHead):
            idx = layer.shard_indices
            return idx.org_vocab_start_index, idx.org_vocab_end_index - idx.org_vocab_start_index, size
        if isinstance(layer, RowParallelLinear) or getattr(layer, "tp_size", 1) == 1:
            return 0, size, size
        rank = layer.tp_rank
        if isinstance(layer, QKVParallelLinear) and shard > 0:
            rank //= layer.num_kv_head_replicas
        return rank * size, size, size

    def _rank_shard(self, layer: torch.nn.Module, shard: int, tensors: dict[str, torch.Tensor], full_out: int):
        """This rank's part of one checkpoint tensor set: its 128-aligned cover and where the part sits."""
        lin = parse_linear(tensors, self.shard_names[shard], self.input_size, full_out)
        start, valid, rows = self._output_range(layer, shard)
        lin, out_offset = cover_output(lin, start, start + valid)
        in_start = layer.tp_rank * self.input_size_per_partition if isinstance(layer, RowParallelLinear) else 0
        lin, in_offset = cover_input(lin, in_start, in_start + self.input_size_per_partition, keep_bias=True)
        return LinearShard(lin, out_offset, valid, rows, in_offset, self.input_size_per_partition)

    def _shard_full_out(self, layer: torch.nn.Module, shard: int) -> int:
        if isinstance(layer, ParallelLMHead):
            return layer.org_vocab_size
        sizes = getattr(layer, "output_sizes", None) or [layer.output_size]
        return sizes[shard]

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        loaded = take_loaded(layer, list(TENSOR_SUFFIXES))
        del self._layer
        shards = []
        for shard, name in enumerate(self.shard_names):
            if shard not in loaded:
                raise Exl3FormatError(f"{name}.trellis: missing from the checkpoint")
            shards.append(self._rank_shard(layer, shard, loaded[shard], self._shard_full_out(layer, shard)))
        # Shards stay on the host, where the collectors keep what the checkpoint delivered: a dequantizing
        # backend decodes there and moves only the result, a trellis-reading one moves the trellis.
        layer_spec = LinearLayer(shards, self.params_dtype, self.device, self.quant_config.capture_sizes())
        self.kernel = build_linear_kernel(self.kernels, layer_spec)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = ops.exl3_linear(self, self.op_name, self.kernel.out_features, x)
        return y if bias is None else y + bias

    def linear_forward(self, x: torch.Tensor) -> torch.Tensor:
        """What the op runs: the backend's product of every shard, without bias."""
        return self.kernel.forward(x)
