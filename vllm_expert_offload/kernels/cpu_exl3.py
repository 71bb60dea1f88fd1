"""The compiled CPU kernels (vllm_expert_offload/csrc/): the EXL3 matmul over pointer tables and the encoder's
Viterbi search, one extension built on first use.

The C++ sources ship inside the package, so an editable checkout, a wheel and an sdist install all get the
same kernels; `cpu_extension` builds them against the running torch into its extension cache (once per machine,
torch and source version; concurrent processes wait for one build) and says what is missing when it cannot. The
kernels are compiled for AVX-512, AVX2 and the x86-64 baseline in the same build and chosen at run time
(`cpu_kernel_isa`), so a build is not tied to the CPU that made it.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

import torch

from ..exl3.codebook import codebook_table
from ..exl3.encode import register_compiled_viterbi
from .contract import Backend, MoEKernel, MoELayer
from .cpu_extension import CpuKernelUnavailable, Extension, load_extension
from .launch_ops import register_table_launch
from .matrix_table import CODEBOOK_IDS, MatrixTable
from .rotated import MatmulBackend, rotated_linear, rotated_moe

logger = logging.getLogger("vllm.expert_offload")
CSRC = Path(__file__).resolve().parents[1] / "csrc"
# -Wno-psabi: the baseline copy passes GCC vectors wider than SSE registers, only between its own functions.
EXTENSION = Extension("vllm_expert_offload_exl3_cpu",
                      (CSRC / "exl3_cpu.cpp", CSRC / "exl3_matmul.inc", CSRC / "exl3_moe_rows.inc",
                       CSRC / "exl3_moe.inc", CSRC / "exl3_viterbi.inc"),
                      cflags=("-O3", "-fopenmp", "-Wno-psabi"), ldflags=("-fopenmp",))
BLOCK_M = 32  # rows that share one decode of each tile


@functools.cache
def _load_once() -> ModuleType | CpuKernelUnavailable:
    """The module, or why not: one attempt per process (a failed build is not retried on every call)."""
    try:
        return load_extension(EXTENSION)
    except CpuKernelUnavailable as exc:
        logger.warning("the compiled EXL3 CPU kernels are unavailable: %s", exc)
        return exc


def extension() -> ModuleType:
    """The loaded extension module (built on the first call), or CpuKernelUnavailable saying why not."""
    loaded = _load_once()
    if isinstance(loaded, CpuKernelUnavailable):
        raise CpuKernelUnavailable(str(loaded))
    return loaded


def kernel_sources() -> tuple[Path, ...]:
    """The C++ files the extension is built from (what a fixture encoded by its Viterbi search depends on)."""
    return EXTENSION.sources


def cpu_kernel_unavailable() -> str | None:
    """None when the CPU kernel is built and loadable, else why not (the build is attempted once)."""
    try:
        extension()
    except CpuKernelUnavailable as exc:
        return str(exc)
    return None


def cpu_kernel_isa() -> str:
    """The instruction set the compiled kernels run with on this CPU: "avx512", "avx2" or "baseline"."""
    return extension().exl3_cpu_isa()


@functools.cache
def codebook_values() -> torch.Tensor:
    """(3, 65536) fp32 rows in CODEBOOK_IDS order: the reference tables, so decoding is bit-exact with them."""
    rows = sorted(CODEBOOK_IDS.items(), key=lambda item: item[1])
    return torch.stack([codebook_table(cb).float() for cb, _ in rows]).contiguous()


def _exl3_matmul_compiled(
    a: torch.Tensor, row_ids: torch.Tensor, block_matrix: torch.Tensor, table: MatrixTable, out: torch.Tensor,
    fill: torch.Tensor | None = None,
) -> None:
    """out[row] = a[row] @ W_hat[matrix of row's block] (the Triton launcher's contract), fp32; with `fill`, each
    matrix whose entry is an address is also written there as it is read (write-through, rotated.py)."""
    extension().exl3_matmul_cpu(a, row_ids, block_matrix, table.trellis, table.twice_k, table.codebook,
                                 codebook_values(), table.in_features, table.out_features, BLOCK_M, out, fill)


# An op (launch_ops.py), so the glue around it runs on the meta device in the no-sync proof.
launch_cpu_matmul = register_table_launch("exl3_matmul_cpu", _exl3_matmul_compiled)


CPU_MATMUL = MatmulBackend("cpu", launch_cpu_matmul, block_m=BLOCK_M, per_slot_max_tokens=0,
                           dot_dtype=lambda dtype: torch.float32, write_through=True)


def cpu_unavailable(device: torch.device) -> str | None:
    """None when the compiled CPU kernel can run on `device`, else why not (building it on first use)."""
    if device.type != "cpu":
        return f"the CPU kernel computes on CPU tensors, and this layer lives on {device}"
    return cpu_kernel_unavailable()


def _loaded() -> MatmulBackend:
    """The launcher with the extension built and its codebook tables made now, at load: a forward then finds
    both in memory (nothing is built or read from disk inside a forward)."""
    extension()
    codebook_values()
    return CPU_MATMUL


def _build_moe(layer: MoELayer) -> MoEKernel:
    """The C++ MoE forward (cpu_moe.py: one job per layer on a persistent pool); with an expert cache, the rotated
    glue, whose launcher writes each expert through into its slot (the C++ forward has no fill)."""
    if layer.cache is not None:
        return rotated_moe(layer, _loaded())
    from .cpu_moe import CpuMoE  # cpu_moe imports this module (the extension it calls)

    _loaded()
    return CpuMoE(layer)


BACKEND = Backend(
    name="cpu", description="the compiled CPU kernel", auto_on=("cpu",), graph_safe=True, write_through=True,
    unavailable=cpu_unavailable,
    build_moe=_build_moe,
    build_linear=lambda layer: rotated_linear(layer, _loaded()),
)


register_compiled_viterbi("the compiled CPU kernels", lambda: extension().exl3_viterbi_cpu)
