"""EXL3 matrices decoded once into a workspace of plain weights, for prefills large enough that one decode per
forward beats the fused kernels' decode per 16-row block (exllamav3 switches to dequantize-and-GEMM at 144 rows).

`dequantize_kernel` stores, per (matrix, 128-wide output piece) program, the matrix's column of 128 x 128 pieces
(`triton_decode.decode_block`, bit-exact) in the workspace's dtype, with the input rotation folded in where asked:
- `FOLD`: W' = H · W_hat, unnormalised (one 128-deep product per weight with the exact ±1 signs, `fold_rows`), so
  (x ⊙ suh / √128) @ W' equals had(x ⊙ suh) @ W_hat: what a MoE's gate and up need, whose input differs per
  expert (rotating it per slot would copy the input top-k times), and a dense linear, which rotates its product
  back. The scale diag(suh) / √128 is left to the product (the grouped GEMM scales each A tile by suh and its
  sums by 1 / √128, the linear its rows by both): per input element or output rather than per weight, and the decode loop keeps
  no vector load and no multiply per weight for it (sm_90 8.9 PTX per weight with it out, 11.0 with it in);
- else W_hat as decoded (a MoE's down, whose input the gate/up epilogue rotates). (Folding the output side too,
  W' · H · diag(svh), spilled 520-6124 B: a second chained 128-deep product.)
Which matrices qualify is read on the device (`counts` against `min_rows`), so the launch needs no host
synchronisation; with a fill table (the expert cache) each matrix decoded is also written through as it is read.
One workspace per device (`WORKSPACE`, `DEQUANT_WORKSPACE_BYTES`) serves every layer, reserved when the layers are
built so vLLM's memory profile sees it; a layer whose matrices do not fit decodes them in chunks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch_ops import register_launch
from .matrix_table import CODEBOOK_IDS_BY_NAME, MatrixTable
from .static_spec import LayerShape, StaticKernel
from .triton_decode import COMPILED, decode_block
from .triton_fused import HALF, MATMUL_WARPS, PIECE, hadamard_signs, write_through
from .triton_moe_steps import matrix_facts

DEQUANT_MIN_ROWS = 144  # rows of one matrix from which it is decoded once (exllamav3's dequantize threshold)
DEQUANT_WORKSPACE_BYTES = 512 << 20  # the decoded matrices' workspace, shared by every layer of a device
WORKSPACE = "dequantized"  # its purpose in triton_fused.WORKSPACES
_PIECE: tl.constexpr = tl.constexpr(PIECE)


@triton.jit
def fold_rows(lo, hi):
    """H @ [lo; hi] (unnormalised) for the two (64, 128) fp16 halves of a decoded 128 x 128 piece, in fp32: H's left
    and right column halves (`hadamard_signs` with COLS) times each half, exact ±1 products with fp32 accumulation
    (fp16 tensor cores on a GPU; fp32 in the interpreter, whose tl.dot reads bf16 as integers). (H = [[S, S], [S, -S]]
    would halve the products: t = S @ lo + S @ hi chained, then t - 2 S @ hi. Measured: sm_120 11.4 PTX / 11.8 SASS
    per weight against 13.1 / 19.5, but sm_90 11.1 / 10.9 against 8.9 / 8.8, whose wgmma takes the 128-deep product
    at once; the kernel is bound by its fp16 stores on both (docs/kernels.md), so one form serves both.)"""
    left = hadamard_signs(_PIECE, HALF, 0)
    right = hadamard_signs(_PIECE, HALF, HALF)
    if COMPILED:
        acc = tl.dot(left.to(tl.float16), lo)
        acc = tl.dot(right.to(tl.float16), hi, acc)
    else:
        acc = tl.dot(left.to(tl.float32), lo.to(tl.float32), input_precision="ieee")
        acc = tl.dot(right.to(tl.float32), hi.to(tl.float32), acc, input_precision="ieee")
    return acc


@triton.jit
def dequantize_kernel(
    trellis_table, twice_k_table, codebook_table, fill_table, counts_ptr, min_rows, first, num_matrices, size_k, size_n,
    n_first, out_ptr, matrix_stride, out_stride,
    TWICE_K: tl.constexpr, CODEBOOK: tl.constexpr, FOLD: tl.constexpr, FILL: tl.constexpr,
):
    """out[slot, k, n - n_first] (row stride `out_stride`) for n in the program's piece n_first + 128·j, of matrix
    `first` + slot (program (slot, j)) where that matrix has at least `min_rows` rows (see the module docstring)."""
    slot = tl.program_id(0)
    matrix = first + slot
    if matrix < num_matrices:
        if tl.load(counts_ptr + matrix) >= min_rows:
            trellis, twice_k, codebook, fill = matrix_facts(trellis_table, twice_k_table, codebook_table, fill_table,
                                                            matrix, TWICE_K, CODEBOOK, FILL)
            n0 = n_first + tl.program_id(1) * _PIECE
            cols = n0 - n_first + tl.arange(0, _PIECE)[None, :]
            dst = out_ptr + slot.to(tl.int64) * matrix_stride
            for k0 in range(0, size_k, _PIECE):
                if FILL:
                    if fill != 0:
                        write_through(trellis, fill, k0, n0, size_n, twice_k)
                lo = decode_block(trellis, k0, n0, size_n, twice_k, codebook, HALF, _PIECE)
                hi = decode_block(trellis, k0 + HALF, n0, size_n, twice_k, codebook, HALF, _PIECE)
                if FOLD:
                    rows = k0 + tl.arange(0, _PIECE)[:, None]
                    tl.store(dst + rows * out_stride + cols, fold_rows(lo, hi).to(dst.dtype.element_ty))
                else:
                    rows = k0 + tl.arange(0, HALF)[:, None]
                    tl.store(dst + rows * out_stride + cols, lo.to(dst.dtype.element_ty))
                    tl.store(dst + (rows + HALF) * out_stride + cols, hi.to(dst.dtype.element_ty))


def _launch(trellis, twice_k, codebook, fill, counts, min_rows, first, chunk, fold, out, offset, matrix_stride, size_k,
            size_n, n_first, columns, uniform_twice_k, uniform_codebook):
    with_fill = fill is not None
    dequantize_kernel[(chunk, columns // PIECE)](
        trellis, twice_k, codebook, fill if with_fill else trellis, counts, min_rows, first, trellis.shape[0],
        size_k, size_n, n_first, out[offset:], matrix_stride, columns,
        TWICE_K=uniform_twice_k, CODEBOOK=uniform_codebook, FOLD=fold, FILL=with_fill,
        num_warps=MATMUL_WARPS,
    )


_dequantize = register_launch(
    "dequantize_triton",
    "Tensor trellis, Tensor twice_k, Tensor codebook, Tensor? fill, Tensor counts, int min_rows, int first, "
    "int chunk, bool fold, Tensor(a!) out, int offset, int matrix_stride, int size_k, int size_n, "
    "int n_first, int columns, int uniform_twice_k, int uniform_codebook",
    _launch,
)


def dequantize(table: MatrixTable, out: torch.Tensor, *, counts: torch.Tensor, min_rows: int, first: int = 0,
               chunk: int = 1, offset: int = 0, matrix_stride: int = 0, fold: bool = False,
               fill: torch.Tensor | None = None, n_first: int = 0, columns: int | None = None) -> None:
    """Matrices first .. first + chunk - 1 of `table` that have at least `min_rows` rows (`counts`, int64 per
    matrix), columns n_first .. n_first + columns - 1 (all by default, multiples of 128), into `out` (flat) from
    `offset` on, one matrix every `matrix_stride` elements, each (in_features, columns) row-major; `fold`: H · W_hat
    rather than W_hat (module docstring)."""
    _dequantize(table.trellis, table.twice_k, table.codebook, fill, counts, min_rows, first, chunk, fold, out,
                offset, matrix_stride, table.in_features, table.out_features, n_first,
                table.out_features - n_first if columns is None else columns, table.uniform_twice_k,
                table.uniform_codebook)


def static_kernels(shape: LayerShape) -> list[StaticKernel]:
    """What `bench-kernels --static` compiles of this module at `shape`, for half-precision models (fp16 weights
    stored): with the input rotation folded (a MoE's gate/up, a dense linear) and as decoded (a MoE's down).
    Aligned at every launch: the sides (multiples of 128, as EXL3 requires), the output (the workspace's start,
    plus offsets and strides of whole matrices) and the column offset and count (whole 128-wide pieces)."""
    codebook = CODEBOOK_IDS_BY_NAME[shape.codebook]
    signature = {"trellis_table": "*i64", "twice_k_table": "*i32", "codebook_table": "*i32", "fill_table": "*i64",
                 "counts_ptr": "*i64", "min_rows": "i32", "first": "i32", "num_matrices": "i32",
                 "size_k": "i32", "size_n": "i32", "n_first": "i32", "out_ptr": "*fp16",
                 "matrix_stride": "i32", "out_stride": "i32"}
    return [
        StaticKernel(f"dequantize[{shape.codebook},{label}]", dequantize_kernel, signature,
                     dict(TWICE_K=int(2 * shape.k_bits), CODEBOOK=codebook, FOLD=fold, FILL=False), MATMUL_WARPS, 3,
                     PIECE * PIECE, trellis_arg="trellis_table",
                     aligned=("size_k", "size_n", "out_ptr", "matrix_stride", "out_stride", "n_first"))
        for label, fold in (("folded", True), ("plain", False))
    ]
