"""What `vllm_expert_offload.register()` installs in each vLLM process."""

from __future__ import annotations

from .versions import check_vllm_version

_registered = False


def register_plugin() -> None:
    """Idempotent: vLLM calls general plugins once per process, and spawned children call them again."""
    global _registered
    if _registered:
        return
    check_vllm_version()
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    if "exl3" not in QUANTIZATION_METHODS:
        from .methods import quant_config  # noqa: F401  (registers the `exl3` quantization method on import)
    # Everything else the plugin changes in vLLM, declared in one place (vllm_hooks.py): decoding DeepSeek-V4's
    # plain-weight EXL3 sets at load, KV block sizes (off with VLLM_EXPERT_OFFLOAD_KV_FIX=0), the engine
    # factories (options refused before any engine starts, the readiness smoke, statistics and /metrics while
    # `vllm serve` serves), the arena released when a load fails, and the worker RPC methods.
    from .vllm_hooks import install_in_every_process

    install_in_every_process()
    _registered = True
