"""DeepSeek-V4.1's replay batch (vLLM's decoder-replay layers) gets a padding mask: its kept rows take the step's
mask, rows past them (a captured size's tail, an earlier step's rows) are padding; one persistent buffer per model
state, so a captured graph reads each step's values; the fields read exist in this vLLM."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from vllm_expert_offload.integration.methods.replay_padding import (
    ReplayPaddingError, replay_padding, wrap_prepare_replay_batch)


class _ModelState:
    """Stands for vLLM's model state (weak-referenceable, as a class instance is)."""

    def __init__(self, **fields) -> None:
        self.__dict__.update(fields)


def _step_mask(values: list[bool], capacity: int = 8) -> torch.Tensor:
    buffer = torch.zeros(capacity, dtype=torch.bool)  # the runner's persistent is_padding
    buffer[:len(values)] = torch.tensor(values)
    return buffer[:len(values)]


def test_kept_rows_take_the_steps_mask_and_the_tail_is_padding() -> None:
    owner = _ModelState()
    mask = replay_padding(owner, _step_mask([False, False, True, False, False, False]), torch.tensor([0, 2, 3]), 5)
    assert mask.tolist() == [False, True, False, True, True]
    again = replay_padding(owner, _step_mask([True, False, False, False]), torch.tensor([1, 3], dtype=torch.int32), 3)
    assert again.tolist() == [False, False, True]
    assert again.data_ptr() == mask.data_ptr()  # the same storage: a graph captured on the first reads the second


def test_a_replay_batch_past_the_runners_buffer_is_refused() -> None:
    with pytest.raises(ReplayPaddingError, match=r"replay batch of 9 rows, .* holds 8"):
        replay_padding(_ModelState(), _step_mask([False] * 4), torch.tensor([0]), 9)


def _state(rows: list[int], padded: int, is_padding=None):
    context = SimpleNamespace(is_padding=is_padding, batch_descriptor=SimpleNamespace(num_tokens=padded))
    layers = SimpleNamespace(replay_batch=None)

    def prepare(self, input_batch, *args, **kwargs):  # vLLM's: sets the replay batch, or none
        layers.replay_batch = None if not rows else SimpleNamespace(rows=torch.tensor(rows), forward_context=context)

    return _ModelState(decoder_replay_layers=layers), wrap_prepare_replay_batch(prepare), context


def test_the_wrapped_prepare_leaves_the_replay_context_a_mask_unless_vllm_gave_one() -> None:
    state, prepare, context = _state([1, 2], 4)
    prepare(state, SimpleNamespace(is_padding=_step_mask([False, False, True])), None)
    assert context.is_padding.tolist() == [False, True, True, True]
    given = torch.zeros(4, dtype=torch.bool)  # 0.33 under prefill context parallelism
    state, prepare, context = _state([1, 2], 4, given)
    prepare(state, SimpleNamespace(is_padding=_step_mask([True, True, True])), None)
    assert context.is_padding is given
    state, prepare, _ = _state([], 4)  # no replay batch this step
    prepare(state, SimpleNamespace(is_padding=_step_mask([True])), None)
    assert state.decoder_replay_layers.replay_batch is None


def test_the_fields_read_exist_in_this_vllm() -> None:
    from vllm.forward_context import BatchDescriptor, ForwardContext
    from vllm.models.deepseek_v41.decoder_replay_layers import ReplayBatch
    from vllm.v1.worker.gpu.input_batch import InputBatch

    assert {"rows", "forward_context"} <= {f.name for f in dataclasses.fields(ReplayBatch)}
    assert {"is_padding", "batch_descriptor"} <= {f.name for f in dataclasses.fields(ForwardContext)}
    assert "is_padding" in {f.name for f in dataclasses.fields(InputBatch)}
    assert "num_tokens" in BatchDescriptor._fields if hasattr(BatchDescriptor, "_fields") else (
        "num_tokens" in {f.name for f in dataclasses.fields(BatchDescriptor)})
