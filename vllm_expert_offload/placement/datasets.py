"""Readers for the public routing datasets under shared/data/routing (see its README for provenance).

Recognized by content, one small reader per format:

- `.npz` with `counts` [layers, experts] (OLMoE routing_output, moe-interp)             -> RoutingCounts
- `.npz` with `counts` [segments, layers, experts] (+ `prompt_ids`; moe-beyond derived)    -> SegmentedCounts
- `.npz` with `expert_ids` [tokens, layers, k] (+ `prompt_offsets`; moe-beyond derived)   -> RoutingTrace
- `.csv` "Layer ID, Batch Number, Token, Activated Expert IDs" (moe-beyond originals)     -> RoutingTrace
- `.csv` "Layer, Language, Expert_0.." selection frequencies (qwen-hebrew-finetuning)     -> RoutingCounts per language
- `.jsonl` {"dataset", "problem_id", "layer", "token_idx", "experts"} (speculative-moe)   -> RoutingTrace
- `.json` with `expert_usage_by_layer` (specMoE)                                          -> RoutingCounts

Anything else (READMEs, cross-layer pair counts, pooled histograms, per-layer samples of different prompts) carries no
per-layer-per-expert routing and is skipped when a directory is loaded.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .errors import PlacementError
from .stats import RoutingCounts, RoutingTrace, SegmentedCounts

RoutingData = RoutingCounts | SegmentedCounts | RoutingTrace
# Frequency files store the fraction of tokens selecting each expert; scaled to selections per this many tokens.
FREQUENCY_TOKENS = 1_000_000


class UnsupportedRoutingFile(PlacementError):
    """The file holds no per-layer, per-expert routing data this module can read."""


def load_routing_dataset(path: str | Path, *, num_experts: int | None = None) -> dict[str, RoutingData]:
    """Every recognized routing file under `path` (or `path` itself), keyed by relative path without suffix.

    Trace files do not say how many experts the model has; they get `num_experts` when given, else max id + 1
    (a lower bound: pass it when combining a trace with counts).
    """
    path = Path(path)
    if not path.is_dir():
        return {path.stem + suffix: data for suffix, data in read_routing_file(path, num_experts).items()}
    found: dict[str, RoutingData] = {}
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        try:
            entries = read_routing_file(file, num_experts)
        except UnsupportedRoutingFile:
            continue
        stem = file.relative_to(path).with_suffix("").as_posix()
        found.update({stem + suffix: data for suffix, data in entries.items()})
    return found


def read_routing_file(path: Path, num_experts: int | None = None) -> dict[str, RoutingData]:
    """{key suffix: data}; the suffix is "" except for files holding several sets (e.g. "/English")."""
    reader = _READERS.get(path.suffix.lower())
    if reader is None:
        raise UnsupportedRoutingFile(f"{path}: no routing reader for '{path.suffix}' files")
    return reader(path, num_experts)


def _npz(path: Path, num_experts: int | None) -> dict[str, RoutingData]:
    with np.load(path) as z:
        layers = next((tuple(z[k].tolist()) for k in ("moe_layer_ids", "layer_ids") if k in z), None)
        if "expert_ids" in z:
            ids = z["expert_ids"]
            offsets = z["prompt_offsets"] if "prompt_offsets" in z else np.array([0, len(ids)])
            names = tuple(str(p) for p in z["prompt_ids"]) if "prompt_ids" in z else (path.stem,)
            return {"": RoutingTrace(ids, offsets, names, layers or _rows(ids.shape[1]), _experts(ids, num_experts))}
        if "counts" not in z:
            raise UnsupportedRoutingFile(f"{path}: no 'counts' or 'expert_ids' array")
        counts = z["counts"]
        if counts.ndim == 3:
            names = tuple(str(p) for p in z["prompt_ids"]) if "prompt_ids" in z else _segment_numbers(len(counts))
            return {"": SegmentedCounts(counts.astype(np.int64), names, layers or _rows(counts.shape[1]))}
        return {"": RoutingCounts(_whole(counts, path), layers or _rows(counts.shape[0]))}


def _csv(path: Path, num_experts: int | None) -> dict[str, RoutingData]:
    with path.open(newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    header = [h.strip() for h in rows[0]] if rows else []
    if header[:1] == ["Layer ID"] and "Activated Expert IDs" in header:
        return {"": _trace_csv(rows[1:], header.index("Activated Expert IDs"), path, num_experts)}
    if header[:2] == ["Layer", "Language"]:
        return _frequency_csv(rows[1:])
    raise UnsupportedRoutingFile(f"{path}: unknown CSV header {header[:4]}")


def _trace_csv(rows: list[list[str]], column: int, path: Path, num_experts: int | None) -> RoutingTrace:
    """Rows grouped by layer, tokens in order within a layer (moe-beyond's per-prompt CSVs)."""
    per_layer: dict[int, list[list[int]]] = {}
    for row in rows:
        per_layer.setdefault(int(row[0]), []).append(json.loads(row[column]))
    lengths = {len(v) for v in per_layer.values()}
    if len(lengths) != 1:
        raise PlacementError(f"{path}: layers have different token counts {sorted(lengths)}")
    layers = sorted(per_layer)
    ids = np.stack([np.asarray(per_layer[layer], dtype=np.int64) for layer in layers], axis=1)
    offsets = np.array([0, ids.shape[0]])
    return RoutingTrace(ids, offsets, (path.stem,), tuple(layers), _experts(ids, num_experts))


def _frequency_csv(rows: list[list[str]]) -> dict[str, RoutingData]:
    by_language: dict[str, dict[int, list[float]]] = {}
    for row in rows:
        by_language.setdefault(row[1], {})[int(row[0])] = [float(v) for v in row[2:]]
    result: dict[str, RoutingData] = {}
    for language, layers in by_language.items():
        order = sorted(layers)
        counts = np.rint(np.array([layers[layer] for layer in order]) * FREQUENCY_TOKENS).astype(np.int64)
        result[f"/{language}"] = RoutingCounts(counts, tuple(order))
    return result


def _jsonl(path: Path, num_experts: int | None) -> dict[str, RoutingData]:
    """One record per (segment, layer, token); segments are (dataset, problem_id) in order of appearance.

    Tokens not recorded for every layer are dropped (speculative-moe's collection stops mid-step: the last 1-3
    generated tokens of a problem lack some layers).
    """
    cells: dict[str, dict[tuple[int, int], list[int]]] = {}
    with path.open(encoding="utf-8") as f:
        for line in filter(str.strip, f):
            rec = json.loads(line)
            if not {"layer", "token_idx", "experts"} <= rec.keys():
                raise UnsupportedRoutingFile(f"{path}: records lack layer/token_idx/experts")
            segment = f"{rec.get('dataset', path.stem)}/{rec.get('problem_id', 0)}"
            cells.setdefault(segment, {})[(rec["token_idx"], rec["layer"])] = rec["experts"]
    layers = sorted({layer for seg in cells.values() for _, layer in seg})
    parts = []
    for seg in cells.values():
        tokens = sorted({token for token, _ in seg})
        tokens = [t for t in tokens if all((t, layer) in seg for layer in layers)]
        parts.append(np.array([[seg[(t, layer)] for layer in layers] for t in tokens], dtype=np.int64))
    if not parts:
        raise UnsupportedRoutingFile(f"{path}: no records")
    ids = np.concatenate(parts)
    offsets = np.concatenate(([0], np.cumsum([len(p) for p in parts])))
    return {"": RoutingTrace(ids, offsets, tuple(cells), tuple(layers), _experts(ids, num_experts))}


def _json(path: Path, num_experts: int | None) -> dict[str, RoutingData]:
    doc = json.loads(path.read_text(encoding="utf-8"))
    usage = doc.get("expert_usage_by_layer") if isinstance(doc, dict) else None
    if not isinstance(usage, dict):
        raise UnsupportedRoutingFile(f"{path}: no 'expert_usage_by_layer'")
    experts = num_experts or int(doc.get("num_experts") or 1 + max(int(e) for row in usage.values() for e in row))
    layers = sorted(usage, key=int)
    counts = np.zeros((len(layers), experts), dtype=np.int64)
    for row, layer in enumerate(layers):
        for expert, count in usage[layer].items():
            counts[row, int(expert)] = count
    return {"": RoutingCounts(counts, tuple(int(layer) for layer in layers))}


def _rows(n: int) -> tuple[int, ...]:
    return tuple(range(n))


def _segment_numbers(n: int) -> tuple[str, ...]:
    return tuple(str(i) for i in range(n))


def _experts(ids: np.ndarray, num_experts: int | None) -> int:
    return num_experts if num_experts is not None else int(ids.max()) + 1


def _whole(counts: np.ndarray, path: Path) -> np.ndarray:
    """Counts stored as floats (moe-interp) must still be whole numbers."""
    if (counts != np.round(counts)).any():
        raise PlacementError(f"{path}: 'counts' are not whole numbers")
    return counts.astype(np.int64)


_READERS: dict[str, Callable[[Path, int | None], dict[str, RoutingData]]] = {
    ".npz": _npz,
    ".csv": _csv,
    ".jsonl": _jsonl,
    ".json": _json,
}
