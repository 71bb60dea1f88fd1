"""The vLLM versions this plugin was verified against. Internals we touch change between releases,
so an unverified version is refused rather than guessed at."""

from __future__ import annotations

import os

VERIFIED_VLLM = ("0.32", "0.33")
OVERRIDE_ENV = "VLLM_EXPERT_OFFLOAD_ALLOW_UNVERIFIED_VLLM"


def vllm_series(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def check_vllm_version(version: str | None = None) -> str:
    if version is None:
        import vllm

        version = vllm.__version__
    series = vllm_series(version)
    if series not in VERIFIED_VLLM and os.environ.get(OVERRIDE_ENV) != "1":
        raise RuntimeError(
            f"vllm-expert-offload was verified on vLLM {', '.join(VERIFIED_VLLM)}; this is vLLM {version}. "
            f"Install a verified vLLM, or set {OVERRIDE_ENV}=1 to try anyway at your own risk."
        )
    return series
