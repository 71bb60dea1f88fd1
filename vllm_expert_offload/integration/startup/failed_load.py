"""A model load that fails midway gives the host arena back before the error propagates.

The process's placement (plan, host arena, routing counts) is made at the first EXL3 MoE layer and kept by the
model's quant config (`Exl3Config.process.placement`); the load can still fail after that: a tensor refused, a backend that
cannot build a layer, vLLM's own loader. The arena is pinned host memory as large as the host tier, so it is
released at once (logged, with the reason), the quant config forgets the placement, so a retry in the same process
plans afresh, and nothing of the failed model is written to `record_stats` at exit.

The hook wraps `BaseModelLoader.load_model`, which vLLM's default loader (and every loader that does not override
it) runs from building the model to processing its weights; checked against vLLM 0.32 and 0.33.
"""

from __future__ import annotations

import functools

LOADER = "vllm.model_executor.model_loader.base_loader"


def wrap_load_model(original):
    @functools.wraps(original)
    def load_model(self, vllm_config, model_config, prefix=""):
        try:
            return original(self, vllm_config, model_config, prefix)
        except BaseException as exc:
            from ..methods.quant_config import Exl3Config

            quant_config = vllm_config.quant_config
            if isinstance(quant_config, Exl3Config):
                quant_config.process.abandon_placement(f"the model load failed: {type(exc).__name__}: {exc}")
            raise

    return load_model
