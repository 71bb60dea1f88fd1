"""The worker methods reachable through collective_rpc (and so through vLLM's dev-mode /collective_rpc, with any
arguments): the save writes the configured file only, and no method zeroes what serving counted."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from vllm_expert_offload.exl3.checkpoint import Exl3Checkpoint
from vllm_expert_offload.exl3.validate import validate_checkpoint
from vllm_expert_offload.integration.methods.quant_config import Exl3Config, ProcessState
from vllm_expert_offload.integration import vllm_hooks
from vllm_expert_offload.integration.startup import worker_rpc
from vllm_expert_offload.offload.options import OffloadOptions
from vllm_expert_offload.offload.process import ProcessPlacement, StartupCountsSpent
from vllm_expert_offload.offload.rank_plan import ExpertGeometry
from vllm_expert_offload.testing.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def summary():
    return validate_checkpoint(Exl3Checkpoint.open(build_tiny_model(None, "qwen3_moe")))


def _worker(summary, record_stats, tp_rank: int = 0, dp_rank: int = 0, dp_size: int = 1,
            first_in_engine: bool = True):
    geometry = ExpertGeometry(hidden=128, intermediate=256, intermediate_per_rank=128, tp_rank=tp_rank, tp_size=2)
    quant_config = Exl3Config.__new__(Exl3Config)
    quant_config.process = ProcessState()
    placement = ProcessPlacement(OffloadOptions(host_fraction=0.0, record_stats=record_stats), summary, geometry, 2,
                                 torch.device("cpu"), dp_rank=dp_rank, dp_size=dp_size, first_in_engine=first_in_engine)
    if placement._exit_save is not None:
        placement._exit_save.cancel()  # no save when the test process ends
    quant_config.process.placement = placement
    return SimpleNamespace(vllm_config=SimpleNamespace(quant_config=quant_config))


def test_save_writes_the_configured_file_and_takes_no_path(tmp_path, summary) -> None:
    configured = tmp_path / "stats.json"
    worker = _worker(summary, configured)
    assert worker_rpc.save_expert_stats(worker) == str(configured)
    assert json.loads(configured.read_text())["format"] == "vllm-expert-offload/routing-counts"
    elsewhere = tmp_path / "elsewhere.json"
    with pytest.raises(TypeError):
        worker_rpc.save_expert_stats(worker, str(elsewhere))  # what a dev-mode client could send
    assert not elsewhere.exists()
    assert worker_rpc.save_expert_stats(_worker(summary, configured, tp_rank=1)) is None
    with pytest.raises(ValueError, match="serve with expert_offload.record_stats"):
        worker_rpc.save_expert_stats(_worker(summary, None))


def test_under_data_parallelism_each_engine_reports_its_counts_and_no_worker_writes(tmp_path, summary) -> None:
    configured = tmp_path / "stats.json"
    # DP rank 1's first worker: MoE TP rank 1 of the flattened TP x DP group, its engine's TP rank 0.
    worker = _worker(summary, configured, tp_rank=1, dp_rank=1, dp_size=2)
    placement = worker.vllm_config.quant_config.process.placement
    assert placement._exit_save is None  # nothing written at exit either: only the API server writes under DP
    placement.counts[1, 5] += 4
    report = worker_rpc.save_expert_stats(worker)
    assert report["dp_rank"] == 1 and report["counts"]["counts"]["1"] == [0, 0, 0, 0, 0, 4, 0, 0]
    assert not configured.exists()
    assert worker_rpc.save_expert_stats(_worker(summary, configured, dp_rank=1, dp_size=2,
                                                first_in_engine=False)) is None
    assert worker_rpc.save_expert_stats(_worker(summary, configured, dp_size=2)) != str(configured)  # rank 0 reports
    assert not configured.exists()


def test_startup_counts_are_dropped_once_then_the_method_is_refused(tmp_path, summary) -> None:
    worker = _worker(summary, tmp_path / "stats.json")
    counts = worker.vllm_config.quant_config.process.placement.counts
    counts += 5  # what vLLM's warm-up runs and the readiness smoke routed
    assert worker_rpc.end_of_startup(worker) is True and int(counts.sum()) == 0
    counts += 1  # serving
    with pytest.raises(StartupCountsSpent):
        worker_rpc.end_of_startup(worker)
    assert int(counts.sum()) == counts.numel()


def test_no_worker_method_resets_the_counts() -> None:
    from vllm.v1.worker.worker_base import WorkerBase

    for addition in vllm_hooks.WORKER_METHODS:
        addition.install()
    ours = {name for name in dir(WorkerBase) if name.startswith("vllm_expert_offload_")}
    assert ours == {worker_rpc.END_OF_STARTUP, worker_rpc.SAVE_STATS, worker_rpc.MEMORY_REPORT,
                    worker_rpc.TIER_COUNTERS}


def test_tier_counters_report_reads_without_resetting_them(tmp_path, summary) -> None:
    worker = _worker(summary, None)
    placement = worker.vllm_config.quant_config.process.placement
    placement.tier_counters.counts[1] += torch.tensor([1, 2, 3, 4, 5, 6])
    placement.tier_counters.add_cpu_busy(1, 0.5)
    first = worker_rpc.tier_counters(worker)
    assert first["layers"] == list(placement.moe_layers) and first["counts"][1] == [1, 2, 3, 4, 5, 6]
    assert first["cpu_busy_s"][1] == 0.5 and first["cpu_busy_s"][0] == 0.0
    assert first["gpu_tier_bytes"] == placement.gpu_tier_bytes() and first["host_tier_bytes"] == 0  # all on GPU
    assert worker_rpc.tier_counters(worker) == first
    with pytest.raises(TypeError):
        worker_rpc.tier_counters(worker, "reset")  # what a dev-mode client could send
