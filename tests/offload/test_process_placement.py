"""One process's placement (offload/process.py): budgets and plan files checked against the GPU's memory by name,
the arena given back when the load fails, the startup counts dropped once and never again."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_expert_offload.exl3.checkpoint import Exl3Checkpoint
from vllm_expert_offload.exl3.validate import validate_checkpoint
from vllm_expert_offload.offload.options import OffloadOptionError, OffloadOptions
from vllm_expert_offload.offload.process import ProcessPlacement, StartupCountsSpent
from vllm_expert_offload.offload.rank_plan import ExpertGeometry
from vllm_expert_offload.placement import save_plan
from vllm_expert_offload.placement.errors import PlacementError
from vllm_expert_offload.testing.tiny_models import build_tiny_model

GIB = 1 << 30
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def summary():
    return validate_checkpoint(Exl3Checkpoint.open(build_tiny_model(None, "qwen3_moe")))


GEOMETRY = ExpertGeometry(hidden=128, intermediate=256, intermediate_per_rank=256, tp_rank=0, tp_size=1)


def _placement(summary, gpu_bytes: int | None = None, **options) -> ProcessPlacement:
    return ProcessPlacement(OffloadOptions(**options), summary, GEOMETRY, 2, CPU, gpu_bytes)


def test_gpu_budget_beyond_the_gpu_is_refused_by_name(summary) -> None:
    with pytest.raises(OffloadOptionError, match=r"--additional-config expert_offload\.gpu_budget_gib: 2 GiB is more "
                                                 r"than this GPU's 1\.00 GiB"):
        _placement(summary, GIB, gpu_budget_gib=2.0)
    assert _placement(summary, GIB, gpu_budget_gib=0.001).gpu_tier.any()  # within the GPU: planned
    assert _placement(summary, None, gpu_budget_gib=2.0).gpu_tier.all()  # no GPU to bound it (CPU)


def _plan_file(tmp_path: Path, summary, gpu_tier: np.ndarray, budget_bytes: int | None) -> Path:
    reference = _placement(summary, host_fraction=0.0)
    path = tmp_path / "plan.json"
    save_plan(path, gpu_tier, reference.identity, budget_bytes=budget_bytes)
    return path


def test_plan_file_within_its_budget_and_the_gpu_is_accepted(tmp_path, summary) -> None:
    sizes = _placement(summary, host_fraction=0.0).record_bytes
    half = np.zeros(sizes.shape, dtype=bool)
    half[:, :4] = True
    path = _plan_file(tmp_path, summary, half, int(sizes[half].sum()))  # to the byte
    assert np.array_equal(_placement(summary, GIB, plan=path).gpu_tier, half)


def test_hand_edited_plan_over_its_budget_is_refused(tmp_path, summary) -> None:
    sizes = _placement(summary, host_fraction=0.0).record_bytes
    path = _plan_file(tmp_path, summary, np.zeros(sizes.shape, dtype=bool), int(sizes[0, 0]))
    doc = json.loads(path.read_text())
    doc["gpu_experts"]["0"] = [0, 1]  # one expert more than the budget it was made for
    path.write_text(json.dumps(doc))
    with pytest.raises(PlacementError, match=f"plan file {path}: its GPU-tier experts take {2 * sizes[0, 0]} bytes, "
                                             f"more than its budget_bytes {sizes[0, 0]}"):
        _placement(summary, None, plan=path)


@pytest.mark.parametrize(("budget", "named"), [(2 * GIB, r"budget_bytes 2147483648 \(2\.00 GiB\) is more than this GPU's"),
                                               (None, r"its GPU-tier experts take \d+ bytes \(\d\.\d\d GiB\), more than "
                                                      r"this GPU's 0\.00 GiB")])
def test_plan_file_beyond_the_gpu_is_refused(tmp_path, summary, budget: int | None, named: str) -> None:
    sizes = _placement(summary, host_fraction=0.0).record_bytes
    path = _plan_file(tmp_path, summary, np.ones(sizes.shape, dtype=bool), budget)
    too_small = int(sizes.sum()) - 1
    with pytest.raises(PlacementError, match=named):
        _placement(summary, too_small if budget is None else GIB, plan=path)


@pytest.mark.parametrize("budget", [-1, 1.5, "many", True])
def test_plan_file_with_a_malformed_budget_is_refused(tmp_path, summary, budget) -> None:
    sizes = _placement(summary, host_fraction=0.0).record_bytes
    path = _plan_file(tmp_path, summary, np.zeros(sizes.shape, dtype=bool), None)
    doc = json.loads(path.read_text())
    doc["budget_bytes"] = budget
    path.write_text(json.dumps(doc))
    with pytest.raises(PlacementError, match=f"plan file {path}: budget_bytes must be"):
        _placement(summary, None, plan=path)


def test_release_gives_the_arena_back_and_cancels_the_exit_save(tmp_path, summary, arena_log) -> None:
    placement = _placement(summary, record_stats=tmp_path / "stats.json", host_fraction=0.5)
    assert placement.arena is not None and placement._exit_save.still_active()
    placement.release("the model load failed: Exl3FormatError: x")
    assert not placement._exit_save.still_active()
    assert arena_log.text.count("host arena released: ") == 1
    assert "unmapped (the model load failed: Exl3FormatError: x)" in arena_log.text
    placement.release("again")
    assert arena_log.text.count("host arena released: ") == 1


def test_startup_counts_are_dropped_once_and_never_again(summary) -> None:
    placement = _placement(summary, record_stats=None, host_fraction=0.5)
    placement.counts += 3
    placement.discard_startup_counts()
    assert int(placement.counts.sum()) == 0
    placement.counts += 1
    with pytest.raises(StartupCountsSpent, match="dropped already"):
        placement.discard_startup_counts()
    assert int(placement.counts.sum()) == placement.counts.numel()


def test_with_a_cache_every_expert_gets_a_host_record_and_slots_cost_the_static_tier(tmp_path) -> None:
    """The slots take what the plan's GPU experts took (one size per layer here), and the arena grows by their
    records: an evicted expert is read from there."""
    from vllm_expert_offload.offload.cache_policy import CacheSettings

    summary = validate_checkpoint(Exl3Checkpoint.open(build_tiny_model(None, "qwen3_moe")))
    geometry = ExpertGeometry(hidden=128, intermediate=256, intermediate_per_rank=256, tp_rank=0, tp_size=1)
    options = OffloadOptions(host_fraction=0.75)
    static = ProcessPlacement(options, summary, geometry, 2, torch.device("cpu"))
    cached = ProcessPlacement(options, summary, geometry, 2, torch.device("cpu"), cache=CacheSettings())
    assert cached.gpu_tier_bytes() == static.gpu_tier_bytes() > 0
    assert sorted(cached.gpu_tier_sizes()) == sorted(static.gpu_tier_sizes())
    assert cached.host_tier_bytes() == int(static.record_bytes.sum()) <= cached.arena.capacity_bytes
    assert [cached.slots(layer) for layer in cached.moe_layers] == [2, 2]
    assert not any(cached.loads_to_gpu(layer, e) for layer in cached.moe_layers for e in range(8))
    assert static.loads_to_gpu(0, 0) and not static.loads_to_gpu(0, 7)
    for placement in (static, cached):
        placement.release("test")
