"""Input checks shared by the placement modules, so every refusal names the argument the caller got wrong."""

from __future__ import annotations

import json
import numbers
from pathlib import Path

import numpy as np

from .errors import PlacementError


def as_matrix(name: str, value: object, *, integer: bool) -> np.ndarray:
    """A non-empty [layers, experts] array of finite values >= 0 (int64 when `integer`, else float64)."""
    try:
        arr = np.asarray(value)
    except ValueError as exc:  # ragged nested lists
        raise PlacementError(f"{name} must be a rectangular [layers][experts] matrix: {exc}") from None
    if arr.dtype.kind not in "iuf":
        raise PlacementError(f"{name} must hold numbers, got dtype {arr.dtype} (ragged rows or non-numeric entries?)")
    if arr.ndim != 2 or 0 in arr.shape:
        raise PlacementError(f"{name} must be a non-empty [layers][experts] matrix, got shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise PlacementError(f"{name} must be finite")
    if (arr < 0).any():
        layer, expert = np.argwhere(arr < 0)[0]
        raise PlacementError(f"{name} must be >= 0, got {arr[layer, expert]} at layer row {layer}, expert {expert}")
    if integer:
        if (arr != np.round(arr)).any():
            raise PlacementError(f"{name} must hold whole numbers of bytes")
        return arr.astype(np.int64)
    return arr.astype(np.float64)


def as_byte_count(name: str, value: object, *, round_down: bool = False) -> int:
    """A non-negative number of bytes: whole, or rounded down when `round_down` (limits such as 0.1 * GiB)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise PlacementError(f"{name} must be a number of bytes, got {value!r}")
    if not np.isfinite(value) or value < 0 or (value != int(value) and not round_down):
        raise PlacementError(f"{name} must be a whole number of bytes >= 0, got {value!r}")
    return int(value)


def read_versioned_json(path: str | Path, where: str, fmt: str, version: int) -> dict:
    """A JSON object whose "format" is `fmt` and "version" is `version`; ValueError (prefixed `where`) otherwise."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PlacementError(f"{where}: cannot read it as JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise PlacementError(f"{where}: 'format' must be {fmt!r}, got {found!r}")
    if doc.get("version") != version:
        raise PlacementError(f"{where}: 'version' {doc.get('version')!r} is not supported (this build reads {version})")
    return doc
