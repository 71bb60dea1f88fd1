"""Per-layer KV-cache specs of a model, built from its config.json with vLLM's own cache classes, no weights.

For the `check-kv` tool. Each spec passes through `vllm.v1.worker.utils.customize_attention_spec`, looked up at call
time as the model runner does, so the startup fix (when installed) shapes it exactly as it would in a worker.
DeepSeek-V4 is modelled on its CUDA FlashMLA path (the deployment being checked); its attention layer needs
CUDA to construct, so its `get_kv_cache_spec` runs unbound on a stand-in carrying the fields it reads. Other
models are taken as standard decoders: full attention, or sliding window where `layer_types` says so.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.v1.attention.backend import AttentionBackend
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from vllm.v1.worker import utils as worker_utils

LayerSpecs = dict[str, tuple[KVCacheSpec, type[AttentionBackend]]]


def _add(out: LayerSpecs, name: str, spec: KVCacheSpec, backend: type[AttentionBackend]) -> None:
    """Record a layer as the runner's `get_kv_cache_spec` would: attention specs customized per backend."""
    if isinstance(spec, AttentionSpec):
        spec = worker_utils.customize_attention_spec(backend, spec)
    out[name] = (spec, backend)


def _compress_ratios(hf_config) -> list[int]:
    """0.33 reads transformers' DeepseekV4Config through a helper; 0.32 configs carry `compress_ratios`."""
    try:
        from vllm.transformers_utils.deepseek_v4_utils import get_compress_ratios
    except ImportError:
        return list(hf_config.compress_ratios)
    return list(get_compress_ratios(hf_config))


def deepseek_v4_specs(vllm_config: VllmConfig) -> LayerSpecs:
    """Every KV cache a DeepSeek-V4 decoder layer registers (attention.py, compressor.py): a sliding-window
    cache in every layer; for compressed layers the compressed MLA cache and its compressor state; for
    ratio-4 layers also the indexer's key cache and compressor state."""
    from vllm.models.deepseek_v4.attention import (
        DeepseekV4Attention,
        DeepseekV4IndexerCache,
        _resolve_dsv4_kv_cache_dtype,
    )
    from vllm.models.deepseek_v4.compressor import CompressorBackend, CompressorStateCache
    from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention
    from vllm.v1.attention.backends.mla.indexer import DeepseekV4IndexerBackend
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache

    hf = vllm_config.model_config.hf_config
    cache_config = vllm_config.cache_config
    layer_cls = DeepseekV4FlashMLAAttention
    kv_dtype, kv_torch_dtype = _resolve_dsv4_kv_cache_dtype(
        layer_cls.use_fp8_ds_mla_layout, cache_config.cache_dtype, cache_config
    )
    index_dim = hf.index_head_dim + hf.index_head_dim // 128 * 4  # fp8 keys + one fp32 scale per 128
    out: LayerSpecs = {}
    # The layers register themselves in the forward context, as they do while the model is built.
    vllm_config.compilation_config.static_forward_context.clear()
    with set_current_vllm_config(vllm_config):
        for i, ratio in enumerate(_compress_ratios(hf)[: hf.num_hidden_layers]):
            prefix = f"model.layers.{i}.attn"
            if ratio == 4:
                k_cache = DeepseekV4IndexerCache(
                    head_dim=index_dim, dtype=torch.uint8, prefix=f"{prefix}.indexer.k_cache",
                    cache_config=cache_config, compress_ratio=ratio,
                )
                _add(out, k_cache.prefix, k_cache.get_kv_cache_spec(vllm_config), DeepseekV4IndexerBackend)
                state = CompressorStateCache(
                    state_dim=2 * 2 * hf.index_head_dim, dtype=torch.float32, compress_ratio=ratio,
                    prefix=f"{prefix}.indexer.compressor.state_cache",
                )
                _add(out, state.prefix, state.get_kv_cache_spec(vllm_config), CompressorBackend)
            swa = DeepseekV4SWACache(
                head_dim=hf.head_dim, window_size=hf.sliding_window, dtype=kv_torch_dtype,
                prefix=f"{prefix}.swa_cache", cache_config=cache_config, backend_cls=layer_cls.swa_backend_cls,
            )
            _add(out, swa.prefix, swa.get_kv_cache_spec(vllm_config), swa.get_attn_backend())
            if ratio > 1:
                stand_in = SimpleNamespace(
                    compress_ratio=ratio, kv_cache_dtype=kv_dtype, head_dim=hf.head_dim,
                    kv_cache_torch_dtype=kv_torch_dtype,
                )
                _add(out, prefix, DeepseekV4Attention.get_kv_cache_spec(stand_in, vllm_config), layer_cls.backend_cls)
                overlap = 2 if ratio == 4 else 1  # ratio-4 compressors keep overlapping windows
                state = CompressorStateCache(
                    state_dim=2 * overlap * hf.head_dim, dtype=torch.float32, compress_ratio=ratio,
                    prefix=f"{prefix}.compressor.state_cache",
                )
                _add(out, state.prefix, state.get_kv_cache_spec(vllm_config), CompressorBackend)
    return out


def standard_specs(vllm_config: VllmConfig, tp: int, backend_name: str) -> LayerSpecs:
    """One attention cache per layer, KV heads split over `tp` ranks (at least one head each)."""
    hf = vllm_config.model_config.hf_config
    backend = AttentionBackendEnum[backend_name].get_class()
    head_size = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    kv_heads = max(1, getattr(hf, "num_key_value_heads", hf.num_attention_heads) // tp)
    layer_types = getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers
    common = dict(
        block_size=vllm_config.cache_config.block_size, num_kv_heads=kv_heads, head_size=head_size,
        dtype=vllm_config.model_config.dtype,
    )
    out: LayerSpecs = {}
    for i, layer_type in enumerate(layer_types[: hf.num_hidden_layers]):
        if layer_type == "sliding_attention":
            spec: AttentionSpec = SlidingWindowSpec(sliding_window=hf.sliding_window, **common)
        else:
            spec = FullAttentionSpec(**common)
        _add(out, f"model.layers.{i}.self_attn.attn", spec, backend)
    return out


def layer_specs(vllm_config: VllmConfig, tp: int, backend_name: str) -> LayerSpecs:
    hf = vllm_config.model_config.hf_config
    if hf.model_type == "deepseek_v4":
        return deepseek_v4_specs(vllm_config)
    if getattr(hf, "kv_lora_rank", None):
        raise ValueError(f"check-kv models DeepSeek-V4 and standard attention; {hf.model_type} uses MLA")
    return standard_specs(vllm_config, tp, backend_name)
