"""The CPU tier's step in a layer's runtime forward (MoERuntime with the tier), in process on the compiled CPU
kernel: the device path and the tier together equal the device path alone (with and without the expert cache,
whose policy must decide exactly as if the device had read every miss), reads counted by tier, the tier's partial
sums deterministic, the whole forward free of host synchronisation on meta, and the probe."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

from vllm_expert_offload.integration.methods.cpu_tier_step import CpuTierStep
from vllm_expert_offload.integration.methods.moe_runtime import MoERuntime
from vllm_expert_offload.kernels import host_tier
from vllm_expert_offload.kernels.contract import MoELayer
from vllm_expert_offload.kernels.cpu_exl3 import BACKEND as CPU_BACKEND
from vllm_expert_offload.kernels.cpu_exl3 import CPU_MATMUL
from vllm_expert_offload.kernels.expert_slots import ExpertSlots, expert_trellis_bytes
from vllm_expert_offload.kernels.host_tier import build_host_tier, probe_counts, probe_rates
from vllm_expert_offload.kernels.oracle import BackendUnavailable
from vllm_expert_offload.kernels.pointer_tables import build_pointer_tables, kernel_address, stack_scales
from vllm_expert_offload.kernels.rotated import RotatedMoE
from vllm_expert_offload.memory import HostArena
from vllm_expert_offload.offload import counters as tier_counters
from vllm_expert_offload.offload.cache_policy import CacheSettings
from vllm_expert_offload.offload.cpu_tier import CpuTierSettings, TierSplit
from vllm_expert_offload.offload.tiers import host_record_bytes, place_expert, record_layout
from vllm_expert_offload.placement.cost import TierRates

from support.host_jobs import MAX_TOKENS, meta_tier
from support.meta_proof import META, forward_on_meta, meta_moe_layer, meta_routing
from support.moe_layers import CPU, FULL, HIDDEN, TIERS, assert_close_to_reference, expert_sets

FAST_CPU = TierRates(((1, 1e15),), device_bytes_per_s=1.0)  # "auto" then takes every candidate
SLOW_CPU = TierRates(((1, 1.0),), device_bytes_per_s=1e15)  # "auto" then takes none


def _layer(cache: CacheSettings | None = None) -> MoELayer:
    """The mixed-K test layer: TIERS' GPU experts (with a cache: every expert in a host record, the same experts
    starting in 2 slots)."""
    sets = expert_sets(0)
    in_gpu = [gpu and cache is None for gpu in TIERS]
    arena = HostArena(sum(host_record_bytes(s) for s, g in zip(sets, in_gpu) if not g), device=CPU)
    experts, scales = stack_scales([place_expert(s, g, arena, CPU) for s, g in zip(sets, in_gpu)], CPU)
    tables = build_pointer_tables(experts, kernel_address(arena, CPU), CPU)
    slots = None
    if cache is not None:
        slots = ExpertSlots(experts, tables, cache, TIERS, max(record_layout(e.projections)[1] for e in experts), CPU)
    return MoELayer(experts, tables, scales, arena, FULL, torch.float32, CPU, top_k=2, cache=slots)


def _step(layer: MoELayer, split: str, rates: TierRates = FAST_CPU) -> tuple[MoERuntime, tier_counters.TierCounters]:
    """The layer's runtime with the tier: the compiled CPU kernel as the device path, counters of one layer."""
    counters = tier_counters.TierCounters(1, CPU)
    nbytes = expert_trellis_bytes(layer.experts, CPU)
    host = build_host_tier(layer, False, functools.partial(counters.add_cpu_busy, 0))
    tier = CpuTierStep(TierSplit(CpuTierSettings(split=split), rates, nbytes), host, layer.cache,
                       layer.tables.in_gpu_tier, counters, 0)
    runtime = MoERuntime(
        op_name="model.layers.0.mlp.experts.exl3", layer_index=0, counter_row=0, geometry=None, tables=layer.tables,
        expert_bytes=nbytes, kernel=CPU_BACKEND.build_moe(layer), cache=layer.cache,
        placement=SimpleNamespace(recording=False, tier_counters=counters), expert_map=None,
        num_local_experts=len(layer.experts), apply_router_weight_on_input=False, check_ranks=False, cpu_tier=tier,
    )
    return runtime, counters


def _routing(tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(len(TIERS), generator=gen)[:2] for _ in range(tokens)])
    return torch.randn(tokens, HIDDEN, generator=gen), torch.rand(tokens, 2, generator=gen), ids


@pytest.mark.parametrize("split", ["all", "auto"])
def test_both_tiers_equal_the_device_path_alone_and_count_cpu_reads(split: str) -> None:
    layer = _layer()
    step, counters = _step(layer, split)
    device_only = CPU_BACKEND.build_moe(layer)
    host = torch.tensor([not g for g in TIERS])
    for tokens, seed in ((1, 1), (3, 2), (7, 3)):  # 7: not a power of two
        x, weights, ids = _routing(tokens, seed)
        got = step.forward(x, weights, ids)
        assert_close_to_reference(got, device_only.forward(x, weights, ids, False))
        assert torch.equal(got, step.forward(x, weights, ids))  # deterministic for a given split
    row = counters.counts[0]
    assert int(row[tier_counters.CPU_READS]) > 0 and int(row[tier_counters.HOST_READS]) == 0
    assert int(row[tier_counters.GPU_READS]) + int(row[tier_counters.CPU_READS]) == 2 * 2 * (1 + 3 + 7)
    assert counters.cpu_busy_s[0] > 0
    assert host.any()


def test_a_slower_cpu_leaves_every_read_on_the_device() -> None:
    layer = _layer()
    step, counters = _step(layer, "auto", SLOW_CPU)
    x, weights, ids = _routing(5, 4)
    want = CPU_BACKEND.build_moe(layer).forward(x, weights, ids, False)
    assert torch.equal(step.forward(x, weights, ids), want)
    assert int(counters.counts[0, tier_counters.CPU_READS]) == 0 and int(counters.counts[0, tier_counters.HOST_READS])


def test_other_ranks_entries_stay_out_of_both_tiers() -> None:
    layer = _layer()
    step, counters = _step(layer, "all")
    x, weights, ids = _routing(4, 5)
    ids[:, 1] = -1  # expert parallelism: the second choice of every token is another rank's expert
    want = CPU_BACKEND.build_moe(layer).forward(x, torch.where(ids >= 0, weights, 0.0), ids.clamp(min=0), False)
    assert_close_to_reference(step.forward(x, weights, ids), want)
    reads = counters.counts[0]
    assert int(reads[tier_counters.GPU_READS] + reads[tier_counters.HOST_READS] + reads[tier_counters.CPU_READS]) == 4


def _assert_slots_hold_their_experts(layer: MoELayer) -> None:
    """Each resident expert's slot holds its trellis bytes: every fill was written by a device read."""
    cache = layer.cache
    for expert, slot in enumerate(cache.policy.slot_of_expert.tolist()):
        if slot < 0:
            continue
        offsets, _ = record_layout(layer.experts[expert].projections)
        for p, linear in layer.experts[expert].projections.items():
            held = cache.pool[slot, offsets[p]: offsets[p] + linear.trellis.numel() * 2]
            assert torch.equal(held, linear.trellis.reshape(-1).view(torch.uint8)), (expert, p)


def test_the_cache_decides_as_if_the_device_read_every_miss() -> None:
    """The tier's misses are still misses to the policy: slots and fills follow the device-only run step by step,
    and an expert filled this step stays on the device (its read writes the slot)."""
    settings = CacheSettings("lru", 2.0)
    tiered_layer, plain_layer = _layer(settings), _layer(settings)
    step, counters = _step(tiered_layer, "all")
    plain = CPU_BACKEND.build_moe(plain_layer)
    for tokens, seed in ((1, 6), (2, 7), (1, 8), (5, 9), (1, 10), (3, 11)):
        x, weights, ids = _routing(tokens, seed)
        got = step.forward(x, weights, ids)
        assert_close_to_reference(got, plain.forward(x, weights, ids, False))
        assert torch.equal(tiered_layer.cache.policy.slot_of_expert, plain_layer.cache.policy.slot_of_expert)
        assert torch.equal(tiered_layer.tables.in_gpu_tier, plain_layer.tables.in_gpu_tier)
        _assert_slots_hold_their_experts(tiered_layer)
    assert int(counters.counts[0, tier_counters.CPU_READS]) > 0


@pytest.mark.parametrize("split", ["all", "auto"])
def test_a_layers_forward_with_the_tier_on_runs_with_every_tensor_on_meta(split: str) -> None:
    """The runtime's steps (cache-less split, CPU reads counted, the stream tier's job, device kernel, add)."""
    layer = meta_moe_layer(expert_sets(0), FULL)
    counters = tier_counters.TierCounters(1, META)
    nbytes = expert_trellis_bytes(layer.experts, META)
    rates = TierRates(((1, 1e9), (8, 4e9)), device_bytes_per_s=2e9)
    tier, order = meta_tier()
    runtime = MoERuntime(
        op_name="model.layers.0.mlp.experts.exl3", layer_index=0, counter_row=0, geometry=None, tables=layer.tables,
        expert_bytes=nbytes, kernel=RotatedMoE(layer.experts, layer.tables, layer.scales, None, FULL, META, CPU_MATMUL),
        cache=None, placement=SimpleNamespace(recording=False, tier_counters=counters), expert_map=None,
        num_local_experts=len(layer.experts), apply_router_weight_on_input=False, check_ranks=False,
        cpu_tier=CpuTierStep(TierSplit(CpuTierSettings(split=split, max_tokens=MAX_TOKENS), rates, nbytes), tier,
                             None, layer.tables.in_gpu_tier, counters, 0),
    )
    assert forward_on_meta(runtime.forward, *meta_routing(3, 2, HIDDEN)).shape == (3, HIDDEN)
    assert len(order.launches) == 2 and counters.counts[0, tier_counters.CPU_READS].device == META
    forward_on_meta(runtime.forward, *meta_routing(MAX_TOKENS + 1, 2, HIDDEN))  # above max_tokens: no job
    assert len(order.launches) == 2


def test_probe_measures_each_count_within_its_budget() -> None:
    assert probe_counts(64) == [1, 2, 4, 8, 16, 32, 64] and probe_counts(6) == [1, 2, 4, 6] and probe_counts(1) == [1]
    layer = _layer()
    tier = build_host_tier(layer, False, lambda seconds: None)
    host_expert = TIERS.index(False)
    nbytes = int(expert_trellis_bytes(layer.experts, CPU)[host_expert])
    rates = probe_rates(tier, host_expert, nbytes, HIDDEN, torch.float32, CpuTierSettings(max_tokens=6), budget_s=1e3)
    assert [n for n, _ in rates.cpu_points] == [1, 2, 4, 6]
    assert rates.device_bytes_per_s == rates.cpu_points[0][1]  # the CPU engine: the same kernel, the same record
    cut = probe_rates(tier, host_expert, nbytes, HIDDEN, torch.float32, CpuTierSettings(max_tokens=6), budget_s=0.0)
    assert [n for n, _ in cut.cpu_points] == [1]


def test_a_tier_without_the_compiled_kernel_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_tier, "cpu_kernel_unavailable", lambda: "no compiler")
    with pytest.raises(BackendUnavailable, match=r"expert_offload\.cpu_tier: the CPU tier computes with the "
                                                 r"compiled CPU kernel, which cannot here: no compiler"):
        build_host_tier(_layer(), False, print)
