"""Memory ledger of a placement: every device and host byte by purpose, checked against the GPU before loading.

Device rows are one GPU's (one tensor-parallel rank's); host rows are the node's pinned memory, all ranks together
(each rank pins its own share of the host-tier experts; tables vLLM keeps on the host, such as DeepSeek-V4.1's
engram tables, are split between the ranks the same way). Under expert parallelism each rank holds other experts, so
a ledger is made per rank (`owned`: that rank's experts) and its host rows are that rank's.

Out-of-memory during weight loading or KV-cache profiling says nothing about what to change; the ledger says where the
bytes go and, when they do not fit, how many bytes (and experts) must move to the host tier. Host-tier experts are
stored as 4 KiB-aligned records in the pinned arena, so their padding is a row of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from ..units import GIB
from ._validate import as_byte_count, as_matrix
from .errors import PlacementError

ARENA_ALIGNMENT = 4096


@dataclass(frozen=True)
class LedgerRow:
    tier: str  # "device" or "host"
    item: str
    nbytes: int
    experts: int | None = None


NON_EXPERT = "non-expert weights"


@dataclass(frozen=True)
class Ledger:
    non_expert_bytes: int  # all device weight lines together
    gpu_expert_bytes: int
    kv_cache_bytes: int
    workspace_bytes: int
    headroom_bytes: int
    host_expert_bytes: int
    host_alignment_bytes: int
    gpu_experts: int
    host_experts: int
    gpu_expert_sizes: tuple[int, ...] = field(default=(), repr=False)  # largest first: what moving frees fastest
    weight_lines: tuple[tuple[str, int], ...] = ()  # device weights besides the GPU-tier experts, by purpose
    host_lines: tuple[tuple[str, int], ...] = ()  # node pinned memory besides the host-tier experts, by purpose
    ranks: int = 1  # tensor-parallel ranks pinning host-tier experts (host rows are node totals)

    @classmethod
    def from_plan(
        cls,
        plan: np.ndarray,
        expert_bytes: object,
        *,
        non_expert_bytes: int | Mapping[str, int],
        kv_cache_bytes: int,
        workspace_bytes: int = 0,
        headroom_bytes: int = 0,
        alignment: int = ARENA_ALIGNMENT,
        host_bytes: Mapping[str, int] | None = None,
        ranks: int = 1,
        owned: np.ndarray | None = None,
    ) -> Ledger:
        """Ledger for GPU mask `plan` [layers, experts] and one rank's per-expert sizes `expert_bytes` of the same
        shape. `non_expert_bytes` is one number or the device weights by purpose; `host_bytes` the node's other
        pinned memory by purpose; `ranks` how many ranks each pin their share of the host-tier experts. `owned`
        ([experts] bool, expert parallelism): the rank's experts; the others are another rank's and counted nowhere."""
        lines = {NON_EXPERT: non_expert_bytes} if not isinstance(non_expert_bytes, Mapping) else dict(non_expert_bytes)
        lines = {item: as_byte_count(item, amount) for item, amount in lines.items()}
        extra = {item: as_byte_count(item, amount) for item, amount in (host_bytes or {}).items()}
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
            raise PlacementError(f"ranks must be a positive integer, got {ranks!r}")
        sizes = as_matrix("expert_bytes", expert_bytes, integer=True)
        plan = np.asarray(plan)
        if plan.dtype != bool or plan.shape != sizes.shape:
            raise PlacementError(f"plan must be a bool mask of shape {sizes.shape}, got {plan.dtype} {plan.shape}")
        if alignment < 1:
            raise PlacementError(f"alignment must be >= 1, got {alignment}")
        mine = np.ones(sizes.shape, dtype=bool) if owned is None else np.broadcast_to(np.asarray(owned), sizes.shape)
        if mine.dtype != bool:
            raise PlacementError(f"owned must be a bool mask over the {sizes.shape[1]} experts, got {mine.dtype}")
        on_gpu, on_host = sizes[plan & mine], sizes[~plan & mine]
        padded = -(-on_host // alignment) * alignment
        return cls(
            non_expert_bytes=sum(lines.values()),
            gpu_expert_bytes=int(on_gpu.sum()),
            kv_cache_bytes=as_byte_count("kv_cache_bytes", kv_cache_bytes),
            workspace_bytes=as_byte_count("workspace_bytes", workspace_bytes),
            headroom_bytes=as_byte_count("headroom_bytes", headroom_bytes),
            host_expert_bytes=int(on_host.sum()),
            host_alignment_bytes=int((padded - on_host).sum()),
            gpu_experts=int(on_gpu.size),
            host_experts=int(on_host.size),
            gpu_expert_sizes=tuple(int(s) for s in np.sort(on_gpu)[::-1]),
            weight_lines=tuple(lines.items()), host_lines=tuple(extra.items()), ranks=ranks,
        )

    def rows(self) -> list[LedgerRow]:
        weights = self.weight_lines or ((NON_EXPERT, self.non_expert_bytes),)
        return [
            *(LedgerRow("device", item, amount) for item, amount in weights),
            LedgerRow("device", "GPU-tier experts", self.gpu_expert_bytes, self.gpu_experts),
            LedgerRow("device", "KV cache", self.kv_cache_bytes),
            LedgerRow("device", "workspace", self.workspace_bytes),
            LedgerRow("device", "headroom", self.headroom_bytes),
            LedgerRow("host", "host-tier experts", self.host_expert_bytes * self.ranks, self.host_experts),
            LedgerRow("host", "arena alignment", self.host_alignment_bytes * self.ranks),
            *(LedgerRow("host", item, amount) for item, amount in self.host_lines),
        ]

    @property
    def gpu_weight_bytes(self) -> int:
        """Weights on one GPU (no KV cache, workspace or headroom): what the seeds' per-GPU figures count."""
        return self.non_expert_bytes + self.gpu_expert_bytes

    @property
    def device_bytes(self) -> int:
        return sum(row.nbytes for row in self.rows() if row.tier == "device")

    @property
    def host_bytes(self) -> int:
        return sum(row.nbytes for row in self.rows() if row.tier == "host")

    def format_table(self, capacity_bytes: int | None = None, margin_fraction: float = 0.0) -> str:
        """Plain-text table (bytes and GiB), tier totals and, given a capacity, the device total against it."""
        lines = [("tier", "item", "experts", "bytes", "GiB")]
        lines += [(r.tier, r.item, "" if r.experts is None else str(r.experts), *_amount(r.nbytes))
                  for r in self.rows()]
        lines += [("device", "total", "", *_amount(self.device_bytes)),
                  ("host", "total", "", *_amount(self.host_bytes))]
        if capacity_bytes is not None:
            usable = _usable(capacity_bytes, margin_fraction)
            lines += [
                ("device", "capacity", "", *_amount(capacity_bytes)),
                ("device", f"usable ({margin_fraction:.0%} margin)", "", *_amount(usable)),
                ("device", "free" if usable >= self.device_bytes else "OVER", "",
                 *_amount(abs(usable - self.device_bytes))),
            ]
        widths = [max(len(line[i]) for line in lines) for i in range(5)]
        aligned = [[cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths))]
                   for line in lines]
        return "\n".join("  ".join(cells).rstrip() for cells in aligned)

    def check_fits(self, capacity_bytes: int, margin_fraction: float = 0.05) -> None:
        """Raise ValueError (with the table and what to move) unless device bytes <= capacity * (1 - margin)."""
        usable = _usable(capacity_bytes, margin_fraction)
        excess = self.device_bytes - usable
        if excess <= 0:
            return
        freed = np.cumsum(self.gpu_expert_sizes)
        if freed.size and freed[-1] >= excess:
            experts = int(np.searchsorted(freed, excess)) + 1
            advice = (
                f"move at least {excess:,} bytes ({excess / GIB:.2f} GiB) of experts to the host tier: "
                f"at least {experts} of the {self.gpu_experts} GPU-tier experts (that many if the largest move first)"
            )
        else:
            advice = (
                f"the device is {excess:,} bytes over even with every expert on host; "
                "reduce the KV cache, workspace or headroom, or add GPUs"
            )
        table = self.format_table(capacity_bytes, margin_fraction)
        raise PlacementError(f"placement does not fit the device: {advice}\n{table}")


def _usable(capacity_bytes: int, margin_fraction: float) -> int:
    capacity = as_byte_count("capacity_bytes", capacity_bytes)
    if not 0.0 <= margin_fraction < 1.0:
        raise PlacementError(f"margin_fraction must be in [0, 1), got {margin_fraction}")
    return int(capacity * (1.0 - margin_fraction))


def _amount(nbytes: int) -> tuple[str, str]:
    return f"{nbytes:,}", f"{nbytes / GIB:.3f}"
