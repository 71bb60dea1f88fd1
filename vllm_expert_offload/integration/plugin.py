"""What `vllm_expert_offload.register()` installs in each vLLM process."""

from __future__ import annotations

import logging

from .versions import check_vllm_version

logger = logging.getLogger("vllm_expert_offload")
_registered = False


def register_plugin() -> None:
    """Idempotent: vLLM calls general plugins once per process, and spawned children call them again."""
    global _registered
    if _registered:
        return
    check_vllm_version()
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    if "exl3" not in QUANTIZATION_METHODS:
        from . import quant_config  # noqa: F401  (registers the `exl3` quantization method on import)
    _registered = True
