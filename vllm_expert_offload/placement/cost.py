"""Per-token decode-time model of routed-expert reads, shared by the layer-balancing planner and the benchmark.

Model (batch 1 decode, one token, one MoE layer l):

    t_gpu(l)  = (dense_bytes_per_layer + routed bytes read from the GPU tier) / gpu_bytes_per_s
    t_host(l) = routed bytes read from the host tier / link_bytes_per_s
    t(l)      = max(t_gpu, t_host)   if overlap (the fused kernel streams host experts while other SMs read HBM)
              = t_gpu + t_host       otherwise (host reads serialized after the GPU work)
    t_token   = sum over MoE layers of t(l)

A decode step of c concurrent streams reads each distinct selected expert once (`batch_read_probability`): expert e
with per-token selection probability p_e is read with probability 1 - (1 - p_e)^c, tokens routing independently.

Every selected expert is read once per token (weights dominate at batch 1); compute, launch overhead, attention KV
reads, the LM head and sampling are left out, so absolute numbers are lower bounds on time per token. With expected
(count-derived) bytes instead of per-token bytes, the `max` form is a lower bound of the per-token mean (Jensen).

The CPU tier (issue 41) splits each step's host-resident misses between the device path and the host cores:
`TierRates` holds the rates measured at startup and `balanced_cpu_split` the per-step choice, one rule for the
server's forward and for any prediction of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .errors import PlacementError


@dataclass(frozen=True)
class DecodeCostModel:
    """Bandwidths and per-layer fixed traffic of one model on one machine; see the module docstring for the formula.

    `top_k` converts routing counts (selections) into expected selections per token: tokens = row sum / top_k.
    """

    top_k: int
    link_bytes_per_s: float = 25e9  # PCIe 4.0 x16, practical (exllamav3 PR #392: 24-26.8 GB/s)
    gpu_bytes_per_s: float = 1.0e12  # GDDR6X-class GPU memory (RTX 4090/3090 Ti)
    dense_bytes_per_layer: float = 0.0  # attention, shared experts, router: read every token from GPU memory
    overlap: bool = True

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise PlacementError(f"top_k must be >= 1, got {self.top_k}")
        if self.link_bytes_per_s <= 0 or self.gpu_bytes_per_s <= 0:
            raise PlacementError("link_bytes_per_s and gpu_bytes_per_s must be > 0")
        if self.dense_bytes_per_layer < 0:
            raise PlacementError(f"dense_bytes_per_layer must be >= 0, got {self.dense_bytes_per_layer}")

    def layer_seconds(self, gpu_bytes: np.ndarray | float, host_bytes: np.ndarray | float) -> np.ndarray | float:
        """t(l) for routed bytes read per layer from each tier (floats, or arrays that broadcast)."""
        t_gpu = (self.dense_bytes_per_layer + gpu_bytes) / self.gpu_bytes_per_s
        t_host = host_bytes / self.link_bytes_per_s
        return np.maximum(t_gpu, t_host) if self.overlap else t_gpu + t_host

    def selections_per_token(self, counts: np.ndarray) -> np.ndarray:
        """Expected selections of each expert per token, [layers, experts]; an all-zero layer stays zero."""
        counts = np.asarray(counts, dtype=np.float64)
        tokens = counts.sum(axis=1, keepdims=True) / self.top_k
        return np.divide(counts, tokens, out=np.zeros_like(counts), where=tokens > 0)


def batch_read_probability(selections_per_token: np.ndarray, concurrency: int) -> np.ndarray:
    """Probability that a decode step of `concurrency` streams reads each expert, [layers, experts].

    Experts shared between the streams of a batch are read once, so routed traffic grows slower than the batch;
    tokens are assumed to route independently (the same shape as `selections_per_token`, values in [0, 1]).
    """
    if concurrency < 1:
        raise PlacementError(f"concurrency must be >= 1, got {concurrency}")
    p = np.clip(np.asarray(selections_per_token, dtype=np.float64), 0.0, 1.0)
    return 1.0 - (1.0 - p) ** concurrency


def expected_layer_bytes(
    host_fraction: np.ndarray, expert_bytes: np.ndarray, selections_per_token: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Expected routed bytes per token and layer read from (GPU, host); `host_fraction` in [0, 1] per expert.

    A fraction rather than a flag so that tensor-granular offload (part of every expert of a layer on host) fits.
    """
    traffic = np.asarray(selections_per_token, dtype=np.float64) * np.asarray(expert_bytes, dtype=np.float64)
    host = (traffic * host_fraction).sum(axis=1)
    return traffic.sum(axis=1) - host, host


def trace_layer_bytes(
    host_fraction: np.ndarray, expert_bytes: np.ndarray, expert_ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Routed bytes read from (GPU, host) per token and layer, [tokens, layers] each, for ids [tokens, layers, k]."""
    nbytes = np.asarray(expert_bytes, dtype=np.float64)
    host_bytes = nbytes * np.asarray(host_fraction, dtype=np.float64)
    gpu = np.empty(expert_ids.shape[:2])
    host = np.empty(expert_ids.shape[:2])
    for layer in range(expert_ids.shape[1]):  # per-layer gathers from short rows: far faster than one 3-D gather
        ids = expert_ids[:, layer]
        host[:, layer] = host_bytes[layer][ids].sum(axis=1)
        gpu[:, layer] = nbytes[layer][ids].sum(axis=1) - host[:, layer]
    return gpu, host


@dataclass(frozen=True)
class StepBound:
    """Bytes and time of one decode step of `concurrency` streams under a `DecodeCostModel` (per GPU)."""

    concurrency: int
    distinct_experts_per_layer: float  # mean over MoE layers of experts read once per step
    gpu_bytes: float  # routed bytes read from the GPU tier per step, all layers
    host_bytes: float  # routed bytes read over the link per step, all layers
    step_s: float

    @property
    def per_stream_tok_s(self) -> float:
        return 1.0 / self.step_s

    @property
    def aggregate_tok_s(self) -> float:
        return self.concurrency / self.step_s


def step_bound(
    model: DecodeCostModel, gpu_mask: np.ndarray, expert_bytes: np.ndarray, selections_per_token: np.ndarray,
    concurrency: int,
) -> StepBound:
    """The model's step time for `concurrency` streams: the distinct experts a step reads, split by the plan."""
    reads = batch_read_probability(selections_per_token, concurrency)
    host_fraction = 1.0 - np.asarray(gpu_mask, dtype=np.float64)
    gpu, host = expected_layer_bytes(host_fraction, expert_bytes, reads)
    step_s = float(np.sum(model.layer_seconds(gpu, host)))
    return StepBound(concurrency, float(reads.sum(axis=1).mean()), float(gpu.sum()), float(host.sum()), step_s)


@dataclass(frozen=True)
class TierRates:
    """What the CPU tier's split decides from: how fast each tier finishes one host-resident expert of a step.

    `cpu_points`: (tokens, trellis bytes/s) measured by the startup probe (offload/cpu_tier.py) of the CPU kernel
    with that many tokens on one expert (each decoded tile used for every token, so bytes/s falls as tokens grow);
    `device_bytes_per_s`: the rate at which the device path reads a host-resident expert (on a GPU its mapped
    (zero-copy) read over the link; on the CPU engine the device path's own kernel); `cpu_overhead_s`: the fixed
    cost of a step that gives the CPU any expert (handing the job over, copying rows and partial sums).
    """

    cpu_points: tuple[tuple[int, float], ...]
    device_bytes_per_s: float
    cpu_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        counts = [n for n, _ in self.cpu_points]
        if not counts or counts != sorted(set(counts)) or counts[0] < 1:
            raise PlacementError(f"cpu_points must be ascending distinct token counts >= 1, got {counts}")
        if not all(math.isfinite(r) and r > 0 for _, r in self.cpu_points):
            raise PlacementError(f"cpu_points rates must be finite and > 0, got {[r for _, r in self.cpu_points]}")
        if not (math.isfinite(self.device_bytes_per_s) and self.device_bytes_per_s > 0):
            raise PlacementError(f"device_bytes_per_s must be finite and > 0, got {self.device_bytes_per_s}")
        if not (math.isfinite(self.cpu_overhead_s) and self.cpu_overhead_s >= 0):
            raise PlacementError(f"cpu_overhead_s must be finite and >= 0, got {self.cpu_overhead_s}")

    def cpu_seconds_per_byte(self, max_tokens: int) -> np.ndarray:
        """Seconds per trellis byte of one expert computed on the CPU with n = 0..max_tokens tokens.

        Between probed counts the next larger count's rate is taken (never optimistic); beyond the largest, time
        grows in proportion to the tokens. Made non-decreasing in n (more tokens never cost less), which is what
        lets the split order candidates by their token count alone."""
        counts = np.array([n for n, _ in self.cpu_points])
        per_byte = 1.0 / np.array([r for _, r in self.cpu_points])
        n = np.arange(max_tokens + 1)
        at = np.minimum(np.searchsorted(counts, n), len(counts) - 1)
        table = np.where(n <= counts[-1], per_byte[at], per_byte[-1] * n / counts[-1])
        table[0] = 0.0
        return np.maximum.accumulate(table)

    def describe(self) -> str:
        """For the startup log: the measured rates the split decides from."""
        cpu = ", ".join(f"{n} tok {r / 1e9:.2f}" for n, r in self.cpu_points)
        return (f"CPU kernel GB/s of trellis [{cpu}], device path {self.device_bytes_per_s / 1e9:.2f} GB/s, "
                f"CPU step overhead {self.cpu_overhead_s * 1e6:.0f} us")


def balanced_cpu_split(
    seconds_per_byte: torch.Tensor, device_bytes_per_s: float, cpu_overhead_s: float, tokens: torch.Tensor,
    candidates: torch.Tensor, expert_bytes: torch.Tensor, device_base_s: float | torch.Tensor = 0.0,
) -> torch.Tensor:
    """Which candidates of each step go to the CPU so that the device path and the CPU finish together.

    Shapes: `tokens` int [..., E] (tokens routed to each expert this step), `candidates` bool [..., E] (routed,
    host-resident, not cached: only these may leave the device path), `expert_bytes` [E] or [..., E],
    `seconds_per_byte` the table of `TierRates.cpu_seconds_per_byte` (covering every count in `tokens`),
    `device_base_s` the device's own work of the step (its GPU-resident experts; a float or a tensor broadcasting
    against [..., 1]). Returns bool [..., E].

    Candidates are ordered by (tokens, expert id): a byte costs the device the same for every expert while the CPU
    pays more per byte the more tokens an expert has, so an expert with fewer tokens gains at least as much on the
    CPU. The CPU takes the prefix of that order minimising max(device time, CPU time), the shortest such prefix on a
    tie. Device tensor ops only (no host synchronisation, fixed shapes), so a captured CUDA graph can replay it.
    """
    num_experts = tokens.shape[-1]
    ids = torch.arange(num_experts, device=tokens.device)
    key = torch.where(candidates, tokens.long() * num_experts + ids, torch.iinfo(torch.int64).max)
    order = torch.argsort(key, dim=-1, stable=True)
    nbytes = torch.broadcast_to(expert_bytes, tokens.shape).to(torch.float64)
    cpu_s = torch.where(candidates, nbytes * seconds_per_byte.to(tokens.device, torch.float64)[tokens.long()], 0.0)
    device_s = torch.where(candidates, nbytes / device_bytes_per_s, 0.0)
    zero = torch.zeros((*tokens.shape[:-1], 1), dtype=torch.float64, device=tokens.device)
    cpu_prefix = torch.cat([zero, torch.cumsum(torch.gather(cpu_s, -1, order), -1)], -1)
    device_prefix = torch.cat([zero, torch.cumsum(torch.gather(device_s, -1, order), -1)], -1)
    overhead = torch.full_like(cpu_prefix, cpu_overhead_s)
    overhead[..., 0] = 0.0
    device_total = device_prefix[..., -1:] + device_base_s
    step_s = torch.maximum(device_total - device_prefix, cpu_prefix + overhead)
    taken = torch.argmin(step_s, dim=-1, keepdim=True)  # the first minimum: the shortest best prefix
    in_prefix = torch.arange(num_experts, device=tokens.device) < taken
    return torch.zeros_like(candidates).scatter(-1, order, in_prefix & torch.gather(candidates, -1, order))
