"""Decode tok/s per stream for a described machine, predicted from real routing replayed token by token.

One stream decodes one token per step; every MoE layer of the step reads each selected expert once. Per layer:

    t(l) = dense / L / gpu_bw + max(t_hbm, t_link, t_cpu)
    t_hbm  = experts read from GPU memory x expert_bytes / gpu_bw        (planned or cached: a hit)
    t_link = experts the device path reads from host x expert_bytes / link_bw   (zero-copy, mapped)
    t_cpu  = sum over CPU-computed experts of expert_bytes x s/byte(tokens), + the step overhead if any

The non-routed weights (attention, shared experts, router: `dense_bytes_per_token`) run before the routed experts
of their layer, so their time adds; the routed experts' three paths overlap (the fused kernel streams host experts
while other SMs read GPU memory; the host cores compute beside both). Three modes, one GPU budget:

- zero-copy: the planner's static plan from counts gathered elsewhere (cache_replay.py's "calibrated elsewhere"),
  every other expert read zero-copy over the link (a zero budget: every expert over the link);
- cache: the engine's expert cache (offload/cache_policy.py) replayed; misses read zero-copy, fills written through
  by that read (no extra link bytes);
- cache + CPU tier: as cache, and each step's host-resident misses split between the link and the host cores by
  `placement.cost.balanced_cpu_split`, the rule the server runs. A miss the cache fills this step stays on the
  device path (write-through needs the device to read it), so fills bound what the tier can take.

The routing data comes from a smaller model than the one described, so it supplies which experts each token
reads and hits, not their bytes: the budget becomes a fraction of the described model's experts, each data layer
gets floor(fraction x its experts) slots, and the data's layers stand for the described model's (time x L / L_data).
Left out, as in placement/cost.py: attention KV reads, the LM head and sampling beyond `dense_bytes_per_token`,
launch overhead and compute time on the GPU: the numbers are upper bounds on tok/s for the rates given.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import ExpertOffloadError
from ..offload.cache_policy import CacheSettings
from ..placement.cost import TierRates, balanced_cpu_split
from .cache_replay import cache_steps, slots_per_layer, static_plan
from .cache_workloads import Workload

MODES = ("zero_copy", "cache", "cache_cpu_tier")
CHUNK_STEPS = 2048  # steps timed at once (bounds the [steps, layers, experts] masks' memory)


class MachineDescriptionError(ExpertOffloadError, ValueError):
    """A machine or model description the prediction cannot use; the message names the flag."""


@dataclass(frozen=True)
class Machine:
    """The rates the prediction needs, bytes/s: `cpu` is the tier's (its `device_bytes_per_s` is the link's)."""

    gpu_bytes_per_s: float  # GPU memory read rate (GPU-resident experts, non-routed weights)
    cpu: TierRates  # the CPU tier's rate at 1 token, the device path's mapped-read rate, the per-step overhead
    gpu_budget_bytes: float  # GPU memory for routed experts (plan or cache slots)

    @property
    def link_bytes_per_s(self) -> float:
        return self.cpu.device_bytes_per_s


@dataclass(frozen=True)
class DescribedModel:
    """The model being served: its MoE geometry and the bytes one token reads."""

    layers: int  # MoE layers
    experts: int  # routed experts per layer
    top_k: int  # experts a token selects per layer
    expert_bytes: float  # one routed expert's record (trellis and scales of gate, up, down)
    dense_bytes_per_token: float = 0.0  # non-routed weights read from GPU memory per token


@dataclass(frozen=True)
class StepReads:
    """What a chunk of steps reads, [steps, layers, experts] each: tokens routed to each expert, whether it was in
    GPU memory when the step started, whether the cache fills it this step (written through by its device read)."""

    tokens: torch.Tensor  # int64
    resident: torch.Tensor  # bool
    filled: torch.Tensor  # bool


@dataclass
class ModeTotals:
    """Sums over the replayed steps of one mode (per-layer counts summed over the data's layers)."""

    seconds: float = 0.0  # described-model seconds
    gpu_reads: int = 0
    link_reads: int = 0
    cpu_reads: int = 0
    fills: int = 0
    bound_by: np.ndarray | None = None  # layer-steps whose max was GPU memory, link, CPU (3,)

    def add(self, other: ModeTotals) -> None:
        self.seconds += other.seconds
        self.gpu_reads += other.gpu_reads
        self.link_reads += other.link_reads
        self.cpu_reads += other.cpu_reads
        self.fills += other.fills
        self.bound_by = other.bound_by if self.bound_by is None else self.bound_by + other.bound_by


def data_budget(machine: Machine, model: DescribedModel) -> tuple[int, float]:
    """(slots per layer of the described model, the budget as a fraction of its experts) for `machine`'s budget."""
    slots = min(model.experts, int(machine.gpu_budget_bytes // (model.expert_bytes * model.layers)))
    return slots, slots / model.experts


def time_steps(machine: Machine, model: DescribedModel, reads: StepReads, cpu_tier: bool) -> ModeTotals:
    """The described model's decode time of a chunk of steps (module docstring), and what each tier read."""
    data_layers = reads.tokens.shape[1]
    nbytes = model.expert_bytes
    routed = reads.tokens > 0
    hits = (routed & reads.resident).sum(-1).double()  # counts times bytes in float64 (int x float is float32)
    missed = routed & ~reads.resident
    written = missed & reads.filled
    table = torch.from_numpy(machine.cpu.cpu_seconds_per_byte(max(1, int(reads.tokens.max()))))
    if cpu_tier:
        on_cpu = balanced_cpu_split(table, machine.link_bytes_per_s, machine.cpu.cpu_overhead_s, reads.tokens,
                                    missed & ~reads.filled, torch.tensor(float(nbytes), dtype=torch.float64),
                                    written.sum(-1, keepdim=True).double() * nbytes / machine.link_bytes_per_s)
    else:
        on_cpu = torch.zeros_like(missed)
    link = (missed & ~on_cpu).sum(-1).double()
    cpu_s = torch.where(on_cpu, table[reads.tokens] * nbytes, 0.0).sum(-1)
    cpu_s = cpu_s + on_cpu.any(-1).double() * machine.cpu.cpu_overhead_s
    paths = torch.stack([hits * nbytes / machine.gpu_bytes_per_s, link * nbytes / machine.link_bytes_per_s, cpu_s])
    routed_s = paths.max(0).values
    bound = torch.bincount(paths.argmax(0).flatten(), minlength=3)
    steps = reads.tokens.shape[0]
    seconds = (float(routed_s.sum()) * model.layers / data_layers
               + steps * model.dense_bytes_per_token / machine.gpu_bytes_per_s)
    return ModeTotals(seconds, int(hits.sum()), int(link.sum()), int(on_cpu.sum()), int(reads.filled.sum()),
                      bound.numpy())


def static_chunks(workload: Workload, fraction: float) -> Iterator[StepReads]:
    """The stream's steps under the static plan calibrated elsewhere (one plan per block, no fills)."""
    for block in workload.blocks:
        plan = torch.from_numpy(static_plan(workload, fraction, block.calibration))
        for start in range(block.start, block.end, CHUNK_STEPS):
            tokens = routed_tokens(workload.expert_ids[start : min(block.end, start + CHUNK_STEPS)],
                                   workload.num_experts)
            yield StepReads(tokens, plan.expand(tokens.shape), torch.zeros_like(tokens, dtype=torch.bool))


def cache_chunks(workload: Workload, settings: CacheSettings, fraction: float, progress: bool) -> Iterator[StepReads]:
    """The stream's steps through the engine's expert cache (cache_replay.cache_steps), CHUNK_STEPS at a time."""
    tokens, layers, _ = workload.shape
    experts = workload.num_experts
    resident, filled = [], []
    rows = torch.arange(layers)[:, None]
    for index, (before, step) in enumerate(cache_steps(workload, settings, fraction, progress)):
        fill = torch.zeros(layers, experts + 1, dtype=torch.bool)
        fill[rows, step.fill_expert.long()] = True  # -1 entries land in the dropped last column
        resident.append(before)
        filled.append(fill[:, :experts])
        if len(resident) == CHUNK_STEPS or index == tokens - 1:
            start = index + 1 - len(resident)
            yield StepReads(routed_tokens(workload.expert_ids[start : index + 1], experts), torch.stack(resident),
                            torch.stack(filled))
            resident, filled = [], []


def routed_tokens(expert_ids: np.ndarray, num_experts: int) -> torch.Tensor:
    """int64 [steps, layers, experts]: tokens each expert gets per step from top-k ids [steps, layers, k]."""
    ids = torch.from_numpy(np.ascontiguousarray(expert_ids)).long()
    out = torch.zeros(*ids.shape[:2], num_experts, dtype=torch.int64)
    return out.scatter_add_(-1, ids, torch.ones_like(ids))


def predict(machine: Machine, model: DescribedModel, workload: Workload, settings: CacheSettings,
            progress: bool = False) -> dict[str, ModeTotals]:
    """Each mode's totals over the whole stream: zero-copy from the static plan; cache and cache + CPU tier from one
    cache replay (the tier does not change what the cache sees: a CPU-computed expert is still a miss)."""
    if workload.shape[2] != model.top_k:
        raise MachineDescriptionError(f"--model-top-k: the routing data selects {workload.shape[2]} experts per token "
                                      f"and layer, the described model {model.top_k}; pick data with the model's k")
    _, fraction = data_budget(machine, model)
    totals = {mode: ModeTotals() for mode in MODES}
    for chunk in static_chunks(workload, fraction):
        totals["zero_copy"].add(time_steps(machine, model, chunk, cpu_tier=False))
    for chunk in cache_chunks(workload, settings, fraction, progress):
        totals["cache"].add(time_steps(machine, model, chunk, cpu_tier=False))
        totals["cache_cpu_tier"].add(time_steps(machine, model, chunk, cpu_tier=True))
    return totals


def data_slots(machine: Machine, model: DescribedModel, workload: Workload) -> int:
    """Slots each layer of the routing data gets: the described budget's fraction of the data's experts."""
    return slots_per_layer(data_budget(machine, model)[1], workload.num_experts)
