"""`predict-decode` (tools/decode_prediction.py, predict_decode_cmd.py): step times of hand-made routing against a
plain-Python reference and hand-worked numbers, the boundary classes (nothing missing, everything missing, ties,
fills that keep a miss on the link), the cache replay's per-step masks against the cache's own counts, and the
command refusing bad machine descriptions by flag."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_expert_offload.cli import main
from vllm_expert_offload.offload.cache_policy import CacheSettings
from vllm_expert_offload.placement.cost import TierRates
from vllm_expert_offload.tools import decode_prediction
from vllm_expert_offload.tools.cache_replay import replay_cache
from vllm_expert_offload.tools.cache_workloads import Block, Workload
from vllm_expert_offload.tools.decode_prediction import (
    DescribedModel,
    Machine,
    MachineDescriptionError,
    StepReads,
    cache_chunks,
    data_budget,
    predict,
    routed_tokens,
    time_steps,
)

MB = 1e6


def _machine(gpu=1e9, link=1e8, cpu=2e8, overhead=0.0, budget=0.0) -> Machine:
    return Machine(gpu, TierRates(((1, cpu),), link, overhead), budget)


def _reads(ids: list[list[list[int]]], resident: list[list[int]], filled: list[list[list[int]]] | None = None,
           experts: int = 4) -> StepReads:
    """Steps of top-k `ids` [steps][layers][k]; `resident` [layers][ids] GPU experts for every step; `filled`
    [steps][layers][ids] the cache's fills of each step."""
    tokens = routed_tokens(np.array(ids), experts)
    res = torch.zeros(tokens.shape[1:], dtype=torch.bool)
    for layer, on_gpu in enumerate(resident):
        res[layer, on_gpu] = True
    fill = torch.zeros_like(tokens, dtype=torch.bool)
    for step, layers in enumerate(filled or []):
        for layer, experts_filled in enumerate(layers):
            fill[step, layer, experts_filled] = True
    return StepReads(tokens, res.expand(tokens.shape).clone(), fill)


def _reference_seconds(machine: Machine, model: DescribedModel, reads: StepReads, tier: bool) -> float:
    """Plain Python over steps and layers: at one token per step every candidate costs the same on each path, so the
    tier takes the number c of the free misses that minimises max(link, CPU), the smallest c on a tie."""
    b, gpu, link = model.expert_bytes, machine.gpu_bytes_per_s, machine.link_bytes_per_s
    cpu_rate, overhead = machine.cpu.cpu_points[0][1], machine.cpu.cpu_overhead_s
    steps, layers, experts = reads.tokens.shape
    total = 0.0
    for s in range(steps):
        for layer in range(layers):
            routed = [e for e in range(experts) if reads.tokens[s, layer, e] > 0]
            hits = sum(1 for e in routed if reads.resident[s, layer, e])
            misses = [e for e in routed if not reads.resident[s, layer, e]]
            written = sum(1 for e in misses if reads.filled[s, layer, e])
            free = len(misses) - written
            best_c, best = 0, None
            for c in range(free + 1 if tier else 1):
                t = max((len(misses) - c) * b / link, c * b / cpu_rate + (overhead if c else 0.0))
                if best is None or t < best:
                    best_c, best = c, t
            c = best_c
            cpu_s = c * b / cpu_rate + (overhead if c else 0.0)
            total += max(hits * b / gpu, (len(misses) - c) * b / link, cpu_s) * model.layers / layers
        total += model.dense_bytes_per_token / gpu
    return total


def test_hand_worked_step() -> None:
    # one data layer standing for 2; experts 0, 1 routed, 0 on the GPU: 1 ms on GPU memory, 10 ms over the link
    model = DescribedModel(layers=2, experts=4, top_k=2, expert_bytes=MB, dense_bytes_per_token=3 * MB)
    reads = _reads([[[0, 1]]], [[0]])
    zero_copy = time_steps(_machine(), model, reads, cpu_tier=False)
    assert zero_copy.seconds == pytest.approx(2 * 0.010 + 0.003)
    assert (zero_copy.gpu_reads, zero_copy.link_reads, zero_copy.cpu_reads) == (1, 1, 0)
    # the tier: expert 1 on the CPU at 200 MB/s is 5 ms (better than 10 ms over the link)
    tier = time_steps(_machine(), model, reads, cpu_tier=True)
    assert tier.seconds == pytest.approx(2 * 0.005 + 0.003)
    assert (tier.link_reads, tier.cpu_reads, tier.bound_by.tolist()) == (0, 1, [0, 0, 1])


def test_an_overhead_larger_than_the_gain_keeps_the_miss_on_the_link() -> None:
    model = DescribedModel(1, 4, 2, MB)
    reads = _reads([[[0, 1]]], [[0]])
    tier = time_steps(_machine(overhead=0.006), model, reads, cpu_tier=True)  # 5 + 6 ms > 10 ms over the link
    assert (tier.cpu_reads, tier.seconds) == (0, pytest.approx(0.010))


@pytest.mark.parametrize("cpu, overhead", [(2e8, 0.0), (1e8, 0.0), (3e7, 0.0), (5e8, 0.002), (1e9, 0.0)])
def test_random_traces_match_the_plain_python_reference(cpu: float, overhead: float) -> None:
    """Non-power-of-two experts (6) and layers (3), top-3, random residency and fills."""
    rng = np.random.default_rng(7)
    ids = np.stack([np.stack([rng.choice(6, 3, replace=False) for _ in range(3)]) for _ in range(40)])
    tokens = routed_tokens(ids, 6)
    reads = StepReads(tokens, torch.from_numpy(rng.random(tokens.shape) < 0.3),
                      torch.from_numpy(rng.random(tokens.shape) < 0.3) & (tokens > 0))
    model = DescribedModel(layers=5, experts=96, top_k=3, expert_bytes=1.5 * MB, dense_bytes_per_token=2 * MB)
    machine = _machine(gpu=9e8, link=1.3e8, cpu=cpu, overhead=overhead)
    for tier in (False, True):
        got = time_steps(machine, model, reads, cpu_tier=tier).seconds
        assert got == pytest.approx(_reference_seconds(machine, model, reads, tier), rel=1e-12)


def test_nothing_missing_leaves_the_link_and_the_tier_idle() -> None:
    model = DescribedModel(1, 4, 2, MB)
    reads = _reads([[[0, 1]], [[1, 2]]], [[0, 1, 2, 3]])
    for tier in (False, True):
        totals = time_steps(_machine(), model, reads, cpu_tier=tier)
        assert (totals.link_reads, totals.cpu_reads, totals.gpu_reads) == (0, 0, 4)
        assert totals.seconds == pytest.approx(2 * 2 * MB / 1e9)
        assert totals.bound_by.tolist() == [2, 0, 0]


def test_every_expert_missing_splits_by_the_rates() -> None:
    # 3 misses of 1 MB, link 100 MB/s, CPU 200 MB/s: c=2 gives max(10, 10) ms, the best (c=1: 20; c=3: 15)
    model = DescribedModel(1, 4, 3, MB)
    reads = _reads([[[0, 1, 3]]], [[]])
    assert time_steps(_machine(), model, reads, cpu_tier=False).seconds == pytest.approx(0.030)
    tier = time_steps(_machine(), model, reads, cpu_tier=True)
    assert (tier.seconds, tier.cpu_reads, tier.link_reads) == (pytest.approx(0.010), 2, 1)


def test_a_tie_gives_the_cpu_the_fewest_experts() -> None:
    # equal rates, 3 misses: c=1 -> max(2, 1), c=2 -> max(1, 2): the same 20 ms; the shorter prefix wins
    model = DescribedModel(1, 4, 3, MB)
    tier = time_steps(_machine(cpu=1e8), model, _reads([[[0, 2, 3]]], [[]]), cpu_tier=True)
    assert (tier.seconds, tier.cpu_reads, tier.link_reads) == (pytest.approx(0.020), 1, 2)


def test_a_filled_miss_stays_on_the_link() -> None:
    # misses 0, 1, 3; the cache fills 0 and 1 this step (write-through needs the device to read them): only 3 may
    # go to the CPU, so the link carries 2 x 10 ms whatever the CPU's speed
    model = DescribedModel(1, 4, 3, MB)
    reads = _reads([[[0, 1, 3]]], [[]], filled=[[[0, 1]]])
    tier = time_steps(_machine(cpu=1e12), model, reads, cpu_tier=True)
    assert (tier.seconds, tier.cpu_reads, tier.link_reads, tier.fills) == (pytest.approx(0.020), 1, 2, 2)


def test_budget_becomes_slots_of_the_described_model() -> None:
    model = DescribedModel(layers=40, experts=384, top_k=6, expert_bytes=12.65 * 2**20)
    slots, fraction = data_budget(_machine(budget=709 * 12.65 * 2**20), model)
    assert (slots, fraction) == (17, 17 / 384)  # 709 slots over 40 layers: 17 per layer (rounded down)
    assert data_budget(_machine(budget=1e15), model) == (384, 1.0)
    assert data_budget(_machine(budget=0.0), model) == (0, 0.0)


def _workload() -> Workload:
    """2 layers x 6 experts, top-2, 9 tokens: the first half of the stream on experts 0-2, the rest on 3-5;
    calibrated on counts that favour 5, then 4."""
    rng = np.random.default_rng(3)
    first = [np.stack([rng.choice(3, 2, replace=False) for _ in range(2)]) for _ in range(5)]
    second = [np.stack([3 + rng.choice(3, 2, replace=False) for _ in range(2)]) for _ in range(4)]
    calibration = np.array([[0, 0, 0, 1, 5, 9]] * 2)
    return Workload("hand-made", np.stack(first + second).astype(np.int64), 6, (Block("all", 0, 9, calibration),))


@pytest.mark.parametrize("chunk", [2, 4, 2048])
def test_cache_chunks_hit_what_the_cache_counts(chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-step resident masks (tracked from fills and evictions) give the cache's own hits and fills, across
    chunk boundaries."""
    monkeypatch.setattr(decode_prediction, "CHUNK_STEPS", chunk)
    workload, settings = _workload(), CacheSettings("lru")
    replay = replay_cache(workload, settings, 0.5, progress=False)
    chunks = list(cache_chunks(workload, settings, 0.5, progress=False))
    assert sum(c.tokens.shape[0] for c in chunks) == 9
    hits = sum(((c.tokens > 0) & c.resident).sum((0, 2)) for c in chunks)
    misses = sum(((c.tokens > 0) & ~c.resident).sum((0, 2)) for c in chunks)
    assert hits.tolist() == replay.hits.tolist() and misses.tolist() == replay.misses.tolist()
    assert sum(int(c.filled.sum()) for c in chunks) == replay.fills
    assert all(not (c.filled & c.resident).any() and not (c.filled & (c.tokens == 0)).any() for c in chunks)


def test_predict_zero_budget_reads_everything_over_the_link() -> None:
    model = DescribedModel(layers=4, experts=12, top_k=2, expert_bytes=MB)
    totals = predict(_machine(cpu=1e8), model, _workload(), CacheSettings())
    for mode in ("zero_copy", "cache"):  # 9 tokens x 4 layers x 2 misses x 10 ms
        assert totals[mode].seconds == pytest.approx(9 * 4 * 0.020)
    assert totals["cache_cpu_tier"].seconds == pytest.approx(9 * 4 * 0.010)  # one miss each way


def test_predict_refuses_data_of_another_top_k() -> None:
    with pytest.raises(MachineDescriptionError, match="--model-top-k"):
        predict(_machine(), DescribedModel(4, 12, 6, MB), _workload(), CacheSettings())


@pytest.fixture
def trace_folder(tmp_path: Path) -> Path:
    """1 layer, 4 experts, top-2: held-out prompt 3 reads experts 0 and 1 for 10 tokens; the counts of prompts 1
    and 2 (calibration) favour expert 2, so a one-slot plan keeps 2, which the prompt never reads."""
    np.savez(tmp_path / "x_topk.npz", expert_ids=np.array([[[0, 1]]] * 10, dtype=np.uint8),
             prompt_offsets=np.array([0, 10]), prompt_ids=np.array([3]), moe_layer_ids=np.array([0]))
    counts = np.zeros((3, 1, 4), dtype=np.int64)
    counts[0, 0], counts[1, 0], counts[2, 0] = [0, 0, 9, 1], [0, 0, 5, 0], [50, 50, 0, 0]
    np.savez(tmp_path / "x_per_prompt_counts.npz", counts=counts, prompt_ids=np.array([1, 2, 3]),
             moe_layer_ids=np.array([0]))
    return tmp_path


MACHINE_FLAGS = ["--gpu-gbs", "1", "--link-gbs", "0.1", "--cpu-gbs", "0.2", "--gpu-budget-gib", "2",
                 "--expert-mib", "1024", "--model-layers", "2", "--model-experts", "4", "--model-top-k", "2"]


def test_the_command_on_a_hand_made_trace(trace_folder: Path, tmp_path: Path, capsys) -> None:
    """1 GiB experts; a 2 GiB budget over 2 layers: 1 slot per layer (25 %), holding expert 2 (the calibration's).
    A GiB takes 10.7 s over the link, 5.4 s on the CPU, 1.07 s from GPU memory. Zero-copy: both experts over the
    link every token. The cache: the first token misses both and installs one (2 is not read, so it leaves), which
    the other 9 tokens hit. The tier: the first token's installed miss stays on the link (write-through), the other
    goes to the CPU; later tokens send their one miss to the CPU."""
    out = tmp_path / "out.json"
    assert main(["predict-decode", "--data", str(trace_folder), "--policy", "lru", *MACHINE_FLAGS,
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["slots_per_layer"], result["data_slots_per_layer"], result["tokens"]) == (1, 1, 10)
    link, cpu = 2**30 / 1e8, 2**30 / 2e8
    modes = result["modes"]  # per token: 2 described layers for the data's one
    assert modes["zero_copy"]["ms_per_token"] == pytest.approx(1e3 * 2 * 2 * link)
    assert modes["cache"]["ms_per_token"] == pytest.approx(1e3 * 2 * (2 * link + 9 * link) / 10)
    assert modes["cache_cpu_tier"]["ms_per_token"] == pytest.approx(1e3 * 2 * (link + 9 * cpu) / 10)
    assert modes["cache_cpu_tier"]["tok_s"] == pytest.approx(10 / (2 * (link + 9 * cpu)))
    assert modes["cache_cpu_tier"]["per_layer"] == {"gpu": 0.9, "link": 0.1, "cpu": 1.0, "fills": 0.1}
    assert (modes["zero_copy"]["gpu_read_share"], modes["cache"]["gpu_read_share"]) == (0.0, 0.45)
    assert "decode tok/s per stream" in capsys.readouterr().out


@pytest.mark.parametrize("flag, value", [
    ("--gpu-gbs", "0"), ("--link-gbs", "-1"), ("--cpu-gbs", "nan"), ("--cpu-gbs", "inf"), ("--link-gbs", "fast"),
    ("--gpu-budget-gib", "-0.5"), ("--expert-mib", "0"), ("--dense-gib", "-1"), ("--cpu-overhead-us", "-3"),
    ("--model-layers", "0"), ("--model-experts", "2.5"), ("--model-top-k", "6"), ("--max-tokens", "0"),
])
def test_bad_machine_descriptions_are_refused_by_flag(trace_folder: Path, flag: str, value: str, capsys) -> None:
    flags = list(MACHINE_FLAGS)
    if flag in flags:
        flags[flags.index(flag) + 1] = value
    else:
        flags += [flag, value]
    assert main(["predict-decode", "--data", str(trace_folder), *flags]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {flag}") and captured.out == ""
