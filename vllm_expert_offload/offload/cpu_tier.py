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

from ..errors import ExpertOffloadError
from ..memory.topology import parse_cpulist
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
