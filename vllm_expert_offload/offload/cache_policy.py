"""The GPU tier as an expert cache: which host-tier experts a forward installs into GPU slots, decided on the device.

One `ExpertCache` holds one MoE layer's slot assignment on one device (or, with `layers=L`, L layers' at once: the
simulator replays every layer of a token in one step). `step(topk_ids)` is called once per forward with the router's
top-k ids and returns the fills the kernels perform while they read those experts from host memory (write-through:
a fill adds no link bytes), plus the hits and misses of this forward, counted before its fills.

Why it looks the way it does:

- Every TP rank routes the same tokens to the same experts, so a decision that is a deterministic function of the
  top-k ids and the prior state (ties broken by expert id, stable sorts, no atomics whose order varies) keeps the
  ranks' caches identical without communication; `state_digest()` lets a debug build compare them.
- `step` runs inside the forward, possibly captured in a CUDA graph: fixed output shapes (a function of the batch's
  tokens T, k and the slots S only, -1 padding), state updated in place, and no op that reads device data on the
  host (no `.item()`, `nonzero`, `unique`, boolean-mask indexing); the meta-device proof checks this.
- Decay is counted in tokens seen, not time, so a replay and a server make the same decisions for the same routing.
  A token is seen when it reads one of the layer's experts: a padding row (every id -1: a captured size's tail, an
  idle data-parallel engine's dummy batch, replayed) neither reads nor ages anything, so an all-padding step leaves
  the policy as it was (under expert parallelism a token routed only to other ranks' experts is not this rank's
  either). Counted on the device: a replayed graph's T is the captured size, not the step's tokens.
- An expert selected in this step is never evicted (a kernel may be reading its slot while a fill writes another
  slot), pinned experts are never evicted, at most `slots` experts are resident, and only experts read from the host
  in this step are filled (that is what makes the fill free: the kernel already has the bytes).

Policies: "lru" ranks by the last token that read an expert. "decayed-lfu" keeps reads decayed per token at two
half-lives, `half_life_tokens` (recency) and FREQUENCY_SCALE times it (frequency), and each layer ranks by the scale
whose top `slots` experts held more of its reads lately: recency wins inside a prompt, frequency across domain
shifts, and no single half-life serves both (docs/benchmarks.md). A missed expert is installed when it ranks
strictly above the weakest evictable resident (an empty slot always admits): at a tied score the incumbent stays,
since evicting it for an equal gains nothing and would let two experts read equally often trade a slot back and
forth. For LRU admission is always, since what was just read is the most recent. "off" never fills (the static
plan), while still counting hits and misses. Negative ids (padding) are neither counted nor filled.
"""

from __future__ import annotations

import math
from dataclasses import InitVar, dataclass
from typing import Any

import torch

from ..errors import ExpertOffloadError, InvalidValueError
from ..validation import finite_number, refuse_unknown

POLICIES = ("decayed-lfu", "lru", "off")
# Tuned on the held-out moe-beyond traces and the DeepSeekMoE-16B domain stream (docs/placement.md,
# "Dynamic placement"): short enough to follow a prompt's recent experts, long enough not to churn between tokens.
DEFAULT_HALF_LIFE_TOKENS = 8.0
FREQUENCY_SCALE = 64.0  # the frequency half-life, in recency half-lives
ADVANTAGE_HALF_LIFE = 8.0  # how fast a layer forgets which scale served it better, in recency half-lives
_NEVER = math.inf  # the rank key of what must not be chosen (a non-candidate, an unevictable resident)


class CacheSettingsError(ExpertOffloadError, ValueError):
    """The "dynamic" options are malformed; the message names the key."""


@dataclass(frozen=True)
class CacheSettings:
    """`"expert_offload": {"dynamic": {"policy": ..., "half_life_tokens": H}}`, checked here, once, however it is
    built (the JSON reader below, the simulator's flags, tests); `where` names the object in a refusal."""

    policy: str = "decayed-lfu"
    half_life_tokens: float = DEFAULT_HALF_LIFE_TOKENS
    where: InitVar[str] = "dynamic"

    def __post_init__(self, where: str) -> None:
        if self.policy not in POLICIES:
            raise CacheSettingsError(f"{where}.policy: {self.policy!r} is not one of {list(POLICIES)}")
        half_life = finite_number(self.half_life_tokens, f"{where}.half_life_tokens", CacheSettingsError, 1e-3, 1e12)
        object.__setattr__(self, "half_life_tokens", half_life)  # a JSON integer read as the float it stands for

    @property
    def enabled(self) -> bool:
        return self.policy != "off"


def parse_cache_settings(raw: Any, where: str = "--additional-config expert_offload.dynamic") -> CacheSettings:
    """The settings of a "dynamic" JSON object; unknown keys and bad values are refused with `where.KEY` named."""
    if not isinstance(raw, dict):
        raise CacheSettingsError(f"{where}: expected an object, got {raw!r}")
    refuse_unknown(raw, ("policy", "half_life_tokens"), where, CacheSettingsError, "unknown option")
    return CacheSettings(raw.get("policy", CacheSettings.policy),
                         raw.get("half_life_tokens", DEFAULT_HALF_LIFE_TOKENS), where)


@dataclass(frozen=True)
class CacheStep:
    """One forward's decisions. Shapes depend on (T, k, S) only: F = min(T * k, S); with `layers=L` every field has
    a leading L axis. Entries past the fills made are -1."""

    fill_expert: torch.Tensor  # int32 (F,): host-tier experts read this forward that get a slot
    fill_slot: torch.Tensor  # int32 (F,): their slots
    evicted: torch.Tensor  # int32 (F,): the experts that left those slots (-1: the slot was empty)
    hits: torch.Tensor  # int64 scalar: token x expert reads served from GPU slots (before this step's fills)
    misses: torch.Tensor  # int64 scalar: token x expert reads from the host tier


class ExpertCache:
    """One MoE layer's expert slots on one device (`layers=L`: L independent layers stepped together).

    `pinned`: bool (E,) experts that stay resident for good (a static plan's hottest), given slots in expert order
    unless `initial` places them; `initial`: int32 (E,) slot of each expert or -1, the starting content (e.g. the
    static plan's GPU experts). With a layer axis both take a leading L axis.
    """

    def __init__(self, settings: CacheSettings, num_experts: int, slots: int, device: torch.device | str,
                 pinned: torch.Tensor | None = None, initial: torch.Tensor | None = None,
                 layers: int | None = None) -> None:
        if not 0 <= slots <= num_experts:
            raise InvalidValueError(f"slots must be in [0, num_experts={num_experts}], got {slots}")
        self.settings = settings
        self.num_experts, self.slots, self.layers = num_experts, slots, layers
        self.device = torch.device(device)
        rows = 1 if layers is None else layers
        self._pinned = self._per_layer(pinned, torch.bool, False, rows, "pinned")
        start = self._per_layer(initial, torch.int32, -1, rows, "initial")
        if initial is None:
            start = _pinned_first(self._pinned, slots)
        _check_assignment(start, self._pinned, slots)
        # The last column of each state is a sink: -1 padding scatters there, so updates need no masking.
        self._slot_state = torch.full((rows, num_experts + 1), -1, dtype=torch.int32, device=self.device)
        self._slot_state[:, :num_experts] = start.to(self.device)
        self._expert_state = torch.full((rows, slots + 1), -1, dtype=torch.int32, device=self.device)
        layer, expert = torch.nonzero(start >= 0, as_tuple=True)  # construction only: host-side set-up is fine
        self._expert_state[layer.to(self.device), start[layer, expert].long().to(self.device)] = expert.to(
            self.device, torch.int32)
        self._score = torch.zeros(rows, num_experts, dtype=torch.float64, device=self.device)
        # decayed-LFU's two time scales and, per layer, which one would have served more reads lately
        self._scales = torch.zeros(2, rows, num_experts, dtype=torch.float64, device=self.device)
        self._advantage = torch.zeros(rows, dtype=torch.float64, device=self.device)
        self._clock = torch.zeros(rows, dtype=torch.float64, device=self.device)  # tokens seen (LRU stamps)
        self._pinned = self._pinned.to(self.device)
        self._rows = torch.arange(rows, device=self.device)[:, None]

    def _per_layer(self, value: torch.Tensor | None, dtype: torch.dtype, fill: object, rows: int,
                   name: str) -> torch.Tensor:
        if value is None:
            return torch.full((rows, self.num_experts), fill, dtype=dtype)
        value = value.detach().cpu().to(dtype)
        want = (self.num_experts,) if self.layers is None else (self.layers, self.num_experts)
        if tuple(value.shape) != want:
            raise InvalidValueError(f"{name} must have shape {want}, got {tuple(value.shape)}")
        return value.reshape(rows, self.num_experts)

    def _view(self, state: torch.Tensor, width: int) -> torch.Tensor:
        part = state[:, :width]
        return part[0] if self.layers is None else part

    @property
    def slot_of_expert(self) -> torch.Tensor:
        """int32 (E,): each expert's slot, -1 = host tier only (a view of the live state)."""
        return self._view(self._slot_state, self.num_experts)

    @property
    def expert_of_slot(self) -> torch.Tensor:
        """int32 (S,): each slot's expert, -1 = empty (a view of the live state)."""
        return self._view(self._expert_state, self.slots)

    def state_digest(self) -> torch.Tensor:
        """int64 (2,) (or (L, 2)): hashes of the slot assignment and of the policy's scores. Equal on every rank
        as long as the ranks decided the same; compared across ranks in debug builds."""
        slots = self._slot_state[:, : self.num_experts].long() + 2
        weights = _hash_weights(self.num_experts, self.device)
        scores = self._score.view(torch.int64)
        digest = torch.stack([(slots * weights).sum(-1), (scores * weights).sum(-1)], dim=-1)
        return digest[0] if self.layers is None else digest

    def _decay(self, tokens: torch.Tensor, scale: float) -> torch.Tensor:
        """Factors (rows,) that age each layer's decayed counts by its `tokens` (seen this step, float64 on the
        device) at `scale` x the half-life: 1 exactly where none was seen."""
        return torch.exp2(tokens * (-1.0 / (scale * self.settings.half_life_tokens)))

    def step(self, topk_ids: torch.Tensor) -> CacheStep:
        """Count this forward's reads, update the policy and install the missed experts it admits; device ops only.

        `topk_ids`: (T, k) integer ids of one forward (with `layers=L`: (L, T, k)).
        """
        ids = topk_ids.reshape(-1, *topk_ids.shape[-2:]) if self.layers is not None else topk_ids[None]
        rows, tokens, k = ids.shape
        ids = ids.long()
        seen = (ids >= 0).any(-1)  # (rows, T): tokens that read one of the layer's experts (not padding)
        ids = torch.where(ids < 0, self.num_experts, ids)  # padding counts into a sink column, dropped below
        reads = torch.zeros(rows, self.num_experts + 1, dtype=torch.int64, device=self.device)
        reads.scatter_add_(1, ids.reshape(rows, -1), torch.ones_like(ids).reshape(rows, -1))
        reads = reads[:, : self.num_experts]
        slot_of_expert = self._slot_state[:, : self.num_experts]
        resident = slot_of_expert >= 0
        hits = torch.where(resident, reads, 0).sum(-1)
        misses = torch.where(resident, 0, reads).sum(-1)
        selected = reads > 0
        self._update_scores(ids, reads, selected, seen)
        fills = min(tokens * k, self.slots)
        if self.settings.enabled and fills:
            fill_expert, fill_slot, evicted = self._choose(selected, resident, fills)
            self._apply(fill_expert, fill_slot, evicted)
        else:
            fill_expert = fill_slot = evicted = torch.full((rows, fills), -1, dtype=torch.int32, device=self.device)
        result = (fill_expert, fill_slot, evicted, hits, misses)
        if self.layers is None:
            result = tuple(t[0] for t in result)
        return CacheStep(*result)

    def _update_scores(self, ids: torch.Tensor, reads: torch.Tensor, selected: torch.Tensor,
                       seen: torch.Tensor) -> None:
        """`seen`: bool (rows, T), the tokens that count (module docstring): only they advance the clock / decay."""
        tokens = seen.sum(-1, dtype=torch.float64)  # (rows,)
        if self.settings.policy == "lru":
            # stamp = tokens seen before this forward + the last seen token in it that read the expert (1-based)
            rows = ids.shape[0]
            position = torch.cumsum(seen, -1, dtype=torch.float64)
            position = position[:, :, None].expand(ids.shape).reshape(rows, -1)
            last = torch.zeros(rows, self.num_experts + 1, dtype=torch.float64, device=self.device)
            last.scatter_reduce_(1, ids.reshape(rows, -1), position, reduce="amax")
            last = last[:, : self.num_experts]
            self._score.copy_(torch.where(selected, self._clock[:, None] + last, self._score))
            self._clock.add_(tokens)
        else:
            self._update_frequency(reads, tokens)

    def _update_frequency(self, reads: torch.Tensor, tokens: torch.Tensor) -> None:
        """Decayed counts at the recency and frequency half-lives; each layer ranks by the scale whose top `slots`
        experts (before this forward) held more of its reads lately (a decayed tally of the difference)."""
        ghost_hits = (reads[None] * _top(self._scales, self.slots)).sum(-1)
        self._advantage.mul_(self._decay(tokens, ADVANTAGE_HALF_LIFE)).add_(ghost_hits[0] - ghost_hits[1])
        self._scales[0].mul_(self._decay(tokens, 1.0)[:, None]).add_(reads)
        self._scales[1].mul_(self._decay(tokens, FREQUENCY_SCALE)[:, None]).add_(reads)
        self._score.copy_(torch.where(self._advantage[:, None] > 0, self._scales[0], self._scales[1]))

    def _choose(self, selected: torch.Tensor, resident: torch.Tensor,
                fills: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pair the `fills` strongest missed experts with the `fills` weakest evictable slots, strongest with weakest,
        and keep the pairs where the newcomer strictly outranks the occupant (a tie keeps the occupant; empty slots
        always admit)."""
        score = self._score
        missed = selected & ~resident
        # candidates: missed experts by score, descending; a stable sort keeps expert order among equals
        cand_key = torch.where(missed, -score, _NEVER)
        cand_key, candidates = torch.sort(cand_key, dim=1, stable=True)
        cand_key, candidates = cand_key[:, :fills], candidates[:, :fills]
        # victims: empty slots first (in slot order), then evictable residents by score, ascending (expert order)
        empty_key = torch.where(self._expert_state[:, : self.slots] < 0, -_NEVER, _NEVER)
        evictable = resident & ~selected & ~self._pinned
        resident_key = torch.where(evictable, score, _NEVER)
        victim_key, order = torch.sort(torch.cat([empty_key, resident_key], dim=1), dim=1, stable=True)
        victim_key, order = victim_key[:, :fills], order[:, :fills]
        is_slot = order < self.slots
        occupant = torch.where(is_slot, -1, order - self.slots)
        slot_of_expert = self._slot_state[:, : self.num_experts]
        victim_slot = torch.where(is_slot, order, torch.gather(slot_of_expert, 1, occupant.clamp(min=0)).long())
        admit = (cand_key < _NEVER) & (victim_key < _NEVER) & (-cand_key > victim_key)
        fill_expert = torch.where(admit, candidates, -1).to(torch.int32)
        fill_slot = torch.where(admit, victim_slot, -1).to(torch.int32)
        evicted = torch.where(admit, occupant, -1).to(torch.int32)
        return fill_expert, fill_slot, evicted

    def _apply(self, fill_expert: torch.Tensor, fill_slot: torch.Tensor, evicted: torch.Tensor) -> None:
        """Evict, then install; -1 entries land in the sink column."""
        sink_expert, sink_slot = self.num_experts, self.slots
        gone = torch.where(evicted < 0, sink_expert, evicted).long()
        self._slot_state.index_put_((self._rows, gone), torch.full_like(evicted, -1))
        came = torch.where(fill_expert < 0, sink_expert, fill_expert).long()
        self._slot_state.index_put_((self._rows, came), fill_slot)
        into = torch.where(fill_slot < 0, sink_slot, fill_slot).long()
        self._expert_state.index_put_((self._rows, into), fill_expert)
        self._slot_state[:, sink_expert] = -1
        self._expert_state[:, sink_slot] = -1


def _top(scores: torch.Tensor, count: int) -> torch.Tensor:
    """1 where an expert is among the `count` highest scores of its row (ties to the lower expert id), else 0."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(scores.shape[-1], device=scores.device)
                                            .expand_as(order))
    return (rank < count).to(scores.dtype)


def _pinned_first(pinned: torch.Tensor, slots: int) -> torch.Tensor:
    """Pinned experts in slots 0, 1, ... in expert order, everything else on the host."""
    order = torch.cumsum(pinned.to(torch.int32), dim=1) - 1
    return torch.where(pinned, order, -1).to(torch.int32)


def _check_assignment(start: torch.Tensor, pinned: torch.Tensor, slots: int) -> None:
    """The starting assignment must be a partial injection into [0, slots) that places every pinned expert."""
    if (pinned.sum(-1) > slots).any():
        raise InvalidValueError(f"pinned experts need slots: {int(pinned.sum(-1).max())} pinned, {slots} slots")
    if ((start < -1) | (start >= slots)).any():
        raise InvalidValueError(f"initial slots must be -1 or in [0, {slots})")
    for row in range(start.shape[0]):
        used = start[row][start[row] >= 0]
        if len(used) != len(torch.unique(used)):
            raise InvalidValueError(f"initial assigns a slot to two experts (layer row {row})")
    if (pinned & (start < 0)).any():
        raise InvalidValueError("initial leaves a pinned expert without a slot")


def _hash_weights(n: int, device: torch.device) -> torch.Tensor:
    """Fixed odd int64 multipliers (a multiplicative hash; int64 products wrap identically everywhere)."""
    generator = torch.Generator().manual_seed(0x5EED)
    weights = torch.randint(1, 2**62, (n,), generator=generator, dtype=torch.int64) | 1
    return weights.to(device)
