"""DeepSeek-V4 in exllamav3's layout: which linears are EXL3, their true shapes, and the names around them.

Facts from exllamav3 1.6.5 (`architecture/deepseek_v4.py`, `modules/dsv4.py`): the checkpoint keeps DeepSeek's
native names with no `model.` prefix (`embed`, `head`, `layers.L.attn.wq_a`, `layers.L.ffn.experts.E.w1`, ...);
`wo_a` (o_groups x o_lora_rank rows) is stored as one EXL3 set per group, `attn.wo_a.slice.{g}`, rows
g*o_lora_rank..(g+1)*o_lora_rank of the source `wo_a`; `indexer.weights_proj` stays unquantized; every other
attention linear, the compressors, the indexer's `wq_b`, the routed and shared experts and `head` are EXL3.
Unquantized padding is trimmed (`trim_padded_out`), so the true shapes below crop the padded trellis.

transformers' `save_pretrained` writes nearly the same names under `model.` (`source_name` maps both spellings).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from .errors import Exl3FormatError

ARCHITECTURE = "DeepseekV4ForCausalLM"
HEAD = "head"
EMBEDDING = "embed"
WO_A_SLICE = re.compile(r"^(?P<attn>.*\.attn)\.wo_a\.slice\.(?P<group>\d+)$")
_WO_A_SLICE_REST = re.compile(r"wo_a\.slice\.(\d+)")  # the same, after `layers.L.attn.`
# Module suffixes (after `layers.L.attn.` / `layers.L.ffn.`) that exllamav3 stores as EXL3 sets.
_ATTN_EXL3 = ("wq_a", "wq_b", "wkv", "wo_b", "compressor.wkv", "compressor.wgate", "indexer.wq_b",
              "indexer.compressor.wkv", "indexer.compressor.wgate")
_FFN_EXL3 = re.compile(r"^(experts\.\d+|shared_experts)\.w[123]$")
_LAYER = re.compile(r"^(?:layers|mtp)\.(?P<layer>\d+)\.(?P<block>attn|ffn)\.(?P<rest>.+)$")
# Linears vLLM's DeepSeek-V4 model reads `.weight` from directly, or builds without a quant config
# (vLLM 0.32/0.33: compressor.py `fused_wkv_wgate` quant_config=None; attention.py `weights_proj`
# quant_config=None; `_o_proj` reads `wo_a.weight` as a grouped bmm on every platform; `ParallelLMHead`
# without a quant config). Their EXL3 sets are decoded once, at load.
# Draft layers (`mtp.`) are not decoded: vLLM drops them unless a draft model is requested.
_DENSE_AT_LOAD = re.compile(r"^(head|layers\.\d+\.attn\.((indexer\.)?compressor\.w(kv|gate)|indexer\.weights_proj"
                            r"|wo_a\.slice\.\d+))$")


# DeepSeek-V4.1 (vLLM 0.32 `vllm/models/deepseek_v41/`): a vision-language wrapper around a V4-style text model.
# Its checkpoint keeps V4's native names (vLLM's `_make_deepseek_v4_vl_weights_mapper` re-roots `layers.` under
# `language_model.model.` and drops `mtp.`), adds `layers.L.engram.{embed,wkv,q_weight,k_weight}` and the vision
# tower `vision.*`, `aligner.*`, `image_*`; vLLM builds its MoE with no hash-routed layer (`num_hash_layers=0`,
# nvidia/model.py) whatever config.json says.
V41_ARCHITECTURE = "DeepseekV41ForCausalLM"
V41_WHY = (
    "exllamav3 1.6.5 defines no DeepSeek-V4.1 architecture, so only its routed experts (named as in DeepSeek-V4) "
    "have an EXL3 layout to check; a V4.1 pack is served as a mixed pack: routed experts EXL3, the rest as stored"
)
V41_VISION_ROOTS = ("vision.", "aligner.")
# Linears vLLM 0.32 builds without a quant config, so a mixed pack's delegate never serves them and they must be
# stored as floats: the compressors' `fused_wkv_wgate` (compressor.py) and the indexer's `weights_proj` and `wk`
# (attention.py) in V4 and V4.1, and V4.1's vision tower (deepseek_v4/common/vision.py, the aligner's w1/w2).
_BUILT_UNQUANTIZED = r"\.compressor\.w(kv|gate)$|\.indexer\.(weights_proj|wk)$"
BUILT_UNQUANTIZED = {
    ARCHITECTURE: re.compile(_BUILT_UNQUANTIZED),
    V41_ARCHITECTURE: re.compile("|".join([_BUILT_UNQUANTIZED, *(f"^{re.escape(r)}" for r in V41_VISION_ROOTS)])),
}


def is_deepseek_v4(hf_config: Mapping[str, Any]) -> bool:
    return ARCHITECTURE in (hf_config.get("architectures") or [])


def v41_part(prefix: str) -> str:
    """Which part of a DeepSeek-V4.1 checkpoint module `prefix` is, for refusals that name it."""
    if prefix.startswith(V41_VISION_ROOTS):
        return "the vision tower"
    if ".engram." in prefix:
        return "an engram (n-gram table) layer"
    if prefix.startswith("mtp."):
        return "a draft (mtp) layer, which vLLM's V4.1 wrapper drops"
    return "a non-routed linear"


def source_name(name: str) -> str:
    """exllamav3's (= DeepSeek's release) name for a tensor of a release or a transformers-saved checkpoint.

    transformers 5.19's `save_pretrained` reverses its load-time renames (conversion_mapping.py, "deepseek_v4")
    under `model.`, except three it cannot invert: the embedding stays `embed_tokens`, the head mixer stays
    `hc_head.hc_{fn,base,scale}`, and the attention's `kv_norm` comes out as `attn.norm` (the forward rule
    `.norm.` -> `.kv_norm.` also covers the compressors' `norm`)."""
    name = name.removeprefix("model.")
    name = {"embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight"}.get(name, name)
    name = re.sub(r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1", name)
    return re.sub(r"^((?:layers|mtp)\.\d+\.attn)\.norm\.weight$", r"\1.kv_norm.weight", name)


# transformers' DeepseekV4Config defaults (`default_compress_rates`), which vLLM 0.33 reads the config through.
DEFAULT_COMPRESS_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
_LEGACY_RATE_KEYS = {"compress_rate_csa": "compressed_sparse_attention", "compress_rate_hca": "heavily_compressed_attention"}
# vLLM 0.33's DeepSeek-V4 compressor takes these rates only (models/deepseek_v4/compressor.py asserts it).
SERVED_COMPRESS_RATES = (4, 128)


def compress_ratios(hf_config: Mapping[str, Any]) -> list[int]:
    """Per-layer KV compression rates, draft (`mtp`) layers included, as vLLM reads them: 0.32's (and V4.1's)
    explicit `compress_ratios`; else 0.33's `layer_types` mapped through `compress_rates` (transformers' defaults,
    its legacy `compress_rate_csa` / `compress_rate_hca` folded in), with draft layers sliding-window (0) as
    vLLM's `get_compress_ratios` appends them. A rate vLLM's V4 compressor cannot take is refused by key."""
    explicit = hf_config.get("compress_ratios")
    if explicit is not None:
        return [int(r) for r in explicit]
    types = hf_config.get("layer_types")
    if types is None:
        raise Exl3FormatError("config.json: DeepSeek-V4 needs compress_ratios, or layer_types (with compress_rates)")
    rates = {**DEFAULT_COMPRESS_RATES, **(hf_config.get("compress_rates") or {})}
    rates |= {rates_key: int(hf_config[key]) for key, rates_key in _LEGACY_RATE_KEYS.items() if key in hf_config}
    for name, rate in rates.items():
        if int(rate) not in SERVED_COMPRESS_RATES:
            raise Exl3FormatError(f"config.json: compress_rates[{name!r}] = {rate}; vLLM's DeepSeek-V4 compressor "
                                  f"takes {list(SERVED_COMPRESS_RATES)} only")
    unknown = sorted({t for t in types if t != "sliding_attention" and t not in rates})
    if unknown:
        raise Exl3FormatError(f"config.json: layer_types has {unknown}, which compress_rates does not name")
    main = types[: _int(hf_config, "num_hidden_layers")]
    return [0 if t == "sliding_attention" else int(rates[t]) for t in main] + \
        [0] * int(hf_config.get("num_nextn_predict_layers") or 0)


def compress_ratio(hf_config: Mapping[str, Any], layer: int) -> int:
    """The layer's KV compression rate (0 sliding window, 4 CSA with indexer, 128 HCA); draft (`mtp`) layers are
    numbered after the main stack (`compress_ratios`)."""
    ratios = compress_ratios(hf_config)
    if layer >= len(ratios):
        raise Exl3FormatError(f"config.json: compress_ratios has no entry for layer {layer}")
    return ratios[layer]


def _int(cfg: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise Exl3FormatError(f"config.json: missing {key} (DeepSeek-V4)")
    return int(value)


def _attn_shape(rest: str, cfg: Mapping[str, Any], layer: int, is_draft: bool) -> tuple[int, int] | None:
    hidden, heads = _int(cfg, "hidden_size"), _int(cfg, "num_attention_heads")
    head_dim, q_rank = _int(cfg, "head_dim", 512), _int(cfg, "q_lora_rank")
    groups, o_rank = _int(cfg, "o_groups", 8), _int(cfg, "o_lora_rank", 1024)
    index_heads, index_dim = _int(cfg, "index_n_heads", 64), _int(cfg, "index_head_dim", 128)
    ratio = compress_ratio(cfg, layer + (_int(cfg, "num_hidden_layers") if is_draft else 0))
    shapes = {
        "wq_a": (q_rank, hidden), "wq_b": (heads * head_dim, q_rank), "wkv": (head_dim, hidden),
        "wo_a": (groups * o_rank, heads * head_dim // groups), "wo_b": (hidden, groups * o_rank),
    }
    if ratio > 1:
        width = (2 if ratio == 4 else 1) * head_dim
        shapes |= {"compressor.wkv": (width, hidden), "compressor.wgate": (width, hidden)}
    if ratio == 4:
        shapes |= {
            "indexer.wq_b": (index_heads * index_dim, q_rank), "indexer.weights_proj": (index_heads, hidden),
            "indexer.compressor.wkv": (2 * index_dim, hidden), "indexer.compressor.wgate": (2 * index_dim, hidden),
        }
    match = _WO_A_SLICE_REST.fullmatch(rest)
    if match:
        if int(match.group(1)) >= groups:
            return None
        return o_rank, heads * head_dim // groups
    return shapes.get(rest)


def linear_shape(prefix: str, cfg: Mapping[str, Any]) -> tuple[int, int]:
    """(out_features, in_features) of a DeepSeek-V4 linear as the model declares it, from config.json."""
    hidden = _int(cfg, "hidden_size")
    if prefix == HEAD:
        return _int(cfg, "vocab_size"), hidden
    match = _LAYER.match(prefix)
    shape = None
    if match and match.group("block") == "attn":
        shape = _attn_shape(match.group("rest"), cfg, int(match.group("layer")), prefix.startswith("mtp."))
    elif match and _FFN_EXL3.match(match.group("rest")):
        inter = _int(cfg, "moe_intermediate_size")
        if match.group("rest").startswith("shared_experts"):
            inter *= _int(cfg, "n_shared_experts", 1)
        shape = (hidden, inter) if match.group("rest").endswith("w2") else (inter, hidden)
    if shape is None:
        raise Exl3FormatError(f"{prefix}: not a DeepSeek-V4 linear this model's config.json declares")
    return shape


def is_exl3_linear(prefix: str) -> bool:
    """Whether exllamav3 stores module `prefix` (exllamav3 naming) as an EXL3 set; `wo_a` is stored in slices."""
    if prefix == HEAD:
        return True
    match = _LAYER.match(prefix)
    if match is None:
        return False
    rest = match.group("rest")
    if match.group("block") == "attn":
        return rest in _ATTN_EXL3 or _WO_A_SLICE_REST.fullmatch(rest) is not None
    return _FFN_EXL3.match(rest) is not None


def wo_a_slices(cfg: Mapping[str, Any]) -> tuple[int, int]:
    """(o_groups, o_lora_rank): `wo_a` is split into o_groups slices of o_lora_rank rows."""
    return _int(cfg, "o_groups", 8), _int(cfg, "o_lora_rank", 1024)


def decoded_at_load(prefix: str, hf_config: Mapping[str, Any]) -> bool:
    """Whether EXL3 set `prefix` of this model goes to a vLLM module that needs a plain `.weight` (_DENSE_AT_LOAD):
    the loader decodes it, and `plan` counts it decoded."""
    return is_deepseek_v4(hf_config) and _DENSE_AT_LOAD.search(prefix) is not None


def dense_name(prefix: str) -> str:
    """The plain tensor a decoded-at-load set becomes: the slices of `wo_a` become rows of one `wo_a.weight`."""
    match = WO_A_SLICE.match(prefix)
    return f"{match.group('attn')}.wo_a.weight" if match else f"{prefix}.weight"


def plain_weights(prefixes: Iterable[str], hf_config: Mapping[str, Any]) -> dict[str, list[str]]:
    """The decoded-at-load sets among `prefixes`, grouped by the plain tensor each becomes, in row order: each
    `wo_a` from exactly its o_groups slices 0..G-1, a missing or extra slice refused by name. The loader and the
    dense twin join them the same way."""
    groups: dict[str, list[str]] = {}
    for prefix in prefixes:
        if decoded_at_load(prefix, hf_config):
            groups.setdefault(dense_name(prefix), []).append(prefix)
    n_groups = wo_a_slices(hf_config)[0] if groups else 0
    for dense, parts in groups.items():
        if not dense.endswith(".wo_a.weight"):
            continue
        want = [f"{dense.removesuffix('.weight')}.slice.{g}" for g in range(n_groups)]
        odd = sorted(set(want).symmetric_difference(parts))
        if odd:
            what = "missing" if odd[0] in want else f"unexpected (o_groups is {n_groups})"
            raise Exl3FormatError(f"{odd[0]}.trellis: {what}; {dense} is joined from slices 0..{n_groups - 1}")
        groups[dense] = want
    return groups
