"""Plan for a named NVIDIA GPU on a machine without it: vLLM's device-capability answers, emulated.

Which kernel block sizes a backend takes can depend on the GPU (DeepSeek-V4.1's sparse-MLA and indexer
backends take 64-token blocks on SM90, 128 on SM100 and SM120; its KV record differs on SM100), and vLLM asks
`current_platform` for the capability while building specs and checking kernels. `check-kv` answers those
questions for the GPU it is told to plan for, and only while it plans.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from .errors import ToolInputError

# --gpu-arch names -> (major, minor) of the CUDA compute capability.
ARCHES: dict[str, tuple[int, int]] = {"sm90": (9, 0), "sm100": (10, 0), "sm120": (12, 0)}


@contextmanager
def emulated(arch: str | None) -> Iterator[None]:
    """Inside, `current_platform.get_device_capability()` (and so `has_device_capability`,
    `is_device_capability_family`, which vLLM 0.32 and 0.33 derive from it) reports `arch`; None leaves the
    platform alone. The platform class's own method is restored on exit."""
    if arch is None:
        yield
        return
    if arch not in ARCHES:
        raise ToolInputError(f"--gpu-arch {arch!r}: use one of {', '.join(ARCHES)}")
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    from ..integration.vllm_hooks import EMULATED_CAPABILITY

    with EMULATED_CAPABILITY.applied(type(current_platform), DeviceCapability(*ARCHES[arch])):
        yield
