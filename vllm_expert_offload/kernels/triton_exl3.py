"""The Triton backend (`BACKEND`), and its one-matrix-per-block matmul launcher `TRITON_MATMUL`.

What the backend builds: `triton_moe.FusedTritonMoE` (a MoE layer in three launches) and
`triton_linear.FusedTritonLinear` (a dense linear in one or two), each with the rotations in-kernel.

`TRITON_MATMUL` is the plain launcher of the shared glue's contract (rotated.py): C[row] = A[row] @ W_hat[matrix
of row's block], decoded in place, with the rotations outside. The tests read W_hat back through it (bit for bit
against the format's reference) and compare the fused kernels with the glue it computes under; the backend
itself no longer launches it. Each program owns BLOCK_M rows that share one matrix and BLOCK_N
output columns; it walks the input dimension in BLOCK_K steps, decoding the (BLOCK_K, BLOCK_N) piece of
W_hat from the trellis the table entry points to (VRAM or the host arena's UVA alias alike) straight into
a `tl.dot`. Nothing decoded is ever stored. The Hadamard rotations and suh/svh scales stay outside, in
the rotated-basis form of exl3-format.md §2.1: the caller passes A = had(x ⊙ suh) and applies
had(C) ⊙ svh to the result.

Decoding is `triton_decode.decode_block` (bit-exact W_hat, exl3-format.md §2.3-2.7).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..errors import InvalidValueError
from .contract import Backend
from .launch_ops import register_table_launch
from .launch_spec import ACTIVATION, Arg, LaunchArgs, LaunchSpec, arg, constexpr, pointer, strided
from .matrix_table import CODEBOOK_IDS, MatrixTable, present_key
from .rotated import MatmulBackend
from .static_spec import LayerShape, StaticKernel
from .triton_decode import decode_block, matrix_rate
from . import triton_dequantize, triton_linear, triton_moe, triton_prefill
from .triton_linear import fused_linear
from .triton_moe import fused_moe


@triton.jit
def exl3_matmul_kernel(
    a_ptr, stride_am, c_ptr, stride_cm,
    row_ids_ptr, block_matrix_ptr,
    trellis_table_ptr, twice_k_table_ptr, codebook_table_ptr,
    size_k, size_n,
    CODEBOOK: tl.constexpr, TWICE_K: tl.constexpr, DOT_FP16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    matrix = tl.load(block_matrix_ptr + block)
    if matrix >= 0:
        rows = tl.load(row_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        row_ok = rows >= 0
        trellis = tl.load(trellis_table_ptr + matrix)
        twice_k, codebook = matrix_rate(twice_k_table_ptr + matrix, codebook_table_ptr + matrix, TWICE_K, CODEBOOK)
        n0 = tl.program_id(1) * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_kb = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, size_k, BLOCK_K):
            offs_k = k0 + offs_kb
            a = tl.load(a_ptr + rows[:, None] * stride_am + offs_k[None, :], mask=row_ok[:, None], other=0.0)
            w = decode_block(trellis, k0, n0, size_n, twice_k, codebook, BLOCK_K, BLOCK_N, TWICE_K, CODEBOOK)
            if DOT_FP16:
                acc += tl.dot(a.to(tl.float16), w)
            else:
                acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        tl.store(c_ptr + rows[:, None] * stride_cm + offs_n[None, :], acc, mask=row_ok[:, None])


BLOCK_M = 16  # rows per program: tl.dot's minimum; decode fills one row of it, prefill up to all of it
BLOCK_N = 64
BLOCK_K = 64


def launch_exl3_matmul(
    a: torch.Tensor, row_ids: torch.Tensor, block_matrix: torch.Tensor, table: MatrixTable, out: torch.Tensor
) -> None:
    """out[row] = a[row] @ W_hat[block_matrix[row's block]] for every row listed in `row_ids`.

    a: (rows, table.in_features) fp16 or fp32; out: (rows, table.out_features) fp32; row_ids: int32
    (blocks * BLOCK_M,), -1 = empty; block_matrix: int32 (blocks,), -1 = skip the block. Rows not listed
    keep what `out` held. The grid depends on shapes only, never on values, so launches are CUDA-graph safe.
    """
    blocks = block_matrix.shape[0]
    if row_ids.shape[0] != blocks * BLOCK_M:
        raise InvalidValueError(f"row_ids holds {row_ids.shape[0]} entries, expected {blocks} blocks x {BLOCK_M}")
    if a.dtype not in (torch.float16, torch.float32) or out.dtype != torch.float32:
        raise InvalidValueError(f"a must be fp16/fp32 and out fp32, got {a.dtype} and {out.dtype}")
    _launch_kernel(a, row_ids, block_matrix, table, out)


def _exl3_matmul_grid(
    a: torch.Tensor, row_ids: torch.Tensor, block_matrix: torch.Tensor, table: MatrixTable, out: torch.Tensor
) -> None:
    args = LaunchArgs(a=a, row_ids=row_ids, block_matrix=block_matrix, table=TableArgs.of(table), out=out)
    exl3_matmul_kernel[(block_matrix.shape[0], table.out_features // BLOCK_N)](
        **MATMUL.kernel_kwargs(args, dot_fp16=a.dtype == torch.float16, block_m=BLOCK_M, block_n=BLOCK_N,
                               block_k=BLOCK_K))


@dataclass(slots=True)
class TableArgs:
    """A MatrixTable as `exl3_matmul_kernel` reads it: field for field (the op itself takes the MatrixTable, the
    contract's launcher argument, kernels/launch_ops.py's `register_table_launch`)."""

    trellis: torch.Tensor = arg(pointer("trellis_table_ptr", "*i64"))
    twice_k: torch.Tensor = arg(pointer("twice_k_table_ptr", "*i32"))
    codebook: torch.Tensor = arg(pointer("codebook_table_ptr", "*i32"))
    uniform_codebook: int = arg(constexpr("CODEBOOK", "int"))
    in_features: int = arg(Arg("int", {"size_k": "i32"}))
    out_features: int = arg(Arg("int", {"size_n": "i32"}))
    uniform_twice_k: int = arg(constexpr("TWICE_K", "int"))

    @classmethod
    def of(cls, table: MatrixTable) -> TableArgs:
        return cls(*(getattr(table, f.name) for f in dataclasses.fields(cls)))


# The kernel's arguments and static signature; the op is the table launch's (`_launch_kernel` below).
MATMUL = LaunchSpec("exl3_matmul_triton", exl3_matmul_kernel, {
    "a": strided("a_ptr", ACTIVATION, ("stride_am",)), "row_ids": pointer("row_ids_ptr", "*i32"),
    "block_matrix": pointer("block_matrix_ptr", "*i32"), "table": TableArgs,
    "out": strided("c_ptr", "*fp32", ("stride_cm",), "Tensor(a!)"),
}, derived={"dot_fp16": constexpr("DOT_FP16"), "block_m": constexpr("BLOCK_M"), "block_n": constexpr("BLOCK_N"),
            "block_k": constexpr("BLOCK_K")})
# The kernel launch alone is an op (launch_ops.py): the checks above stay in the glue, which the no-sync proof
# runs on the meta device.
_launch_kernel = register_table_launch("exl3_matmul_triton", _exl3_matmul_grid)


def static_kernels(shape: LayerShape) -> list[StaticKernel]:
    """Every variant of `exl3_matmul_kernel` the backend launches for `shape`'s K (kernels/static_spec.py): each
    codebook as a constexpr and the mixed-table one, with fp16 products (fp16 and bf16 models: bf16 inputs are
    rounded to fp16) and exact fp32 ones (fp32 models); and the mixed-K one (MUL1 and mixed codebooks, fp16) of a
    table holding K = 2, 3 and 4, which holds those rates' branches in its loop. Sizes are runtime arguments."""
    codebooks = {cb.value: cid for cb, cid in CODEBOOK_IDS.items()} | {"mixed": present_key(CODEBOOK_IDS.values())}
    variants = [(f"{name},{dtype}", cid, int(2 * shape.k_bits), dtype)
                for dtype in ("fp16", "fp32") for name, cid in codebooks.items()]
    mixed_k = present_key((4, 6, 8))
    variants += [(f"{name},mixed-k,fp16", codebooks[name], mixed_k, "fp16") for name in ("mul1", "mixed")]
    return [
        StaticKernel(
            name=f"exl3_matmul[{label}]", fn=exl3_matmul_kernel, signature=MATMUL.signature(f"*{dtype}"),
            constexprs={"CODEBOOK": cid, "TWICE_K": twice_k, "DOT_FP16": dtype == "fp16", "BLOCK_M": BLOCK_M,
                        "BLOCK_N": BLOCK_N, "BLOCK_K": BLOCK_K},
            num_warps=4, num_stages=3, weights_per_iteration=BLOCK_K * BLOCK_N, dtype=dtype,
            trellis_arg="trellis_table_ptr",
        )
        for label, cid, twice_k, dtype in variants
    ]


def backend_static_kernels(shape: LayerShape) -> list[StaticKernel]:
    """What the backend launches (kernels/static_spec.py): the fused MoE and dense kernels; `static_kernels`
    above lists the matmul launcher the tests read W_hat through."""
    return (triton_moe.static_kernels(shape) + triton_dequantize.static_kernels(shape)
            + triton_prefill.static_kernels(shape) + triton_linear.static_kernels(shape))


def dot_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """What the Triton kernel multiplies in: fp16 tensor-core products for half-precision models (bf16
    activations are rotated, then rounded to fp16, as exllamav3 does); exact fp32 products for fp32 models."""
    return torch.float16 if dtype in (torch.float16, torch.bfloat16) else torch.float32


TRITON_MATMUL = MatmulBackend("triton", launch_exl3_matmul, block_m=BLOCK_M, per_slot_max_tokens=8,
                              dot_dtype=dot_dtype_for)


def triton_unavailable(device: torch.device) -> str | None:
    """None when Triton can run kernels on `device`, else why not (this module imports only where triton does)."""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton runs on CPU tensors only in its interpreter, and TRITON_INTERPRET=1 is not set"
    if device.type not in ("cpu", "cuda"):
        return f"no Triton backend for device type {device.type!r}"
    try:
        import triton  # noqa: F401  (imported above once; a test may have made it unimportable since)
    except ImportError as exc:
        return f"triton does not import ({exc})"
    return None


BACKEND = Backend(
    name="triton", description="the Triton kernels", auto_on=("cuda",), graph_safe=True, write_through=True,
    unavailable=triton_unavailable,
    build_moe=lambda layer: fused_moe(layer),
    build_linear=lambda layer: fused_linear(layer),
)
