"""The CPU expert tier's settings and its split rule: which routed experts of a step the host cores compute.

`"expert_offload": {"cpu_tier": {...}}` asks that host-resident experts the router picked may be computed by host
cores from their arena record instead of read by the device over the link. Only host-resident misses can move:
GPU-resident and cached experts always stay on the device. Each step either tier's experts are handed to it as
top-k ids with the other tier's entries set to -1 (the MoE kernel contract's "not this tier's expert"), so both
kernels run over the same routing tensors and their partial sums add up to the whole layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ExpertOffloadError
from ..memory.topology import parse_cpulist
from ..placement.cost import TierRates, balanced_cpu_split
from ..validation import refuse_unknown

SPLITS = ("auto", "all")  # auto: the cost model balances the tiers; all: every host-resident miss to the CPU
DEFAULT_MAX_TOKENS = 64  # above this many tokens in a step (prefill) the device path takes everything
_KEYS = ("threads", "cpus", "max_tokens", "split")


class CpuTierSettingsError(ExpertOffloadError, ValueError):
    """The "cpu_tier" options are malformed; the message names the key."""


@dataclass(frozen=True)
class CpuTierSettings:
    """`cpu_tier` as given: `threads`/`cpus` None mean "auto" (decided at startup from the arena's node)."""

    threads: int | None = None
    cpus: tuple[int, ...] | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    split: str = "auto"


def _count(raw: dict[str, Any], key: str, where: str, default: int | str) -> int | None:
    value = raw.get(key, default)
    if value == "auto" and key == "threads":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        allowed = '"auto" or ' if key == "threads" else ""
        raise CpuTierSettingsError(f"{where}.{key}: expected {allowed}an integer >= 1, got {value!r}")
    return value


def _cpus(raw: dict[str, Any], where: str) -> tuple[int, ...] | None:
    value = raw.get("cpus", "auto")
    if value == "auto":
        return None
    ranges = [part.partition("-") for part in value.split(",")] if isinstance(value, str) else []
    well_formed = bool(ranges) and all(a.isdigit() and (not dash or (b.isdigit() and int(a) <= int(b)))
                                       for a, dash, b in ranges)
    cpus = parse_cpulist(value) if well_formed else ()
    if not cpus or len(set(cpus)) != len(cpus):
        raise CpuTierSettingsError(f'{where}.cpus: expected "auto" or a CPU list such as "2-23" or "0,2,4-7", '
                                   f"got {value!r}")
    return tuple(sorted(cpus))


def parse_cpu_tier_settings(raw: Any, where: str = "--additional-config expert_offload.cpu_tier") -> CpuTierSettings:
    """The settings of a "cpu_tier" JSON object; unknown keys and bad values are refused with `where.KEY` named."""
    if not isinstance(raw, dict):
        raise CpuTierSettingsError(f"{where}: expected an object, got {raw!r}")
    refuse_unknown(raw, _KEYS, where, CpuTierSettingsError, "unknown option")
    split = raw.get("split", "auto")
    if split not in SPLITS:
        raise CpuTierSettingsError(f"{where}.split: {split!r} is not one of {list(SPLITS)}")
    threads, cpus = _count(raw, "threads", where, "auto"), _cpus(raw, where)
    if threads is not None and cpus is not None and threads > len(cpus):
        raise CpuTierSettingsError(f"{where}.threads: {threads} threads on the {len(cpus)} CPUs of cpus "
                                   f"{raw['cpus']!r}; give at most one thread per CPU")
    return CpuTierSettings(threads, cpus, _count(raw, "max_tokens", where, DEFAULT_MAX_TOKENS), split)


def routed_tokens(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 (E,): how many tokens of the step chose each local expert (-1 entries, another rank's or tier's
    experts, are not counted)."""
    ids = topk_ids.reshape(-1).long()
    sink = torch.where(ids >= 0, ids, num_experts)  # -1 lands in a sink entry past the experts
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    return counts.scatter_add_(0, sink, torch.ones_like(sink))[:num_experts]


def split_ids(topk_ids: torch.Tensor, on_cpu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(device ids, CPU ids): `topk_ids` with each entry kept in the tier its expert goes to and -1 in the other
    (`on_cpu`: bool (E,) per local expert). An entry already -1 stays -1 in both."""
    ids = topk_ids.long()
    cpu = on_cpu[ids.clamp(min=0)] & (ids >= 0)
    minus_one = torch.full_like(ids, -1)
    return torch.where(cpu, minus_one, ids), torch.where(cpu, ids, minus_one)


class TierSplit:
    """One MoE layer's split rule: per step, which routed experts the host cores compute.

    Only candidates may leave the device path: routed experts that are host-resident now (not GPU-resident, not in
    a cache slot) and that the expert cache does not fill this step (a fill is written as the device reads the
    expert, so that read must happen). `split` "all" hands every candidate to the CPU; "auto" lets the cost model
    balance the two tiers (placement/cost.py `balanced_cpu_split`). Steps above `max_tokens` tokens (prefill) stay
    on the device whole. Device ops of fixed shapes only: no host synchronisation.
    """

    def __init__(self, settings: CpuTierSettings, rates: TierRates, expert_bytes: torch.Tensor) -> None:
        self.settings, self.rates = settings, rates
        self.expert_bytes = expert_bytes
        self.seconds_per_byte = torch.from_numpy(rates.cpu_seconds_per_byte(settings.max_tokens)).to(
            expert_bytes.device)

    def active(self, tokens: int) -> bool:
        """Whether a step of `tokens` tokens may use the CPU tier (a shape: known without a sync)."""
        return tokens <= self.settings.max_tokens

    def on_cpu(self, topk_ids: torch.Tensor, resident: torch.Tensor, filled: torch.Tensor | None = None
               ) -> torch.Tensor:
        """bool (E,): the local experts the CPU computes this step (`resident`: bool (E,) in GPU memory now;
        `filled`: bool (E,) installed into a cache slot by this step's reads, or None without a cache)."""
        tokens = routed_tokens(topk_ids, self.expert_bytes.shape[0])
        candidates = (tokens > 0) & ~resident
        if filled is not None:
            candidates &= ~filled
        if self.settings.split == "all":
            return candidates
        return balanced_cpu_split(self.seconds_per_byte, self.rates.device_bytes_per_s, self.rates.cpu_overhead_s,
                                  tokens, candidates, self.expert_bytes)
