"""One process's expert placement: the plan, the host arena it implies, and routing statistics (no vLLM: the
integration layer installs the hooks that act on it, such as the crash line).

Made once per process at the first MoE layer's create_weights, from the checkpoint's headers, so the
arena is sized exactly before a single expert is loaded and each expert goes straight to its tier.
"""

from __future__ import annotations

import logging
import multiprocessing.util
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import ExpertOffloadError
from ..exl3.validate import CheckpointSummary
from ..memory.arena import HostArena
from ..placement import RoutingCounts
from ..placement.cost import TierRates
from .cache_policy import CacheSettings
from .counters import TierCounters
from .options import OffloadOptions
from .rank_plan import ExpertGeometry, RankExperts, make_plan, model_identity, record_bytes_matrix

logger = logging.getLogger("vllm.expert_offload")  # a child of vLLM's logger, so it shares its handlers


def _arena_numa_node(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    from ..memory.topology import numa_node_of_gpu

    return numa_node_of_gpu(device.index if device.index is not None else torch.cuda.current_device())


def at_process_exit(callback: Callable[..., object], *args: object) -> multiprocessing.util.Finalize:
    """Call `callback(*args)` when this process ends normally: also in a child started with the fork method.
    Returns the finalizer: calling it runs the callback now instead (once), `.cancel()` drops it.

    vLLM forks its engine-core and worker processes on GPU machines, and a forked multiprocessing child ends
    with os._exit, so `atexit` handlers never run there; multiprocessing runs its own finalizers when the child's
    target returns or raises (SystemExit on SIGTERM included), and from atexit in the main process."""
    return multiprocessing.util.Finalize(None, callback, args, exitpriority=10)


class StartupCountsSpent(ExpertOffloadError, RuntimeError):
    """The routing counts of startup were already dropped; the counts of serving are never reset on request."""


class ProcessPlacement:
    def __init__(
        self,
        options: OffloadOptions,
        summary: CheckpointSummary,
        geometry: ExpertGeometry,
        top_k: int,
        device: torch.device,
        gpu_bytes: int | None = None,
        rank: RankExperts | None = None,
        dp_rank: int = 0,
        dp_size: int = 1,
        cache: CacheSettings | None = None,
        first_in_engine: bool = True,
    ) -> None:
        """`gpu_bytes`: the memory of this worker's GPU (None off CUDA), the bound a budget or plan must fit.
        `rank`: the experts this rank holds (expert parallelism; default every expert, each a TP slice).
        `dp_rank`, `dp_size`: this engine's data-parallel rank and their number (each engine has its own arena and
        plan, and counts its own tokens: engine_stats.py). `first_in_engine`: this worker is its engine's first
        (tensor-parallel rank 0 of the engine), the one that reports the engine's counts under data parallelism.
        `cache`: the GPU tier is an expert cache (the backend writes through): every expert gets a host record
        (an evicted expert is read from there), and each layer's GPU tier is as many slots as the plan gives it
        GPU experts, each the size of the layer's largest record (kernels/expert_slots.py)."""
        self.options = options
        self.cache = cache
        self.geometry = geometry
        self.top_k = top_k
        self.moe_layers = summary.layout.moe_layers
        self.record_bytes = record_bytes_matrix(summary, geometry)
        self.rank = RankExperts.every(self.record_bytes.shape[1]) if rank is None else rank
        if self.rank.num_experts != self.record_bytes.shape[1]:
            raise ExpertOffloadError(f"vLLM's expert map covers {self.rank.num_experts} routed experts, the checkpoint "
                                     f"has {self.record_bytes.shape[1]} per MoE layer")
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.first_in_engine = first_in_engine
        self.identity = model_identity(summary, geometry.tp_size, self.record_bytes, self.rank.ep_size)
        self.gpu_tier, source = make_plan(options, self.record_bytes, self.identity, gpu_bytes, self.rank)
        self.host_tier = ~self.gpu_tier & self.rank.mask  # this rank's experts only; others belong to other ranks
        self.counts = torch.zeros(self.gpu_tier.shape, dtype=torch.int64, device=device)  # global ids: all experts
        self.tier_counters = TierCounters(len(self.moe_layers), device)
        host_bytes = self.host_tier_bytes()
        # Last of what can fail here: nothing is left holding a mapped arena when an earlier step raises.
        self.arena = HostArena(host_bytes, device=device, numa_node=_arena_numa_node(device)) if host_bytes else None
        self.counting_since = time.time()
        self.startup_counts_spent = False
        self.recording = options.record_stats is not None
        self.loading_peak_bytes = 0  # CUDA: peak allocated while the MoE layers were loaded (memory_report)
        self._tier_rates: TierRates | None = None  # the CPU tier's probed rates, once per process (tier_rates)
        self._exit_save = None
        if self.recording and self.writes_stats:
            self._exit_save = at_process_exit(self.save_stats, options.record_stats, "at exit")
        logger.info(
            "expert placement (%s): %d of %d routed experts in the host tier (%.1f MiB arena%s), "
            "%.1f MiB of expert trellises in the GPU tier; plan from %s%s",
            self.rank_label(), int(self.host_tier.sum()), len(self.moe_layers) * len(self.rank.local),
            host_bytes / 2**20,
            "" if self.arena is None or self.arena.numa_node is None else f" on NUMA node {self.arena.numa_node}",
            self.gpu_tier_bytes() / 2**20, source,
            "" if cache is None else (f"; dynamic: the GPU tier is {int(self.gpu_tier.sum())} expert slots, starting "
                                      f"with the plan's GPU experts ({cache.policy}, half-life "
                                      f"{cache.half_life_tokens:g} tokens; every expert has a host record)"),
        )

    def rank_label(self) -> str:
        """'tp rank 0 of 2' / 'ep rank 1 of 2, experts 4-7', with 'dp rank d' under data parallelism."""
        parts = [self.rank.label() or f"tp rank {self.geometry.tp_rank} of {self.geometry.tp_size}"]
        return ", ".join(([f"dp rank {self.dp_rank} of {self.dp_size}"] if self.dp_size > 1 else []) + parts)

    @property
    def writes_stats(self) -> bool:
        """Every rank of one engine sees the same routing (TP and EP ranks compute the same router), so its first
        rank writes for all. Under data parallelism no worker writes: each engine's first worker reports its own
        counts and the API server writes their sum (`reports_engine_counts`, engine_stats.py)."""
        return self.dp_size == 1 and self.geometry.tp_rank == 0 and self.rank.ep_rank == 0

    @property
    def reports_engine_counts(self) -> bool:
        """This worker hands its engine's counts to the API server (data parallelism, the engine's first worker)."""
        return self.dp_size > 1 and self.first_in_engine

    def release(self, why: str) -> None:
        """Give the host arena back now and write no statistics at exit: the load this placement was made for
        failed (`why`), and counts of a model that never served must not replace a record_stats file."""
        if self._exit_save is not None:
            self._exit_save.cancel()
        if self.arena is not None:
            self.arena.release(why)

    def loads_to_host_mask(self):
        """bool [moe layers, experts]: the experts placed into host records at load (with a cache: all of them)."""
        return self.host_tier if self.cache is None else self.host_tier | self.gpu_tier

    def loads_to_gpu(self, layer: int, expert: int) -> bool:
        """Whether loading copies this expert's trellises into GPU memory of its own (static plan); with a cache
        every expert goes to its host record and the plan's GPU experts are copied into slots afterwards."""
        return self.cache is None and self.in_gpu_tier(layer, expert)

    def slots(self, layer: int) -> int:
        """Expert slots of this layer's GPU tier (the plan's GPU experts of the layer)."""
        return int(self.gpu_tier[self.row(layer)].sum())

    def slot_bytes(self, layer: int) -> int:
        """One slot: the layer's largest host record, so any of its experts fits any slot."""
        return int(self.record_bytes[self.row(layer)].max())

    def gpu_tier_sizes(self) -> list[int]:
        """Bytes of each GPU-tier expert (or slot) on this rank (what the crash line offers to move to the host)."""
        if self.cache is None:
            return self.record_bytes[self.gpu_tier].tolist()  # gpu_tier holds this rank's experts only
        return [self.slot_bytes(layer) for layer in self.moe_layers for _ in range(self.slots(layer))]

    def gpu_tier_bytes(self) -> int:
        """GPU memory the routed experts' tier holds on this rank (slots with a cache, else the plan's experts)."""
        return int(sum(self.gpu_tier_sizes()))

    def host_tier_bytes(self) -> int:
        """Host arena bytes this rank holds for expert records."""
        return int(self.record_bytes[self.loads_to_host_mask()].sum())

    def note_loading_peak(self, device: torch.device) -> None:
        """Called as each MoE layer finishes loading, before vLLM allocates the KV cache: the highest
        allocation seen by then is the loading peak (a layer that held decoded experts transiently shows here)."""
        if device.type == "cuda":
            self.loading_peak_bytes = max(self.loading_peak_bytes, torch.cuda.max_memory_allocated(device))

    def memory_report(self) -> dict[str, int]:
        """What this rank placed, beside what loading cost (scripts/gpu_engine_check.py compares them)."""
        return {
            "tp_rank": self.geometry.tp_rank,
            "ep_rank": self.rank.ep_rank,
            "dp_rank": self.dp_rank,
            "local_experts": list(self.rank.local),
            "gpu_tier_expert_bytes": self.gpu_tier_bytes(),
            "host_tier_expert_bytes": self.host_tier_bytes(),
            "loading_peak_bytes": self.loading_peak_bytes,
        }

    def row(self, layer: int) -> int:
        return self.moe_layers.index(layer)

    def tier_rates(self, probe: Callable[[], TierRates]) -> TierRates:
        """The CPU tier's rates (expert_offload.cpu_tier): `probe` runs at the first layer that asks (one that has
        a host-resident expert to time), and every later layer splits by the same rates."""
        if self._tier_rates is None:
            self._tier_rates = probe()
        return self._tier_rates

    def in_gpu_tier(self, layer: int, expert: int) -> bool:
        return bool(self.gpu_tier[self.row(layer), expert])

    def record(self, layer: int, topk_ids: torch.Tensor, real: torch.Tensor | None = None) -> None:
        """Count selections on the device (no host sync, so it is safe inside CUDA graphs); `real` (bool, one per
        row of topk_ids): only those rows count (vLLM's padding rows add 0), all where None."""
        ids = topk_ids.long()
        weight = torch.ones_like(ids) if real is None else real[:, None].long().expand_as(ids)
        self.counts[self.row(layer)].index_add_(0, ids.reshape(-1), weight.reshape(-1))

    def discard_startup_counts(self) -> None:
        """Zero what startup routed (vLLM's warm-up runs, the readiness smoke), once, when the plugin hands the
        engine out; refused afterwards, so nothing that reaches the worker later can erase what serving counted."""
        if self.startup_counts_spent:
            raise StartupCountsSpent("the routing counts of startup were dropped already; serving's are never reset")
        self.startup_counts_spent = True
        self.counts.zero_()
        self.counting_since = time.time()

    def routing_counts(self) -> RoutingCounts:
        """The counts so far, with the tokens and the interval they cover.

        Called on the worker's main thread between engine steps (a collective_rpc, or at process exit), never
        inside a forward pass or a CUDA-graph capture: `.cpu()` waits for the work already queued on the current
        stream, so the copy holds every step that ran before the request (on CUDA one stream sync per save, not
        per step). Every token is routed through every MoE layer, top_k experts each, so one layer's row sum
        divided by top_k is the number of tokens."""
        counts = self.counts.cpu().numpy()
        tokens = int(counts[0].sum()) // self.top_k
        return RoutingCounts(counts, self.moe_layers, self.identity, tokens, (self.counting_since, time.time()))

    def save_stats(self, path: Path, when: str = "on request") -> None:
        counts = self.routing_counts()
        counts.save(path)
        logger.info("routing statistics written to %s %s (%d tokens, %d selections)", path, when, counts.tokens,
                    int(counts.counts.sum()))
