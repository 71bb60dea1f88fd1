"""Routing statistics: how often each routed expert is selected, the input the planner weighs host reads with.

`RoutingCounts` accumulates selections ([moe layers, experts], int64) from router top-k ids, merges across TP ranks or
runs (counts add up), and persists as JSON, written atomically because a running server rewrites it while others read
it. Counts recorded while serving also say how many tokens they cover and over which wall-clock interval (`tokens`,
`interval`: unix seconds); files without them, written by earlier versions, still load. `SegmentedCounts` and
`RoutingTrace` hold counts per prompt and per-token selections, so calibration and evaluation can use different
prompts. Layers are named by their model layer index (`moe_layers`); row i holds layer `moe_layers[i]`.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ._atomic import write_atomically
from ._validate import read_versioned_json
from .errors import PlacementError
from .planfile import ModelIdentity

COUNTS_FORMAT = "vllm-expert-offload/routing-counts"
COUNTS_VERSION = 1
# Routing statistics transfer across TP sizes and quantizations of one model, so only these fields must agree.
ROUTING_FIELDS = ("architecture", "num_layers", "num_experts", "moe_layers")


def _is_number(value: object, kind: type) -> bool:
    return isinstance(value, kind) and not isinstance(value, bool)


def _coverage(tokens: object, interval: object) -> tuple[int | None, tuple[float, float] | None]:
    """Checked (tokens, interval): a whole number >= 0 and (start, end) unix seconds with start <= end, or None."""
    if tokens is not None and not (_is_number(tokens, numbers.Integral) and tokens >= 0):
        raise PlacementError(f"tokens must be a whole number >= 0, got {tokens!r}")
    if interval is not None:
        pair = isinstance(interval, (tuple, list)) and len(interval) == 2
        if not (pair and all(_is_number(t, numbers.Real) for t in interval) and interval[0] <= interval[1]):
            raise PlacementError(f"interval must be (start, end) in unix seconds with start <= end, got {interval!r}")
        interval = (float(interval[0]), float(interval[1]))
    return (None if tokens is None else int(tokens)), interval


@dataclass
class RoutingCounts:
    counts: np.ndarray
    moe_layers: tuple[int, ...]
    model: ModelIdentity | None = None
    tokens: int | None = None  # tokens routed (each counted once, not once per layer or per top-k pick)
    interval: tuple[float, float] | None = None  # (start, end) of the counting, unix seconds
    _rows: dict[int, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.counts = np.asarray(self.counts)
        if self.counts.ndim != 2 or self.counts.dtype.kind not in "iu":
            raise PlacementError(f"counts must be an integer [layers, experts] array, got {self.counts.dtype} "
                             f"{self.counts.shape}")
        self.counts = self.counts.astype(np.int64)
        self.moe_layers = tuple(int(layer) for layer in self.moe_layers)
        if len(self.moe_layers) != self.counts.shape[0] or len(set(self.moe_layers)) != len(self.moe_layers):
            raise PlacementError(f"moe_layers {self.moe_layers} must name each of the {self.counts.shape[0]} rows once")
        geometry = (self.moe_layers, self.num_experts)
        if self.model is not None and (self.model.moe_layers, self.model.num_experts) != geometry:
            raise PlacementError("model identity does not match counts' moe_layers / number of experts")
        self.tokens, self.interval = _coverage(self.tokens, self.interval)
        self._rows = {layer: row for row, layer in enumerate(self.moe_layers)}

    @classmethod
    def zeros(cls, moe_layers: Sequence[int], num_experts: int, model: ModelIdentity | None = None) -> RoutingCounts:
        return cls(np.zeros((len(moe_layers), num_experts), dtype=np.int64), tuple(moe_layers), model)

    @property
    def num_experts(self) -> int:
        return self.counts.shape[1]

    def add(self, layer: int, topk_ids: object) -> None:
        """Count the expert ids selected in model layer `layer` (any shape, e.g. router top-k [tokens, k])."""
        if layer not in self._rows:
            raise PlacementError(f"layer {layer} is not one of the MoE layers {self.moe_layers}")
        ids = np.asarray(topk_ids).ravel()
        if ids.size and (ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= self.num_experts):
            raise PlacementError(f"topk_ids must be integer expert ids in [0, {self.num_experts})")
        self.counts[self._rows[layer]] += np.bincount(ids, minlength=self.num_experts)

    @classmethod
    def merge(cls, parts: Iterable[RoutingCounts]) -> RoutingCounts:
        """Sum of counts (and tokens) over TP ranks, runs or files of the same model geometry; the interval spans
        all of the parts' intervals. Tokens and interval are kept only when every part has them."""
        parts = list(parts)
        if not parts:
            raise PlacementError("merge needs at least one RoutingCounts")
        first = parts[0]
        models = [p.model for p in parts if p.model is not None]
        for part in parts[1:]:
            if (part.moe_layers, part.num_experts) != (first.moe_layers, first.num_experts):
                raise PlacementError(
                    f"cannot merge counts for layers {part.moe_layers} x {part.num_experts} experts "
                    f"into layers {first.moe_layers} x {first.num_experts} experts"
                )
        for model in models[1:]:
            if (difference := model.first_difference(models[0], ROUTING_FIELDS)) is not None:
                raise PlacementError(f"cannot merge counts of different models: {difference}")
        tokens = None if any(p.tokens is None for p in parts) else sum(p.tokens for p in parts)
        intervals = [p.interval for p in parts]
        interval = None if None in intervals else (min(i[0] for i in intervals), max(i[1] for i in intervals))
        return cls(sum(p.counts for p in parts), first.moe_layers, models[0] if models else None, tokens, interval)

    def to_json(self) -> dict:
        """The saved document as plain JSON types (what `save` writes; also how a worker hands its counts over)."""
        doc = {
            "format": COUNTS_FORMAT,
            "version": COUNTS_VERSION,
            "model": None if self.model is None else self.model.to_json(),
            "moe_layers": list(self.moe_layers),
            "num_experts": self.num_experts,
            "counts": {str(layer): row.tolist() for layer, row in zip(self.moe_layers, self.counts)},
        }
        if self.tokens is not None:
            doc["tokens"] = self.tokens
        if self.interval is not None:
            doc["interval"] = {"start": self.interval[0], "end": self.interval[1]}
        return doc

    def save(self, path: str | Path) -> None:
        write_atomically(path, json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path, expected: ModelIdentity | None = None) -> RoutingCounts:
        """Counts saved by `save`; with `expected`, refused unless made for the same model geometry (ROUTING_FIELDS)."""
        where = f"routing counts file {path}"
        return cls.from_json(read_versioned_json(path, where, COUNTS_FORMAT, COUNTS_VERSION), where, expected)

    @classmethod
    def from_json(cls, doc: dict, where: str, expected: ModelIdentity | None = None) -> RoutingCounts:
        """Counts from `to_json`'s document (format and version already checked); `where` names it in errors."""
        model = None if doc.get("model") is None else ModelIdentity.from_json(doc["model"], where)
        if expected is not None:
            if model is None:
                raise PlacementError(f"{where} records no model identity to check against the running model")
            if (difference := model.first_difference(expected, ROUTING_FIELDS)) is not None:
                raise PlacementError(f"{where} was made for another model: {difference}")
        try:
            layers = [int(layer) for layer in doc["moe_layers"]]
            counts = np.array([doc["counts"][str(layer)] for layer in layers], dtype=np.int64)
        except (KeyError, TypeError, ValueError) as exc:
            raise PlacementError(f"{where}: malformed 'moe_layers'/'counts': {exc}") from None
        try:
            interval = None if "interval" not in doc else (doc["interval"]["start"], doc["interval"]["end"])
        except (KeyError, TypeError) as exc:
            raise PlacementError(f"{where}: malformed 'interval': {exc!r}") from None
        try:
            return cls(counts, tuple(layers), model, doc.get("tokens"), interval)
        except ValueError as exc:
            raise PlacementError(f"{where}: {exc}") from None


@dataclass(frozen=True)
class SegmentedCounts:
    """Counts per segment (prompt, problem, document): counts [segments, layers, experts]."""

    counts: np.ndarray
    segment_names: tuple[str, ...]
    moe_layers: tuple[int, ...]

    def total(self, segments: Sequence[int] | slice = slice(None)) -> RoutingCounts:
        """Counts summed over the chosen segments (positions, not names)."""
        return RoutingCounts(self.counts[segments].sum(axis=0, dtype=np.int64), self.moe_layers)


@dataclass(frozen=True)
class RoutingTrace:
    """Per-token selections expert_ids [tokens, layers, k]; segment i is tokens segment_offsets[i]:[i + 1]."""

    expert_ids: np.ndarray
    segment_offsets: np.ndarray
    segment_names: tuple[str, ...]
    moe_layers: tuple[int, ...]
    num_experts: int

    def __post_init__(self) -> None:
        ids, offsets = self.expert_ids, self.segment_offsets
        if ids.ndim != 3 or ids.shape[1] != len(self.moe_layers):
            raise PlacementError(f"expert_ids must be [tokens, {len(self.moe_layers)} layers, k], got {ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_experts):
            raise PlacementError(f"expert_ids must be in [0, {self.num_experts})")
        bounds_ok = len(offsets) == len(self.segment_names) + 1 and offsets[0] == 0 and offsets[-1] == len(ids)
        if not bounds_ok or (np.diff(offsets) < 0).any():
            raise PlacementError("segment_offsets must rise from 0 to the token count, one step per segment name")

    def select(self, segments: Sequence[int]) -> RoutingTrace:
        """The trace restricted to the chosen segments (positions), in the given order."""
        parts = [self.expert_ids[self.segment_offsets[s] : self.segment_offsets[s + 1]] for s in segments]
        offsets = np.concatenate(([0], np.cumsum([len(p) for p in parts], dtype=np.int64)))
        names = tuple(self.segment_names[s] for s in segments)
        ids = np.concatenate(parts) if parts else self.expert_ids[:0]
        return RoutingTrace(ids, offsets, names, self.moe_layers, self.num_experts)

    def segmented(self) -> SegmentedCounts:
        """Per-segment counts: one bincount over (segment, layer, expert) cells."""
        tokens, layers, _ = self.expert_ids.shape
        segment = np.repeat(np.arange(len(self.segment_names)), np.diff(self.segment_offsets))
        cell = (segment[:, None, None] * layers + np.arange(layers)[None, :, None]) * self.num_experts + self.expert_ids
        size = len(self.segment_names) * layers * self.num_experts
        counts = np.bincount(cell.ravel(), minlength=size).reshape(len(self.segment_names), layers, self.num_experts)
        return SegmentedCounts(counts, self.segment_names, self.moe_layers)

    def total(self) -> RoutingCounts:
        return self.segmented().total()
