"""What routing statistics need of vLLM under data parallelism (offload/engine_stats.py says why): which rows of a
gathered MoE batch are this engine's own tokens, and when the engine is running a dummy batch.

Read against vLLM 0.32's naive dispatch (`MoERunner._maybe_dispatch` -> `AgRsAll2AllManager.dispatch_router_logits`):
every engine's tokens are concatenated in DP rank order, engine d contributing `sizes[d]` rows, where `sizes` is
the step's `dp_metadata.get_chunk_sizes_across_dp_rank()`; an idle engine's step is `Worker.execute_dummy_batch`.
"""

from __future__ import annotations

import functools

import torch

from ...errors import ExpertOffloadError
from ...offload.phase import PHASE


class GatheredBatchError(ExpertOffloadError, RuntimeError):
    """A gathered MoE batch that does not split into the engines' shares the step's DP metadata names."""


def own_rows(topk_ids: torch.Tensor, sizes: list[int] | None, dp_rank: int, dp_size: int) -> torch.Tensor:
    """This engine's rows of `topk_ids` [gathered tokens, top_k], gathered from all `dp_size` engines, engine d
    contributing `sizes[d]` rows (the step's `dp_metadata.get_chunk_sizes_across_dp_rank()`)."""
    if sizes is None or len(sizes) != dp_size or sum(sizes) != topk_ids.shape[0]:
        raise GatheredBatchError(
            f"routing statistics under data parallelism: topk_ids of {topk_ids.shape[0]} gathered tokens do not "
            f"split into {dp_size} engines' shares {sizes} (vLLM's dp_metadata); sequence-parallel MoE or another "
            "dispatch than vLLM's naive all-gather is not supported with record_stats"
        )
    start = sum(sizes[:dp_rank])
    return topk_ids[start: start + sizes[dp_rank]]


def flag_dummy(execute_dummy_batch):
    """`Worker.execute_dummy_batch` with the dummy-batch flag up while it runs (vllm_hooks.DUMMY_BATCH)."""

    @functools.wraps(execute_dummy_batch)
    def wrapper(self):
        with PHASE.dummy_batch_pass():
            return execute_dummy_batch(self)

    return wrapper

