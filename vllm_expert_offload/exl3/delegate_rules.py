"""What a mixed pack's delegate (`non_routed_quantization`) loads, read from its parameters as vLLM resolves them,
so the safetensors headers can be checked against it before a layer is built.

vLLM does not take a declared `quant_method` as is: `ModelConfig._verify_quantization` (vLLM 0.32
`config/model.py`) first lets every method's `override_quantization_method` claim the config with the model type,
and `fp8` on a DeepSeek-V4 / V4.1 model becomes `deepseek_v4_fp8` (`models/deepseek_v4*/quant_config.py`). That
config's linears load FP8 E4M3 weights with UE8M0 (E8M0) block scales when the experts are FP4
(`is_scale_e8m0`), float32 scales otherwise; its routed experts (here: only source-format draft experts) are
MXFP4 (`Mxfp4MoEMethod`: I8-packed E2M1 pairs, one E8M0 scale per 32 columns) for `expert_dtype` fp4, block FP8
for fp8. Only methods whose stored tensors are known here are accepted: an unchecked delegate is the
silent-garbage case (an FP8 layer booted with an uninitialized scale) this check exists for.

The same resolution runs in `integration/methods/delegate.py` through vLLM itself; a test checks they agree.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .contract import KEY
from .errors import Exl3FormatError

FP8 = "fp8"
DEEPSEEK_FP8 = "deepseek_v4_fp8"
# model_type values vLLM 0.32's DeepseekV4FP8Config overrides claim (the V4.1 class's list; the V4 class's is the
# first entry only, which is what vLLM off CUDA/ROCm uses, see integration/methods/delegate.py).
DEEPSEEK_MODEL_TYPES = ("deepseek_v4", "deepseek_v4_text", "deepseek_v41", "deepseek_v41_text")
EXPERT_DTYPES = ("fp4", "fp8")
E8M0, F32, FP8_E4M3, PACKED_FP4 = "F8_E8M0", "F32", "F8_E4M3", "I8"
MXFP4_BLOCK = 32  # columns per E8M0 scale of an MXFP4 expert (mxfp4.py `mxfp4_block`)


@dataclass(frozen=True)
class DelegateRules:
    """The stored form of everything the delegate serves."""

    method: str  # as vLLM resolves it
    block: tuple[int, int] | None  # weight_block_size; None: per-tensor scales
    scale_dtype: str  # E8M0 (UE8M0 power-of-two scales) or F32
    expert_dtype: str | None  # deepseek_v4_fp8's routed-expert format; None: plain fp8 (block FP8 experts)
    ignored: frozenset[str]  # checkpoint prefixes the delegate leaves unquantized

    @property
    def detail(self) -> str:
        block = f"block {self.block[0]}x{self.block[1]}" if self.block else "per-tensor"
        scales = "UE8M0" if self.scale_dtype == E8M0 else "float32"
        return f"{block}, {scales} scales"

    def linear_scale_shape(self, out_features: int, in_features: int) -> tuple[int, ...]:
        if self.block is None:
            return ()
        return math.ceil(out_features / self.block[0]), math.ceil(in_features / self.block[1])

    @property
    def mxfp4_experts(self) -> bool:
        return self.expert_dtype == "fp4"


def resolve_method(params: Mapping[str, Any], model_type: str | None) -> str:
    """The method vLLM builds for `params` on a model of `model_type` (its override step)."""
    method = str(params["quant_method"]).lower()
    if method in (FP8, DEEPSEEK_FP8) and model_type in DEEPSEEK_MODEL_TYPES:
        return DEEPSEEK_FP8
    return method


def delegate_rules(params: Mapping[str, Any], model_type: str | None, hf_expert_dtype: str | None = None) -> DelegateRules:
    """The header rules of a delegate; `hf_expert_dtype` is config.json's own `expert_dtype` (vLLM's
    DeepseekV4FP8Config reads it from the HF config, default fp4)."""
    where = f"{KEY}.non_routed_quantization"
    method = resolve_method(params, model_type)
    if method not in (FP8, DEEPSEEK_FP8):
        raise Exl3FormatError(
            f"{where}.quant_method: {params['quant_method']!r}; this plugin checks the stored tensors of 'fp8' and "
            f"'{DEEPSEEK_FP8}' delegates only, so it cannot tell whether this pack's layers match"
        )
    if method == DEEPSEEK_FP8 and model_type not in DEEPSEEK_MODEL_TYPES:
        raise Exl3FormatError(f"{where}.quant_method: '{DEEPSEEK_FP8}' is DeepSeek-V4's FP8 config, but config.json's "
                              f"model_type is {model_type!r}")
    block = params.get("weight_block_size")
    if block is not None and (
        not isinstance(block, (list, tuple)) or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise Exl3FormatError(f"{where}.weight_block_size: {block!r}, expected [rows, cols]")
    if params.get("fmt", "e4m3") != "e4m3":
        raise Exl3FormatError(f"{where}.fmt: {params['fmt']!r}; vLLM's fp8 methods load e4m3 weights")
    expert_dtype = None
    if method == DEEPSEEK_FP8:
        declared = params.get("expert_dtype", hf_expert_dtype)
        expert_dtype = "fp4" if declared is None else declared
        if expert_dtype not in EXPERT_DTYPES:
            raise Exl3FormatError(f"{where}.expert_dtype: {expert_dtype!r}, expected one of {list(EXPERT_DTYPES)}")
        if hf_expert_dtype is not None and hf_expert_dtype != expert_dtype:
            raise Exl3FormatError(f"{where}.expert_dtype: {expert_dtype!r}, but config.json's expert_dtype is "
                                  f"{hf_expert_dtype!r}, which vLLM's {DEEPSEEK_FP8} config reads")
    e8m0 = expert_dtype == "fp4" or params.get("scale_fmt") == "ue8m0"
    ignored = params.get("ignored_layers") or params.get("modules_to_not_convert") or ()
    return DelegateRules(method, tuple(block) if block else None, E8M0 if e8m0 else F32, expert_dtype,
                         frozenset(ignored))
