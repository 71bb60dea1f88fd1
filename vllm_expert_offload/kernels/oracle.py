"""The one place that decides which backend computes EXL3 layers; layer code never branches on hardware.

`expert_offload.kernel` asks for a backend: "auto" (default), "cpu", "exllamav3", "triton" or "torch".
- auto: on CUDA exllamav3 when its compiled extension imports, with Triton (else torch) for each layer its
  kernels refuse; else Triton; on a CPU the compiled CPU kernel, else the torch reference (with the reason the
  CPU kernel is unavailable).
- A backend asked for by name that cannot run here is refused at startup with the reason, never replaced; so is
  a layer that exllamav3, asked for by name, cannot compute (when its weights are placed).
The decision is made once per process for each layer kind and logged in one line with its reasons.

Backends and what they compute:
- cpu: `RotatedMoE` and `RotatedLinear` over the compiled CPU kernel (csrc/exl3_cpu.cpp), every trellis read in
  place, nothing kept decoded: the CPU production path.
- torch: routed experts through `TableMoE` (decodes per batch: host syncs, needs --enforce-eager on a GPU);
  dense linears decoded once at load. The reference, and the fallback where the CPU kernel cannot be built.
- triton: `RotatedMoE` and `RotatedLinear` over the Triton kernel (CUDA, or the interpreter on a CPU with
  TRITON_INTERPRET=1); no host sync, CUDA-graph safe. Dense linears keep nothing decoded unless
  `dequantize_linears` asks for it.
- exllamav3: exllamav3 1.6.5's compiled CUDA kernels over the same pointer tables (`exllamav3_backend.py`):
  exl3_moe_coop / exl3_moe for routed experts of layers within their constraints (one codebook, MCG or MUL1,
  one K per projection and one for gate and up, no TP crop or clamp), exl3_gemm for every dense linear.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import ExpertOffloadError
from .exllamav3_backend import Exllamav3Linear, Exllamav3MoE, exllamav3_unavailable, moe_refusal
from .linear import DequantizedLinear, LinearShard
from .pointer_tables import PlacedExpert, PointerTables, ScaleStacks
from .rotated import MatmulBackend, RotatedLinear, RotatedMoE
from .table_moe import ExpertCrop, TableMoE

BACKENDS = ("auto", "cpu", "exllamav3", "triton", "torch")
logger = logging.getLogger("vllm.expert_offload")


class BackendUnavailable(ExpertOffloadError, RuntimeError):
    pass


@dataclass(frozen=True)
class KernelChoice:
    moe: str  # backend for routed experts
    linear: str  # backend for dense EXL3 linears ("dequantized" = decoded once at load)
    reason: str
    fallback: str | None = None  # auto with exllamav3: the backend of a MoE layer its kernels refuse

    @property
    def graph_safe(self) -> bool:
        """Whether the routed-expert forward can be captured in a CUDA graph (no host syncs)."""
        return "torch" not in (self.moe, self.fallback)


def triton_unavailable(device: torch.device) -> str | None:
    """None when Triton can run kernels on `device`, else why not."""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton runs on CPU tensors only in its interpreter, and TRITON_INTERPRET=1 is not set"
    if device.type not in ("cpu", "cuda"):
        return f"no Triton backend for device type {device.type!r}"
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"triton does not import ({exc})"
    return None


def cpu_unavailable(device: torch.device) -> str | None:
    """None when the compiled CPU kernel can run on `device`, else why not (building it on first use)."""
    if device.type != "cpu":
        return f"the CPU kernel computes on CPU tensors, and this layer lives on {device}"
    from .cpu_exl3 import cpu_kernel_unavailable

    return cpu_kernel_unavailable()


def choose_kernels(requested: str, device: torch.device, dequantize_linears: bool = False) -> KernelChoice:
    """The backend for each layer kind on `device`, or BackendUnavailable naming the option and the reason."""
    if requested not in BACKENDS:
        raise BackendUnavailable(f"--additional-config expert_offload.kernel={requested!r}: expected one of {BACKENDS}")
    fallback = None
    if requested == "auto":
        moe, fallback, reason = _auto(device)
    else:
        refusal = {
            "cpu": lambda: cpu_unavailable(device),
            "exllamav3": lambda: exllamav3_unavailable(device),
            "triton": lambda: triton_unavailable(device),
            "torch": lambda: None,
        }[requested]()
        if refusal is not None:
            raise BackendUnavailable(f"--additional-config expert_offload.kernel={requested!r} cannot run: {refusal}")
        moe, reason = requested, "asked for by expert_offload.kernel"
    if moe == "torch" or dequantize_linears:
        linear = "dequantized"
        reason += "; dense linears decoded once at load" + (" (dequantize_linears)" if dequantize_linears else "")
    else:
        linear = moe
    return KernelChoice(moe, linear, reason, fallback)


def _auto(device: torch.device) -> tuple[str, str | None, str]:
    """(backend, fallback for MoE layers exllamav3 refuses, reason)."""
    if device.type == "cpu":
        why_not_cpu = cpu_unavailable(device)
        if why_not_cpu is None:
            return "cpu", None, "CPU: the compiled CPU kernel"
        reason = f"CPU: the torch reference, because the compiled CPU kernel is unavailable ({why_not_cpu})"
        return "torch", None, reason
    why_not_triton = triton_unavailable(device)
    other, why_other = ("triton", "") if why_not_triton is None else ("torch", f"; triton: {why_not_triton}")
    why_not_exllamav3 = exllamav3_unavailable(device)
    if why_not_exllamav3 is None:
        return "exllamav3", other, f"{device.type}: exllamav3, {other} for MoE layers its kernels refuse{why_other}"
    return other, None, f"{device.type}: exllamav3 passed over ({why_not_exllamav3}){why_other}"


def log_choice(choice: KernelChoice) -> None:
    logger.info("EXL3 kernels: routed experts -> %s, dense linears -> %s (%s)", choice.moe, choice.linear, choice.reason)


def build_moe_kernel(
    choice: KernelChoice,
    experts: Sequence[PlacedExpert],
    tables: PointerTables,
    scales: ScaleStacks,
    arena,
    crop: ExpertCrop,
    dtype: torch.dtype,
    device: torch.device,
    swiglu_limit: float | None = None,
):
    backend = choice.moe
    if backend == "exllamav3":
        refusal = moe_refusal(experts, crop, swiglu_limit)
        if refusal is None:
            return Exllamav3MoE(experts, tables, arena, crop, device)
        layer = experts[0].projections["gate"].name
        if choice.fallback is None:
            raise BackendUnavailable(f"--additional-config expert_offload.kernel='exllamav3' cannot compute {layer}: "
                                     f"{refusal}")
        _log_once(f"EXL3 kernels: {layer} and layers like it -> {choice.fallback} (exllamav3: {refusal})")
        backend = choice.fallback
    if backend == "torch":
        return TableMoE(experts, tables, arena, crop, dtype, device, swiglu_limit)
    return RotatedMoE(experts, tables, scales, arena, crop, device, _matmul_backend(backend), swiglu_limit)


@functools.cache
def _log_once(message: str) -> None:
    logger.info(message)


def build_linear_kernel(choice: KernelChoice, shards: Sequence[LinearShard], dtype: torch.dtype, device: torch.device):
    if choice.linear == "dequantized":
        return DequantizedLinear(shards, dtype, device)
    if choice.linear == "exllamav3":
        return Exllamav3Linear(shards, device)
    return RotatedLinear(shards, device, _matmul_backend(choice.linear))


def _matmul_backend(name: str) -> MatmulBackend:
    """The launcher of a trellis-reading backend, imported only where it is used (Triton, the C++ build)."""
    if name == "triton":
        from .triton_exl3 import TRITON_MATMUL

        return TRITON_MATMUL
    if name == "cpu":
        from .cpu_exl3 import CPU_MATMUL

        return CPU_MATMUL
    raise ValueError(f"{name!r} is not a trellis-reading backend")
