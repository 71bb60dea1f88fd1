"""Per-layer KV-cache specs of a model, built from its config.json with vLLM's own cache classes, no weights.

For the `check-kv` tool. Each spec passes through `vllm.v1.worker.utils.customize_attention_spec`, looked up at call
time as the model runner does, so the startup fix (when installed) shapes it exactly as it would in a worker.
DeepSeek-V4 and V4.1 are modelled on the attention class vLLM's CUDA model picks for the GPU (or the one named;
V4 without a GPU on its FlashMLA path). Their attention layers need CUDA to construct, so
`get_kv_cache_spec` runs unbound on a stand-in carrying the fields it reads. Other models are taken as standard
decoders: full attention, or sliding window where `layer_types` says so.
"""

from __future__ import annotations

import importlib
import inspect
import math
from types import SimpleNamespace

import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.v1.attention.backend import AttentionBackend
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from vllm.v1.worker import utils as worker_utils

from ...errors import InvalidValueError
from ...exl3.deepseek_v4 import compress_ratios

LayerSpecs = dict[str, tuple[KVCacheSpec, type[AttentionBackend]]]


def _add(out: LayerSpecs, name: str, spec: KVCacheSpec, backend: type[AttentionBackend]) -> None:
    """Record a layer as the runner's `get_kv_cache_spec` would: attention specs customized per backend."""
    if isinstance(spec, AttentionSpec):
        spec = worker_utils.customize_attention_spec(backend, spec)
    out[name] = (spec, backend)


# DeepSeek-V4 and V4.1's CUDA attention classes by the backend they run (vllm/models/<model>/nvidia/, 0.32 and
# 0.33): model -> backend name -> (module, class on SM120, class elsewhere).
ATTENTION_CLASSES = {
    "deepseek_v4": {
        "FLASHMLA_SPARSE_DSV4": ("flashmla", "DeepseekV4FlashMLAAttention", "DeepseekV4FlashMLAAttention"),
        "FLASHINFER_MLA_SPARSE_DSV4": (
            "flashinfer_sparse", "DeepseekV4FlashInferSM120Attention", "DeepseekV4FlashInferMLAAttention",
        ),
    },
    "deepseek_v41": {
        "FLASHMLA_SPARSE_DSV41": ("flashmla", "DeepseekV4FlashMLAAttention", "DeepseekV4FlashMLAAttention"),
        "FLASHMLA_MEGA_ATTN_DSV41": (
            "flash_mla_mega_attn", "DeepseekV4MegaAttnAttention", "DeepseekV4MegaAttnAttention",
        ),
        "FLASHINFER_MLA_SPARSE_DSV41": (
            "flashinfer_sparse", "DeepseekV4FlashInferSM120Attention", "DeepseekV4FlashInferMLAAttention",
        ),
    },
}
# What vLLM picks without --attention-backend: V4 (`_select_dsv4_attn_cls`, deepseek_v4/nvidia/model.py) FlashInfer
# on SM12x, FlashMLA otherwise; V4.1 (deepseek_v41/nvidia/model.py) FlashInfer on SM12x, mega attention on SM100
# (where the build and the TP split allow it, else FlashMLA), FlashMLA otherwise.
DEFAULT_BACKEND = {
    "deepseek_v4": {"sm90": "FLASHMLA_SPARSE_DSV4", "sm100": "FLASHMLA_SPARSE_DSV4",
                    "sm120": "FLASHINFER_MLA_SPARSE_DSV4", None: "FLASHMLA_SPARSE_DSV4"},
    "deepseek_v41": {"sm90": "FLASHMLA_SPARSE_DSV41", "sm100": "FLASHMLA_MEGA_ATTN_DSV41",
                     "sm120": "FLASHINFER_MLA_SPARSE_DSV41"},
}


def attention_class(model_type: str, gpu_arch: str | None, backend_name: str | None) -> type:
    """The attention layer class a CUDA worker on `gpu_arch` builds for `backend_name` (None: vLLM's default)."""
    classes = ATTENTION_CLASSES[model_type]
    name = backend_name or DEFAULT_BACKEND[model_type][gpu_arch]
    if name not in classes:
        raise InvalidValueError(
            f"--attention-backend {name}: {model_type} runs on {', '.join(classes)} (vLLM 0.32, 0.33)"
        )
    module, on_sm120, elsewhere = classes[name]
    found = importlib.import_module(f"vllm.models.{model_type}.nvidia.{module}")
    return getattr(found, on_sm120 if gpu_arch == "sm120" else elsewhere)


def deepseek_v4_specs(vllm_config: VllmConfig, gpu_arch: str | None, backend_name: str | None) -> LayerSpecs:
    """Every KV cache a DeepSeek-V4 decoder layer registers (attention.py, compressor.py): a sliding-window
    cache in every layer; for compressed layers the compressed MLA cache and its compressor state; for
    ratio-4 layers also the indexer's key cache and compressor state."""
    from vllm.models.deepseek_v4.attention import (
        DeepseekV4Attention,
        DeepseekV4IndexerCache,
        _resolve_dsv4_kv_cache_dtype,
    )
    from vllm.models.deepseek_v4.compressor import CompressorBackend, CompressorStateCache
    from vllm.v1.attention.backends.mla.indexer import DeepseekV4IndexerBackend
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache

    hf = vllm_config.model_config.hf_config
    cache_config = vllm_config.cache_config
    layer_cls = attention_class("deepseek_v4", gpu_arch, backend_name)
    kv_dtype, kv_torch_dtype = _resolve_dsv4_kv_cache_dtype(
        layer_cls.use_fp8_ds_mla_layout, cache_config.cache_dtype, cache_config
    )
    index_dim = hf.index_head_dim + hf.index_head_dim // 128 * 4  # fp8 keys + one fp32 scale per 128
    out: LayerSpecs = {}
    # The layers register themselves in the forward context, as they do while the model is built.
    vllm_config.compilation_config.static_forward_context.clear()
    with set_current_vllm_config(vllm_config):
        # exl3's rule on the config's dict: the rates the checkpoint's compressor shapes were checked against
        for i, ratio in enumerate(compress_ratios(hf.to_dict())[: hf.num_hidden_layers]):
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


def deepseek_v41_specs(vllm_config: VllmConfig, gpu_arch: str, backend_name: str | None) -> LayerSpecs:
    """Every KV cache a DeepSeek-V4.1 decoder layer registers, in `DeepseekV4Attention.__init__` order
    (deepseek_v41/attention.py): the main MLA cache of kv-source layers (compress ratio 1 or 2), the indexer's
    key cache of layers that are both index and kv sources, a sliding-window cache in every layer (32-token
    blocks, fixed by the model), and for ratio-2 kv sources the compressor's state ring.

    The per-arch record sizes are those `__init__` sets (528 B MXFP8 records on SM100, else 584 B; 288 B for
    the NVFP4 compressed record; pages aligned to 512 or 576 B), read while the GPU is emulated.
    """
    from vllm.models.deepseek_v41.attention import (
        DeepseekV4Attention,
        DeepseekV4IndexerCache,
        _indexer_k_cache_head_dim,
        _resolve_dsv4_kv_cache_dtype,
        _use_v41_mxfp8_kv_record,
    )
    from vllm.models.deepseek_v41.compressor import CompressorStateCache
    from vllm.v1.attention.backends.mla.indexer import dsa_indexer_uses_fp4
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache

    hf = vllm_config.model_config.hf_text_config
    cache_config = vllm_config.cache_config
    layer_cls = attention_class("deepseek_v41", gpu_arch, backend_name)
    packed_dtype = layer_cls.packed_kv_cache_dtype.fget(None)  # a constant per class
    kv_dtype, kv_torch_dtype = _resolve_dsv4_kv_cache_dtype(
        layer_cls.use_fp8_ds_mla_layout, cache_config.cache_dtype, cache_config, packed_dtype
    )
    kv_mxfp8 = _use_v41_mxfp8_kv_record()
    swa_bytes = 528 if kv_mxfp8 else 584
    compressed_bytes = 288 if kv_dtype == "nvfp4_ds_mla" else swa_bytes
    page_alignment = 512 if kv_mxfp8 else 576
    if kv_dtype == "nvfp4_ds_mla" and not kv_mxfp8:
        raise InvalidValueError(
            f"{layer_cls.backend_cls.get_name()} stores NVFP4 records, which need SM100 (not {gpu_arch})"
        )
    swa_kwargs = {}
    if "packed_block_stride_alignment" in inspect.signature(DeepseekV4SWACache).parameters:  # 0.33
        swa_kwargs["packed_block_stride_alignment"] = (
            math.lcm(swa_bytes, compressed_bytes) if kv_mxfp8 else None
        )
    ratios = compress_ratios(hf.to_dict())
    kv_sources = set(hf.kv_source_layer_ids or ())
    index_sources = set(hf.index_source_layer_ids or ())
    out: LayerSpecs = {}
    vllm_config.compilation_config.static_forward_context.clear()
    with set_current_vllm_config(vllm_config):
        for i in range(hf.num_hidden_layers):
            ratio = int(ratios[i]) if i < len(ratios) else 0
            prefix = f"model.layers.{i}.attn"
            stand_in = SimpleNamespace(
                is_kv_source=i in kv_sources, compress_ratio=ratio, head_dim=hf.head_dim,
                kv_cache_dtype=kv_dtype, kv_cache_torch_dtype=kv_torch_dtype,
                kv_page_alignment=page_alignment, compressed_bytes_per_token=compressed_bytes,
            )
            spec = DeepseekV4Attention.get_kv_cache_spec(stand_in, vllm_config)
            if spec is not None:
                _add(out, prefix, spec, layer_cls.backend_cls)
            if i in index_sources and i in kv_sources:
                k_cache = DeepseekV4IndexerCache(
                    head_dim=_indexer_k_cache_head_dim(hf.index_head_dim, dsa_indexer_uses_fp4(vllm_config)),
                    dtype=torch.uint8, prefix=f"{prefix}.indexer.k_cache", cache_config=cache_config,
                    compress_ratio=ratio,
                )
                _add(out, k_cache.prefix, k_cache.get_kv_cache_spec(vllm_config), k_cache.get_attn_backend())
            swa = DeepseekV4SWACache(
                head_dim=hf.head_dim, window_size=hf.sliding_window, dtype=kv_torch_dtype,
                prefix=f"{prefix}.swa_cache", cache_config=cache_config, backend_cls=layer_cls.swa_backend_cls,
                block_size=32, packed_bytes_per_token=swa_bytes, packed_page_alignment=page_alignment,
                bounded_replay=False, **swa_kwargs,
            )
            _add(out, swa.prefix, swa.get_kv_cache_spec(vllm_config), swa.get_attn_backend())
            if i in kv_sources and ratio > 1:
                state = CompressorStateCache(
                    state_dim=2 * hf.head_dim, dtype=torch.float32, prefix=f"{prefix}.compressor.state_cache"
                )
                _add(out, state.prefix, state.get_kv_cache_spec(vllm_config), state.get_attn_backend())
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


def layer_specs(vllm_config: VllmConfig, tp: int, backend_name: str | None, gpu_arch: str | None) -> LayerSpecs:
    """The model's layer specs; `backend_name` None means the model's (or FLASH_ATTN's) default."""
    hf = vllm_config.model_config.hf_text_config
    if hf.model_type == "deepseek_v41":
        if gpu_arch is None:
            raise InvalidValueError(
                "DeepSeek-V4.1's kernel block sizes depend on the GPU: name it with --gpu-arch sm90|sm100|sm120"
            )
        return deepseek_v41_specs(vllm_config, gpu_arch, backend_name)
    if hf.model_type == "deepseek_v4":
        return deepseek_v4_specs(vllm_config, gpu_arch, backend_name)
    if getattr(hf, "kv_lora_rank", None):
        raise InvalidValueError(f"check-kv models DeepSeek-V4, V4.1 and standard attention; {hf.model_type} uses MLA")
    return standard_specs(vllm_config, tp, backend_name or "FLASH_ATTN")
