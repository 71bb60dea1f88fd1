"""EXL3 sets that vLLM's model needs as plain weights, decoded once while the checkpoint streams in.

vLLM's DeepSeek-V4 model builds some linears without a quant config (the compressors' `fused_wkv_wgate`, the
indexer's `weights_proj`, `lm_head`) and reads `wo_a.weight` directly as a grouped bmm on every platform, so
no quant method can serve them from a trellis (exl3/deepseek_v4.py lists them). exllamav3 stores them in EXL3;
here each such set is decoded with the format decoder as its last tensor arrives and handed on as the plain
`.weight` the model declares (`wo_a` from its o_groups slices, in group order). Everything else passes through
untouched, so the rest of the checkpoint is never held in memory. A set still incomplete when the checkpoint
ends is refused by name: nothing is half-loaded.

The hook wraps `DefaultModelLoader.get_all_weights` (checked against vLLM 0.32 and 0.33), the one iterator every
safetensors load goes through, and acts only for EXL3 checkpoints that have such sets.
"""

from __future__ import annotations

import functools
import logging
import re
import time
from collections.abc import Iterable, Iterator, Mapping

import torch

from ...exl3 import deepseek_v4 as dsv4
from ...exl3.checkpoint import split_name
from ...exl3.decode import dequantize
from ...exl3.errors import Exl3FormatError
from ...exl3.tensors import parse_linear
from ...exl3.validate import CheckpointSummary

logger = logging.getLogger("vllm.expert_offload")
LOADER = "vllm.model_executor.model_loader.default_loader"


class DecodedAtLoad:
    """The sets of one checkpoint to decode, grouped by the plain tensor each becomes."""

    def __init__(self, summary: CheckpointSummary, hf_config: Mapping, dtype: torch.dtype) -> None:
        self.hf_config = hf_config
        self.dtype = dtype
        self.suffixes = summary.suffixes
        self.members = dsv4.plain_weights(summary.quantized_prefixes, hf_config)
        self.target = {prefix: dense for dense, parts in self.members.items() for prefix in parts}

    def __bool__(self) -> bool:
        return bool(self.target)

    def _decode(self, prefix: str, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        out_features, in_features = dsv4.linear_shape(prefix, self.hf_config)
        layer = parse_linear(dict(tensors), prefix, in_features, out_features)
        if layer.bias is not None:
            raise Exl3FormatError(f"{prefix}.bias: the module vLLM builds for it has no bias")
        return dequantize(layer)[:out_features, :in_features].to(self.dtype)

    def transform(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        pending: dict[str, dict[str, torch.Tensor]] = {}
        decoded: dict[str, dict[str, torch.Tensor]] = {}
        start, count = time.perf_counter(), 0
        for name, tensor in weights:
            prefix, suffix = split_name(name)
            if prefix not in self.target:
                yield name, tensor
                continue
            parts = pending.setdefault(prefix, {})
            parts[suffix] = tensor
            if set(parts) != self.suffixes[prefix]:
                continue
            dense = self.target[prefix]
            decoded.setdefault(dense, {})[prefix] = self._decode(prefix, pending.pop(prefix))
            count += 1
            if len(decoded[dense]) == len(self.members[dense]):
                done = decoded.pop(dense)
                yield dense, torch.cat([done[p] for p in self.members[dense]])
        for prefix, parts in pending.items():
            missing = sorted(self.suffixes[prefix] - set(parts))
            raise Exl3FormatError(f"{prefix}.{missing[0]}: not delivered by the loader (received {sorted(parts)})")
        for dense, done in decoded.items():
            missing = [p for p in self.members[dense] if p not in done]
            raise Exl3FormatError(f"{missing[0]}.trellis: not delivered by the loader; {dense} needs every slice")
        kinds = sorted({re.sub(r"^layers\.\d+\.", "", split_name(dense)[0]) for dense in self.members})
        logger.info("Decoded %d EXL3 sets into %d plain weights vLLM reads directly (%s) in %.1f s",
                    count, len(self.members), ", ".join(kinds), time.perf_counter() - start)


def _exl3_config(model: torch.nn.Module):
    """The model's EXL3 quant config, reached through any layer's EXL3 method; None for other models."""
    from .quant_config import Exl3Config

    for module in model.modules():
        config = getattr(getattr(module, "quant_method", None), "quant_config", None)
        if isinstance(config, Exl3Config):
            return config
    return None


def wrap_get_all_weights(original):
    @functools.wraps(original)
    def get_all_weights(self, model_config, model):
        weights = original(self, model_config, model)
        quant_config = _exl3_config(model)
        if quant_config is None:
            return weights
        decoder = DecodedAtLoad(quant_config.summary, model_config.hf_config.to_dict(), model_config.dtype)
        return decoder.transform(weights) if decoder else weights

    return get_all_weights
