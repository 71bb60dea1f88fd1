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
from ...offload.phase import dummy_batch_pass
from ..patching import SENTINEL, Hook, HookError, require_checked_version


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


def _flag_dummy(execute_dummy_batch):
    @functools.wraps(execute_dummy_batch)
    def wrapper(self):
        with dummy_batch_pass():
            return execute_dummy_batch(self)

    return wrapper


DUMMY_BATCH_HOOK = Hook("vllm.v1.worker.gpu_worker", "Worker.execute_dummy_batch", ("self",), _flag_dummy)


def install_dummy_batch_flag() -> None:
    """Raise the dummy-batch flag around every dummy batch this worker runs (the CPU worker inherits the GPU
    worker's method). Idempotent; refuses a vLLM whose method changed."""
    require_checked_version("the dummy-batch hook")
    DUMMY_BATCH_HOOK.install()
    from vllm.v1.worker.gpu_worker import Worker

    if not getattr(Worker.execute_dummy_batch, SENTINEL, False):
        raise HookError(f"{DUMMY_BATCH_HOOK.target}: not wrapped; dummy batches would be counted as traffic")
