"""Expert parallelism, one rank's share (offload/rank_plan.py RankExperts, make_plan): the experts vLLM's expert map
gives a rank, and the plan each rank makes for its own experts only (budget per GPU, host fraction per rank)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_expert_offload.offload.options import OffloadOptions
from vllm_expert_offload.offload.rank_plan import RankExperts, make_plan
from vllm_expert_offload.placement import ModelIdentity, RoutingCounts, save_plan
from vllm_expert_offload.placement.errors import PlacementError

SIZES = np.array([[100, 200, 300, 400, 500, 600, 700, 800],
                  [800, 700, 600, 500, 400, 300, 200, 100]], dtype=np.int64)
LAYERS = (0, 1)


def _identity(ep_size: int = 1) -> ModelIdentity:
    return ModelIdentity.from_expert_bytes("TestMoe", 2, LAYERS, 1, SIZES, ep_size)


@pytest.mark.parametrize(("num_experts", "ep_size"), [(8, 2), (8, 4), (10, 4), (7, 3), (8, 8)])
def test_linear_share_equals_vllm_expert_map(num_experts: int, ep_size: int) -> None:
    """`plan` assigns experts offline the way vLLM's default placement does at serving time."""
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    shares = []
    for ep_rank in range(ep_size):
        count, expert_map, _ = determine_expert_map(ep_size, ep_rank, num_experts, "linear")
        ours = RankExperts.linear(num_experts, ep_rank, ep_size)
        assert ours == RankExperts.from_expert_map(expert_map.tolist(), ep_rank, ep_size)
        assert len(ours.local) == count
        shares.extend(ours.local)
    assert sorted(shares) == list(range(num_experts)), "every expert on exactly one rank"


def test_expert_map_round_robin_and_local_order() -> None:
    """Local slot i holds the global expert the map sends to i, whatever the placement strategy."""
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    _, expert_map, _ = determine_expert_map(2, 1, 8, "round_robin")
    rank = RankExperts.from_expert_map(expert_map.tolist(), 1, 2)
    assert rank.local == (1, 3, 5, 7)
    assert rank.mask.tolist() == [False, True] * 4
    assert rank.label() == "ep rank 1 of 2, experts 1,3,5,7"
    assert RankExperts.linear(8, 1, 2).label() == "ep rank 1 of 2, experts 4-7"
    assert RankExperts.every(8).label() == ""


@pytest.mark.parametrize("bad", [[0, -1, 0, -1], [1, -1, 2, -1], [0, -1, 2, -1]])
def test_expert_map_that_does_not_number_local_slots_is_refused(bad: list[int]) -> None:
    with pytest.raises(ValueError, match="does not number this rank's experts"):
        RankExperts.from_expert_map(bad, 0, 2)


def test_host_fraction_is_per_rank_and_layer() -> None:
    """Each EP rank puts the last half of its own experts on host: half of the model in all, spread over ranks
    (a global 'last half' would leave rank 0 all GPU and rank 1 all host)."""
    options = OffloadOptions(host_fraction=0.5)
    plans = [make_plan(options, SIZES, _identity(2), rank=RankExperts.linear(8, r, 2))[0] for r in range(2)]
    assert plans[0].tolist() == [[True, True, False, False, False, False, False, False]] * 2
    assert plans[1].tolist() == [[False, False, False, False, True, True, False, False]] * 2
    assert not (plans[0] & plans[1]).any()
    whole, source = make_plan(options, SIZES, _identity())
    assert whole.tolist() == [[True] * 4 + [False] * 4] * 2 and "the last 4 experts of each layer" in source


def test_gpu_budget_is_spent_per_rank_on_its_own_experts(tmp_path) -> None:
    """A budget is GiB per GPU: each EP rank fills it from its own experts, hottest first by its statistics."""
    counts = np.zeros_like(SIZES)
    counts[:, 2] = 50  # rank 0's hottest: expert 2 in both layers (300 + 600 bytes)
    counts[:, 7] = 90  # rank 1's hottest: expert 7 (800 + 100 bytes)
    stats = tmp_path / "stats.json"
    RoutingCounts(counts, LAYERS, _identity()).save(stats)
    options = OffloadOptions(gpu_budget_gib=900 / 2**30, stats=stats)
    for ep_rank, hottest in ((0, 2), (1, 7)):
        rank = RankExperts.linear(8, ep_rank, 2)
        plan, _ = make_plan(options, SIZES, _identity(2), rank=rank)
        assert np.flatnonzero(plan.any(axis=0)).tolist() == [hottest]
        assert SIZES[plan].sum() <= 900 and not plan[:, ~rank.mask].any()


def test_plan_file_budget_is_checked_per_rank(tmp_path) -> None:
    """A plan file names GPU-tier experts of every rank; each rank takes its own and checks them against the
    budget, which is per GPU: the whole model's GPU tier may exceed it, one rank's may not."""
    gpu = np.zeros(SIZES.shape, dtype=bool)
    gpu[:, [0, 4]] = True  # rank 0: 100 + 800 bytes, rank 1: 500 + 400 bytes
    path = tmp_path / "plan.json"
    save_plan(path, gpu, _identity(2), budget_bytes=900)
    for ep_rank in (0, 1):
        rank = RankExperts.linear(8, ep_rank, 2)
        plan, _ = make_plan(OffloadOptions(plan=path), SIZES, _identity(2), rank=rank)
        assert (plan == (gpu & rank.mask)).all()
    save_plan(path, gpu, _identity(2), budget_bytes=899)
    with pytest.raises(PlacementError, match="its GPU-tier experts take 900 bytes, more than its budget_bytes 899"):
        make_plan(OffloadOptions(plan=path), SIZES, _identity(2), rank=RankExperts.linear(8, 0, 2))
    with pytest.raises(PlacementError, match="model.ep_size is 2 in the file but 1 for the running model"):
        make_plan(OffloadOptions(plan=path), SIZES, _identity(1))


def test_identity_without_ep_size_reads_as_one_and_split_with_whole_is_refused() -> None:
    doc = _identity().to_json()
    del doc["ep_size"]  # a plan written before expert parallelism
    assert ModelIdentity.from_json(doc, "old plan") == _identity()
    with pytest.raises(PlacementError, match="one of them 1"):
        ModelIdentity.from_expert_bytes("TestMoe", 2, LAYERS, 2, SIZES, 2)


def test_process_placement_counts_global_ids_and_places_only_local(tmp_path) -> None:
    """Under EP the arena, the log and the crash line's expert list are the rank's; routing counts stay global."""
    from vllm_expert_offload.exl3.checkpoint import Exl3Checkpoint
    from vllm_expert_offload.exl3.validate import validate_checkpoint
    from vllm_expert_offload.offload.process import ProcessPlacement
    from vllm_expert_offload.offload.rank_plan import ExpertGeometry
    from vllm_expert_offload.testing.tiny_models import build_tiny_model

    summary = validate_checkpoint(Exl3Checkpoint.open(build_tiny_model(None, "qwen3_moe")))
    geometry = ExpertGeometry(hidden=128, intermediate=256, intermediate_per_rank=256, tp_rank=0, tp_size=1)
    options = OffloadOptions(host_fraction=0.5, record_stats=tmp_path / "stats.json")
    whole = ProcessPlacement(options, summary, geometry, 2, torch.device("cpu"))
    ranks = [ProcessPlacement(options, summary, geometry, 2, torch.device("cpu"), rank=RankExperts.linear(8, r, 2))
             for r in range(2)]
    assert [int(p.host_tier.sum()) for p in ranks] == [4, 4]  # 2 layers x 2 of each rank's 4 experts
    assert [len(p.gpu_tier_sizes()) for p in ranks] == [4, 4]
    assert sum(p.arena.capacity_bytes for p in ranks) == whole.arena.capacity_bytes  # equal-sized experts: same bytes in all
    assert [p.rank_label() for p in ranks] == ["ep rank 0 of 2, experts 0-3", "ep rank 1 of 2, experts 4-7"]
    assert [p.writes_stats for p in ranks] == [True, False]
    ranks[1].record(1, torch.tensor([[7, 0]]))
    assert ranks[1].counts[1].tolist() == [1, 0, 0, 0, 0, 0, 0, 1]
    report = ranks[1].memory_report()
    assert report["local_experts"] == [4, 5, 6, 7] and report["ep_rank"] == 1
    for p in (whole, *ranks):
        p.release("test done")
    from vllm_expert_offload.errors import ExpertOffloadError

    with pytest.raises(ExpertOffloadError, match="vLLM's expert map covers 6 routed experts, the checkpoint has 8"):
        ProcessPlacement(options, summary, geometry, 2, torch.device("cpu"), rank=RankExperts.linear(6, 0, 2))


def test_data_parallel_engines_label_their_rank_and_each_reports_its_own_statistics() -> None:
    """Under DP without EP vLLM splits each expert over the TP x DP ranks (DP rank 1 of 2 at TP 1 is MoE TP rank 1 of
    2). Each engine counts its own tokens, so no worker writes: each engine's first worker reports its counts and
    the API server writes their sum (offload/engine_stats.py)."""
    from vllm_expert_offload.exl3.checkpoint import Exl3Checkpoint
    from vllm_expert_offload.exl3.validate import validate_checkpoint
    from vllm_expert_offload.offload.process import ProcessPlacement
    from vllm_expert_offload.offload.rank_plan import ExpertGeometry
    from vllm_expert_offload.testing.tiny_models import build_tiny_model

    summary = validate_checkpoint(Exl3Checkpoint.open(build_tiny_model(None, "qwen3_moe")))
    options = OffloadOptions(host_fraction=0.5)
    engines = []
    for dp_rank in (0, 1):
        geometry = ExpertGeometry(hidden=128, intermediate=256, intermediate_per_rank=128, tp_rank=dp_rank, tp_size=2)
        engines.append(ProcessPlacement(options, summary, geometry, 2, torch.device("cpu"), dp_rank=dp_rank,
                                        dp_size=2))
    assert [p.rank_label() for p in engines] == ["dp rank 0 of 2, tp rank 0 of 2", "dp rank 1 of 2, tp rank 1 of 2"]
    assert [p.writes_stats for p in engines] == [False, False]
    assert [p.reports_engine_counts for p in engines] == [True, True]  # each its engine's TP rank 0
    assert [int(p.host_tier.sum()) for p in engines] == [8, 8]  # each engine: half of every layer's experts, sliced
    for p in engines:
        p.release("test done")
