"""The delegate of a mixed pack is the config vLLM's own ModelConfig builds for the same quantization_config and
model type, and the header rules checked before loading (exl3/delegate_rules.py) resolve the same method.

vLLM 0.32 returns V4.1's DeepseekV4FP8Config for `deepseek_v4_fp8` on CUDA/ROCm and V4's elsewhere
(`quantization/__init__.py`); the CUDA case is exercised here by telling the registry it runs on CUDA.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.model_executor.layers.linear import ColumnParallelLinear
from vllm.model_executor.layers.quantization import fp8 as vllm_fp8

from vllm_expert_offload.exl3.config import parse_quant_config
from vllm_expert_offload.exl3.delegate_rules import resolve_method
from vllm_expert_offload.integration.methods import delegate
from vllm_expert_offload.testing.dsv41_pack import published_contract
from vllm_expert_offload.testing.tiny_models import FP8_DELEGATE


def _contract(non_routed: dict):
    return parse_quant_config({"quant_method": "exl3", "bits": 3, "non_routed_quantization": non_routed}).contract


@pytest.fixture
def on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.model_executor.layers import quantization

    monkeypatch.setattr(quantization.current_platform, "is_cuda", lambda: True)


CASES = [
    ("deepseek_v4", FP8_DELEGATE, "deepseek_v4_fp8"),  # plain fp8 on V4 is claimed by V4's FP8 config
    ("deepseek_v4", {**FP8_DELEGATE, "quant_method": "deepseek_v4_fp8"}, "deepseek_v4_fp8"),
    ("qwen3_moe", FP8_DELEGATE, "fp8"),  # no DeepSeek model: the declared method as is
]


@pytest.mark.parametrize("model_type,params,method", CASES)
def test_resolution_agrees_with_vllm(model_type: str, params: dict, method: str) -> None:
    hf = SimpleNamespace(model_type=model_type)
    assert delegate.resolve_method(dict(params), hf) == method
    assert resolve_method(params, model_type) == method


def test_published_v41_delegate_is_vllms_v41_config(on_cuda: None) -> None:
    """On CUDA, the published pack's `deepseek_v4_fp8` (and a plain `fp8`) delegate on model_type deepseek_v41 is
    V4.1's DeepseekV4FP8Config; its linears at [32, 32] get ModelOpt's MXFP8 method, whose `weight_scale` is what
    V4.1's name mapper renames `.scale` to (through Exl3Config, which forwards weight_block_size)."""
    from vllm.model_executor.layers.quantization.modelopt import ModelOptLinearMethod
    from vllm.models.deepseek_v41 import DeepseekV4FP8Config as V41FP8Config
    from vllm.models.deepseek_v41.nvidia.model import _linear_scale_param_name

    hf = SimpleNamespace(model_type="deepseek_v41")
    published = published_contract(3)["non_routed_quantization"]
    for params in (published, {**published, "quant_method": "fp8"}):
        assert delegate.resolve_method(dict(params), hf) == resolve_method(params, "deepseek_v41") == \
            "deepseek_v4_fp8"
        config = delegate.build_delegate(_contract(params), hf)
        assert type(config) is V41FP8Config and config.weight_block_size == [32, 32]
        linear = object.__new__(ColumnParallelLinear)
        torch.nn.Module.__init__(linear)
        assert isinstance(config.get_quant_method(linear, "language_model.model.layers.0.attn.wq_b"),
                          ModelOptLinearMethod)
        assert _linear_scale_param_name(SimpleNamespace(quant_config=config), "fp4") == "weight_scale"


def test_plain_fp8_off_the_deepseek_family_is_vllms_fp8() -> None:
    config = delegate.build_delegate(_contract(FP8_DELEGATE), SimpleNamespace(model_type="qwen3_moe"))
    assert type(config) is vllm_fp8.Fp8Config and config.weight_block_size == [128, 128]


def test_changed_vllm_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(delegate.importlib.metadata, "version", lambda name: "0.40.0")
    with pytest.raises(RuntimeError, match="vLLM 0.32/0.33; found vLLM 0.40.0"):
        delegate.resolve_method(dict(FP8_DELEGATE), SimpleNamespace(model_type="deepseek_v4"))
