"""The CPU expert tier's step in a MoE layer's forward (issue 41, `expert_offload.cpu_tier`).

After the expert cache's step (which sees every routed expert: a CPU-computed expert is still a miss its policy
counts), the split (offload/cpu_tier.py) picks the host-resident misses the host cores compute; the device kernel
gets the other entries, the CPU tier (kernels/host_tier.py) its own, and the two partial sums are added, the
device's first (a fixed order: deterministic for a given split). Each TP rank computes its own shard of a miss
from its own host record; under expert parallelism another rank's entry (-1) stays -1 in both tiers.

Made once per layer at load. The process's first layer with a host-resident expert resolves the tier's cores
(memory/tier_cpus.py) and probes the rates the split decides from; both go to the start-up log with the rule.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...kernels.contract import MoEKernel, MoELayer
from ...kernels.expert_slots import ExpertSlots
from ...kernels.host_tier import HostTier, build_host_tier, probe_rates
from ...memory.tier_cpus import TierCpus, tier_cpus
from ...memory.topology import node_cpus, parse_cpulist
from ...offload.counters import TierCounters
from ...offload.cpu_tier import TierSplit, split_ids
from ...offload.process import ProcessPlacement

logger = logging.getLogger("vllm.expert_offload")
SPLIT_RULES = {
    "auto": "per step and layer, routed host-resident misses not being cached, ordered by (tokens, expert id); the "
            "CPU takes the prefix that makes both tiers finish together (placement/cost.py balanced_cpu_split)",
    "all": "every routed host-resident miss not being cached goes to the CPU",
}


@dataclass(frozen=True)
class CpuTierStep:
    """One layer's split, device kernel and CPU tier, and what they read each forward."""

    split: TierSplit
    kernel: MoEKernel  # the layer's device path (its cache's launches included)
    tier: HostTier
    cache: ExpertSlots | None
    resident: torch.Tensor  # bool (E,): the layer's pointer tables' in_gpu_tier (a cache updates it in place)
    expert_bytes: torch.Tensor  # int64 (E,): trellis bytes of each expert (read counters)
    counters: TierCounters
    row: int

    def active(self, tokens: int) -> bool:
        return self.split.active(tokens)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, local_ids: torch.Tensor,
                apply_router_weight_on_input: bool) -> torch.Tensor:
        """Both tiers' sum for this rank's local ids (-1: another rank's expert): the cache steps on every tier's
        ids, the split, reads counted by tier, the device path on its entries (the other entries weighted 0 on
        expert 0 until every backend skips -1, issue 38 item 6), the CPU tier on its own, timed."""
        filled = None if self.cache is None else self.cache.decide(local_ids)
        device_ids, cpu_ids = split_ids(local_ids, self.split.on_cpu(local_ids, self.resident, filled))
        self.counters.count_reads(self.row, device_ids, self.resident, self.expert_bytes)
        self.counters.count_cpu_reads(self.row, cpu_ids)
        device_weights = torch.where(device_ids >= 0, topk_weights, torch.zeros_like(topk_weights))
        out = self.kernel.forward(x, device_weights, device_ids.clamp(min=0), apply_router_weight_on_input)
        began = time.perf_counter()
        partial = self.tier.forward(x, topk_weights, cpu_ids, apply_router_weight_on_input)
        self.counters.add_cpu_busy(self.row, time.perf_counter() - began)
        return out + partial


def _engine_bound(device: torch.device) -> set[int]:
    """Cores vLLM's own processes are bound to: on the CPU engine every rank's OpenMP list when given
    (VLLM_CPU_OMP_THREADS_BIND="0-3|4-7"), and this worker's own places; on a GPU vLLM binds nothing."""
    if device.type != "cpu":
        return set()
    bound = set(os.sched_getaffinity(0))  # the CPU engine binds its worker's threads before the model loads
    lists = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if lists not in ("auto", "nobind", "all"):
        bound.update(c for part in lists.split("|") for c in parse_cpulist(part))
    return bound


def resolve_tier_cpus(placement: ProcessPlacement, device: torch.device, share: tuple[int, int]) -> TierCpus:
    """The tier's cores: the options' list, or the arena's node minus vLLM's cores, this rank's share of it."""
    settings = placement.options.cpu_tier
    online = parse_cpulist(open("/sys/devices/system/cpu/online").read())
    node = None if placement.arena is None else placement.arena.numa_node
    return tier_cpus(settings.cpus, settings.threads, online, node_cpus(node) if node is not None else (),
                     _engine_bound(device), share)


def build_cpu_tier_step(placement: ProcessPlacement, layer: MoELayer, kernel: MoEKernel, expert_bytes: torch.Tensor,
                        row: int, share: Callable[[], tuple[int, int]]) -> CpuTierStep | None:
    """The layer's CPU tier step, or None without `cpu_tier` or without a host-resident expert in the layer.
    `share`: (this worker's index, workers) on this host, asked only when the tier's cores are resolved."""
    settings = placement.options.cpu_tier
    host_resident = torch.nonzero(~layer.tables.in_gpu_tier).flatten().tolist()
    if settings is None or not host_resident:
        return None
    tier = build_host_tier(layer)

    def probe():
        cpus = resolve_tier_cpus(placement, layer.device, share())
        expert = host_resident[0]
        rates = probe_rates(tier, expert, int(expert_bytes[expert]), layer.crop.hidden, layer.dtype, settings)
        logger.info("expert_offload.cpu_tier (%s): computed %s (the tier's cores: %s); steps of up to %d tokens; "
                    "split %s: %s; rates from the start-up probe of %s expert %d: %s", placement.rank_label(),
                    tier.where, cpus.describe(), settings.max_tokens, settings.split, SPLIT_RULES[settings.split],
                    layer.name, expert, rates.describe())
        return rates

    rates = placement.tier_rates(probe)
    return CpuTierStep(TierSplit(settings, rates, expert_bytes), kernel, tier, layer.cache, layer.tables.in_gpu_tier,
                       expert_bytes, placement.tier_counters, row)
