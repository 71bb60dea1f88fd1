"""DeepSeek-V4.1 Engram n-gram tables as a pack stores them, checked from headers, and their reference decode.

A table is `layers.L.engram.embed.{weight,scale}` for each of config.json's `engram_layer_ids`, one row per hash
bucket (`engram_num_embeddings`), `engram_head_dim` columns, one scale per row per 32 columns. Two stored forms:

- **fp8** (DeepSeek's release): weight F8_E4M3 [rows, dim], scale F8_E8M0 [rows, dim/32]. vLLM 0.32's own
  `ParallelEngramEmbedding` (models/deepseek_v41/common/engram.py) reads exactly this.
- **mxint4** (the published "EngramQ4" recompression, satindergrewal/DeepSeek-v4.1-Flash-EXL3-2.0bpw-Ablit-EngramQ4
  `tools/engram_write.py`): weight U8 [rows, dim/2], two's-complement 4-bit codes, the even column in the low
  nibble; scale F8_E4M3 [rows, dim/32]; value = code * scale / 8 (the writer's prescale, not stored in the pack;
  its reader's default). It halves the tables (2 x 91.5 GiB -> 2 x 48.6 GiB at full size) but is no exact
  conversion of vLLM's fp8 rows (code x an e4m3 mantissa needs up to 7 significant bits, e4m3 has 4), so the
  plugin serves it with a lookup of its own over the rows as stored.

Both live in host memory by default (vLLM's `EngramConfig.cpu_offload`, config/engram.py), head-sharded over TP.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .errors import Exl3FormatError

SCALE_BLOCK = 32  # columns per scale, both forms (engram.py `block_size=32`)
MXINT4_PRESCALE = 8.0  # tools/engram_write.py `--prescale` default; engram_q4.py `DSV41_ENGRAM_PRESCALE` default
TABLE = re.compile(r"^(?P<root>layers\.(?P<layer>\d+)\.engram\.embed)\.(?P<suffix>weight|scale)$")


class EngramFormat(enum.Enum):
    FP8 = "fp8"
    MXINT4 = "mxint4"


# format -> (weight dtype, weight columns per row given dim, scale dtype)
_STORED = {
    EngramFormat.FP8: ("F8_E4M3", lambda dim: dim, "F8_E8M0"),
    EngramFormat.MXINT4: ("U8", lambda dim: dim // 2, "F8_E4M3"),
}


@dataclass(frozen=True)
class EngramTable:
    """One layer's table as stored."""

    root: str  # "layers.L.engram.embed"
    layer: int
    rows: int
    dim: int
    format: EngramFormat

    @property
    def nbytes(self) -> int:
        _, width, _ = _STORED[self.format]
        return self.rows * (width(self.dim) + self.dim // SCALE_BLOCK)

    def shard_rows(self, head_sizes: tuple[int, ...], tp_size: int, rank: int) -> tuple[int, int]:
        """[start, end) rows rank `rank` holds: whole hash heads, ceil(heads / tp) per rank, as vLLM's
        ParallelEngramEmbedding shards them (`part_n_hash_cols`, `vocab_start_idx`)."""
        per_rank = -(-len(head_sizes) // tp_size)
        first = rank * per_rank
        return sum(head_sizes[:first]), sum(head_sizes[:first + per_rank])


def _text(hf_config: Mapping[str, Any]) -> Mapping[str, Any]:
    return {**hf_config, **(hf_config.get("text_config") or {})}


def engram_tables(shapes: Mapping[str, tuple[tuple[int, ...], str]], hf_config: Mapping[str, Any]) -> dict[str, EngramTable]:
    """Every engram table of the pack, checked against config.json: the declared layers, row counts and width,
    one of the two stored forms with a consistent scale; a table the config does not declare, or a declared one
    missing or in another form, is refused by name before anything is loaded."""
    cfg = _text(hf_config)
    layers = list(cfg.get("engram_layer_ids") or [])
    rows = list(cfg.get("engram_num_embeddings") or [])
    if len(layers) != len(rows):
        raise Exl3FormatError(f"config.json: engram_layer_ids has {len(layers)} layers but engram_num_embeddings "
                              f"{len(rows)} row counts")
    dim = int(cfg.get("engram_head_dim") or 0)
    stored = {}
    for name in shapes:
        match = TABLE.match(name)
        if match:
            stored.setdefault(match.group("root"), {})[match.group("suffix")] = name
    tables = {}
    for layer, count in zip(layers, rows):
        root = f"layers.{layer}.engram.embed"
        names = stored.pop(root, {})
        for suffix in ("weight", "scale"):
            if suffix not in names:
                raise Exl3FormatError(f"{root}.{suffix}: missing; config.json declares an engram table at layer {layer}")
        tables[root] = EngramTable(root, layer, int(count), dim, _format(root, shapes, int(count), dim))
    if stored:
        root = sorted(stored)[0]
        raise Exl3FormatError(f"{root}.weight: an engram table at a layer config.json's engram_layer_ids "
                              f"({layers}) does not list")
    return tables


def _format(root: str, shapes: Mapping[str, tuple[tuple[int, ...], str]], rows: int, dim: int) -> EngramFormat:
    (w_shape, w_dtype), (s_shape, s_dtype) = shapes[f"{root}.weight"], shapes[f"{root}.scale"]
    if dim <= 0 or dim % SCALE_BLOCK:
        raise Exl3FormatError(f"config.json: engram_head_dim {dim} is not a positive multiple of {SCALE_BLOCK}")
    for fmt, (weight_dtype, width, scale_dtype) in _STORED.items():
        if w_dtype != weight_dtype:
            continue
        if tuple(w_shape) != (rows, width(dim)):
            raise Exl3FormatError(f"{root}.weight: shape {list(w_shape)}, expected {[rows, width(dim)]} for an "
                                  f"{fmt.value} table of {rows} rows x {dim}")
        if s_dtype != scale_dtype or tuple(s_shape) != (rows, dim // SCALE_BLOCK):
            raise Exl3FormatError(f"{root}.scale: {s_dtype} {list(s_shape)}, but an {fmt.value} table's scales are "
                                  f"{scale_dtype} {[rows, dim // SCALE_BLOCK]} (one per {SCALE_BLOCK} columns)")
        return fmt
    known = ", ".join(f"{f.value} ({w} weights)" for f, (w, _, _) in _STORED.items())
    raise Exl3FormatError(f"{root}.weight: stored as {w_dtype} {list(w_shape)}; the engram tables served are {known}")


def dequantize_rows(fmt: EngramFormat, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Reference decode of stored rows to float32 [n, dim], straight from the format's definition (the tests'
    independent reference for every lookup)."""
    if fmt is EngramFormat.FP8:
        values = weight.view(torch.float8_e4m3fn).float()
        scales = torch.exp2(scale.view(torch.uint8).float() - 127.0)
    else:
        packed = weight.view(torch.uint8).to(torch.int16)
        codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
        values = torch.where(codes >= 8, codes - 16, codes).float()
        scales = scale.view(torch.float8_e4m3fn).float() / MXINT4_PRESCALE
    return values * scales.repeat_interleave(SCALE_BLOCK, dim=-1)
