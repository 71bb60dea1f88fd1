"""The tensors of a DeepSeek-V4.1 mixed EXL3 pack as published, derived from its config.json: names, safetensors
dtypes and shapes, in the order a pack lists them.

The published packs (diffbot/DeepSeek-V4.1-Flash-EXL3-2.0bpw-2x-RTX-PRO-6000 and the seeds' 3-bit one) are
DeepSeek's release (96,085 tensors for V4.1-Flash) with only the main stack's routed experts replaced by EXL3 sets;
the release's layout is what public readers regenerate from its config (notes in /work/notes/seeds-contract.md,
docs/models.md): FP8 E4M3 linears with an E8M0 `.scale` per 32x32 block, MXFP4 routed experts (I8 + E8M0 per 32
columns) kept in the DSpark draft stages `mtp.0..2`, BF16 norms/compressors/indexer keys/embeddings/vision tower,
F32 sinks, router biases and hyper-connection mixers, engram tables in FP8 or (the seeds') MXINT-4.

Used at full size (`full_size_packs`, headers only) and shrunk (`tiny_dsv41`, with values).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ..exl3.engram import SCALE_BLOCK, EngramFormat

# deepseek-ai/DeepSeek-V4.1-Flash config.json (text_config and vision_config as released).
V41_FLASH_TEXT: dict[str, Any] = {
    "model_type": "deepseek_v41_text", "vocab_size": 129280, "hidden_size": 5120, "moe_intermediate_size": 2304,
    "num_hidden_layers": 40, "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
    "qk_rope_head_dim": 64, "q_lora_rank": 1280, "o_lora_rank": 1024, "o_groups": 8, "hidden_act": "silu",
    "swiglu_limit": 10.0, "rms_norm_eps": 1e-20, "tie_word_embeddings": False, "max_position_embeddings": 1048576,
    "rope_theta": 10000, "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                                          "original_max_position_embeddings": 65536},
    "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 6, "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5, "sliding_window": 128,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0] * 3, "compress_rope_theta": 160000,
    "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512, "candidate_source_layer_id": 20,
    "candidate_topk_blocks": 2048, "candidate_block_size": 8, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682], "engram_max_ngram_size": 4,
    "engram_vocab_size": 16000000, "engram_n_heads": 8, "engram_head_dim": 256, "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": 99092, "num_nextn_predict_layers": 3, "dspark_block_size": 5,
    "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [37, 38, 39], "dspark_markov_rank": 256,
    "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3,
}
V41_FLASH_VISION: dict[str, Any] = {
    "model_type": "deepseek_v41_vision", "num_hidden_layers": 32, "hidden_size": 1024, "num_attention_heads": 16,
    "intermediate_size": 2816, "patch_size": 14, "rope_theta": 10000, "downsample_ratio": 3, "max_image_tokens": 1024,
    "min_pixels": 295936, "max_wh_ratio": None,
}
FP8_BLOCK = (32, 32)  # V4.1's released weight_block_size


def published_contract(bits: int, *, start_layer: int | None = 40) -> dict[str, Any]:
    """The published packs' quantization_config: routed experts EXL3 (mcg), everything else DeepSeek's block FP8,
    DSpark draft experts in their source MXFP4 (the diffbot pack's contract, also what vllm-exl3's V4.1 doc and two
    public readers accept)."""
    config = {
        "quant_method": "exl3", "bits": bits, "codebook": "mcg", "mtp_experts": "source",
        "weight_block_size": list(FP8_BLOCK),
        "non_routed_quantization": {
            "quant_method": "deepseek_v4_fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "scale_fmt": "ue8m0",
            "weight_block_size": list(FP8_BLOCK), "expert_dtype": "fp4",
        },
    }
    if start_layer is not None:
        config["mtp_experts_start_layer"] = start_layer
    return config


def pack_config(text: Mapping[str, Any], vision: Mapping[str, Any] | None, quant: Mapping[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "image_token_id": 129264,
        "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16", "quantization_config": dict(quant),
        "text_config": dict(text),
    }
    if vision is not None:
        config["vision_config"] = dict(vision)
    return config


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # safetensors header dtype
    shape: tuple[int, ...]
    kind: str  # what fills it in a tiny pack: "float", "fp8", "fp8_scale", "fp4", "fp4_scale", "exl3", "engram"


def _fp8(name: str, out: int, inp: int) -> Iterator[TensorSpec]:
    yield TensorSpec(f"{name}.weight", "F8_E4M3", (out, inp), "fp8")
    yield TensorSpec(f"{name}.scale", "F8_E8M0", (math.ceil(out / FP8_BLOCK[0]), math.ceil(inp / FP8_BLOCK[1])),
                     "fp8_scale")


def _fp4(name: str, out: int, inp: int) -> Iterator[TensorSpec]:
    yield TensorSpec(f"{name}.weight", "I8", (out, inp // 2), "fp4")
    yield TensorSpec(f"{name}.scale", "F8_E8M0", (out, inp // 32), "fp4_scale")


def _exl3(name: str, out: int, inp: int, bits: int) -> Iterator[TensorSpec]:
    yield TensorSpec(f"{name}.trellis", "I16", (inp // 16, out // 16, 16 * bits), "exl3")
    yield TensorSpec(f"{name}.suh", "F16", (inp,), "exl3")
    yield TensorSpec(f"{name}.svh", "F16", (out,), "exl3")
    yield TensorSpec(f"{name}.mcg", "I32", (), "exl3")


def _float(name: str, *shape: int, dtype: str = "BF16") -> TensorSpec:
    return TensorSpec(name, dtype, tuple(shape), "float")


def _block(t: Mapping[str, Any], prefix: str, layer: int, *, draft: bool, vision: bool, bits: int,
           engram: EngramFormat | None) -> Iterator[TensorSpec]:
    """One V4.1 block: attention, its compressor/indexer roles, an engram table, the MoE, hyper-connections."""
    hidden, heads, head_dim = t["hidden_size"], t["num_attention_heads"], t["head_dim"]
    q_rank, groups, o_rank = t["q_lora_rank"], t["o_groups"], t["o_lora_rank"]
    inter, hc = t["moe_intermediate_size"], t["hc_mult"]
    attn = f"{prefix}.attn"
    yield _float(f"{attn}.attn_sink", heads, dtype="F32")
    yield _float(f"{attn}.kv_norm.weight", head_dim)
    yield _float(f"{attn}.q_norm.weight", q_rank)
    yield from _fp8(f"{attn}.wq_a", q_rank, hidden)
    yield from _fp8(f"{attn}.wq_b", heads * head_dim, q_rank)
    yield from _fp8(f"{attn}.wkv", head_dim, hidden)
    yield from _fp8(f"{attn}.wo_a", groups * o_rank, heads * head_dim // groups)
    yield from _fp8(f"{attn}.wo_b", hidden, groups * o_rank)
    yield _float(f"{prefix}.attn_norm.weight", hidden)
    if not draft and layer in t["kv_source_layer_ids"]:
        ratio = t["compress_ratios"][layer]
        yield _float(f"{attn}.compressor.norm.weight", head_dim)
        yield _float(f"{attn}.compressor.wkv.weight", head_dim, hidden)
        if ratio > 1:  # vLLM's V4.1 compressor: "Ratio 1 pools single tokens, so the checkpoint carries no gate"
            yield _float(f"{attn}.compressor.wgate.weight", head_dim, hidden)
        yield _float(f"{attn}.indexer.k_norm.weight", t["index_head_dim"])
        yield _float(f"{attn}.indexer.wk.weight", t["index_head_dim"], head_dim)
    if not draft and layer in t["index_source_layer_ids"]:
        yield _float(f"{attn}.indexer.weights_proj.weight", t["index_n_heads"], hidden)
        yield from _fp8(f"{attn}.indexer.wq_b", t["index_n_heads"] * t["index_head_dim"], q_rank)
    if not draft and layer in t["engram_layer_ids"]:
        yield from _engram(t, prefix, layer, engram)
    experts = t["dspark_n_routed_experts"] if draft else t["n_routed_experts"]
    ffn = f"{prefix}.ffn"
    yield _float(f"{ffn}.gate.weight", experts, hidden)
    yield _float(f"{ffn}.gate.bias", experts, dtype="F32")
    if vision:
        yield _float(f"{ffn}.gate.bias_vl", experts, dtype="F32")
    for expert in range(experts):
        for proj, out, inp in (("w1", inter, hidden), ("w2", hidden, inter), ("w3", inter, hidden)):
            name = f"{ffn}.experts.{expert}.{proj}"
            yield from (_fp4(name, out, inp) if draft else _exl3(name, out, inp, bits))
    for proj, out, inp in (("w1", inter, hidden), ("w2", hidden, inter), ("w3", inter, hidden)):
        yield from _fp8(f"{ffn}.shared_experts.{proj}", out, inp)
    yield _float(f"{prefix}.ffn_norm.weight", hidden)
    mix = (2 + hc) * hc
    for branch in ("attn", "ffn"):
        yield _float(f"{prefix}.hc_{branch}_base", mix, dtype="F32")
        yield _float(f"{prefix}.hc_{branch}_fn", mix, hc * hidden, dtype="F32")
        yield _float(f"{prefix}.hc_{branch}_scale", 3, dtype="F32")


def _engram(t: Mapping[str, Any], prefix: str, layer: int, fmt: EngramFormat | None) -> Iterator[TensorSpec]:
    hidden, hc, dim = t["hidden_size"], t["hc_mult"], t["engram_head_dim"]
    rows = t["engram_num_embeddings"][t["engram_layer_ids"].index(layer)]
    table = f"{prefix}.engram.embed"
    if fmt is EngramFormat.FP8:
        yield TensorSpec(f"{table}.weight", "F8_E4M3", (rows, dim), "engram")
        yield TensorSpec(f"{table}.scale", "F8_E8M0", (rows, dim // SCALE_BLOCK), "engram")
    else:
        yield TensorSpec(f"{table}.weight", "U8", (rows, dim // 2), "engram")
        yield TensorSpec(f"{table}.scale", "F8_E4M3", (rows, dim // SCALE_BLOCK), "engram")
    yield _float(f"{prefix}.engram.q_weight", hc, hidden)
    yield _float(f"{prefix}.engram.k_weight", hc, hidden)
    hash_cols = (t["engram_max_ngram_size"] - 1) * t["engram_n_heads"]
    yield from _fp8(f"{prefix}.engram.wkv", hidden * (hc + 1), hash_cols * dim)


def _vision(t: Mapping[str, Any], v: Mapping[str, Any]) -> Iterator[TensorSpec]:
    hidden, vdim, inter, patch = t["hidden_size"], v["hidden_size"], v["intermediate_size"], v["patch_size"]
    for name in ("image_end", "image_newline", "image_start"):
        yield _float(name, hidden)
    for proj, inp in (("w1", vdim * v["downsample_ratio"] ** 2), ("w2", hidden)):
        yield _float(f"aligner.{proj}.weight", hidden, inp)
        yield _float(f"aligner.{proj}.bias", hidden)
    yield _float("vision.patch_embed.proj.weight", vdim, 3 * patch * patch)
    yield _float("vision.patch_embed.proj.bias", vdim)
    yield _float("vision.norm.weight", vdim)
    for block in range(v["num_hidden_layers"]):
        root = f"vision.blocks.{block}"
        for proj, out in (("wqkv", 3 * vdim), ("wo", vdim)):
            yield _float(f"{root}.attn.{proj}.weight", out, vdim)
            yield _float(f"{root}.attn.{proj}.bias", out)
        yield _float(f"{root}.mlp.w1.weight", 2 * inter, vdim)
        yield _float(f"{root}.mlp.w2.weight", vdim, inter)
        yield _float(f"{root}.norm1.weight", vdim)
        yield _float(f"{root}.norm2.weight", vdim)


def _dspark_heads(t: Mapping[str, Any]) -> Iterator[TensorSpec]:
    hidden, vocab, rank = t["hidden_size"], t["vocab_size"], t["dspark_markov_rank"]
    last = f"mtp.{t['num_nextn_predict_layers'] - 1}"
    yield from _fp8("mtp.0.main_proj", hidden, hidden * len(t["dspark_target_layer_ids"]))
    yield _float("mtp.0.main_norm.weight", hidden)
    yield _float(f"{last}.norm.weight", hidden)
    yield _float(f"{last}.markov_head.embed.weight", vocab, rank)
    yield _float(f"{last}.markov_head.head.weight", vocab, rank)
    yield _float(f"{last}.confidence_head.proj.weight", 1, hidden + rank)


def pack_tensors(config: Mapping[str, Any], engram: EngramFormat) -> list[TensorSpec]:
    """Every tensor of the pack config.json describes: the release's with the main stack's routed experts in EXL3
    at the contract's `bits` (per-layer `layer_bits` honoured)."""
    t, v = config["text_config"], config.get("vision_config")
    quant = config["quantization_config"]
    layer_bits = {int(k): int(b) for k, b in (quant.get("layer_bits") or {}).items()}
    specs = [_float("embed.weight", t["vocab_size"], t["hidden_size"]),
             _float("head.weight", t["vocab_size"], t["hidden_size"]), _float("norm.weight", t["hidden_size"])]
    if v is not None:
        specs += _vision(t, v)
    for layer in range(t["num_hidden_layers"]):
        specs += _block(t, f"layers.{layer}", layer, draft=False, vision=v is not None,
                        bits=layer_bits.get(layer, int(quant["bits"])), engram=engram)
    for stage in range(t["num_nextn_predict_layers"]):
        specs += _block(t, f"mtp.{stage}", stage, draft=True, vision=v is not None, bits=0, engram=None)
    if t["num_nextn_predict_layers"]:
        specs += _dspark_heads(t)
    return specs
