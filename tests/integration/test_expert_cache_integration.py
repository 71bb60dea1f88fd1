"""The expert cache's integration without an engine (tests/engine/test_expert_cache_serve.py runs it in `vllm serve`):
which backends get a cache, the metrics (summed over ranks, in Prometheus's format through prometheus_client) and
the debug rank check."""

from __future__ import annotations

import asyncio

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vllm_expert_offload.integration.methods.moe_method import _cache_settings
from vllm_expert_offload.integration.methods.rank_check import RanksDisagree, check_ranks_agree
from vllm_expert_offload.integration.startup.metrics import TierMetrics, summed
from vllm_expert_offload.integration.startup.worker_rpc import TIER_COUNTERS
from vllm_expert_offload.kernels.oracle import BackendUnavailable, KernelChoice
from vllm_expert_offload.offload.options import parse_offload_options

# columns: gpu_reads, host_reads, host_read_bytes, fills, evictions, cpu_reads
RANK0 = {"layers": [3, 7], "counts": [[5, 3, 300, 2, 1, 4], [0, 8, 800, 4, 0, 0]], "cpu_busy_s": [0.25, 0.0],
         "gpu_tier_bytes": 10, "host_tier_bytes": 40}
RANK1 = {"layers": [3, 7], "counts": [[5, 3, 310, 2, 1, 2], [0, 8, 790, 4, 0, 0]], "cpu_busy_s": [0.5, 0.0],
         "gpu_tier_bytes": 11, "host_tier_bytes": 41}


def _scrape(metrics: TierMetrics) -> dict:
    registry = CollectorRegistry()
    registry.register(metrics)
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_are_the_ranks_counters_summed() -> None:
    metrics = TierMetrics()
    assert _scrape(metrics) == {}  # nothing before the first poll
    metrics.latest = summed([RANK0, None, RANK1])  # a rank without EXL3 experts answers None
    got = _scrape(metrics)
    assert got[("vllm_expert_offload_expert_reads_total", (("layer", "3"), ("tier", "gpu")))] == 10
    assert got[("vllm_expert_offload_expert_reads_total", (("layer", "7"), ("tier", "host")))] == 16
    assert got[("vllm_expert_offload_host_read_bytes_total", (("layer", "3"),))] == 610
    assert got[("vllm_expert_offload_cache_fills_total", (("layer", "7"),))] == 8
    assert got[("vllm_expert_offload_cache_evictions_total", (("layer", "3"),))] == 2
    assert got[("vllm_expert_offload_expert_reads_total", (("layer", "3"), ("tier", "cpu")))] == 6
    assert got[("vllm_expert_offload_expert_reads_total", (("layer", "7"), ("tier", "cpu")))] == 0
    assert got[("vllm_expert_offload_cpu_tier_busy_seconds_total", (("layer", "3"),))] == 0.75
    assert got[("vllm_expert_offload_cache_hit_rate", (("layer", "3"),))] == pytest.approx(10 / 22)  # cpu: misses
    assert got[("vllm_expert_offload_cache_hit_rate", (("layer", "7"),))] == 0.0
    assert got[("vllm_expert_offload_tier_bytes", (("tier", "gpu"),))] == 21
    assert got[("vllm_expert_offload_tier_bytes", (("tier", "host"),))] == 81
    assert summed([None, None]) is None


def test_poll_asks_the_workers_and_survives_a_failed_call() -> None:
    class Client:
        calls = 0

        async def collective_rpc(self, method):
            assert method == TIER_COUNTERS
            Client.calls += 1
            if Client.calls == 1:
                raise RuntimeError("engine busy")
            return [RANK0, RANK1]

    async def run() -> TierMetrics:
        metrics = TierMetrics()
        task = asyncio.get_running_loop().create_task(metrics.poll(Client(), 0.01))
        while Client.calls < 3:
            await asyncio.sleep(0.01)
        task.cancel()
        return metrics

    metrics = asyncio.run(run())
    assert metrics.latest["counts"].tolist() == [[10, 6, 610, 4, 2, 6], [0, 16, 1590, 8, 0, 0]]


def test_poll_under_data_parallelism_sums_every_engines_workers() -> None:
    """`collective_rpc` answers with the first engine's workers only: under DP 2 the poll asks each engine (the
    engine core client's per-engine utility call) and sums both engines' ranks."""
    class Client:
        calls: list[tuple] = []

        async def collective_rpc(self, method):
            raise AssertionError("under DP, collective_rpc would answer for the first engine only")

        @property
        def engine_core(self):
            return self

        async def call_utility_all_async(self, method, *args):
            Client.calls.append((method, *args))
            return [[RANK0, None], [RANK1, None]]  # per engine: each worker's answer

    async def run() -> TierMetrics:
        metrics = TierMetrics()
        task = asyncio.get_running_loop().create_task(metrics.poll(Client(), 0.01, dp_size=2))
        for _ in range(100):  # a poll that asked collective_rpc logs its failure and never calls per engine
            if Client.calls:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        return metrics

    metrics = asyncio.run(run())
    assert Client.calls and Client.calls[0] == ("collective_rpc", TIER_COUNTERS, None, (), None)
    assert metrics.latest["counts"].tolist() == [[10, 6, 610, 4, 2, 6], [0, 16, 1590, 8, 0, 0]]


def test_rank_check_passes_equal_states_and_names_the_layer_of_a_divergence() -> None:
    digest = torch.tensor([11, 22])
    check_ranks_agree("model.layers.1.mlp.experts", digest, lambda d: torch.stack([d, d.clone()]))
    with pytest.raises(RanksDisagree, match=r"model\.layers\.1\.mlp\.experts differ .*\[\[11, 22\], \[11, 23\]\]"):
        check_ranks_agree("model.layers.1.mlp.experts", digest, lambda d: torch.stack([d, d + torch.tensor([0, 1])]))


DYNAMIC = parse_offload_options({"expert_offload": {"host_fraction": 0.5, "dynamic": {"policy": "lru"}}})


def test_only_a_write_through_backend_gets_a_cache_the_others_serve_static_and_say_so(caplog) -> None:
    assert _cache_settings(DYNAMIC, KernelChoice("cpu", "cpu", "auto"), False) == DYNAMIC.dynamic
    assert _cache_settings(DYNAMIC, KernelChoice("triton", "triton", "auto"), False) == DYNAMIC.dynamic
    static = parse_offload_options({"expert_offload": {"host_fraction": 0.5}})
    assert _cache_settings(static, KernelChoice("cpu", "cpu", "auto"), False) is None
    for name, fallback in (("exllamav3", "triton"), ("exllamav3", None), ("torch", None)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="vllm.expert_offload"):
            assert _cache_settings(DYNAMIC, KernelChoice(name, name, "auto", fallback), False) is None
        assert f"routed experts run the {name} backend, which cannot store an expert" in caplog.text
        assert "serving the static plan" in caplog.text


def test_dynamic_with_expert_parallelism_refused_by_name() -> None:
    with pytest.raises(BackendUnavailable, match=r"expert_offload\.dynamic: .*expert parallelism"):
        _cache_settings(DYNAMIC, KernelChoice("cpu", "cpu", "auto"), True)
