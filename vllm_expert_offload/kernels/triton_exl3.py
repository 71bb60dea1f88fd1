"""Triton EXL3 matmul over pointer tables: C[row] = A[row] @ W_hat[matrix of row's block], decoded in place.

One kernel serves every EXL3 product of the plugin: routed experts (decode: one (token, expert) slot per
block; prefill: slots grouped by expert, so each trellis tile is decoded once per block of tokens) and
dense linears (a table of one matrix). Each program owns BLOCK_M rows that share one matrix and BLOCK_N
output columns; it walks the input dimension in BLOCK_K steps, decoding the (BLOCK_K, BLOCK_N) piece of
W_hat from the trellis the table entry points to (VRAM or the host arena's UVA alias alike) straight into
a `tl.dot`. Nothing decoded is ever stored. The Hadamard rotations and suh/svh scales stay outside, in
the rotated-basis form of exl3-format.md §2.1: the caller passes A = had(x ⊙ suh) and applies
had(C) ⊙ svh to the result.

Decoding follows exl3-format.md §2.3-2.7 exactly (bit-exact W_hat; tested against `exl3.decode`):
- ring position p of tile element (r, c) inverts the tensor-core permutation arithmetically;
- its 16-bit state is the ring window ending at S(p) = (p+1)·KA + h·⌊(p+1)/2⌋ (h = 1 for K = KA + ½),
  wrapped mod R = 256·K (tail-biting); the window spans two 16-bit units of the MSB-first stream, and
  unit u is stored at int16 index u ^ 1 (each 32-bit word is stored as two little-endian halves);
- the codebook turns the state into fp16 (3INST, MCG, MUL1 with the kernels' roundings).
K and the codebook come per matrix from small tables, so experts of one launch may differ in both.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .contract import Backend
from .launch_ops import register_table_launch
from .matrix_table import MatrixTable
from .rotated import MatmulBackend, rotated_linear, rotated_moe


@triton.jit
def _lop3_halves(x):
    """3INST/MCG: keep sign, low exponent bits and mantissa of both halves, force the exponent to 011xx,
    add the two fp16 halves in fp32 (exact) and round once, which equals __hadd."""
    x = (x & 0x8FFF8FFF) ^ 0x3B603B60
    lo = (x & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
    hi = (x >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
    return (lo.to(tl.float32) + hi.to(tl.float32)).to(tl.float16)


@triton.jit
def _codebook_value(state, codebook):
    """16-bit state (int64) -> fp16 weight. `codebook` may be a constexpr or a runtime scalar."""
    inst3 = _lop3_halves((state * 89226354 + 64248484) & 0xFFFFFFFF)
    mcg = _lop3_halves((state * 0xCBAC1FED) & 0xFFFFFFFF)
    x = (state * 0x83DCD12D) & 0xFFFFFFFF
    bytesum = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + ((x >> 24) & 0xFF)
    # __hfma(1024 + bs, fp16(0x1EEE), fp16(0xC931)): an integer numerator below 2^20, exact in fp32.
    mul1 = (((1024 + bytesum) * 1774 - 2721792).to(tl.float32) * 3.814697265625e-06).to(tl.float16)
    return tl.where(codebook == 0, inst3, tl.where(codebook == 1, mcg, mul1))


@triton.jit
def _ring_units(offs_k, offs_n, k_int, k_half):
    """For each (row, column) of a block: the two 16-bit stream units its state window spans (already
    swapped to storage order) and the right shift that aligns the window. Independent of the block's
    position, because every block starts on a tile boundary."""
    r = (offs_k % 16)[:, None]
    c = (offs_n % 16)[None, :]
    t = 4 * (c % 8) + (r % 8) // 2
    j = (r % 2) + 2 * (r // 8) + 4 * (c // 8)
    p = 8 * t + j
    units = 16 * k_int + 8 * k_half  # int16 per tile = 16 K
    ring = 16 * units
    start = (p + 1) * k_int + k_half * ((p + 1) // 2) - 16
    start = tl.where(start < 0, start + ring, start)
    first = start // 16
    second = tl.where(first + 1 == units, 0, first + 1)
    return first ^ 1, second ^ 1, 16 - start % 16


@triton.jit
def exl3_matmul_kernel(
    a_ptr, stride_am, c_ptr, stride_cm,
    row_ids_ptr, block_matrix_ptr,
    trellis_table_ptr, twice_k_table_ptr, codebook_table_ptr,
    size_k, size_n,
    CODEBOOK: tl.constexpr, DOT_FP16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    matrix = tl.load(block_matrix_ptr + block)
    if matrix >= 0:
        rows = tl.load(row_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        row_ok = rows >= 0
        trellis = tl.load(trellis_table_ptr + matrix).to(tl.pointer_type(tl.int16))
        twice_k = tl.load(twice_k_table_ptr + matrix)
        k_int = twice_k // 2
        k_half = twice_k % 2
        if CODEBOOK == -1:
            codebook = tl.load(codebook_table_ptr + matrix)
        else:
            codebook = CODEBOOK
        units = 16 * k_int + 8 * k_half
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_kb = tl.arange(0, BLOCK_K)
        first, second, shift = _ring_units(offs_kb, offs_n, k_int, k_half)
        tile_col = (offs_n // 16)[None, :]
        tiles_n = size_n // 16
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, size_k, BLOCK_K):
            offs_k = k0 + offs_kb
            a = tl.load(a_ptr + rows[:, None] * stride_am + offs_k[None, :], mask=row_ok[:, None], other=0.0)
            tile = ((offs_k // 16)[:, None] * tiles_n + tile_col).to(tl.int64) * units
            hi = tl.load(trellis + tile + first).to(tl.int64) & 0xFFFF
            lo = tl.load(trellis + tile + second).to(tl.int64) & 0xFFFF
            state = (((hi << 16) | lo) >> shift) & 0xFFFF
            w = _codebook_value(state, codebook)
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
        raise ValueError(f"row_ids holds {row_ids.shape[0]} entries, expected {blocks} blocks x {BLOCK_M}")
    if a.dtype not in (torch.float16, torch.float32) or out.dtype != torch.float32:
        raise ValueError(f"a must be fp16/fp32 and out fp32, got {a.dtype} and {out.dtype}")
    _launch_kernel(a, row_ids, block_matrix, table, out)


def _exl3_matmul_grid(
    a: torch.Tensor, row_ids: torch.Tensor, block_matrix: torch.Tensor, table: MatrixTable, out: torch.Tensor
) -> None:
    grid = (block_matrix.shape[0], table.out_features // BLOCK_N)
    exl3_matmul_kernel[grid](
        a, a.stride(0), out, out.stride(0), row_ids, block_matrix,
        table.trellis, table.twice_k, table.codebook, table.in_features, table.out_features,
        CODEBOOK=table.uniform_codebook, DOT_FP16=a.dtype == torch.float16,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )


# The kernel launch alone is an op (launch_ops.py): the checks above stay in the glue, which the no-sync proof
# runs on the meta device.
_launch_kernel = register_table_launch("exl3_matmul_triton", _exl3_matmul_grid)


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
    name="triton", description="the Triton kernels", auto_on=("cuda",), graph_safe=True, unavailable=triton_unavailable,
    build_moe=lambda layer: rotated_moe(layer, TRITON_MATMUL),
    build_linear=lambda layer: rotated_linear(layer, TRITON_MATMUL),
)
