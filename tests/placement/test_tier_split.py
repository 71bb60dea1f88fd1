"""The CPU tier's cost model: the rate table the split reads, and the per-step split itself, against plain-Python
references (every prefix of the (tokens, id) order tried by hand) and hand-worked cases."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from vllm_expert_offload.placement.cost import TierRates, balanced_cpu_split
from vllm_expert_offload.placement.errors import PlacementError


def test_rate_table_takes_the_next_probed_count_and_extrapolates_linearly():
    rates = TierRates(((1, 10.0), (2, 8.0), (8, 2.0)), device_bytes_per_s=5.0)
    table = rates.cpu_seconds_per_byte(12)
    want = [0.0, 0.1, 0.125, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5 * 9 / 8, 0.5 * 10 / 8, 0.5 * 11 / 8, 0.5 * 12 / 8]
    assert table.tolist() == pytest.approx(want)


def test_rate_table_never_falls_as_tokens_grow():
    # a probe that measured 4 tokens faster per byte than 2 (noise) must not make 3-4 tokens look cheaper than 2
    table = TierRates(((1, 10.0), (2, 4.0), (4, 5.0)), device_bytes_per_s=5.0).cpu_seconds_per_byte(4)
    assert table.tolist() == pytest.approx([0.0, 0.1, 0.25, 0.25, 0.25])


@pytest.mark.parametrize("points, device, overhead, field", [
    ((), 1.0, 0.0, "cpu_points"),
    (((2, 1.0), (1, 1.0)), 1.0, 0.0, "cpu_points"),
    (((1, 1.0), (1, 2.0)), 1.0, 0.0, "cpu_points"),
    (((0, 1.0),), 1.0, 0.0, "cpu_points"),
    (((1, 0.0),), 1.0, 0.0, "cpu_points"),
    (((1, float("nan")),), 1.0, 0.0, "cpu_points"),
    (((1, 1.0),), 0.0, 0.0, "device_bytes_per_s"),
    (((1, 1.0),), float("inf"), 0.0, "device_bytes_per_s"),
    (((1, 1.0),), 1.0, -1e-6, "cpu_overhead_s"),
])
def test_bad_rates_are_refused_by_name(points, device, overhead, field):
    with pytest.raises(PlacementError, match=field):
        TierRates(points, device, overhead)


def _reference(table, device_rate, overhead, tokens, candidates, nbytes, base=0.0):
    """Every prefix of the candidates sorted by (tokens, id) tried in plain Python; the first best one wins."""
    order = sorted((t, e) for e, (t, c) in enumerate(zip(tokens, candidates)) if c)
    device_all = base + sum(nbytes[e] / device_rate for _, e in order)
    best, best_k = None, 0
    for k in range(len(order) + 1):
        cpu = sum(nbytes[e] * table[t] for t, e in order[:k]) + (overhead if k else 0.0)
        device = device_all - sum(nbytes[e] / device_rate for _, e in order[:k])
        step = max(device, cpu)
        if best is None or step < best - 1e-15:
            best, best_k = step, k
    return sorted(e for _, e in order[:best_k])


def _split(rates, tokens, candidates, nbytes, base=0.0):
    table = torch.from_numpy(rates.cpu_seconds_per_byte(int(np.max(tokens))))
    out = balanced_cpu_split(table, rates.device_bytes_per_s, rates.cpu_overhead_s, torch.tensor(tokens),
                             torch.tensor(candidates), torch.tensor(nbytes), base)
    return out


def test_hand_worked_split_balances_the_tiers():
    # device 1 B/s; CPU 2 B/s at 1 token, 1 B/s at 2 tokens. Four candidates of 4 bytes: the device alone needs 16 s.
    # Ordered by tokens: experts 3 (1 tok), 0 (1 tok)... Taking 3 and 1 (both 1 token, 2 s each on the CPU) leaves
    # 8 s on the device against 4 s on the CPU; adding expert 0 (2 tokens, 4 s) gives device 4 s / CPU 8 s:
    # no better, and the shorter prefix wins the tie.
    rates = TierRates(((1, 2.0), (2, 1.0)), device_bytes_per_s=1.0)
    mask = _split(rates, [2, 1, 2, 1], [True] * 4, [4, 4, 4, 4])
    assert torch.nonzero(mask).flatten().tolist() == [1, 3]


def test_ties_go_to_the_lower_expert_id():
    rates = TierRates(((1, 1.0),), device_bytes_per_s=1.0)
    mask = _split(rates, [1, 1, 1], [True] * 3, [2, 2, 2])  # 3 equal experts: one or two of them on the CPU
    assert torch.nonzero(mask).flatten().tolist() == [0]  # max(4, 2) = 4 with one, max(2, 4) = 4 with two: shortest


def test_non_candidates_never_leave_the_device_and_base_work_shifts_the_split():
    rates = TierRates(((1, 1.0),), device_bytes_per_s=1.0)
    assert not _split(rates, [1, 1], [False, False], [5, 5]).any()
    assert torch.nonzero(_split(rates, [1, 1, 1], [True, False, True], [3, 3, 3])).flatten().tolist() == [0]
    # with 6 s of resident work already on the device, both host misses go to the CPU (6 s against 6 s)
    both = _split(rates, [1, 1, 1], [True, False, True], [3, 3, 3], base=6.0)
    assert torch.nonzero(both).flatten().tolist() == [0, 2]


def test_a_slow_cpu_or_a_large_overhead_takes_nothing():
    slow = TierRates(((1, 0.01),), device_bytes_per_s=1.0)
    assert not _split(slow, [1, 1], [True, True], [3, 3]).any()
    costly = TierRates(((1, 100.0),), device_bytes_per_s=1.0, cpu_overhead_s=10.0)
    assert not _split(costly, [1, 1], [True, True], [3, 3]).any()


@pytest.mark.parametrize("seed", range(6))
def test_batched_split_equals_the_reference_per_step(seed):
    rng = random.Random(seed)
    experts = rng.choice([5, 7, 16])  # non-powers of two too
    rates = TierRates(((1, rng.uniform(0.5, 4)), (2, rng.uniform(0.3, 2)), (4, rng.uniform(0.1, 1))),
                      device_bytes_per_s=rng.uniform(0.5, 3), cpu_overhead_s=rng.choice([0.0, 0.5]))
    steps = 9
    tokens = [[rng.randint(0, 6) for _ in range(experts)] for _ in range(steps)]
    candidates = [[t > 0 and rng.random() < 0.7 for t in row] for row in tokens]
    nbytes = [rng.choice([3, 4, 6]) for _ in range(experts)]  # mixed bitrates: experts of different sizes
    mask = _split(rates, tokens, candidates, nbytes)
    table = rates.cpu_seconds_per_byte(6)
    for step in range(steps):
        want = _reference(table, rates.device_bytes_per_s, rates.cpu_overhead_s, tokens[step], candidates[step],
                          nbytes)
        assert torch.nonzero(mask[step]).flatten().tolist() == want, step


def test_the_split_is_never_worse_than_either_tier_alone():
    rng = random.Random(7)
    rates = TierRates(((1, 2.0), (3, 0.7)), device_bytes_per_s=1.0, cpu_overhead_s=0.25)
    table = rates.cpu_seconds_per_byte(3)
    for tokens in itertools.product(range(4), repeat=4):
        nbytes = [rng.randint(1, 5) for _ in range(4)]
        candidates = [t > 0 for t in tokens]
        mask = _split(rates, list(tokens), candidates, nbytes).tolist()

        def step(on_cpu):
            cpu = sum(nbytes[e] * table[tokens[e]] for e in range(4) if on_cpu[e])
            cpu += rates.cpu_overhead_s if any(on_cpu) else 0.0
            return max(sum(nbytes[e] for e in range(4) if candidates[e] and not on_cpu[e]), cpu)

        assert step(mask) <= min(step([False] * 4), step(candidates)) + 1e-12
