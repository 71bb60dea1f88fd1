"""The delegate of a mixed pack (`non_routed_quantization`), built the way vLLM's ModelConfig builds a checkpoint's
own quantization config, so each non-routed layer gets exactly the method stock vLLM gives the same layer of the
source model.

vLLM does not instantiate the declared `quant_method` directly: `ModelConfig._verify_quantization` first asks
every registered method's `override_quantization_method(quant_cfg, user_quant, hf_config=...)`, in its own order
of preference, and the first to claim the config wins (`fp8` on a DeepSeek-V4 / V4.1 model becomes vLLM's
`deepseek_v4_fp8`, whose linears load UE8M0 scales and, at blocks [32, 32], register `weight_scale` as the V4.1
name mapper expects). That method is run here on a stand-in holding the delegate's parameters and the model's HF
config, then `get_quantization_config(name).from_config(params)` as `get_quant_config` does. Checked against vLLM
0.32 and 0.33 (`config/model.py`, `model_loader/weight_utils.py`); another version, or a `_verify_quantization`
that reads other fields, is refused loudly.
"""

from __future__ import annotations

import importlib.metadata
import inspect
from types import SimpleNamespace
from typing import Any

from vllm.config.model import ModelConfig
from vllm.model_executor.layers.quantization import get_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from ...exl3.contract import KEY, MixedContract
from ...exl3.errors import CheckpointRefused
from ..versions import VERIFIED_VLLM, VLLMVersionError, refusal

# What ModelConfig._verify_quantization reads from `self` (vLLM 0.32/0.33): the stand-in provides exactly these.
VERIFY_READS = ("self.quantization", "self.model_arch_config.quantization_config", "self.hf_config",
                "override_quantization_method")


def _check_version() -> None:
    version = importlib.metadata.version("vllm")
    if refusal(version) is not None:
        raise VLLMVersionError(
            f"vllm-expert-offload: the delegate resolution follows ModelConfig._verify_quantization of "
            f"vLLM {'/'.join(VERIFIED_VLLM)}; found vLLM {version}. Re-check config/model.py first."
        )
    source = inspect.getsource(ModelConfig._verify_quantization)
    missing = [name for name in VERIFY_READS if name not in source]
    if missing:
        raise VLLMVersionError(
            f"vllm-expert-offload: vLLM {version}'s ModelConfig._verify_quantization no longer reads "
            f"{missing}; the delegate resolution must be re-checked"
        )


def resolve_method(params: dict[str, Any], hf_config: Any) -> str:
    """The method name vLLM's ModelConfig resolves `params` to for a model with `hf_config`."""
    _check_version()
    stand_in = SimpleNamespace(quantization=None, model_arch_config=SimpleNamespace(quantization_config=params),
                               hf_config=hf_config, allow_deprecated_quantization=False)
    ModelConfig._verify_quantization(stand_in)
    return stand_in.quantization


def build_delegate(contract: MixedContract | None, hf_config: Any) -> QuantizationConfig | None:
    """vLLM's own config for the pack's `non_routed_quantization`, resolved with the model type."""
    if contract is None or contract.non_routed_quantization is None:
        return None
    params = {**contract.non_routed_quantization, "quant_method": contract.delegate_method}
    try:
        method = resolve_method(params, hf_config)
        return get_quantization_config(method).from_config(params)
    except RuntimeError:
        raise
    except Exception as exc:  # vLLM's configs raise ValueError, KeyError or their own types on bad parameters
        raise CheckpointRefused(
            f"EXL3 checkpoint refused: {KEY}.non_routed_quantization: vLLM refuses {params} ({exc})"
        ) from exc
