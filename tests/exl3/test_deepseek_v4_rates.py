"""DeepSeek-V4 compression rates read from config.json as vLLM reads them (issue 40 item 4): 0.32's explicit
`compress_ratios`, else 0.33's `layer_types` through `compress_rates`. The reference for the 0.33 spelling is
transformers' own DeepseekV4Config (which vLLM 0.33 loads the config with) followed by the rule of vLLM 0.33's
`get_compress_ratios` (rates per layer type, draft layers 0), so defaults and legacy keys are transformers'."""

from __future__ import annotations

import pytest

from vllm_expert_offload.exl3 import deepseek_v4 as dsv4
from vllm_expert_offload.exl3.errors import Exl3FormatError

CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
BASE = {"architectures": ["DeepseekV4ForCausalLM"], "hidden_size": 64, "num_attention_heads": 2, "head_dim": 32,
        "q_lora_rank": 16, "o_groups": 2, "o_lora_rank": 16, "index_n_heads": 2, "index_head_dim": 16,
        "num_hidden_layers": 5, "num_nextn_predict_layers": 1}


def _vllm_033_rule(cfg: dict) -> list[int]:
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV4Config(**{k: v for k, v in cfg.items() if k != "architectures"})
    return [config.compress_rates.get(t, 0) for t in config.layer_types] + [0] * config.num_nextn_predict_layers


@pytest.mark.parametrize("extra", [
    {"layer_types": [SWA, HCA, CSA, HCA, CSA]},  # transformers' default rates
    {"layer_types": [HCA, HCA, CSA, SWA, CSA], "compress_rates": {CSA: 128, HCA: 4}},  # rates swapped
    {"layer_types": [CSA, HCA, CSA, HCA, SWA], "compress_rate_hca": 4},  # the legacy scalar folded in
    {"layer_types": [HCA, CSA, CSA, HCA, HCA, CSA]},  # one entry more than num_hidden_layers (an odd count)
])
def test_layer_types_read_as_vllm_033_reads_them(extra: dict) -> None:
    cfg = {**BASE, **extra}
    assert dsv4.compress_ratios(cfg) == _vllm_033_rule(cfg)
    assert len(dsv4.compress_ratios(cfg)) == 5 + 1 and dsv4.compress_ratio(cfg, 5) == 0  # the draft layer


def test_explicit_compress_ratios_win_as_in_vllm() -> None:
    cfg = {**BASE, "compress_ratios": [0, 4, 128, 4, 0, 128], "layer_types": [SWA] * 5}
    assert dsv4.compress_ratios(cfg) == [0, 4, 128, 4, 0, 128]


def test_the_compressor_shape_follows_the_rate_the_config_gives() -> None:
    """An HCA layer at rate 4 has the overlapping compressor and an indexer, as vLLM builds it for rate 4."""
    default = {**BASE, "layer_types": [SWA, HCA, CSA, HCA, CSA]}
    swapped = {**default, "compress_rates": {HCA: 4, CSA: 128}}
    assert dsv4.linear_shape("layers.1.attn.compressor.wkv", default) == (32, 64)
    assert dsv4.linear_shape("layers.1.attn.compressor.wkv", swapped) == (64, 64)
    assert dsv4.linear_shape("layers.1.attn.indexer.wq_b", swapped) == (32, 16)
    with pytest.raises(Exl3FormatError, match="layers.1.attn.indexer.wq_b: not a DeepSeek-V4 linear"):
        dsv4.linear_shape("layers.1.attn.indexer.wq_b", default)
    with pytest.raises(Exl3FormatError, match="mtp.0.attn.compressor.wkv: not a DeepSeek-V4 linear"):
        dsv4.linear_shape("mtp.0.attn.compressor.wkv", default)  # draft layers are sliding-window in 0.33


@pytest.mark.parametrize(("extra", "message"), [
    ({"layer_types": [CSA] * 5, "compress_rates": {CSA: 8}}, r"compress_rates\['compressed_sparse_attention'\] = 8"),
    ({"layer_types": [CSA] * 5, "compress_rate_csa": 3}, r"compress_rates\['compressed_sparse_attention'\] = 3"),
    ({"layer_types": [CSA, "linear_attention", CSA, CSA, CSA]}, r"layer_types has \['linear_attention'\]"),
    ({}, "needs compress_ratios, or layer_types"),
])
def test_rates_vllm_cannot_serve_are_refused_by_key(extra: dict, message: str) -> None:
    with pytest.raises(Exl3FormatError, match=message):
        dsv4.compress_ratios({**BASE, **extra})
