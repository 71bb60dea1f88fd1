"""One MoE layer's GPU tier as a pool of expert slots, filled by the kernels' own reads (issue 26).

With `expert_offload.dynamic` every expert has a host record (memory/arena.py), and the layer's GPU tier is
`slots` slots of the layer's largest record size, laid out as a record (offload/tiers.py `record_layout`), so the
slots take exactly the memory of the static GPU tier they replace when a layer's experts have one size. The
policy (offload/cache_policy.py) decides which expert occupies which slot; this module turns its decisions into
what the kernels see:

- the pointer tables (pointer_tables.py; the launch's MatrixTable *is* the trellis table tensor) point each
  resident expert's trellises into its slot and every other expert's at its host record;
- `begin(topk_ids)` runs the policy's step and returns, per projection, the launch's fill table: the slot address
  of each expert installed in this step, so the launch that reads it from the host also writes it there;
- `finish()`, after the step's launches, rewrites the tables from the policy's new assignment.

All of it is device ops of fixed shapes (no host sync, CUDA-graph safe; tests run it on `meta`). Ordering makes
a fill safe: the launches read through the tables of the previous step, a filled expert is read from its host
record (its new slot is only written), and the policy never evicts an expert this step reads, so no launch reads
a slot that is being written.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import InvalidValueError
from ..exl3.naming import PROJECTIONS
from ..offload.cache_policy import CacheSettings, ExpertCache
from ..offload.counters import TierCounters
from ..offload.tiers import PlacedExpert, record_layout
from .pointer_tables import PointerTables


def expert_trellis_bytes(experts: Sequence[PlacedExpert], device: torch.device | str) -> torch.Tensor:
    """int64 (E,): the trellis bytes of each expert (gate + up + down), what reading it from the host moves."""
    sizes = [sum(layer.trellis.numel() * layer.trellis.element_size() for layer in e.projections.values())
             for e in experts]
    return torch.tensor(sizes, dtype=torch.int64, device=device)


class ExpertSlots:
    """`slots` expert slots on `device` for one layer whose experts all live in host records, starting with the
    experts `initial` marks (the plan's GPU tier of the layer) in slots 0, 1, ... in expert order."""

    def __init__(
        self,
        experts: Sequence[PlacedExpert],
        tables: PointerTables,
        settings: CacheSettings,
        initial: Sequence[bool],
        slot_bytes: int,
        device: torch.device | str,
        counters: TierCounters | None = None,
        counter_row: int = 0,
    ) -> None:
        device = torch.device(device)
        if len(initial) != len(experts):
            raise InvalidValueError(f"initial marks {len(initial)} experts, the layer has {len(experts)}")
        layouts = [record_layout(expert.projections) for expert in experts]
        too_big = [e for e, (_, size) in enumerate(layouts) if size > slot_bytes]
        if too_big:
            raise InvalidValueError(
                f"expert {too_big[0]} needs {layouts[too_big[0]][1]} bytes, a slot holds {slot_bytes}"
            )
        self.num_experts, self.slot_bytes = len(experts), slot_bytes
        self.tables, self.counters, self.counter_row = tables, counters, counter_row
        marks = torch.tensor([bool(m) for m in initial], dtype=torch.bool)
        start = torch.where(marks, torch.cumsum(marks.to(torch.int32), 0) - 1, -1).to(torch.int32)
        self.policy = ExpertCache(settings, len(experts), int(marks.sum()), device, initial=start)
        self.pool = torch.empty(int(marks.sum()), slot_bytes, dtype=torch.uint8, device=device)
        base = self.pool.data_ptr()
        # Per projection: each expert's trellis address inside a slot (slot 0's base) and its host record's.
        self.slot_address = {
            p: torch.tensor([base + offsets[p] for offsets, _ in layouts], dtype=torch.int64, device=device)
            for p in PROJECTIONS
        }
        self.host_address = {p: tables.table(p, "trellis").clone() for p in PROJECTIONS}
        self._decided: dict[str, torch.Tensor] | None = None  # fills of a step `decide` took, for the next `begin`
        for expert, slot in enumerate(start.tolist()):  # load time: the plan's GPU experts into their slots
            if slot >= 0:
                self._copy_in(experts[expert], layouts[expert][0], slot)
        self.finish()

    def _copy_in(self, expert: PlacedExpert, offsets: dict[str, int], slot: int) -> None:
        for p in PROJECTIONS:
            trellis = expert.projections[p].trellis
            flat = trellis.reshape(-1).view(torch.uint8)
            self.pool[slot, offsets[p] : offsets[p] + flat.numel()].copy_(flat)

    def _addresses(self, projection: str, slot: torch.Tensor) -> torch.Tensor:
        """Each expert's trellis address in `slot` (int, per expert; where slot < 0 its host record)."""
        in_slot = self.slot_address[projection] + slot.long().clamp(min=0) * self.slot_bytes
        return torch.where(slot >= 0, in_slot, self.host_address[projection])

    def decide(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """The policy's step ahead of the launches, for every tier's reads of this forward (the CPU tier's split
        must know which experts are filled: their device read writes the slot); the next `begin` hands the
        launches these fills instead of stepping again. Returns bool (E,): the experts installed now."""
        self._decided = self._step(topk_ids)
        return self._decided["gate"] != 0

    def begin(self, topk_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The policy's step for this forward's local top-k ids (or the one `decide` took); returns the launches'
        fill tables, int64 (E,) per projection: the slot address of each expert installed now, 0 elsewhere."""
        fills, self._decided = self._decided, None
        return self._step(topk_ids) if fills is None else fills

    def _step(self, topk_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        step = self.policy.step(topk_ids)
        filled = step.fill_expert.long()
        # -1 padding scatters into a sink entry past the experts, dropped by the slice
        into = torch.where(filled >= 0, filled, self.num_experts)
        fills = {}
        for p in PROJECTIONS:
            at = self.slot_address[p][filled.clamp(min=0)] + step.fill_slot.long().clamp(min=0) * self.slot_bytes
            table = torch.zeros(self.num_experts + 1, dtype=torch.int64, device=at.device)
            table.scatter_(0, into, torch.where(filled >= 0, at, 0))
            fills[p] = table[: self.num_experts]
        if self.counters is not None:
            self.counters.count_fills(self.counter_row, step.fill_expert, step.evicted)
        return fills

    def finish(self) -> None:
        """Point the tables where the policy's assignment says: resident experts at their slots, others at host."""
        slot = self.policy.slot_of_expert
        for p in PROJECTIONS:
            self.tables.table(p, "trellis").copy_(self._addresses(p, slot))
        self.tables.in_gpu_tier.copy_(slot >= 0)

    def state_digest(self) -> torch.Tensor:
        """The policy's digest (int64 (2,)): equal on every TP rank while they decide the same."""
        return self.policy.state_digest()
