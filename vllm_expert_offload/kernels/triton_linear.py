"""Dense EXL3 linears on the Triton kernel: the trellis is read in place on every call, nothing is kept
decoded. The forward is a registered torch custom op, so vLLM's torch.compile sees one opaque call
instead of tracing into Triton launches over raw pointers; the op finds its kernel by a registry index."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .expert_blocks import single_matrix_blocks
from .linear import LinearShard
from .matrix_table import dot_dtype_for, matrix_table, own_addresses
from .triton_exl3 import BLOCK_M, exl3_matmul


class TritonLinear:
    name = "triton"

    def __init__(self, shards: Sequence[LinearShard], device: torch.device) -> None:
        self.shards = [shard.to(device) for shard in shards]
        self.tables = [matrix_table([s.layer], own_addresses([s.layer]), device) for s in self.shards]
        self.kernel_id = _register(self)

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        """The forward itself (what the custom op runs)."""
        rows = x.reshape(-1, x.shape[-1])
        blocks = single_matrix_blocks(rows.shape[0], BLOCK_M, rows.device)
        outputs = []
        for shard, table in zip(self.shards, self.tables):
            cover = F.pad(rows, (shard.in_offset, table.in_features - shard.in_offset - shard.in_size))
            y = exl3_matmul(cover, shard.layer.suh, shard.layer.svh, *blocks, table, dot_dtype_for(x.dtype))
            y = y[:, shard.out_offset : shard.out_offset + shard.out_valid]
            outputs.append(F.pad(y, (0, shard.out_rows - shard.out_valid)))
        return torch.cat(outputs, dim=-1).to(x.dtype).reshape(*x.shape[:-1], -1)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.ops.vllm_expert_offload.exl3_linear(x, self.kernel_id)
        return y if bias is None else y + bias

    @property
    def out_features(self) -> int:
        return sum(s.out_rows for s in self.shards)


# Weak: a layer owns its kernel, the registry only finds it, so dropped models free their trellises.
_KERNELS: weakref.WeakValueDictionary[int, TritonLinear] = weakref.WeakValueDictionary()
_NEXT_ID = itertools.count()


def _register(kernel: TritonLinear) -> int:
    kernel_id = next(_NEXT_ID)
    _KERNELS[kernel_id] = kernel
    return kernel_id


@torch.library.custom_op("vllm_expert_offload::exl3_linear", mutates_args=())
def _exl3_linear_op(x: torch.Tensor, kernel_id: int) -> torch.Tensor:
    return _KERNELS[kernel_id].compute(x)


@_exl3_linear_op.register_fake
def _(x: torch.Tensor, kernel_id: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], _KERNELS[kernel_id].out_features)
