"""`simulate-cache` (tools/simulate_cache_cmd.py, cache_workloads.py, cache_replay.py) on small generated routing
folders with hand-computed answers; the sampler's selection probabilities; the static baselines on the real data
(no replay: the full replays are benchmarks, docs/benchmarks.md), skipped without ../shared."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_expert_offload.cli import main
from vllm_expert_offload.placement.errors import PlacementError
from vllm_expert_offload.tools.cache_replay import static_host_share
from vllm_expert_offload.tools.cache_workloads import inclusion_probabilities, load_workload, sample_tokens

ROUTING = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "routing"


@pytest.fixture
def trace_folder(tmp_path: Path) -> Path:
    """One layer, 8 experts, top-2: held-out prompts 3 (50 tokens of experts 0, 1) and 4 (50 of 4, 5); the counts
    of prompts 1 and 2 favour 6, 7, then 2, 3. The held-out prompts' own counts (favouring 0, 1) must not calibrate."""
    ids = np.array([[[0, 1]]] * 50 + [[[4, 5]]] * 50, dtype=np.uint8)
    np.savez(tmp_path / "x_topk.npz", expert_ids=ids, prompt_offsets=np.array([0, 50, 100]),
             prompt_ids=np.array([3, 4]), moe_layer_ids=np.array([0]))
    counts = np.zeros((4, 1, 8), dtype=np.int64)
    counts[0, 0] = [0, 0, 5, 0, 0, 0, 9, 0]
    counts[1, 0] = [0, 0, 0, 5, 0, 0, 0, 9]
    counts[2:, 0, :2] = 1000
    np.savez(tmp_path / "x_per_prompt_counts.npz", counts=counts, prompt_ids=np.array([1, 2, 3, 4]),
             moe_layer_ids=np.array([0]))
    return tmp_path


def _run(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "out.json"
    assert main(["simulate-cache", *args, "--json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("policy", ["lru", "decayed-lfu"])
def test_a_cache_follows_the_prompts_where_the_static_plan_cannot(trace_folder: Path, policy: str) -> None:
    result = _run(trace_folder, "--data", str(trace_folder), "--budget", "0.5", "--policy", policy)
    # 4 slots start with 6, 7, 2, 3 (calibration); the first token of each prompt misses twice and installs both
    # experts (in place of 2, 3, then of 6, 7, whose scores are the lowest); the other 98 tokens hit
    assert (result["slots_per_layer"], result["reads"], result["host_reads"]) == (4, 200, 4)
    assert result["host_read_share"] == pytest.approx(0.02)
    assert (result["fills"], result["evictions"], result["moves_per_1k_tokens"]) == (4, 4, 40.0)
    assert result["static"] == {"calibrated_elsewhere": 1.0, "oracle_in_sample": 0.0, "oracle_per_block": 0.0}


def test_off_keeps_the_starting_slots(trace_folder: Path) -> None:
    result = _run(trace_folder, "--data", str(trace_folder), "--budget", "0.5", "--policy", "off")
    assert (result["host_read_share"], result["fills"]) == (1.0, 0)


def test_a_zero_budget_reads_everything_from_host(trace_folder: Path) -> None:
    result = _run(trace_folder, "--data", str(trace_folder), "--budget", "0", "--policy", "lru")
    assert (result["host_read_share"], result["fills"], result["slots_per_layer"]) == (1.0, 0, 0)


def test_bad_flags_exit_with_the_flag_named(trace_folder: Path, tmp_path: Path, capsys) -> None:
    assert main(["simulate-cache", "--data", str(trace_folder), "--budget", "1.5"]) == 2
    assert "--budget" in capsys.readouterr().err
    counts_only = tmp_path / "counts"
    counts_only.mkdir()
    np.savez(counts_only / "a.npz", counts=np.ones((2, 4)))
    np.savez(counts_only / "b.npz", counts=np.ones((2, 4)))
    assert main(["simulate-cache", "--data", str(counts_only), "--budget", "0.5"]) == 2
    assert "--top-k" in capsys.readouterr().err
    np.savez(counts_only / "c.npz", counts=np.ones((3, 4)))
    assert main(["simulate-cache", "--data", str(counts_only), "--budget", "0.5", "--top-k", "2"]) == 2
    assert "--subset" in capsys.readouterr().err


@pytest.fixture
def count_folder(tmp_path: Path) -> Path:
    """Two domains of 2 layers x 6 experts whose hot experts differ."""
    np.savez(tmp_path / "one.npz", counts=np.array([[50, 30, 10, 5, 3, 2]] * 2, dtype=float))
    np.savez(tmp_path / "two.npz", counts=np.array([[2, 3, 5, 10, 30, 50]] * 2, dtype=float))
    return tmp_path


def test_count_sets_become_seeded_blocks_calibrated_on_the_other_sets(count_folder: Path) -> None:
    workload = load_workload(count_folder, top_k=2, block_tokens=300, seed=1)
    assert workload.shape == (600, 2, 2) and [b.name for b in workload.blocks] == ["one", "two"]
    assert workload.blocks[0].calibration[0].tolist() == [2, 3, 5, 10, 30, 50]
    assert np.array_equal(workload.expert_ids, load_workload(count_folder, top_k=2, block_tokens=300,
                                                             seed=1).expert_ids)
    assert not np.array_equal(workload.expert_ids, load_workload(count_folder, top_k=2, block_tokens=300,
                                                                 seed=2).expert_ids)
    # calibrated on the other domain, a static plan keeps the wrong half; in-sample per block, the right one
    assert static_host_share(workload, 0.5, "calibrated_elsewhere") > 0.7
    assert static_host_share(workload, 0.5, "oracle_per_block") < 0.2
    result = _run(count_folder, "--data", str(count_folder), "--budget", "0.5", "--top-k", "2", "--block-tokens",
                  "300", "--policy", "decayed-lfu")
    assert result["tokens"] == 600 and result["host_read_share"] < result["static"]["calibrated_elsewhere"]


def test_inclusion_probabilities_are_count_shares_times_k_capped_at_one() -> None:
    pi = inclusion_probabilities(np.array([[1, 1, 2, 4, 8], [1, 1, 1, 1, 12]]), 2)
    np.testing.assert_allclose(pi, [[0.125, 0.125, 0.25, 0.5, 1.0], [0.25, 0.25, 0.25, 0.25, 1.0]])
    with pytest.raises(PlacementError, match="top_k=3"):
        inclusion_probabilities(np.array([[5, 5, 0, 0]]), 3)


def test_sampled_tokens_select_distinct_experts_at_those_probabilities() -> None:
    counts = np.array([[1, 1, 2, 4, 8], [1, 1, 1, 1, 12], [3, 1, 4, 1, 5]])
    ids = sample_tokens(counts, 2, 20_000, torch.Generator().manual_seed(0))
    assert ids.shape == (20_000, 3, 2) and (ids[..., 0] != ids[..., 1]).all()
    frequency = np.stack([np.bincount(ids[:, layer].ravel(), minlength=5) for layer in range(3)]) / 20_000
    np.testing.assert_allclose(frequency, inclusion_probabilities(counts, 2), atol=0.015)


@pytest.mark.skipif(not ROUTING.is_dir(), reason=f"shared routing data not present at {ROUTING}")
def test_static_baselines_on_moe_beyond_match_bench_placement() -> None:
    """The issue's "static, calibrated elsewhere" (= bench_placement's planner (counts)) and in-sample oracle."""
    workload = load_workload(ROUTING / "moe-beyond")
    assert workload.shape == (97_858, 26, 6) and "999 other prompts" in workload.description
    shares = [round(100 * static_host_share(workload, budget, plan), 1)
              for budget in (0.25, 0.5) for plan in ("calibrated_elsewhere", "oracle_in_sample")]
    assert shares == [67.3, 67.0, 41.4, 41.1]
