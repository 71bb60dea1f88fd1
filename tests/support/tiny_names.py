"""The tensor names the tiny fixtures must hold, written out from the architectures' published layouts
(exl3-format.md §1.3-1.5) rather than taken from the converter, so a naming slip in convert.py fails a test."""

from __future__ import annotations

K, HEAD_BITS, EXPERTS, LAYERS = 3, 6, 8, 2
MLP = ("gate_proj", "up_proj", "down_proj")
EXL3_SUFFIXES = ("trellis", "suh", "svh", "mul1")
ITEMSIZE = {"I16": 2, "F16": 2, "I32": 4, "F32": 4, "BF16": 2}


def _layer_modules(arch: str, layer: int) -> tuple[list[str], list[str]]:
    """(quantized linear prefixes, unquantized tensor names) of one decoder layer."""
    base = f"model.layers.{layer}"
    norms = [f"{base}.input_layernorm.weight", f"{base}.post_attention_layernorm.weight"]
    if arch == "deepseek_v3":
        attn = ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
        norms.append(f"{base}.self_attn.kv_a_layernorm.weight")
    else:
        attn = ["q_proj", "k_proj", "v_proj", "o_proj"]
    linears = [f"{base}.self_attn.{p}" for p in attn]
    if arch == "qwen3_moe":
        norms += [f"{base}.self_attn.q_norm.weight", f"{base}.self_attn.k_norm.weight", f"{base}.mlp.gate.weight"]
        linears += [f"{base}.mlp.experts.{e}.{p}" for e in range(EXPERTS) for p in MLP]
    elif arch == "mixtral":
        norms.append(f"{base}.block_sparse_moe.gate.weight")
        linears += [f"{base}.block_sparse_moe.experts.{e}.{p}" for e in range(EXPERTS) for p in ("w1", "w2", "w3")]
    elif layer == 0:  # deepseek_v3, first_k_dense_replace = 1
        linears += [f"{base}.mlp.{p}" for p in MLP]
    else:
        norms += [f"{base}.mlp.gate.weight", f"{base}.mlp.gate.e_score_correction_bias"]
        linears += [f"{base}.mlp.experts.{e}.{p}" for e in range(EXPERTS) for p in MLP]
        linears += [f"{base}.mlp.shared_experts.{p}" for p in MLP]
    return linears, norms


def expected_names(arch: str) -> tuple[set[str], set[str]]:
    linears, plain = ["lm_head"], ["model.embed_tokens.weight", "model.norm.weight"]
    for layer in range(LAYERS):
        q, u = _layer_modules(arch, layer)
        linears += q
        plain += u
    return set(linears), set(plain)
