"""The one place that decides which backend computes EXL3 layers; layer code never branches on hardware.

`expert_offload.kernel` asks for a backend: "auto" (default), "exllamav3", "triton" or "torch".
- auto: exllamav3 when its backend can run, else Triton on CUDA, else the torch reference on a CPU.
- A backend asked for by name that cannot run here is refused at startup with the reason, never replaced.
The decision is made once per process for each layer kind and logged in one line with its reasons.

Backends and what they compute:
- torch: routed experts through `TableMoE` (decodes per batch: host syncs, needs --enforce-eager on a GPU);
  dense linears decoded once at load. The CPU production path today.
- triton: `TritonMoE` and `TritonLinear` read every trellis in place (CUDA, or the interpreter on a CPU
  with TRITON_INTERPRET=1); no host sync, CUDA-graph safe; dense linears keep nothing decoded unless
  `dequantize_linears` asks for it.
- exllamav3: its compiled kernels over the same pointer tables; not wired in this version, so asking for
  it is refused with that reason, and auto passes over it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .linear import DequantizedLinear, LinearShard
from .pointer_tables import PlacedExpert, PointerTables, ScaleStacks
from .table_moe import ExpertCrop, TableMoE

BACKENDS = ("auto", "exllamav3", "triton", "torch")
logger = logging.getLogger("vllm.expert_offload")


class BackendUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class KernelChoice:
    moe: str  # backend for routed experts
    linear: str  # backend for dense EXL3 linears ("dequantized" = decoded once at load)
    reason: str

    @property
    def graph_safe(self) -> bool:
        """Whether the routed-expert forward can be captured in a CUDA graph (no host syncs)."""
        return self.moe != "torch"


def exllamav3_unavailable() -> str:
    """Why the exllamav3 backend cannot run (it is not wired to the pointer tables in this version)."""
    return "the exllamav3 backend is not part of this version of vllm-expert-offload"


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


def choose_kernels(requested: str, device: torch.device, dequantize_linears: bool = False) -> KernelChoice:
    """The backend for each layer kind on `device`, or BackendUnavailable naming the option and the reason."""
    if requested not in BACKENDS:
        raise BackendUnavailable(f"--additional-config expert_offload.kernel={requested!r}: expected one of {BACKENDS}")
    if requested == "auto":
        moe, reason = _auto(device)
    else:
        refusal = {"exllamav3": exllamav3_unavailable(), "triton": triton_unavailable(device), "torch": None}[requested]
        if refusal is not None:
            raise BackendUnavailable(f"--additional-config expert_offload.kernel={requested!r} cannot run: {refusal}")
        moe, reason = requested, "asked for by expert_offload.kernel"
    if moe == "torch" or dequantize_linears:
        linear = "dequantized"
        reason += "; dense linears decoded once at load" + (" (dequantize_linears)" if dequantize_linears else "")
    else:
        linear = moe
    return KernelChoice(moe, linear, reason)


def _auto(device: torch.device) -> tuple[str, str]:
    if device.type == "cpu":
        return "torch", "CPU: the torch reference (no compiled CPU kernel in this version)"
    why_not_triton = triton_unavailable(device)
    if why_not_triton is None:
        return "triton", f"{device.type}: exllamav3 passed over ({exllamav3_unavailable()})"
    return "torch", f"{device.type}: exllamav3 passed over ({exllamav3_unavailable()}); triton: {why_not_triton}"


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
    if choice.moe == "triton":
        from .triton_moe import TritonMoE

        return TritonMoE(experts, tables, scales, arena, crop, device, swiglu_limit)
    return TableMoE(experts, tables, arena, crop, dtype, device, swiglu_limit)


def build_linear_kernel(choice: KernelChoice, shards: Sequence[LinearShard], dtype: torch.dtype, device: torch.device):
    if choice.linear == "triton":
        from .triton_linear import TritonLinear

        return TritonLinear(shards, device)
    return DequantizedLinear(shards, dtype, device)
