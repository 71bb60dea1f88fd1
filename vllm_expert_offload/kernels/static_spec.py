"""What a Triton backend tells `bench-kernels --static` about the kernels it launches, so they can be compiled
ahead of time on a machine without a GPU (Triton's compiler and ptxas only) and their registers, spills, load
widths and inner-loop instruction counts read from the result.

A kernel module lists its kernels at given layer shapes (`static_kernels(shape)`); the report compiles each for
sm_90 and sm_120 (vllm_expert_offload/tools/static_kernels.py). Nothing here launches anything.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class LayerShape:
    """The shapes one MoE layer (or dense linear) of a model gives the kernels."""

    model: str  # e.g. "Qwen3-30B-A3B"
    hidden: int
    intermediate: int  # per expert, this rank's (after TP)
    experts: int  # routed experts of the layer (local)
    top_k: int
    k_bits: float = 3.0
    codebook: str = "mul1"  # "3inst", "mcg", "mul1" (exl3/codebook.py's names)


@dataclass(frozen=True)
class StaticKernel:
    """One compile of one Triton kernel: its `triton.compile` inputs and what one inner-loop iteration decodes."""

    name: str  # how the report names it, e.g. "moe_gate_up[mul1,fp16]"
    fn: Any  # the @triton.jit function
    signature: Mapping[str, str]  # every runtime argument -> Triton type string ("*fp16", "i32", "i64", ...)
    constexprs: Mapping[str, Any]  # every tl.constexpr argument -> value
    num_warps: int
    num_stages: int
    weights_per_iteration: int  # weights decoded by one program per iteration of the inner (K) loop
    # Which loads read trellis memory, found by address provenance in the PTX: the pointer argument the
    # trellis addresses come from, and how many address loads lie between it and the trellis data
    # (1: it points to an int64 table of trellis addresses, as MatrixTable.trellis, whose entries may also hold
    # offsets into other pointer arguments' arrays, as linear_kernel's pieces; 0: it is a trellis). None: the kernel
    # reads no trellis (a GEMM over decoded weights): the report gives its registers, spills and shared memory only.
    trellis_arg: str | None
    trellis_indirection: int = 1
    dtype: str = "fp16"  # activation dtype of this variant ("fp16", "bf16", "fp32"): spills must be 0 for fp16/bf16
    options: Mapping[str, Any] = field(default_factory=dict)  # further triton.compile options, if any
    # Runtime arguments every launch of the backend passes aligned to 16: a pointer to 16-byte-aligned memory, an int
    # that is a multiple of 16. Triton's launch specialises a kernel on that (`tt.divisibility` 16, which lets it
    # vectorise loads and stores), so the report compiles them so (a launch may specialise further, on what it
    # happens to find aligned, which the report does not assume); the kernel's module says why each holds, and
    # tests/kernels/test_triton_fused.py checks it on every launch of the backend's forwards.
    aligned: tuple[str, ...] = ()
    # Which targets launch this variant (compute capability such as 90 or 120 -> bool), where a kernel takes a
    # different form per target (triton_dequantize's fold); None: every target.
    launched_on: Callable[[int], bool] | None = None
