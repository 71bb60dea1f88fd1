"""The CPU expert tier's step in a MoE layer's forward (issue 41, `expert_offload.cpu_tier`).

One named step of the layer's runtime (moe_runtime.py `_start_cpu_tier`, ahead of the read counters and the
kernel): the expert cache's policy steps on every routed expert (a CPU-computed expert is still a miss it counts),
the split (offload/cpu_tier.py) picks the host-resident misses the host cores compute, and the CPU tier's job
starts on them (kernels/host_tier.py on the CPU engine; kernels/stream_host_tier.py is the GPU's stream-ordered
form); the device kernel then gets the other entries (the tier's are -1 there), and the runtime adds the two
partial sums, the device's first (a fixed order: deterministic for a given split). Each TP rank computes its own
shard of a miss from its own host record; under expert parallelism another rank's entry (-1) stays -1 in both.

Made once per layer at load. The process's first layer with a host-resident expert resolves the tier's cores
(memory/tier_cpus.py) and probes the rates the split decides from; both go to the start-up log with the rule.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...kernels.contract import MoEKernel, MoELayer
from ...kernels.device_probe import device_read_rate, exchange_seconds
from ...kernels.expert_slots import ExpertSlots
from ...kernels.host_tier import HostTier, build_host_tier, probe_rates
from ...kernels.stream_host_tier import CpuTierCompute, CudaStreamOrder, HostJob, PendingPartial, StreamHostTier
from ...memory.tier_cpus import TierCpus, node_share, tier_cpus
from ...memory.topology import node_cpus, numa_node_of_gpu, parse_cpulist
from ...offload.counters import TierCounters
from ...offload.cpu_tier import TierSplit, split_ids
from ...offload.process import ProcessPlacement
from ...placement.cost import TierRates

logger = logging.getLogger("vllm.expert_offload")
STREAM_ORDER = ", in the GPU stream's order (two host functions per step, no Python)"
SPLIT_RULES = {
    "auto": "per step and layer, routed host-resident misses not being cached, ordered by (tokens, expert id); the "
            "CPU takes the prefix that makes both tiers finish together (placement/cost.py balanced_cpu_split)",
    "all": "every routed host-resident miss not being cached goes to the CPU",
}


@dataclass(frozen=True)
class CpuTierStep:
    """One layer's split and CPU tier, and what the split reads each forward."""

    split: TierSplit
    tier: CpuTierCompute  # HostTier on the CPU engine; StreamHostTier's interface on a GPU
    cache: ExpertSlots | None
    resident: torch.Tensor  # bool (E,): the layer's pointer tables' in_gpu_tier (a cache updates it in place)
    counters: TierCounters
    row: int

    def start(self, x: torch.Tensor, topk_weights: torch.Tensor, local_ids: torch.Tensor
              ) -> tuple[torch.Tensor, PendingPartial | None]:
        """(the device path's ids, the CPU tier's partial sum to come, or None) for this rank's local ids (-1:
        another rank's expert). A step above max_tokens stays on the device whole. Otherwise the cache steps on
        every tier's ids (a CPU-computed expert is still a miss its policy sees), the split hands the tier its
        experts (-1 in the device's ids), its entries are counted as CPU reads, and the tier's job starts (it
        times itself: the busy time). This step's own ops are device ops of fixed shapes: no host synchronisation
        (the proof: tests/integration/test_cpu_tier_step.py, on meta)."""
        if not self.split.active(x.shape[0]):
            return local_ids, None
        filled = None if self.cache is None else self.cache.decide(local_ids)
        device_ids, cpu_ids = split_ids(local_ids, self.split.on_cpu(local_ids, self.resident, filled))
        self.counters.count_cpu_reads(self.row, cpu_ids)
        return device_ids, self.tier.start(x, topk_weights, cpu_ids)


def host_share() -> tuple[int, int]:
    """(this worker's index, workers) among vLLM's workers on this host, every data-parallel engine's included:
    each takes its share of the CPU tier's cores. vLLM's GPU worker folds its local DP rank into the world group's
    local_rank (gpu_worker.py init_device) and the CPU worker does not, so the index is rebuilt from the DP rank
    and the rank within the engine, the same on both."""
    from vllm.config import get_current_vllm_config
    from vllm.distributed.parallel_state import get_world_group

    parallel = get_current_vllm_config().parallel_config
    return engine_host_share(get_world_group().local_rank, parallel.local_world_size,
                             parallel.data_parallel_rank_local, parallel.data_parallel_index,
                             parallel.data_parallel_size_local, parallel.data_parallel_size)


def engine_host_share(local_rank: int, engine_ranks: int, dp_rank_local: int | None, dp_index: int,
                      dp_size_local: int, dp_size: int) -> tuple[int, int]:
    """`host_share` from vLLM's parallel config values: local DP rank x ranks per engine + the rank in the engine."""
    engines = max(dp_size_local, 1) if dp_size > 1 else 1
    engine = (dp_index if dp_rank_local is None else dp_rank_local) % engines
    return engine * engine_ranks + local_rank % engine_ranks, engines * engine_ranks


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
    """The tier's cores: the options' list split among the host's ranks, or "auto": the arena's node minus vLLM's
    cores and, on a GPU, minus one core per rank on the node and one for the engine core and API server (their
    threads stay unpinned there), split among the ranks whose arena is on the same node."""
    settings = placement.options.cpu_tier
    node = None if placement.arena is None else placement.arena.numa_node
    if device.type == "cpu":  # the CPU engine's worker is bound already: its own affinity is vLLM's cores
        usable, auto_share, reserve = parse_cpulist(open("/sys/devices/system/cpu/online").read()), share, 0
    else:
        usable = sorted(os.sched_getaffinity(0))
        auto_share = node_share(share[0], _host_rank_nodes(share[1], share[0], node))
        reserve = auto_share[1] + 1
    return tier_cpus(settings.cpus, settings.threads, usable, node_cpus(node) if node is not None else (),
                     _engine_bound(device), share if settings.cpus is not None else auto_share, reserve)


@functools.cache
def _host_rank_nodes(ranks: int, index: int, own: int | None) -> tuple[int | None, ...]:
    """Each host rank's GPU's NUMA node (rank i drives CUDA device i when the process sees every GPU, as vLLM's
    multiprocessing workers do); when it sees fewer, every rank counts as on this rank's node (shares then never
    overlap, they are only smaller). Cached: each MoE layer's tier resolves its cores, and each lookup scans the
    PCI tree."""
    try:
        return tuple(numa_node_of_gpu(rank) if rank != index else own for rank in range(ranks))
    except IndexError:
        return (own,) * ranks


def build_cpu_tier_step(placement: ProcessPlacement, layer: MoELayer, expert_bytes: torch.Tensor, row: int,
                        apply_router_weight_on_input: bool, device_kernel: Callable[[], MoEKernel],
                        share: Callable[[], tuple[int, int]] = host_share) -> CpuTierStep | None:
    """The layer's CPU tier step, or None without `cpu_tier` or without a host-resident expert in the layer.
    On the CPU engine the worker's threads compute the tier's experts in the forward; on a GPU the tier's own pool
    does, on the resolved cores, in the stream's order (kernels/stream_host_tier.py). `device_kernel`: builds the
    layer's device path without an expert cache, whose read of a host record the GPU's probe times (a cache would
    take the probe's read for a fill and move the expert into a slot); `share`: (this worker's index, workers) on
    this host."""
    settings = placement.options.cpu_tier
    host_resident = torch.nonzero(~layer.tables.in_gpu_tier).flatten().tolist()
    if settings is None or not host_resident:
        return None
    busy = functools.partial(placement.tier_counters.add_cpu_busy, row)
    cpus = resolve_tier_cpus(placement, layer.device, share())
    on_gpu = layer.device.type != "cpu"
    host = build_host_tier(layer, apply_router_weight_on_input, busy, cpus if on_gpu else None)
    tier: HostTier | StreamHostTier = host
    if on_gpu:
        job = HostJob(layer.name, host.kernel, settings.max_tokens, layer.top_k, layer.crop.hidden,
                      apply_router_weight_on_input, busy)
        tier = StreamHostTier(job, CudaStreamOrder(layer.device), host.where + STREAM_ORDER)
        placement.tier_counters.add_busy_source(job.report_busy)

    def probe() -> TierRates:
        expert = host_resident[0]
        nbytes, hidden = int(expert_bytes[expert]), layer.crop.hidden
        device_rate = overhead = None
        if on_gpu:
            device_rate = device_read_rate(device_kernel(), expert, nbytes, hidden, layer.top_k, layer.dtype,
                                           layer.device)
            overhead = exchange_seconds(tier, hidden, layer.top_k, layer.dtype, layer.device)
        rates = probe_rates(host, expert, nbytes, hidden, layer.dtype, settings, device_rate, overhead or 0.0)
        logger.info("expert_offload.cpu_tier (%s): computed %s (the tier's cores: %s); steps of up to %d tokens; "
                    "split %s: %s; rates from the start-up probe of %s expert %d: %s", placement.rank_label(),
                    tier.where, cpus.describe(), settings.max_tokens, settings.split, SPLIT_RULES[settings.split],
                    layer.name, expert, rates.describe())
        return rates

    rates = placement.tier_rates(probe)
    return CpuTierStep(TierSplit(settings, rates, expert_bytes), tier, layer.cache, layer.tables.in_gpu_tier,
                       placement.tier_counters, row)
