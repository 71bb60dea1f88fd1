"""Exl3MoEMethod under expert parallelism, on a bare method (the engine test covers the served path): the rank's
experts come from vLLM's expert map, a split expert under EP is refused by name, and the profiling pass that sizes
the KV cache puts every token slot on one of this rank's own experts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_expert_offload.exl3.errors import Exl3FormatError
from vllm_expert_offload.integration.methods.moe_method import _rank_experts
from vllm_expert_offload.offload.counters import GPU_READS, HOST_READS
from vllm_expert_offload.offload.phase import PHASE
from vllm_expert_offload.offload.rank_plan import RankExperts

from support.moe_runtimes import runtime

EXPERT_MAP = torch.tensor([-1, -1, -1, -1, 0, 1, 2, 3], dtype=torch.int32)  # EP rank 1 of 2, linear


def _parallel(**changes) -> SimpleNamespace:
    return SimpleNamespace(**({"use_ep": True, "tp_size": 1, "ep_rank": 1, "ep_size": 2, "pcp_size": 1} | changes))


def test_rank_experts_follow_vllms_expert_map() -> None:
    layer = SimpleNamespace(layer_name="model.layers.0.mlp.experts", expert_map=EXPERT_MAP)
    assert _rank_experts(layer, _parallel()) == RankExperts.linear(8, 1, 2)
    assert _rank_experts(SimpleNamespace(layer_name="x", expert_map=None), _parallel(use_ep=False)) is None


def test_expert_parallelism_with_split_experts_is_refused_by_name() -> None:
    layer = SimpleNamespace(layer_name="model.layers.0.mlp.experts", expert_map=EXPERT_MAP)
    with pytest.raises(Exl3FormatError, match=r"model\.layers\.0\.mlp\.experts: --enable-expert-parallel with an MoE "
                                              r"tensor-parallel size of 2 would split each EXL3 expert"):
        _rank_experts(layer, _parallel(tp_size=2))


def test_prefill_context_parallelism_is_refused_by_its_flag() -> None:
    layer = SimpleNamespace(layer_name="model.layers.3.mlp.experts", expert_map=None)
    with pytest.raises(Exl3FormatError, match=r"model\.layers\.3\.mlp\.experts: --prefill-context-parallel-size 2 "
                                              r"is not supported"):
        _rank_experts(layer, _parallel(use_ep=False, pcp_size=2))


def _runtime():
    return runtime(torch.tensor([True, False, False, False]), EXPERT_MAP)  # local expert 0 (global 4) on the GPU


def test_profiling_spreads_every_slot_over_this_ranks_experts() -> None:
    """The worst case of an EP rank is every selection landing on its own experts, all of them read; spreading
    over the global ids would hand other ranks' slots to local expert 0 with weight 0."""
    layer = _runtime()
    ids = torch.zeros((6, 2), dtype=torch.int64)
    weights = torch.full((6, 2), 0.5)
    with PHASE.profiling_pass():
        layer.forward(torch.zeros(6, 4), weights, ids)
    got_weights, got_ids = layer.kernel.calls[0]
    assert sorted(set(got_ids.flatten().tolist())) == [0, 1, 2, 3]
    assert (got_weights == 0.5).all()


def test_serving_maps_global_ids_and_zeroes_other_ranks_slots() -> None:
    layer = _runtime()
    layer.forward(torch.zeros(2, 4), torch.tensor([[0.7, 0.3], [0.6, 0.4]]), torch.tensor([[5, 1], [0, 7]]))
    weights, ids = layer.kernel.calls[0]
    assert ids.tolist() == [[1, -1], [-1, 3]]  # -1 reaches the backend, which skips it
    assert weights.tolist() == [[pytest.approx(0.7), 0.0], [0.0, pytest.approx(0.4)]]
    # Read counters: only this rank's two host-tier reads (global 5, 7); the other rank's ids 1 and 0 are not
    # reads of local expert 0, which sits in the GPU tier here.
    counts = layer.placement.tier_counters.snapshot()[0]
    assert (counts[GPU_READS], counts[HOST_READS]) == (0, 2)
