"""The CPU expert tier's compute (issue 41): host cores run the compiled CPU kernel on the host-resident experts
the split hands them, reading each expert from its arena record in place (no copy of the weights), and a bounded
startup probe of that kernel gives the rates the split decides from.

The tier's kernel is the layer's own description (contract.MoELayer) built by the compiled CPU backend without the
expert cache: the cache's step belongs to the device path, whose reads fill its slots; the tier only reads host
records. It takes the tier's top-k ids (-1: the device's entry) and computes only its own (token, slot) pairs,
gathered on the host, so an expert the device computes is never read here; its partial sums are added to the
device's in a fixed order by the caller (deterministic for a given split).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..memory.tier_cpus import TierCpus
from ..offload.cpu_tier import CpuTierSettings
from ..placement.cost import TierRates
from .contract import MoELayer
from .oracle import BackendUnavailable
from .cpu_exl3 import BACKEND as CPU_BACKEND
from .cpu_exl3 import cpu_kernel_unavailable
from .cpu_moe import CpuMoE

WHERE = "--additional-config expert_offload.cpu_tier"
PROBE_REPEATS = 3  # timed runs per token count (the fastest is kept: the others saw interference)
PROBE_BUDGET_S = 2.0  # the probe stops adding token counts once it has spent this long


@dataclass(frozen=True)
class ReadyPartial:
    """A partial sum computed before the device kernel was queued (the CPU engine: one thread does both)."""

    partial: torch.Tensor

    def result(self) -> torch.Tensor:
        return self.partial


class HostTier:
    """One MoE layer's CPU tier kernel: the compiled CPU MoE kernel over the layer's host records. On the CPU engine
    the forward starts it directly (the worker's own threads run it, the engine's cores being the host's); on a GPU
    the stream tier (stream_host_tier.py) queues the same kernel's C host functions, and the startup probe times it
    here. `busy` is told the seconds each directly started job took (the /metrics busy time)."""

    def __init__(self, kernel: CpuMoE, hidden: int, apply_router_weight_on_input: bool,
                 busy: Callable[[float], None], where: str) -> None:
        self.kernel = kernel
        self.hidden = hidden
        self.on_input = apply_router_weight_on_input
        self.busy = busy
        self.where = where

    def start(self, x: torch.Tensor, topk_weights: torch.Tensor, cpu_ids: torch.Tensor) -> ReadyPartial:
        """This forward's job, computed now and timed (the StreamHostTier's interface, kernels/stream_host_tier.py)."""
        began = time.perf_counter()
        partial = self.forward(x, topk_weights, cpu_ids, self.on_input)
        self.busy(time.perf_counter() - began)
        return ReadyPartial(partial)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, cpu_ids: torch.Tensor,
                apply_router_weight_on_input: bool) -> torch.Tensor:
        """The router-weighted sum over the tier's own entries (cpu_ids >= 0), (tokens, hidden) in x's dtype; the
        other entries contribute nothing and are not read."""
        tokens, slots = torch.nonzero(cpu_ids >= 0, as_tuple=True)
        out = torch.zeros(x.shape[0], self.hidden, dtype=torch.float32, device=x.device)
        if tokens.numel():
            part = self.kernel.forward(x[tokens], topk_weights[tokens, slots, None], cpu_ids[tokens, slots, None],
                                       apply_router_weight_on_input)
            out.index_add_(0, tokens, part.float())  # rows in (token, slot) order: a fixed summation order
        return out.to(x.dtype)


def build_host_tier(layer: MoELayer, apply_router_weight_on_input: bool, busy: Callable[[float], None],
                    cpus: TierCpus | None = None) -> HostTier:
    """The layer's CPU tier kernel, reading the host records in place (the expert cache's slots are the device
    path's: the tier reads only host records). `cpus`: the pool's threads and cores (a GPU box); None: the CPU
    engine, whose worker's own threads run the job. Refused by name where the compiled CPU kernel cannot compute
    the layer."""
    why = cpu_kernel_unavailable() or CPU_BACKEND.moe_refusal(layer)
    if why is not None:
        raise BackendUnavailable(f"{WHERE}: the CPU tier computes with the compiled CPU kernel, which cannot here: "
                                 f"{why}")
    host_layer = replace(layer, cache=None)
    if cpus is None:
        return HostTier(CpuMoE(host_layer), layer.crop.hidden, apply_router_weight_on_input, busy,
                        "in the forward by the worker's own threads, before the device path (cpus/threads not "
                        "applied there)")
    return HostTier(CpuMoE(host_layer, cpus.threads, cpus.cpus), layer.crop.hidden, apply_router_weight_on_input,
                    busy, f"by a pool of {cpus.describe()}")


def probe_counts(max_tokens: int) -> list[int]:
    """1, 2, 4, ... up to max_tokens, and max_tokens itself: the step sizes whose rates the split reads."""
    counts = [1 << i for i in range(max_tokens.bit_length()) if 1 << i <= max_tokens]
    return counts if counts[-1] == max_tokens else [*counts, max_tokens]


def probe_rates(tier: HostTier, expert: int, expert_bytes: int, hidden: int, dtype: torch.dtype,
                settings: CpuTierSettings, device_bytes_per_s: float | None = None, cpu_overhead_s: float = 0.0,
                budget_s: float = PROBE_BUDGET_S) -> TierRates:
    """Time the tier's kernel on one host-resident expert at each probe count (fastest of PROBE_REPEATS after a
    warm-up), trellis bytes per second; counts past `budget_s` are left to the rate table's extrapolation.
    `device_bytes_per_s`: the device path's read rate of a host record; None on the CPU engine, where the device
    path is this same kernel on the same record, so its 1-token rate stands for it. `cpu_overhead_s`: the fixed
    cost of handing a step to the tier (device_probe.py `exchange_seconds` on a GPU; nothing on the CPU engine)."""
    generator = torch.Generator().manual_seed(0)
    points: list[tuple[int, float]] = []
    start = time.perf_counter()
    for count in probe_counts(settings.max_tokens):
        x = torch.randn(count, hidden, generator=generator).to(dtype)
        weights = torch.ones(count, 1)
        ids = torch.full((count, 1), expert, dtype=torch.int64)
        tier.forward(x, weights, ids, False)  # warm-up: first touch of the record, the kernel's set-up
        best = min(_timed(tier, x, weights, ids) for _ in range(PROBE_REPEATS))
        points.append((count, expert_bytes / max(best, 1e-9)))
        if time.perf_counter() - start > budget_s:
            break
    return TierRates(tuple(points), points[0][1] if device_bytes_per_s is None else device_bytes_per_s,
                     cpu_overhead_s)


def _timed(tier: HostTier, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> float:
    began = time.perf_counter()
    tier.forward(x, weights, ids, False)
    return time.perf_counter() - began
