"""The tiny DeepSeek-V4 (tiny_dsv4.py) quantized into exllamav3's layout by `quantize`; `build_dense_twin` gives
its dense twin in DeepSeek's release names, which HF transformers and stock vLLM load."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..exl3.codebook import Codebook
from ..exl3.convert import convert_checkpoint
from .tiny_dsv4 import build_tiny_dsv4
from .tiny_models import cached_fixture

# Two wo_a groups (one head each), so the slices `wo_a.slice.{0,1}` are split, stored and joined back.
EXL3_OVERRIDES = {"o_groups": 2}


def build_tiny_dsv4_exl3(
    *, k: float = 3, head_bits: float = 6, seed: int = 0, config_overrides: Mapping[str, Any] | None = None,
) -> Path:
    """An exllamav3-layout EXL3 checkpoint of the tiny DeepSeek-V4 (random trellises: valid tensors at no encoding
    cost; the dense twin, not the source, is the reference), cached like the other fixtures."""
    overrides = dict(sorted((EXL3_OVERRIDES | dict(config_overrides or {})).items()))
    source = build_tiny_dsv4(seed=seed, config_overrides=overrides)
    spec = {"source": source.name, "k": k, "head_bits": head_bits, "seed": seed}

    def build(work: Path) -> None:
        convert_checkpoint(source, work, bits=k, head_bits=head_bits, codebook=Codebook.MUL1, encoder="random",
                           seed=seed, progress=False)

    return cached_fixture(f"{source.name}-exl3-k{k}-h{head_bits}", spec, build,
                          code=("vllm_expert_offload.exl3.deepseek_v4",))
