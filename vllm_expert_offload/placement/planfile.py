"""Versioned, human-editable JSON plan files: which experts of which MoE layer live in GPU memory.

A plan is only valid for the model, tensor- or expert-parallel size and quantization it was made for: the same expert
ids at another bitrate have other byte sizes, so a plan that fit could overflow the GPU. The file therefore records the model
identity, including a SHA-256 of the per-expert byte sizes, and `load_plan` refuses any mismatch, naming the field.

Layout (one layer per line, so a person can move ids between tiers with a text editor):

    {
      "format": "vllm-expert-offload/plan",
      "version": 1,
      "model": {"architecture": ..., "num_layers": ..., "num_experts": ..., "moe_layers": [...], "tp_size": ...,
                "expert_bytes_sha256": ..., "ep_size": ...},
      "created_by": "...",
      "budget_bytes": 123,
      "gpu_experts": {"<model layer index>": [expert ids in the GPU tier], ...}
    }

Every MoE layer must be listed (an empty list means all of its experts on host), so a typo cannot silently move a
whole layer to the host.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import __version__
from ..units import GIB
from ._validate import as_byte_count, as_matrix, read_versioned_json
from .errors import PlacementError

PLAN_FORMAT = "vllm-expert-offload/plan"
PLAN_VERSION = 1


@dataclass(frozen=True)
class ModelIdentity:
    """What a plan (or routing statistics) was made for. Row i of a plan is model layer `moe_layers[i]`."""

    architecture: str
    num_layers: int
    num_experts: int
    moe_layers: tuple[int, ...]
    tp_size: int  # the MoE layers' TP size: each expert split this many ways (1 under expert parallelism)
    expert_bytes_sha256: str
    # Expert-parallel ranks, each holding whole experts and planning them against its own GPU; files written before
    # expert parallelism have no field and mean 1.
    ep_size: int = 1

    @classmethod
    def from_expert_bytes(
        cls, architecture: str, num_layers: int, moe_layers: Sequence[int], tp_size: int, expert_bytes: object,
        ep_size: int = 1,
    ) -> ModelIdentity:
        """Identity with the checksum of `expert_bytes` [moe layers][experts] (per rank when tp_size > 1)."""
        sizes = as_matrix("expert_bytes", expert_bytes, integer=True)
        moe_layers = tuple(int(layer) for layer in moe_layers)
        if sizes.shape[0] != len(moe_layers):
            raise PlacementError(f"expert_bytes has {sizes.shape[0]} rows but moe_layers lists {len(moe_layers)} layers")
        if len(set(moe_layers)) != len(moe_layers) or not all(0 <= layer < num_layers for layer in moe_layers):
            raise PlacementError(f"moe_layers must be distinct layer indices in [0, {num_layers}), got {list(moe_layers)}")
        if tp_size < 1 or ep_size < 1 or (tp_size > 1 and ep_size > 1):
            raise PlacementError(f"tp_size and ep_size must be >= 1, one of them 1 (experts are split or placed "
                                 f"whole), got tp_size {tp_size}, ep_size {ep_size}")
        checksum = expert_bytes_checksum(sizes)
        return cls(architecture, int(num_layers), sizes.shape[1], moe_layers, int(tp_size), checksum, int(ep_size))

    def to_json(self) -> dict[str, object]:
        return {**dataclasses.asdict(self), "moe_layers": list(self.moe_layers)}

    @classmethod
    def from_json(cls, data: object, where: str) -> ModelIdentity:
        if not isinstance(data, dict):
            raise PlacementError(f"{where}: 'model' must be an object")
        fields = [f.name for f in dataclasses.fields(cls) if f.name in data or f.default is dataclasses.MISSING]
        missing = [name for name in fields if name not in data]
        if missing:
            raise PlacementError(f"{where}: 'model' lacks {', '.join(missing)}")
        if not isinstance(data["moe_layers"], list):
            raise PlacementError(f"{where}: model.moe_layers must be a list of layer indices")
        return cls(**{name: data[name] for name in fields} | {"moe_layers": tuple(data["moe_layers"])})

    def first_difference(self, other: ModelIdentity, fields: Sequence[str] | None = None) -> str | None:
        """'model.<field> is A here but B there' for the first differing field (of `fields`), else None."""
        for name in fields or [f.name for f in dataclasses.fields(self)]:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"model.{name} is {_short(mine)} in the file but {_short(theirs)} for the running model"
        return None


def expert_bytes_checksum(sizes: np.ndarray) -> str:
    """SHA-256 over 'layers,experts;' and the sizes as little-endian int64, row-major (stable across platforms)."""
    digest = hashlib.sha256(f"{sizes.shape[0]},{sizes.shape[1]};".encode())
    digest.update(np.ascontiguousarray(sizes, dtype="<i8").tobytes())
    return digest.hexdigest()


def save_plan(
    path: str | Path,
    plan: np.ndarray,
    identity: ModelIdentity,
    *,
    budget_bytes: int | None = None,
    created_by: str = f"vllm-expert-offload {__version__}",
) -> None:
    """Write `plan` (bool [moe layers, experts], True = GPU) for `identity`."""
    plan = np.asarray(plan)
    if plan.dtype != bool or plan.shape != (len(identity.moe_layers), identity.num_experts):
        raise PlacementError(
            f"plan must be a bool [{len(identity.moe_layers)}, {identity.num_experts}] mask for this model, "
            f"got {plan.dtype} {plan.shape}"
        )
    header = {
        "format": PLAN_FORMAT,
        "version": PLAN_VERSION,
        "model": identity.to_json(),
        "created_by": created_by,
        "budget_bytes": budget_bytes,
    }
    layers = [f'    "{layer}": {json.dumps(np.flatnonzero(row).tolist())}'
              for layer, row in zip(identity.moe_layers, plan)]
    head = json.dumps(header, indent=2)[:-2]  # reopen the object to append gpu_experts one layer per line
    Path(path).write_text(head + ',\n  "gpu_experts": {\n' + ",\n".join(layers) + "\n  }\n}\n")


def load_plan(
    path: str | Path, expected: ModelIdentity, expert_bytes: np.ndarray | None = None, gpu_bytes: int | None = None
) -> np.ndarray:
    """The GPU mask stored at `path`, refused (ValueError naming the field) unless it was made for `expected`.

    With the running model's `expert_bytes` [moe layers, experts] the GPU tier's bytes are checked against the
    file's `budget_bytes` (a hand edit that moves experts to the GPU past the budget the plan was made for), and
    with `gpu_bytes` (the memory of the GPU serving it) both are checked against the GPU: an over-budget plan is
    refused here, before anything is loaded, not found by the crash line after the KV cache is allocated."""
    plan, identity, budget = _read(path)
    difference = identity.first_difference(expected)
    if difference:
        raise PlacementError(f"plan file {path} was made for another model: {difference}")
    if gpu_bytes is not None and budget is not None and budget > gpu_bytes:
        raise PlacementError(f"plan file {path}: budget_bytes {budget} ({budget / GIB:.2f} GiB) is more than this "
                             f"GPU's {gpu_bytes} bytes ({gpu_bytes / GIB:.2f} GiB)")
    if expert_bytes is not None:
        gpu_tier = int(np.asarray(expert_bytes)[plan].sum())
        if budget is not None and gpu_tier > budget:
            raise PlacementError(f"plan file {path}: its GPU-tier experts take {gpu_tier} bytes, more than its "
                                 f"budget_bytes {budget}; move experts to the host tier or make the plan again")
        if gpu_bytes is not None and gpu_tier > gpu_bytes:
            raise PlacementError(f"plan file {path}: its GPU-tier experts take {gpu_tier} bytes "
                                 f"({gpu_tier / GIB:.2f} GiB), more than this GPU's {gpu_bytes / GIB:.2f} GiB")
    return plan


def read_plan(path: str | Path) -> tuple[np.ndarray, ModelIdentity]:
    """The GPU mask stored at `path` and the identity it records, for tools that work without the model."""
    plan, identity, _ = _read(path)
    return plan, identity


def _read(path: str | Path) -> tuple[np.ndarray, ModelIdentity, int | None]:
    where = f"plan file {path}"
    doc = read_versioned_json(path, where, PLAN_FORMAT, PLAN_VERSION)
    identity = ModelIdentity.from_json(doc.get("model"), where)
    budget = doc.get("budget_bytes")
    if budget is not None:
        budget = as_byte_count(f"{where}: budget_bytes", budget)
    return _gpu_mask(doc.get("gpu_experts"), identity, where), identity, budget


def _gpu_mask(entries: object, identity: ModelIdentity, where: str) -> np.ndarray:
    if not isinstance(entries, dict):
        raise PlacementError(f"{where}: 'gpu_experts' must be an object mapping layer index -> expert ids")
    expected_keys = [str(layer) for layer in identity.moe_layers]
    unknown = sorted(set(entries) - set(expected_keys))
    missing = [key for key in expected_keys if key not in entries]
    if unknown or missing:
        raise PlacementError(
            f"{where}: 'gpu_experts' must list exactly the MoE layers {identity.moe_layers} "
            f"(unknown: {unknown}, missing: {missing}; use [] for a layer with all experts on host)"
        )
    plan = np.zeros((len(expected_keys), identity.num_experts), dtype=bool)
    for row, key in enumerate(expected_keys):
        ids = entries[key]
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise PlacementError(f"{where}: gpu_experts[{key!r}] must be a list of integer expert ids")
        bad = [i for i in ids if not 0 <= i < identity.num_experts]
        if bad:
            raise PlacementError(f"{where}: gpu_experts[{key!r}] has expert ids {bad} outside [0, {identity.num_experts})")
        if len(set(ids)) != len(ids):
            duplicates = sorted({i for i in ids if ids.count(i) > 1})
            raise PlacementError(f"{where}: gpu_experts[{key!r}] lists expert ids {duplicates} more than once")
        plan[row, ids] = True
    return plan


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
