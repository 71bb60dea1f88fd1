"""The CPU tier's busy time per layer (offload/counters.py): jobs that time themselves where they run (a GPU's host
functions, which a replayed graph runs with no Python) are asked for it whenever the counters are read."""

from __future__ import annotations

import torch

from vllm_expert_offload.offload.counters import TierCounters


def test_busy_sources_report_whenever_the_counters_are_read() -> None:
    counters = TierCounters(2, torch.device("cpu"))
    pending = [0.25, 0.5]
    counters.add_busy_source(lambda: counters.add_cpu_busy(1, pending.pop(0)) if pending else None)
    counters.add_cpu_busy(0, 1.0)  # a job on the CPU engine reports at once
    assert counters.cpu_busy_s.tolist() == [1.0, 0.25]
    assert counters.cpu_busy_s.tolist() == [1.0, 0.75]
    assert counters.cpu_busy_s.tolist() == [1.0, 0.75]
