"""What an engine counts under data parallelism: its own rows of the batch vLLM gathered from every engine (in DP
rank order, the step's dp_metadata sizes), and nothing while it runs a dummy batch for the others' collectives."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_expert_offload.integration.methods.moe_method import Exl3MoEMethod
from vllm_expert_offload.integration.startup import data_parallel
from vllm_expert_offload.offload.counters import TierCounters
from vllm_expert_offload.offload.phase import dummy_batch, dummy_batch_pass

CPU = torch.device("cpu")


def _step(monkeypatch, sizes: list[int] | None) -> None:
    import vllm.forward_context

    metadata = SimpleNamespace(get_chunk_sizes_across_dp_rank=lambda: sizes)
    monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: SimpleNamespace(dp_metadata=metadata))


def test_each_engine_takes_its_own_rows_in_rank_order(monkeypatch) -> None:
    gathered = torch.arange(7 * 2).view(7, 2)  # engine 0: 3 tokens, engine 1: none (idle), engine 2: 4 tokens
    _step(monkeypatch, [3, 0, 4])
    assert data_parallel.own_rows(gathered, 0, 3).tolist() == gathered[:3].tolist()
    assert data_parallel.own_rows(gathered, 1, 3).numel() == 0
    assert data_parallel.own_rows(gathered, 2, 3).tolist() == gathered[3:].tolist()


@pytest.mark.parametrize("sizes", [None, [3, 3], [3, 4, 1]])
def test_a_batch_that_does_not_split_into_the_engines_shares_is_refused(monkeypatch, sizes) -> None:
    _step(monkeypatch, sizes)
    with pytest.raises(data_parallel.GatheredBatchError, match=r"7 gathered tokens do not split into 3 engines"):
        data_parallel.own_rows(torch.zeros(7, 2), 1, 3)


def test_dummy_batches_run_under_the_flag() -> None:
    from vllm.v1.worker.gpu_worker import Worker

    data_parallel.install_dummy_batch_flag()
    data_parallel.install_dummy_batch_flag()  # idempotent: one wrapper
    seen = []
    runner = SimpleNamespace(_dummy_run=lambda *args, **kwargs: seen.append(dummy_batch()))
    Worker.execute_dummy_batch(SimpleNamespace(model_runner=runner, randomize_dummy_inputs=False))
    assert seen == [True] and not dummy_batch()


class _Kernel:
    def forward(self, x, weights, ids, on_input):
        return x


def _engine_method(recorded: list) -> Exl3MoEMethod:
    """A bare EXL3 MoE method of DP rank 1 of 2 (no EP: every expert, as the engine test's other half covers EP)."""
    method = Exl3MoEMethod.__new__(Exl3MoEMethod)
    method.kernel, method.expert_map, method.layer_index, method.row = _Kernel(), None, 3, 0
    method.placement = SimpleNamespace(recording=True, dp_rank=1, dp_size=2, tier_counters=TierCounters(1, CPU),
                                       record=lambda layer, ids: recorded.append((layer, ids.tolist())))
    method.in_gpu_tier, method.expert_bytes = torch.ones(8, dtype=torch.bool), torch.full((8,), 100)
    method.check_ranks, method.apply_router_weight_on_input = False, False
    return method


def test_the_moe_forward_counts_its_engines_rows_and_no_dummy_batch(monkeypatch) -> None:
    recorded = []
    method = _engine_method(recorded)
    gathered = torch.tensor([[0, 1], [2, 3], [4, 5]])  # engine 0's two tokens, then this engine's one
    _step(monkeypatch, [2, 1])
    method.moe_forward(torch.zeros(3, 4), torch.full((3, 2), 0.5), gathered)
    assert recorded == [(3, [[4, 5]])]
    with dummy_batch_pass():  # this engine's row is a dummy token: nothing of it is counted
        method.moe_forward(torch.zeros(3, 4), torch.full((3, 2), 0.5), gathered)
    assert recorded == [(3, [[4, 5]])]
