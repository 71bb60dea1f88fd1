"""The vLLM versions this plugin was verified against, and what it does on others.

The hooks read vLLM internals, which move between releases. On a verified series the plugin starts quietly. On a
newer series it starts with a warning: every hook still checks, when it installs, that the function it patches
exists with the parameters it was written for (`patching.Hook`) and refuses loudly otherwise, so an upstream fix
(e.g. vLLM declaring DeepSeek-V4.1's SM120 KV pages itself) is not locked out while a changed internal still
stops the start. An older series is refused: the plugin relies on internals that first appeared in the verified
series (DeepSeek-V4.1's model classes, `customize_attention_spec`, block-outermost KV layouts, MLA page
alignment), and an older function of the same name and parameters may behave differently, which no signature
check can see. `VLLM_EXPERT_OFFLOAD_ALLOW_UNVERIFIED_VLLM=1` starts an older vLLM anyway, at the user's risk.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from ..errors import ExpertOffloadError

VERIFIED_VLLM = ("0.32", "0.33")
OVERRIDE_ENV = "VLLM_EXPERT_OFFLOAD_ALLOW_UNVERIFIED_VLLM"

logger = logging.getLogger("vllm.expert_offload")
_warned: set[str] = set()


class VLLMVersionError(ExpertOffloadError, RuntimeError):
    """This vLLM is older than every verified series."""


def vllm_series(version: str) -> str:
    """"0.33.1+cu130" -> "0.33"."""
    return ".".join(version.split("+")[0].split(".")[:2])


def _numbers(series: str) -> tuple[int, ...]:
    """(0, 33) for "0.33"; a part that is no number (a dev tag) ends the comparison there."""
    parts = []
    for part in series.split("."):
        if not part.isdigit():
            break
        parts.append(int(part))
    return tuple(parts)


def newer_than_verified(version: str) -> bool:
    return _numbers(vllm_series(version)) > max(_numbers(series) for series in VERIFIED_VLLM)


def refusal(version: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """Why this vLLM may not run the plugin, or None: a verified or a newer series, or the override set."""
    if vllm_series(version) in VERIFIED_VLLM or newer_than_verified(version) or environ.get(OVERRIDE_ENV) == "1":
        return None
    return (
        f"vllm-expert-offload was verified on vLLM {', '.join(VERIFIED_VLLM)} and starts on newer ones; this is the "
        f"older vLLM {version}, whose internals the hooks were not read against. Install vLLM "
        f"{VERIFIED_VLLM[0]} or newer, or set {OVERRIDE_ENV}=1 to try anyway at your own risk."
    )


def check_vllm_version(version: str | None = None) -> str:
    """The running vLLM's series; refuses an older one, warns (once per version) about a newer one."""
    if version is None:
        import vllm

        version = vllm.__version__
    reason = refusal(version)
    if reason is not None:
        raise VLLMVersionError(reason)
    series = vllm_series(version)
    if series not in VERIFIED_VLLM and version not in _warned:
        _warned.add(version)
        logger.warning(
            "vllm-expert-offload was verified on vLLM %s; starting on vLLM %s anyway. Each hook checks the "
            "function it patches and refuses if its signature changed; report anything else that breaks.",
            ", ".join(VERIFIED_VLLM), version,
        )
    return series
