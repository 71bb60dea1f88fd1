"""vllm-expert-offload: serve EXL3 MoE checkpoints in vLLM with each routed expert placed in GPU or host memory."""

from __future__ import annotations

__version__ = "0.1.0"


def register() -> None:
    """vLLM `general_plugins` entry point; runs in every vLLM process (API server, engine core, each worker).

    Idempotent and cheap, and never touches CUDA: initializing CUDA here would force vLLM to spawn
    every later child process instead of forking it.
    """
    from .integration.plugin import register_plugin

    register_plugin()
