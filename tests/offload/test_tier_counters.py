"""TierCounters.count_reads: token x expert reads by tier and the host bytes of the distinct host experts read,
checked against hand counts; an id of -1 (another expert-parallel rank's expert) counts nowhere."""

from __future__ import annotations

import torch

from vllm_expert_offload.offload.counters import COLUMNS, TierCounters


def _row(counters: TierCounters) -> dict[str, int]:
    return dict(zip(COLUMNS, map(int, counters.snapshot()[0])))


def test_reads_by_tier_and_distinct_host_bytes() -> None:
    counters = TierCounters(1, torch.device("cpu"))
    resident = torch.tensor([True, False, False, True])
    sizes = torch.tensor([10, 20, 40, 80])
    counters.count_reads(0, torch.tensor([[0, 1], [1, 2], [3, 1]]), resident, sizes)
    row = _row(counters)
    assert list(row.values())[:3] == [2, 4, 60]  # gpu reads (0, 3), host reads (1 x3, 2), bytes of 1 and 2 once


def test_other_ranks_experts_are_not_counted() -> None:
    counters = TierCounters(1, torch.device("cpu"))
    resident = torch.tensor([False, True])
    sizes = torch.tensor([10, 20])
    counters.count_reads(0, torch.tensor([[-1, 1], [-1, -1]]), resident, sizes)
    assert list(_row(counters).values())[:3] == [1, 0, 0]  # expert 0 (host) never read: -1 is not expert 0
