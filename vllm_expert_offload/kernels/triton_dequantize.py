"""EXL3 matrices decoded once into a workspace of plain weights, for prefills large enough that one decode per
forward beats the fused kernels' decode per 16-row block (exllamav3 switches to dequantize-and-GEMM at 144 rows).

`dequantize_kernel` stores, per (matrix, 128-wide output piece) program, the matrix's column of 128 x 128 pieces
(`triton_decode.decode_block`, bit-exact) in the workspace's dtype, with the input rotation folded in where asked:
- `FOLD`: W' = H · W_hat, unnormalised (products with the exact ±1 signs on tensor cores, fp32 accumulation, in the
  form the target issues best: `store_folded`, chosen per device by `split_fold`), so (x ⊙ suh / √128) @ W'
  equals had(x ⊙ suh) @ W_hat: what a MoE's gate and up need, whose input differs per expert (rotating it per
  slot would copy the input top-k times), and a dense linear, which rotates its product back. The scale
  diag(suh) / √128 is left to the product (the grouped GEMM scales each A tile by suh and its sums by 1 / √128,
  the linear its rows by both): per input element or output rather than per weight, and the decode loop keeps no
  vector load and no multiply per weight for it (sm_90 8.9 PTX per weight with it out, 11.0 with it in);
- else W_hat as decoded (a MoE's down, whose input the gate/up epilogue rotates). (Folding the output side too,
  W' · H · diag(svh), spilled 520-6124 B: a second chained 128-deep product.)
Which matrices qualify is read on the device (`counts` against `min_rows`), so the launch needs no host
synchronisation; with a fill table (the expert cache) each matrix decoded is also written through as it is read.
One workspace per device (`WORKSPACE`, `DEQUANT_WORKSPACE_BYTES`) serves every layer, reserved when the layers are
built so vLLM's memory profile sees it; a layer whose matrices do not fit decodes them in chunks.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .launch_spec import Arg, LaunchArgs, LaunchSpec, constexpr, derived, integer, pointer
from .matrix_table import CODEBOOK_IDS_BY_NAME, MatrixTable
from .static_spec import LayerShape, StaticKernel
from .triton_decode import COMPILED, decode_block
from .triton_fused import HALF, MATMUL_WARPS, PIECE, hadamard_signs, write_through
from .triton_moe_steps import MatrixArgs, matrix_facts, writes_through

DEQUANT_MIN_ROWS = 144  # rows of one matrix from which it is decoded once (exllamav3's dequantize threshold)
DEQUANT_WORKSPACE_BYTES = 512 << 20  # the decoded matrices' workspace, shared by every layer of a device
WORKSPACE = "dequantized"  # its purpose in triton_fused.WORKSPACES
_PIECE: tl.constexpr = tl.constexpr(PIECE)


@triton.jit
def _operand_signs(N: tl.constexpr, COLS: tl.constexpr = 0, COL0: tl.constexpr = 0):
    """`hadamard_signs` as a tl.dot operand: fp16 on a GPU (tensor cores), fp32 in the interpreter, whose tl.dot reads
    bf16 as integers."""
    signs = hadamard_signs(N, COLS, COL0)
    if COMPILED:
        return signs.to(tl.float16)
    else:
        return signs.to(tl.float32)


@triton.jit
def _signed_product(signs, w, acc):
    """signs @ w + acc in fp32 for `_operand_signs` (or small multiples: every product exact) and fp16 weights."""
    if COMPILED:
        return tl.dot(signs, w, acc)
    else:
        return tl.dot(signs, w.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def _piece_rows(piece, out_stride, ROWS: tl.constexpr):
    """Pointers to the first `ROWS` rows (128 wide, `out_stride` apart) of the piece whose first element `piece`
    points at."""
    return piece + (tl.arange(0, ROWS)[:, None] * out_stride + tl.arange(0, _PIECE)[None, :])


@triton.jit
def store_folded(lo, hi, piece, out_stride, SPLIT: tl.constexpr):
    """Stores H @ [lo; hi] (unnormalised) for the two (64, 128) halves of a decoded 128 x 128 piece, whose first
    element `piece` points at (rows `out_stride` apart). H = [[S, S], [S, -S]] with S the 64 x 64 Sylvester matrix,
    computed in the form the target's tensor cores issue best:
    - SPLIT (mma.sync, one instruction per 16-deep step: sm_120, sm_8x): rows 0-63 = S·lo + S·hi, rows 64-127 = those
      minus 2S·hi, three chained 64-deep products (3/4 of a 128-deep one's steps), the upper half stored before the
      lower reuses its accumulator, S and -2S held in registers across the loop;
    - else (wgmma, sm_90, which issues a 128-deep product whole): [S; S]·lo + [S; -S]·hi in one accumulator.
    Measured: sm_120 9.3 PTX per weight split against 12.0 whole, sm_90 7.8 whole against 10.1 split
    (docs/benchmarks.md)."""
    if SPLIT:
        signs = _operand_signs(HALF)
        upper = _signed_product(signs, lo, _signed_product(signs, hi, None))
        tl.store(_piece_rows(piece, out_stride, HALF), upper.to(piece.dtype.element_ty))
        lower = _signed_product(signs * -2.0, hi, upper)
        tl.store(_piece_rows(piece, out_stride, HALF) + HALF * out_stride, lower.to(piece.dtype.element_ty))
    else:
        acc = _signed_product(_operand_signs(_PIECE, HALF, 0), lo, None)
        acc = _signed_product(_operand_signs(_PIECE, HALF, HALF), hi, acc)
        tl.store(_piece_rows(piece, out_stride, _PIECE), acc.to(piece.dtype.element_ty))


@triton.jit(do_not_specialize=["first"])  # a chunk's first expert: one variant for every chunk
def dequantize_kernel(
    table_trellis, table_twice_k, table_codebook, table_fill, counts_ptr, min_rows, first, num_matrices, size_k, size_n,
    n_first, out_ptr, matrix_stride, out_stride,
    TWICE_K_TABLE: tl.constexpr, CODEBOOK_TABLE: tl.constexpr, FOLD: tl.constexpr, SPLIT: tl.constexpr,
    FILL: tl.constexpr,
):
    """out[slot, k, n - n_first] (row stride `out_stride`) for n in the program's piece n_first + 128·j, of matrix
    `first` + slot (program (slot, j)) where that matrix has at least `min_rows` rows (see the module docstring)."""
    slot = tl.program_id(0)
    matrix = first + slot
    if matrix < num_matrices:
        if tl.load(counts_ptr + matrix) >= min_rows:
            trellis, twice_k, codebook, fill = matrix_facts(table_trellis, table_twice_k, table_codebook, table_fill,
                                                            matrix, TWICE_K_TABLE, CODEBOOK_TABLE, FILL)
            n0 = n_first + tl.program_id(1) * _PIECE
            dst = out_ptr + slot.to(tl.int64) * matrix_stride
            for k0 in range(0, size_k, _PIECE):
                if FILL:
                    if fill != 0:
                        write_through(trellis, fill, k0, n0, size_n, twice_k)
                lo = decode_block(trellis, k0, n0, size_n, twice_k, codebook, HALF, _PIECE, TWICE_K_TABLE,
                                  CODEBOOK_TABLE)
                hi = decode_block(trellis, k0 + HALF, n0, size_n, twice_k, codebook, HALF, _PIECE, TWICE_K_TABLE,
                                  CODEBOOK_TABLE)
                piece = dst + k0 * out_stride + n0 - n_first
                if FOLD:
                    store_folded(lo, hi, piece, out_stride, SPLIT)
                else:
                    tl.store(_piece_rows(piece, out_stride, HALF), lo.to(dst.dtype.element_ty))
                    tl.store(_piece_rows(piece, out_stride, HALF) + HALF * out_stride, hi.to(dst.dtype.element_ty))


def split_fold_for(capability: int) -> bool:
    """Whether a device of compute `capability` (90, 120, ...) folds in the split form (`store_folded`): every target
    but Hopper's, whose wgmma issues the 128-deep product whole."""
    return capability // 10 != 9


@functools.cache
def split_fold(device: torch.device) -> bool:
    """`split_fold_for` the device `device` is (off CUDA, as in the interpreter or on meta tensors: the split form);
    `device` with its index, as a tensor's device has it (cached per device)."""
    if device.type != "cuda":
        return True
    major, minor = torch.cuda.get_device_capability(device)
    return split_fold_for(10 * major + minor)


def _launch(args: LaunchArgs) -> None:
    dequantize_kernel[(args.chunk, args.columns // PIECE)](
        **SPEC.kernel_kwargs(args, num_matrices=args.table.trellis.shape[0], fill=writes_through(args.table)),
        num_warps=MATMUL_WARPS,
    )


SPEC = LaunchSpec("dequantize_triton", dequantize_kernel, {
    "table": MatrixArgs, "counts": pointer("counts_ptr", "*i64"), "min_rows": integer("min_rows"),
    "first": integer("first"), "chunk": Arg("int"), "fold": constexpr("FOLD", "bool"),
    "split": constexpr("SPLIT", "bool"),
    # from `offset` on: whole matrices of the workspace, so 16-byte aligned (a launch refuses an offset that is not)
    "out": Arg("Tensor(a!)", {"out_ptr": "*fp16"}, expand=lambda out, args: (out[args.offset:],), aligned=("out_ptr",)),
    "offset": Arg("int"), "matrix_stride": integer("matrix_stride"), "size_k": integer("size_k"),
    "size_n": integer("size_n"), "n_first": integer("n_first"),
    "columns": Arg("int", {"out_stride": "i32"}),  # the stored rows' stride: a chunk of columns is stored dense
}, derived={"num_matrices": derived("num_matrices"), "fill": constexpr("FILL")})
_dequantize = SPEC.register(_launch)


def dequantize(table: MatrixTable, out: torch.Tensor, *, counts: torch.Tensor, min_rows: int, first: int = 0,
               chunk: int = 1, offset: int = 0, matrix_stride: int = 0, fold: bool = False,
               fill: torch.Tensor | None = None, n_first: int = 0, columns: int | None = None,
               split: bool | None = None) -> None:
    """Matrices first .. first + chunk - 1 of `table` that have at least `min_rows` rows (`counts`, int64 per
    matrix), columns n_first .. n_first + columns - 1 (all by default, multiples of 128), into `out` (flat) from
    `offset` on, one matrix every `matrix_stride` elements, each (in_features, columns) row-major; `fold`: H · W_hat
    rather than W_hat (module docstring), in the split form or not (`store_folded`; by default `out`'s device's; a
    plain launch is one variant everywhere)."""
    split = fold and (split_fold(out.device) if split is None else split)
    _dequantize(table=MatrixArgs.of(table, fill), counts=counts, min_rows=min_rows, first=first, chunk=chunk,
                fold=fold, split=split, out=out, offset=offset, matrix_stride=matrix_stride,
                size_k=table.in_features, size_n=table.out_features, n_first=n_first,
                columns=table.out_features - n_first if columns is None else columns)


def static_kernels(shape: LayerShape) -> list[StaticKernel]:
    """What `bench-kernels --static` compiles of this module at `shape`, for half-precision models (fp16 weights
    stored), as a MoE prefill launches it: a chunk of gate/up matrices with the input rotation folded, in either form
    (`split_fold_for`: each target launches one), and of down matrices as decoded. Each specialised as Triton's JIT
    keys the launch (`LaunchSpec.specialised`) with the prefill's values at `shape`: the experts, the rows from
    which a matrix is decoded, the matrix's sides, its columns from 0 (all stored, so the stored rows' stride is
    the width) and one expert's stride in the workspace."""
    codebook = CODEBOOK_IDS_BY_NAME[shape.codebook]
    gate_up = (shape.hidden, shape.intermediate)
    forms = (("folded", True, True, gate_up), ("folded", True, False, gate_up),
             ("plain", False, False, (shape.intermediate, shape.hidden)))
    kernels = []
    for label, fold, split, (size_k, size_n) in forms:
        launch = SPEC.specialised("*fp16", dict(
            min_rows=DEQUANT_MIN_ROWS, num_matrices=shape.experts, size_k=size_k, size_n=size_n, n_first=0,
            matrix_stride=3 * shape.hidden * shape.intermediate, out_stride=size_n))
        kernels.append(StaticKernel(
            f"dequantize[{shape.codebook},{label}]", dequantize_kernel, launch.signature,
            dict(TWICE_K_TABLE=int(2 * shape.k_bits), CODEBOOK_TABLE=codebook, FOLD=fold, SPLIT=split, FILL=False,
                 **launch.constants),
            MATMUL_WARPS, 3, PIECE * PIECE, trellis_arg="table_trellis", aligned=launch.aligned,
            launched_on=None if not fold else functools.partial(_launches_split, split)))
    return kernels


def _launches_split(split: bool, capability: int) -> bool:
    return split_fold_for(capability) == split
