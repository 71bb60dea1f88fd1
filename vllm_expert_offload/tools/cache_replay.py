"""Replay a routing stream through the engine's expert cache (offload/cache_policy.py) and through static plans.

Every number is a host-read share: token x expert reads served from the host tier / all token x expert reads.

- cache: one `ExpertCache` with a layer axis, one step per token (a decode batch of one), slots = floor(F x experts)
  per layer, starting from each layer's `slots` most-counted experts of the first block's calibration counts (what a
  server would start from); reads are counted before each step's fills, as the engine does.
- static, calibrated elsewhere: per block, the planner's plan (placement/planner.py, equal expert sizes, a global
  budget of F x layers x experts) from the block's calibration counts, evaluated on the block's tokens.
- static oracle (in-sample): the planner's plan from the counts of the evaluated tokens themselves, one plan for the
  whole stream, and (per block) one for each block's tokens: the best any fixed placement could do.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from ..offload.cache_policy import CacheSettings, CacheStep, ExpertCache
from ..placement import plan_placement
from .cache_workloads import Workload


@dataclass(frozen=True)
class CacheReplay:
    hits: np.ndarray  # [layers] token x expert reads from GPU slots
    misses: np.ndarray  # [layers] token x expert reads from host
    fills: int
    evictions: int  # fills that replaced a resident expert (the rest took empty slots)

    @property
    def host_read_share(self) -> float:
        return float(self.misses.sum() / (self.hits.sum() + self.misses.sum()))


def slots_per_layer(budget: float, num_experts: int) -> int:
    """Slots of each layer's cache: the budget fraction of its experts, rounded down (never above the budget)."""
    return int(np.floor(budget * num_experts + 1e-9))


def initial_slots(counts: np.ndarray, slots: int) -> torch.Tensor:
    """int32 [layers, experts]: each layer's `slots` most-counted experts in slots 0.. (ties to the lower id)."""
    order = np.argsort(-counts, axis=-1, kind="stable")[:, :slots]
    start = np.full(counts.shape, -1, dtype=np.int32)
    np.put_along_axis(start, order, np.arange(slots, dtype=np.int32)[None].repeat(len(counts), 0), axis=-1)
    return torch.from_numpy(start)


def cache_steps(workload: Workload, settings: CacheSettings, budget: float, progress: bool = True
                ) -> Iterator[tuple[torch.Tensor, CacheStep]]:
    """The stream through one `ExpertCache` per layer (one object with a layer axis), token by token: each step's
    resident mask bool [layers, experts] as the step found it (what it hits), then the step's decisions."""
    tokens, layers, _ = workload.shape
    slots = slots_per_layer(budget, workload.num_experts)
    start = initial_slots(workload.blocks[0].calibration, slots)
    cache = ExpertCache(settings, workload.num_experts, slots, "cpu", layers=layers, initial=start)
    resident = torch.cat([start >= 0, torch.zeros(layers, 1, dtype=torch.bool)], 1)  # column E: the -1 sink
    rows = torch.arange(layers)[:, None]
    ids = torch.from_numpy(workload.expert_ids)[:, :, None, :]  # [tokens, layers, T=1, k]
    for token in tqdm(range(tokens), desc="replay", unit="tok", disable=not progress, mininterval=2.0):
        step = cache.step(ids[token])
        yield resident[:, :-1].clone(), step
        resident[rows, step.evicted.long()] = False  # -1 entries land in the sink column
        resident[rows, step.fill_expert.long()] = True
        resident[:, -1] = False


def replay_cache(workload: Workload, settings: CacheSettings, budget: float, progress: bool = True) -> CacheReplay:
    """The stream's hits, misses, fills and evictions through the cache (`cache_steps`)."""
    layers = workload.shape[1]
    hits = torch.zeros(layers, dtype=torch.int64)
    misses = torch.zeros(layers, dtype=torch.int64)
    fills = torch.zeros((), dtype=torch.int64)
    evictions = torch.zeros((), dtype=torch.int64)
    for _, step in cache_steps(workload, settings, budget, progress):
        hits += step.hits
        misses += step.misses
        fills += (step.fill_expert >= 0).sum()
        evictions += (step.evicted >= 0).sum()
    return CacheReplay(hits.numpy(), misses.numpy(), int(fills), int(evictions))


def token_counts(expert_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """[layers, experts] selections in a [tokens, layers, k] stretch of the stream."""
    layers = expert_ids.shape[1]
    cells = np.arange(layers)[None, :, None] * num_experts + expert_ids
    return np.bincount(cells.ravel(), minlength=layers * num_experts).reshape(layers, num_experts)


STATIC = ("calibrated_elsewhere", "oracle_in_sample", "oracle_per_block")


def static_host_share(workload: Workload, budget: float, plan: str) -> float:
    """Host-read share of the static plan `plan` (one of STATIC) over the whole stream."""
    whole = token_counts(workload.expert_ids, workload.num_experts)
    host = 0
    for block in workload.blocks:
        counts = token_counts(workload.expert_ids[block.start : block.end], workload.num_experts)
        plan_counts = {"calibrated_elsewhere": block.calibration, "oracle_in_sample": whole,
                       "oracle_per_block": counts}[plan]
        host += int(counts[~static_plan(workload, budget, plan_counts)].sum())
    return host / int(whole.sum())


def static_plan(workload: Workload, budget: float, counts: np.ndarray) -> np.ndarray:
    """GPU mask [layers, experts]: the planner's plan from `counts` (equal expert sizes, a global budget of
    F x layers x experts, so hot layers may hold more than F of their experts)."""
    sizes = np.ones((workload.shape[1], workload.num_experts), dtype=np.int64)
    return plan_placement(sizes, int(np.floor(budget * sizes.sum() + 1e-9)), counts)
