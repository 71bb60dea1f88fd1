"""Which rows of DeepSeek-V4.1's replay batch are padding, for the MoE forward's `is_padding` read.

vLLM's DeepSeek-V4.1 (models/deepseek_v41/nvidia/model_state.py, 0.32 and 0.33) runs its later decoder layers on a
replay batch: the step's kept rows, under a forward context of its own whose `is_padding` is None (0.33 sets it
only under prefill context parallelism). In a replayed graph that batch is padded to the captured size and its
tail holds an earlier step's rows, so without a mask the EXL3 MoE forward would route them as real: host experts
read over PCIe, routing statistics, read counters and the expert cache's policy all fed stale tokens. The mask
built here marks a kept row padding when the step's own mask does, and every row past the kept ones. It is
written into one persistent buffer per model state, so a graph captured with it reads each step's values (vLLM
prepares the replay batch eagerly before every replay).
"""

from __future__ import annotations

import functools
import weakref

import torch

from ...errors import ExpertOffloadError

_BUFFERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model state -> its persistent bool buffer


class ReplayPaddingError(ExpertOffloadError, RuntimeError):
    """A replay batch longer than the step's own mask buffer: the buffer would have to move under a captured graph."""


def wrap_prepare_replay_batch(prepare):
    """`DeepseekV41ModelState._prepare_replay_batch` that leaves the replay batch a padding mask (vllm_hooks.py
    REPLAY_PADDING)."""

    @functools.wraps(prepare)
    def wrapper(self, input_batch, *args, **kwargs):
        prepare(self, input_batch, *args, **kwargs)
        batch = self.decoder_replay_layers.replay_batch
        if batch is not None and batch.forward_context.is_padding is None:
            context = batch.forward_context
            context.is_padding = replay_padding(self, input_batch.is_padding, batch.rows,
                                                context.batch_descriptor.num_tokens)

    return wrapper


def replay_padding(owner: object, step_padding: torch.Tensor, rows: torch.Tensor, padded: int) -> torch.Tensor:
    """bool (padded,): True where the replay batch's row is padding. `step_padding`: the step's mask over its whole
    batch (a view of the runner's persistent buffer, whose size bounds every batch); `rows`: the kept rows' indices
    into the step's batch; `padded`: the replay batch's rows, the captured size in a graph. Device ops only."""
    buffer = _BUFFERS.get(owner)
    if buffer is None:
        buffer = torch.empty(step_padding.untyped_storage().nbytes(), dtype=torch.bool, device=step_padding.device)
        _BUFFERS[owner] = buffer
    if padded > buffer.shape[0]:
        raise ReplayPaddingError(f"DeepSeek-V4.1 replay batch of {padded} rows, the step's is_padding buffer holds "
                                 f"{buffer.shape[0]}")
    mask = buffer[:padded]
    torch.index_select(step_padding, 0, rows, out=mask[:rows.shape[0]])
    mask[rows.shape[0]:].fill_(True)
    return mask
