"""The CPU tier's per-step split: which routed experts may leave the device path, and the ids each tier gets."""

from __future__ import annotations

import torch

from vllm_expert_offload.offload.cpu_tier import CpuTierSettings, TierSplit, routed_tokens, split_ids
from vllm_expert_offload.placement.cost import TierRates

FAST_CPU = TierRates(((1, 1e12),), device_bytes_per_s=1.0)  # the CPU takes every candidate under "auto" too
BYTES = torch.tensor([10, 10, 10, 10, 10], dtype=torch.int64)


def test_routed_tokens_ignore_other_ranks_entries():
    ids = torch.tensor([[0, 3], [3, -1], [4, 0]])
    assert routed_tokens(ids, 5).tolist() == [2, 0, 0, 2, 1]


def test_split_ids_puts_each_entry_in_one_tier_and_keeps_minus_one():
    ids = torch.tensor([[0, 3], [3, -1], [4, 1]])
    on_cpu = torch.tensor([False, True, False, True, False])
    device, cpu = split_ids(ids, on_cpu)
    assert device.tolist() == [[0, -1], [-1, -1], [4, -1]]
    assert cpu.tolist() == [[-1, 3], [3, -1], [-1, 1]]


def test_only_routed_host_resident_unfilled_experts_go_to_the_cpu():
    ids = torch.tensor([[0, 1], [2, 3]])
    resident = torch.tensor([True, False, False, False, False])  # expert 0 in GPU memory
    filled = torch.tensor([False, False, True, False, False])  # expert 2 written into a cache slot by this read
    for split in ("all", "auto"):
        tier = TierSplit(CpuTierSettings(split=split), FAST_CPU, BYTES)
        assert tier.on_cpu(ids, resident, filled).tolist() == [False, True, False, True, False]  # 4: not routed
        assert tier.on_cpu(ids, resident).tolist() == [False, True, True, True, False]


def test_auto_keeps_misses_on_the_device_when_the_cpu_is_slower():
    slow = TierRates(((1, 0.5),), device_bytes_per_s=1.0)
    tier = TierSplit(CpuTierSettings(split="auto"), slow, BYTES)
    assert not tier.on_cpu(torch.tensor([[1, 2]]), torch.zeros(5, dtype=torch.bool)).any()
    every = TierSplit(CpuTierSettings(split="all"), slow, BYTES)
    assert every.on_cpu(torch.tensor([[1, 2]]), torch.zeros(5, dtype=torch.bool)).tolist() == [
        False, True, True, False, False]


def test_steps_above_max_tokens_stay_on_the_device():
    tier = TierSplit(CpuTierSettings(max_tokens=3), FAST_CPU, BYTES)
    assert tier.active(3) and not tier.active(4)


def test_the_split_makes_no_host_sync_on_meta():
    tier = TierSplit(CpuTierSettings(split="auto"), FAST_CPU, BYTES.to("meta"))
    tier.seconds_per_byte = tier.seconds_per_byte.to("meta")
    flags = torch.empty(5, dtype=torch.bool, device="meta")
    on_cpu = tier.on_cpu(torch.empty(4, 2, dtype=torch.int64, device="meta"), flags, flags)
    device, cpu = split_ids(torch.empty(4, 2, dtype=torch.int64, device="meta"), on_cpu)
    assert on_cpu.shape == (5,) and device.shape == cpu.shape == (4, 2)
