"""What an engine counts under data parallelism: its own rows of the batch vLLM gathered from every engine (in DP
rank order, the step's dp_metadata sizes), and nothing while it runs a dummy batch for the others' collectives."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_expert_offload.integration import vllm_hooks
from vllm_expert_offload.integration.startup import data_parallel
from vllm_expert_offload.offload.phase import PHASE

from support.moe_runtimes import runtime


def _step(monkeypatch, sizes: list[int] | None) -> None:
    import vllm.forward_context

    metadata = SimpleNamespace(get_chunk_sizes_across_dp_rank=lambda: sizes)
    monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: SimpleNamespace(dp_metadata=metadata))


def test_each_engine_takes_its_own_rows_in_rank_order() -> None:
    gathered = torch.arange(7 * 2).view(7, 2)  # engine 0: 3 tokens, engine 1: none (idle), engine 2: 4 tokens
    sizes = [3, 0, 4]
    assert data_parallel.own_rows(gathered, sizes, 0, 3).tolist() == gathered[:3].tolist()
    assert data_parallel.own_rows(gathered, sizes, 1, 3).numel() == 0
    assert data_parallel.own_rows(gathered, sizes, 2, 3).tolist() == gathered[3:].tolist()


@pytest.mark.parametrize("sizes", [None, [3, 3], [3, 4, 1]])
def test_a_batch_that_does_not_split_into_the_engines_shares_is_refused(sizes) -> None:
    with pytest.raises(data_parallel.GatheredBatchError, match=r"7 gathered tokens do not split into 3 engines"):
        data_parallel.own_rows(torch.zeros(7, 2), sizes, 1, 3)


def test_dummy_batches_run_under_the_flag() -> None:
    from vllm.v1.worker.gpu_worker import Worker

    vllm_hooks.install_dummy_batch_flag()
    vllm_hooks.install_dummy_batch_flag()  # idempotent: one wrapper
    seen = []
    runner = SimpleNamespace(_dummy_run=lambda *args, **kwargs: seen.append(PHASE.dummy_batch))
    Worker.execute_dummy_batch(SimpleNamespace(model_runner=runner, randomize_dummy_inputs=False))
    assert seen == [True] and not PHASE.dummy_batch


def _engine_layer(recorded: list):
    """Layer 3 of DP rank 1 of 2 (no EP: every expert, as the engine test's other half covers EP)."""
    return runtime(torch.ones(8, dtype=torch.bool), layer_index=3, recording=True, dp_rank=1, dp_size=2,
                   record=lambda layer, ids: recorded.append((layer, ids.tolist())))


def test_the_moe_forward_counts_its_engines_rows_and_no_dummy_batch(monkeypatch) -> None:
    recorded = []
    layer = _engine_layer(recorded)
    gathered = torch.tensor([[0, 1], [2, 3], [4, 5]])  # engine 0's two tokens, then this engine's one
    _step(monkeypatch, [2, 1])
    layer.forward(torch.zeros(3, 4), torch.full((3, 2), 0.5), gathered)
    assert recorded == [(3, [[4, 5]])]
    with PHASE.dummy_batch_pass():  # this engine's row is a dummy token: nothing of it is counted
        layer.forward(torch.zeros(3, 4), torch.full((3, 2), 0.5), gathered)
    assert recorded == [(3, [[4, 5]])]
