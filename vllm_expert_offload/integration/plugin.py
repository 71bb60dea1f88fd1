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
    # DeepSeek-V4's EXL3 sets that vLLM reads as plain weights, decoded as the checkpoint streams in.
    from .methods.decoded_at_load import install as install_decoded_at_load

    install_decoded_at_load()
    # Startup fix: KV-cache block sizes each attention backend can use (integration/kv/fix.py; off with
    # VLLM_EXPERT_OFFLOAD_KV_FIX=0).
    from .kv.fix import install as install_kv_block_fix

    install_kv_block_fix()
    # Around engine construction: options refused before any engine process starts, the readiness smoke (one
    # long request before an EXL3 engine is handed out; off with VLLM_EXPERT_OFFLOAD_READINESS_SMOKE=0), and
    # routing statistics saved while `vllm serve` serves (startup/engine_hooks.py).
    from .startup.engine_hooks import install as install_engine_hooks

    install_engine_hooks()
    # A model load that fails midway releases the host arena before the error propagates.
    from .startup.failed_load import install as install_failed_load

    install_failed_load()
    from .startup.worker_rpc import install as install_worker_rpc

    install_worker_rpc()
    _registered = True
