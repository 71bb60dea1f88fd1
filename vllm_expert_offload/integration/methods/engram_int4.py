"""DeepSeek-V4.1 engram tables stored MXINT-4 (the seeds' pack), served as stored by the plugin's lookup.

vLLM 0.32's `Engram` (models/deepseek_v41/common/engram.py) builds a `ParallelEngramEmbedding` holding FP8 rows
and E8M0 scales; an MXINT-4 table has no exact conversion into those (exl3/engram.py). So, for each engram layer
whose stored table is MXINT-4, `Engram._create_embedding` is wrapped to build `Mxint4EngramEmbedding` instead: the
same sharding (whole hash heads per TP rank, `part_n_hash_cols`, `vocab_start_idx`), the same parameter names
(`weight` <- `engram.embed.weight`, `weight_scale_inv` <- `engram.embed.scale`, as vLLM's V4.1 mapper names them)
and the same `lookup(indices, out)` contract, over the codes and scales as stored: 136 bytes a row for
DeepSeek-V4.1-Flash, in pinned host memory when `EngramConfig.cpu_offload` (vLLM's default) and read over UVA.

Refused by name: the configurations whose paths read the FP8 layout itself (`dp_shared_memory`, `use_thp`, an
engram DP group larger than 1: `DPSharedEngramStorage`, huge-page packing, `EngramBatch`'s packed FP8 staging).
Checked against vLLM 0.32 and 0.33; installed only in processes serving a pack with such tables.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping

import torch
from torch import nn

from ...errors import InvalidStateError
from ...exl3.engram import SCALE_BLOCK, EngramFormat, EngramTable
from ...exl3.errors import CheckpointRefused

logger = logging.getLogger("vllm.expert_offload")
ENGRAM = "vllm.models.deepseek_v41.common.engram"


def _shard_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """This rank's rows of a stored tensor (codes U8, scales E4M3 kept as their bytes), as vLLM's
    `_engram_head_shard_weight_loader` narrows its FP8 table."""
    if loaded_weight.dtype == torch.float8_e4m3fn:
        loaded_weight = loaded_weight.view(torch.uint8)
    if loaded_weight.dtype != torch.uint8 or loaded_weight.shape[1:] != param.shape[1:]:
        raise CheckpointRefused(f"EXL3 checkpoint refused: engram table tensor {tuple(loaded_weight.shape)} "
                                f"{loaded_weight.dtype} does not fit the MXINT-4 table {tuple(param.shape)}")
    param.data.copy_(loaded_weight.narrow(0, param.engram_vocab_start, param.shape[0]))


class Mxint4EngramEmbedding(nn.Module):
    """One layer's MXINT-4 table, head-sharded like vLLM's ParallelEngramEmbedding, looked up as stored."""

    _packed = None  # no huge-page packing (vLLM's collapse_huge_pages reads it)

    def __init__(self, num_embeddings: int, dim: int, head_sizes: tuple[int, ...], *, tp_size: int, tp_rank: int,
                 cpu_offload: bool) -> None:
        super().__init__()
        if dim % SCALE_BLOCK or sum(head_sizes) > num_embeddings:
            raise CheckpointRefused(
                f"EXL3 checkpoint refused: an MXINT-4 engram table of {num_embeddings} rows x {dim} "
                f"cannot hold heads {head_sizes}"
            )
        self.num_embeddings, self.dim, self.block_size = num_embeddings, dim, SCALE_BLOCK
        self.cpu_offload = cpu_offload
        self.dp_size, self.tp_size = 1, tp_size
        self.n_hash_cols = len(head_sizes)
        self.part_n_hash_cols = -(-self.n_hash_cols // tp_size)
        self.head_start = tp_rank * self.part_n_hash_cols
        self.vocab_start_idx = sum(head_sizes[:self.head_start])
        self.vocab_end_idx = sum(head_sizes[:self.head_start + self.part_n_hash_cols])
        self.part_num_embeddings = self.vocab_end_idx - self.vocab_start_idx
        where = {"device": "cpu", "pin_memory": True} if cpu_offload and torch.cuda.is_available() else (
            {"device": "cpu"} if cpu_offload else {})
        rows = self.part_num_embeddings
        self.weight = nn.Parameter(torch.empty(rows, dim // 2, dtype=torch.uint8, **where), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(rows, dim // SCALE_BLOCK, dtype=torch.uint8, **where),
                                             requires_grad=False)
        for param in (self.weight, self.weight_scale_inv):
            param.weight_loader = _shard_loader
            param.engram_vocab_start = self.vocab_start_idx
        if cpu_offload:
            # What vLLM's dummy loader writes into a host table (it never randomizes huge host tables).
            self.weight.dummy_weight_value = 0
            self.weight_scale_inv.dummy_weight_value = 0x38  # E4M3 1.0
        self._views: tuple[torch.Tensor, torch.Tensor] | None = None
        logger.info("Engram table MXINT-4, as stored: %d rows x %d, %.2f GiB in %s", rows, dim,
                    rows * (dim // 2 + dim // SCALE_BLOCK) / 2**30, "pinned host memory" if cpu_offload else "GPU")

    def _storage(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The table as the lookup reads it: the parameters themselves, or their UVA views on a GPU run."""
        if not (self.cpu_offload and torch.cuda.is_available()):
            return self.weight.data, self.weight_scale_inv.data
        source = (self.weight.data_ptr(), self.weight_scale_inv.data_ptr())
        if self._views is None or self._views[2] != source:
            from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor

            self._views = (get_accelerator_view_from_cpu_tensor(self.weight.data),
                           get_accelerator_view_from_cpu_tensor(self.weight_scale_inv.data), source)
        return self._views[0], self._views[1]

    def lookup(self, indices: torch.Tensor, out: torch.Tensor, background: bool = False) -> None:
        """vLLM's contract: bf16 rows of this rank's heads into `out` [T, part_n_hash_cols, dim]."""
        from ...kernels.engram_lookup import lookup_mxint4

        if out.dtype != torch.bfloat16:
            raise InvalidStateError(
                f"MXINT-4 engram tables are looked up into bf16 rows, not {out.dtype} (vLLM's packed "
                f"FP8 staging reads the FP8 layout)"
            )
        codes, scales = self._storage()
        lookup_mxint4(codes, scales, indices, out, head_start=self.head_start, local_heads=self.part_n_hash_cols,
                      vocab_start=self.vocab_start_idx)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        out = torch.empty(indices.shape[0], self.part_n_hash_cols, self.dim, dtype=torch.bfloat16,
                          device=indices.device)
        self.lookup(indices, out)
        if self.tp_size > 1:
            from vllm.distributed import tensor_model_parallel_all_gather

            out = tensor_model_parallel_all_gather(out, dim=1)
        return out[:, :self.n_hash_cols]

    def collapse_huge_pages(self) -> None:
        """Nothing to collapse: use_thp is refused for MXINT-4 tables."""


def refuse_unservable(engram_config) -> None:
    if engram_config.dp_shared_memory or engram_config.use_thp:
        flag = "dp_shared_memory" if engram_config.dp_shared_memory else "use_thp"
        raise CheckpointRefused(
            f"EXL3 checkpoint refused: --engram-config {flag} lays the table out as FP8 rows; this "
            f"pack's engram tables are MXINT-4 (served by the plugin's own lookup); leave {flag} off"
        )


def wrap_create_embedding(original, tables: Mapping[int, EngramTable]):
    """vLLM's `Engram._create_embedding`, building the MXINT-4 table for the layers `tables` stores so."""

    @functools.wraps(original)
    def _create_embedding(self, layout, layer_hash_index):
        table = tables.get(layout.layer_ids[layer_hash_index])
        if table is None or table.format is not EngramFormat.MXINT4:
            return original(self, layout, layer_hash_index)
        from vllm.config import get_current_vllm_config
        from vllm.distributed import (
            get_engram_dp_size,
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        engram_config = get_current_vllm_config().engram_config
        refuse_unservable(engram_config)
        if get_engram_dp_size() > 1:
            raise CheckpointRefused("EXL3 checkpoint refused: an engram DP group larger than 1 stages FP8 rows "
                                    "(EngramBatch); this pack's engram tables are MXINT-4")
        heads = tuple(size for order in layout.primes[layer_hash_index] for size in order)
        return Mxint4EngramEmbedding(
            layout.num_embeddings[layer_hash_index], layout.head_dim, heads,
            tp_size=get_tensor_model_parallel_world_size(), tp_rank=get_tensor_model_parallel_rank(),
            cpu_offload=engram_config.cpu_offload,
        )

    return _create_embedding
