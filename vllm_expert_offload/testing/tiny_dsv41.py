"""A tiny DeepSeek-V4.1 mixed pack in the published contract: the same key set, dtypes and naming as the released
packs (testing/dsv41_pack.py), shapes shrunk, values random but valid in every format.

- routed experts of `layers.*`: EXL3 sets (mcg codebook, `encode_random`: any bit pattern is a valid trellis);
- every linear vLLM builds with the quant config: FP8 E4M3 with one UE8M0 (E8M0) scale per 32x32 block;
- DSpark draft experts (`mtp.0`): MXFP4, E2M1 pairs packed in I8 (even column in the low nibble) with E8M0 scales
  per 32 columns;
- engram tables: MXINT-4 (the seeds') or FP8 (as released);
- everything else BF16/F32 as released.

Sizes obey what vLLM 0.32's V4.1 classes assert at construction (head_dim 512 with a 64-wide rope part, compress
ratios 1 and 2 only, engram rows = the hash layout's prime-sized buckets).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..exl3.codebook import Codebook
from ..exl3.convert import encode_random
from ..exl3.engram import SCALE_BLOCK, EngramFormat
from .dsv41_pack import FP8_BLOCK, V41_FLASH_TEXT, TensorSpec, pack_config, pack_tensors, published_contract
from .tiny_models import cached_fixture

FP8_MAX = 448.0
WEIGHT_STD = 0.05


def _primes_after(start: int, count: int, seen: set[int]) -> list[int]:
    out, n = [], start
    while len(out) < count:
        n += 1
        if n not in seen and n > 1 and all(n % d for d in range(2, int(n**0.5) + 1)):
            out.append(n)
            seen.add(n)
    return out


def engram_rows(layers: list[int], vocab: int, ngram: int, heads: int) -> list[int]:
    """Rows of each engram table: one prime-sized bucket range per (n-gram order, head), primes drawn in order
    and never reused across layers (vLLM's EngramLayout, models/deepseek_v41/common/engram.py)."""
    seen: set[int] = set()
    rows = []
    for _ in layers:
        rows.append(sum(sum(_primes_after(vocab - 1, heads, seen)) for _ in range(ngram - 1)))
    return rows


# The released text_config with its sizes shrunk: the same keys, so the same tensor names (dsv41_pack).
TEXT: dict[str, Any] = V41_FLASH_TEXT | {
    "vocab_size": 1024, "hidden_size": 256, "moe_intermediate_size": 256, "num_hidden_layers": 3,
    "num_attention_heads": 4, "q_lora_rank": 128, "o_lora_rank": 128, "o_groups": 2, "max_position_embeddings": 4096,
    "n_routed_experts": 16, "num_experts_per_tok": 2, "compress_ratios": [0, 2, 1, 0], "kv_source_layer_ids": [1, 2],
    "index_source_layer_ids": [1, 2], "index_n_heads": 2, "candidate_source_layer_id": 2,
    "candidate_topk_blocks": 64, "engram_layer_ids": [1], "engram_max_ngram_size": 3, "engram_vocab_size": 40,
    "engram_n_heads": 2, "engram_head_dim": 64,
    # What vLLM's compressed token map makes of write_tokenizer's vocabulary (NgramHashState checks it).
    "engram_compressed_vocab_size": 632, "num_nextn_predict_layers": 1, "dspark_noise_token_id": 1000,
    "dspark_target_layer_ids": [1, 2], "dspark_markov_rank": 32, "dspark_n_routed_experts": 8,
    "dspark_num_experts_per_tok": 2,
}
TEXT["engram_num_embeddings"] = engram_rows(TEXT["engram_layer_ids"], TEXT["engram_vocab_size"],
                                            TEXT["engram_max_ngram_size"], TEXT["engram_n_heads"])
VISION: dict[str, Any] = {
    "model_type": "deepseek_v41_vision", "num_hidden_layers": 1, "hidden_size": 64, "num_attention_heads": 2,
    "intermediate_size": 96, "patch_size": 14, "rope_theta": 10000, "downsample_ratio": 2, "max_image_tokens": 64,
    "min_pixels": 3136, "max_wh_ratio": None,
}


def tiny_config(bits: int = 3, layer_bits: Mapping[int, int] | None = None, **quant: Any) -> dict[str, Any]:
    contract = published_contract(bits, start_layer=TEXT["num_hidden_layers"]) | quant
    if layer_bits:
        contract["layer_bits"] = {str(k): v for k, v in layer_bits.items()}
    return pack_config(TEXT, VISION, contract)


def quantize_fp8_ue8m0(weight: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(F8_E4M3 weight, F8_E8M0 scale per block) as DeepSeek's V4.1 release stores a linear: each block's scale
    the power of two at or above amax / 448."""
    out_f, in_f = weight.shape
    rows, cols = -(-out_f // block[0]), -(-in_f // block[1])
    w = torch.nn.functional.pad(weight.float(), (0, cols * block[1] - in_f, 0, rows * block[0] - out_f))
    tiles = w.reshape(rows, block[0], cols, block[1])
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=2.0**-100)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    q = (tiles / scale[:, None, :, None]).reshape(rows * block[0], cols * block[1])[:out_f, :in_f]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.to(torch.float8_e8m0fnu).contiguous()


def _fill(spec: TensorSpec, gen: torch.Generator, tensors: dict[str, torch.Tensor], bits_of: Mapping[str, int]) -> None:
    name, shape = spec.name, spec.shape
    if spec.kind == "float":
        dtype = torch.float32 if spec.dtype == "F32" else torch.bfloat16
        base = 1.0 if name.endswith("norm.weight") or ".norm" in name else 0.0
        tensors[name] = (base + WEIGHT_STD * torch.randn(shape, generator=gen)).to(dtype)
    elif spec.kind == "fp8":
        weight, scale = quantize_fp8_ue8m0(WEIGHT_STD * torch.randn(shape, generator=gen))
        tensors[name], tensors[name.removesuffix(".weight") + ".scale"] = weight, scale
    elif spec.kind == "fp4":
        tensors[name] = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(torch.int8)
        scale_shape = (shape[0], shape[1] * 2 // 32)
        exponents = torch.randint(120, 124, scale_shape, generator=gen, dtype=torch.uint8)
        tensors[name.removesuffix(".weight") + ".scale"] = exponents.view(torch.float8_e8m0fnu)
    elif spec.kind == "exl3" and name.endswith(".trellis"):
        prefix = name.removesuffix(".trellis")
        out_f, in_f = spec.shape[1] * 16, spec.shape[0] * 16
        lin = encode_random(torch.randn(out_f, in_f, generator=gen) * WEIGHT_STD, bits_of[prefix], Codebook.MCG,
                            name=prefix)
        tensors |= {f"{prefix}.{suffix}": t for suffix, t in lin.tensors().items()}
    elif spec.kind == "engram" and name.endswith(".weight"):
        root = name.removesuffix(".weight")
        if spec.dtype == "U8":
            tensors[name] = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
            scale = 0.02 + 0.1 * torch.rand((shape[0], shape[1] * 2 // SCALE_BLOCK), generator=gen)
            tensors[f"{root}.scale"] = scale.to(torch.float8_e4m3fn)
        else:
            tensors[name] = (torch.randn(shape, generator=gen) * 100).to(torch.float8_e4m3fn)
            exponents = torch.randint(118, 122, (shape[0], shape[1] // SCALE_BLOCK), generator=gen, dtype=torch.uint8)
            tensors[f"{root}.scale"] = exponents.view(torch.float8_e8m0fnu)


def write_tiny_dsv41(out: Path, config: Mapping[str, Any], engram: EngramFormat, seed: int = 0) -> None:
    from safetensors.torch import save_file

    from .tiny_models import write_tokenizer

    specs = pack_tensors(config, engram)
    quant = config["quantization_config"]
    layer_bits = {int(k): int(v) for k, v in (quant.get("layer_bits") or {}).items()}
    bits_of = {}
    for spec in specs:
        if spec.name.endswith(".trellis"):
            layer = int(spec.name.split(".")[1])
            bits_of[spec.name.removesuffix(".trellis")] = layer_bits.get(layer, int(quant["bits"]))
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for spec in specs:
        _fill(spec, gen, tensors, bits_of)
    missing = {s.name for s in specs} - set(tensors)
    assert not missing, sorted(missing)[:3]
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer(out)


def build_tiny_dsv41(engram: EngramFormat = EngramFormat.MXINT4, bits: int = 3,
                     layer_bits: Mapping[int, int] | None = None, **quant: Any) -> Path:
    """The tiny pack, cached (testing/tiny_models.cached_fixture)."""
    config = tiny_config(bits, layer_bits, **quant)
    spec = {"config": config, "engram": engram.value}
    return cached_fixture("tiny-dsv41", spec, lambda out: write_tiny_dsv41(out, config, engram),
                          code=[__name__, "vllm_expert_offload.testing.dsv41_pack"])
