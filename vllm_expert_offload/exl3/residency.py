"""Where a served pack's weights live, per tensor-parallel rank, besides the routed experts the plan places: split
over the TP group, replicated on every GPU, in pinned host memory, or not loaded at all.

Read from vLLM 0.32's DeepSeek-V4 / V4.1 models (`models/deepseek_v4*/`): the fused `wq_a`+`wkv` projection,
compressors, indexers, routers, norms and hyper-connection mixers are replicated (`disable_tp=True`,
`ReplicatedLinear`, plain parameters); `wq_b`, `wo_a`, `wo_b`, shared experts, the engram `wkv`, the embedding and
the head are split; the vision tower is split like them under vLLM's default `--mm-encoder-tp-mode weights` and
replicated under `data` (`models/vision.is_vit_use_data_parallel`); the engram tables are head-sharded and kept in
pinned host memory unless `EngramConfig.cpu_offload` is off (`config/engram.py`, default on); the draft layers
(`mtp.*`) are loaded only by a speculative-decoding drafter. Other architectures are counted split evenly (an
estimate: their norms and routers are small).

An EXL3 set counts at its quantized size where a kernel reads it, decoded (2 bytes a weight) where vLLM reads a
plain weight (DeepSeek-V4's compressors, `wo_a`, head; exl3/deepseek_v4.py) or under `dequantize_linears`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import deepseek_v4 as dsv4
from .checkpoint import DTYPE_BYTES, split_name
from .engram import TABLE as ENGRAM_TABLE
from .validate import CheckpointSummary

DECODED_BYTES_PER_WEIGHT = 2  # fp16/bf16
DEEPSEEK = (dsv4.ARCHITECTURE, dsv4.V41_ARCHITECTURE)
EMBEDDING = "embed.weight"
VISION = re.compile(r"^(vision\.|aligner\.|image_)")
DRAFT = re.compile(r"^mtp\.")
VISION_WHOLE = ("norm.weight", "norm1.weight", "norm2.weight", "patch_embed.proj.weight", "patch_embed.proj.bias",
                "wo.bias", "w2.bias")  # what a split vision tower still holds whole on every rank
# Modules vLLM's DeepSeek-V4/V4.1 build whole on every rank.
REPLICATED = re.compile(
    r"(^|\.)(norm|attn_norm|ffn_norm|kv_norm|q_norm|k_norm)\.weight$|\.hc_(attn|ffn)_|^hc_head|\.attn\.(wq_a|wkv)\."
    r"|\.compressor\.|\.indexer\.|\.ffn\.gate\.|\.engram\.(q|k)_weight$|\.main_norm\.|\.markov_head\.|\.confidence_head\."
)

# Lines of the ledger (rows of `plan`): device lines are per GPU, host lines are the whole node's.
SPLIT, REPLICATED_LINE, DRAFT_LINE, EXPERT_SCALES = (
    "non-expert weights (split over TP)", "non-expert weights (replicated)", "draft layers (speculative decoding)",
    "expert scales suh/svh (all experts)",
)
VISION_LINES = {True: "vision tower (replicated)", False: "vision tower (split over TP)"}
ENGRAM_LINE, EMBEDDING_LINE = "engram tables (pinned)", "embedding (host arena, UVA row gather)"


def nbytes(shape: tuple[int, ...], dtype: str) -> int:
    return math.prod(shape) * DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class ResidencyOptions:
    tp: int = 1
    speculative: bool = False  # a drafter loads the draft layers (mtp.*)
    engram_on_host: bool = True  # vLLM's EngramConfig.cpu_offload (default True)
    embedding_on_host: bool = False  # the token embedding in the host arena, gathered per token over UVA
    dequantized: bool = False  # expert_offload.dequantize_linears: dense EXL3 linears held decoded
    vision_replicated: bool = False  # --mm-encoder-tp-mode data (vLLM's default, weights, splits the tower)
    # Routed experts' own parallelism, where it differs from `tp`: vLLM splits each expert over TP x DP ranks
    # (`moe_tp`), or under --enable-expert-parallel gives each of `ep` ranks whole experts (an even share counted).
    moe_tp: int | None = None
    ep: int = 1


@dataclass
class Residency:
    """Bytes by ledger line: `device` on each GPU, `host` in the node's pinned memory (all ranks)."""

    device: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)
    not_loaded: dict[str, int] = field(default_factory=dict)  # stored but not loaded (draft layers without a drafter)

    def add(self, table: dict[str, int], line: str, amount: int) -> None:
        table[line] = table.get(line, 0) + amount

    @property
    def device_bytes(self) -> int:
        return sum(self.device.values())

    @property
    def host_bytes(self) -> int:
        return sum(self.host.values())


def _held_bytes(summary: CheckpointSummary, prefix: str, suffix: str, shape, dtype, hf_config, dequantized) -> int:
    """What a dense EXL3 set's tensor costs when loaded: stored, or its decoded weight once (on the trellis)."""
    lin = summary.linears[prefix]
    if not (dequantized or dsv4.decoded_at_load(prefix, hf_config)):
        return nbytes(shape, dtype)
    return lin.in_features * lin.out_features * DECODED_BYTES_PER_WEIGHT if suffix == "trellis" else 0


def residency(summary: CheckpointSummary, shapes: Mapping[str, tuple[tuple[int, ...], str]],
              hf_config: Mapping[str, Any], options: ResidencyOptions) -> Residency:
    """Every stored tensor but the main stack's routed-expert trellises (the plan places those), by ledger line."""
    layout = summary.layout
    deepseek = layout is not None and layout.architecture in DEEPSEEK
    tp = options.tp
    out = Residency()
    for name, (shape, dtype) in shapes.items():
        prefix, suffix = split_name(name)
        layer = None if layout is None else layout.expert_layer(prefix)
        main_expert = layer is not None and not layout.is_draft_layer(layer)
        if main_expert and prefix in summary.linears:
            if suffix in ("suh", "svh"):  # TP: the hidden side is whole on every rank, the intermediate side split
                whole = shape[0] == layout.hidden_size
                split = options.ep if options.ep > 1 else 1 if whole else options.moe_tp or tp
                out.add(out.device, EXPERT_SCALES, nbytes(shape, dtype) // split)
            continue
        size = (_held_bytes(summary, prefix, suffix, shape, dtype, hf_config, options.dequantized)
                if prefix in summary.linears else nbytes(shape, dtype))
        if deepseek and DRAFT.match(name):
            out.add(out.device if options.speculative else out.not_loaded, DRAFT_LINE, size // tp)
        elif deepseek and VISION.match(name):
            replicated = options.vision_replicated or name.startswith("image_") or name.endswith(VISION_WHOLE)
            out.add(out.device, VISION_LINES[options.vision_replicated], size // (1 if replicated else tp))
        elif deepseek and ENGRAM_TABLE.match(name):
            out.add(out.host, ENGRAM_LINE, size) if options.engram_on_host else out.add(out.device, SPLIT, size // tp)
        elif name == EMBEDDING and options.embedding_on_host:
            out.add(out.host, EMBEDDING_LINE, size)
        elif deepseek and REPLICATED.search(name):
            out.add(out.device, REPLICATED_LINE, size)
        else:
            out.add(out.device, SPLIT, size // tp)
    return out
