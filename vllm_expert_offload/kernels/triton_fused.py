"""Pieces the fused Triton EXL3 kernels share (triton_moe.py, triton_linear.py): in-kernel Hadamard rotations,
the split of the input dimension, the write-through copy of trellis tiles, and the per-device workspaces.

Every fused kernel works on 128 x 128 pieces of W_hat: 128 is EXL3's Hadamard block (exl3-format.md §2.1), so
a program that holds a 128-wide piece of an input row can rotate it itself, `had(a ⊙ s) = (a ⊙ s) @ H` with
H the normalised 128 x 128 Sylvester matrix, and a program that holds a 128-wide piece of an output row can
rotate that back. Input pieces are held as two 64-wide halves: H = [[S, S], [S, -S]] / √128 for the 64-point
Sylvester matrix S, so rotating an input piece is one butterfly of the halves and two 64-point products
(`rotated_pieces`), and each rotated half meets one 64 x 128 half of the W_hat piece; outputs are rotated back once,
after the K loop (`rotate`). The products run on tensor cores at fp32's accuracy where it matters: the fp32 operand
is split exactly into bf16 terms (`rotation_terms`), each multiplied by the exact ±1 signs (made in registers from
indices) with fp32 accumulation. A half-precision model's rotated input is then rounded to fp16 for the
tensor-core product with the decoded weights, as exllamav3 rounds it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..errors import InvalidStateError
from ..exl3.hadamard import HADAMARD_BLOCK
from .triton_decode import COMPILED, decode_block

PIECE = HADAMARD_BLOCK  # BLOCK_K = BLOCK_N of every fused kernel
HALF: tl.constexpr = tl.constexpr(HADAMARD_BLOCK // 2)  # kernels hold a piece's 128-wide rows as two halves
RSQRT_128: tl.constexpr = tl.constexpr(128**-0.5)
MATMUL_WARPS = 8  # 256 threads per (BLOCK_M, 128) x (128, 128) piece product: 32 decoded weights per thread and half


@triton.jit
def hadamard_signs(N: tl.constexpr, COLS: tl.constexpr = 0, COL0: tl.constexpr = 0):
    """The unnormalised N x N Sylvester matrix (N = 64 or 128), ±1 in bf16 (exact): entry (i, j) is
    (-1)^popcount(i & j); with COLS, only its columns COL0..COL0+COLS-1. Made from indices in registers, so no
    kernel reads a matrix from memory."""
    i = tl.arange(0, N)[:, None]
    j = COL0 + tl.arange(0, N if COLS == 0 else COLS)[None, :]
    parity = i & j
    parity ^= parity >> 4
    parity ^= parity >> 2
    parity ^= parity >> 1  # bit 0: the parity of i & j's 8 low bits (N <= 256)
    return tl.where((parity & 1) == 1, -1.0, 1.0).to(tl.bfloat16)


@triton.jit
def _pinned(x):
    """x, kept in the layout it was computed in. Triton moves the elementwise chain that feeds a tl.dot operand into
    the operand's layout, where, with the warps split along N, every warp holds the whole operand: the bf16 split
    below then runs 8 times over (and every load feeding it too), which made the fused kernels spill. An opaque
    identity (an inline `mov` with side effects) stops that; the interpreter has no inline asm."""
    if COMPILED:
        x = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=False, pack=1)
    return x


@triton.constexpr_function
def rotation_terms(dot_fp16):
    """bf16 terms a rotation's operand is split into: 3 (fp32's 24 significant bits) for fp32 models, 2 (16 bits)
    for half-precision ones, whose rotated values are rounded to fp16/bf16 next anyway."""
    return 2 if dot_fp16 else 3


@triton.jit
def _signed_sum(term, signs, acc):
    """acc + term @ signs, exact products and fp32 sums: bf16 on tensor cores, fp32 in the interpreter (whose
    tl.dot multiplies bf16 bit patterns as integers)."""
    if COMPILED:
        y = tl.dot(term, signs, acc)
    else:
        y = tl.dot(term.to(tl.float32), signs.to(tl.float32), acc, input_precision="ieee")
    return y


@triton.jit
def rotate(x, signs, DOT_FP16: tl.constexpr):
    """x @ signs / √128 for x (M, N) fp32 (had(x) for N = 128 and `signs` = hadamard_signs(128), as the kernels'
    epilogues use it): x split exactly into bf16 terms (`rotation_terms`), each times the ±1 signs on tensor cores
    with fp32 accumulation. (An fp32 `tl.dot` of the same product runs on FMA units and holds whole operand rows
    per thread: it made every fused kernel spill.)"""
    x = _pinned(x)
    term = x.to(tl.bfloat16)
    y = _signed_sum(term, signs, None)
    for _ in tl.static_range(rotation_terms(DOT_FP16) - 1):
        x = x - term.to(tl.float32)
        term = x.to(tl.bfloat16)
        y = _signed_sum(term, signs, y)
    return y * RSQRT_128


@triton.jit
def product(acc, a, w, DOT_FP16: tl.constexpr):
    """acc + a @ w: fp16 tensor cores for half-precision models (a rounded to fp16, as exllamav3 rounds the
    rotated input), exact fp32 otherwise."""
    if DOT_FP16:
        acc = tl.dot(a.to(tl.float16), w, acc)
    else:
        acc = tl.dot(a, w.to(tl.float32), acc, input_precision="ieee")
    return acc


@triton.jit
def rotated_pieces(acc, acc_second, s_lo, s_hi, signs, trellis, k0, n0, size_n, twice_k, codebook, second,
                   RATES: tl.constexpr, CODEBOOKS: tl.constexpr, DOT_FP16: tl.constexpr, ROTATE: tl.constexpr = True):
    """(acc + had([s_lo | s_hi]) @ W_hat[k0:+128, n0:+128], acc_second + the same with the piece at n0 + 128 where
    `second`) for one 128-wide input piece held as two (M, 64) fp32 halves, `signs` = hadamard_signs(64); without
    ROTATE the halves are already rotated (the down kernel's input when the gate/up kernel finished it). RATES,
    CODEBOOKS: the values twice_k and codebook may take (`decode_block`).

    H128 = [[S, S], [S, -S]] / √128, so had([lo | hi]) = [(lo + hi) @ S, (lo - hi) @ S] / √128: one butterfly and
    two 64-point products. Each rotated half meets the 64 x 128 half of W_hat's piece (or pieces) it multiplies
    before the other half is rotated, so one rotated half and one decoded half (a 64 x 128 block is 256 tile
    groups: one per thread, the decode's design) are live at a time."""
    acc, acc_second = _half_products(acc, acc_second, rotate(s_lo + s_hi, signs, DOT_FP16) if ROTATE else s_lo,
                                     trellis, k0, n0, size_n, twice_k, codebook, second, RATES, CODEBOOKS, DOT_FP16)
    return _half_products(acc, acc_second, rotate(s_lo - s_hi, signs, DOT_FP16) if ROTATE else s_hi, trellis,
                          k0 + HALF, n0, size_n, twice_k, codebook, second, RATES, CODEBOOKS, DOT_FP16)


@triton.jit
def _half_products(acc, acc_second, x, trellis, k, n0, size_n, twice_k, codebook, second, RATES: tl.constexpr,
                   CODEBOOKS: tl.constexpr, DOT_FP16: tl.constexpr):
    """(acc + x @ W_hat[k:+64, n0:+128], acc_second + x @ W_hat[k:+64, n0+128:+128] where `second`): one rotated
    input half times the row half of the piece (or of both pieces of a pair) it meets."""
    acc = product(acc, x, decode_block(trellis, k, n0, size_n, twice_k, codebook, HALF, 2 * HALF, RATES, CODEBOOKS),
                  DOT_FP16)
    if second:
        acc_second = product(acc_second, x, decode_block(trellis, k, n0 + 128, size_n, twice_k, codebook, HALF,
                                                         2 * HALF, RATES, CODEBOOKS), DOT_FP16)
    return acc, acc_second


@triton.jit
def load_row_halves(rows_ptr, row_ok, k0, limit, start=0, AS_STORED: tl.constexpr = False):
    """Columns k0..k0+127 of the rows at `rows_ptr` ((M, 1) pointers) as two (M, 64) fp32 halves (AS_STORED: in
    the stored dtype), zero on masked rows and outside columns [start, limit)."""
    lo_cols = k0 + tl.arange(0, HALF)[None, :]
    hi_cols = lo_cols + HALF
    lo = tl.load(rows_ptr + lo_cols, mask=row_ok[:, None] & (lo_cols >= start) & (lo_cols < limit), other=0.0)
    hi = tl.load(rows_ptr + hi_cols, mask=row_ok[:, None] & (hi_cols >= start) & (hi_cols < limit), other=0.0)
    if not AS_STORED:
        lo = lo.to(tl.float32)
        hi = hi.to(tl.float32)
    return lo, hi


@triton.jit
def load_vector_halves(ptr, k0):
    """Entries k0..k0+127 of a vector (a scale) as two (1, 64) fp32 halves, to broadcast over rows."""
    offs = k0 + tl.arange(0, HALF)[None, :]
    return tl.load(ptr + offs).to(tl.float32), tl.load(ptr + offs + HALF).to(tl.float32)


@triton.jit
def write_through(trellis, fill, k0, n0, size_n, twice_k):
    """Copy the trellis words of the (128, 128) piece at (k0, n0) from `trellis` to `fill` (same layout).

    A piece is 8 x 8 tiles; each of its 8 tile rows is 8 consecutive tiles of 16·K int16 (an even count, so
    whole 32-bit words), copied as int32 words."""
    units = 8 * twice_k  # int16 per tile = 16 K
    words = 4 * units  # int32 per tile row of the piece: 8 tiles x units / 2
    src = trellis.to(tl.pointer_type(tl.int32))
    dst = fill.to(tl.pointer_type(tl.int32))
    offs = tl.arange(0, 512)  # the widest tile row: K = 8
    for tile_row in range(8):
        first = (((k0 // 16 + tile_row) * (size_n // 16) + n0 // 16) * units // 2).to(tl.int64)
        ok = offs < words
        tl.store(dst + first + offs, tl.load(src + first + offs, mask=ok), mask=ok)


def split_for(steps: int, programs: int, target: int) -> int:
    """How many parts to split `steps` K-steps into so that `programs` x parts reaches `target` programs: the
    smallest divisor of `steps` that does, else `steps` itself (one step per program)."""
    for parts in range(1, steps + 1):
        if steps % parts == 0 and programs * parts >= target:
            return parts
    return steps


# Shared memory a block may use (the opt-in maximum Triton checks a launch against) on the targets the static report
# compiles for: sm_90 (H100/H200) and sm_120 (RTX PRO 6000 Blackwell, RTX 50 series).
SHARED_PER_BLOCK = {90: 232_448, 120: 101_376}
# Their SMs, for the decode split a launch chooses there (`fill_target`): H200 SXM, RTX PRO 6000 Blackwell.
SM_COUNT = {90: 132, 120: 188}


@functools.cache
def shared_per_block(device: torch.device) -> int | None:
    """The device's shared memory per block, as Triton's launcher reads it (OutOfResources beyond it); None
    off CUDA (the interpreter stages nothing)."""
    if device.type != "cuda":
        return None
    from triton.runtime import driver

    index = device.index if device.index is not None else torch.cuda.current_device()
    return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])


def fill_target(device: torch.device) -> int:
    """Programs a launch should have to fill the device: its SM count on CUDA (twice, so each SM has a second
    block to hide latency with); 1 elsewhere (the interpreter runs programs one at a time)."""
    if device.type != "cuda":
        return 1
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


class Workspaces:
    """Scratch tensors of the fused kernels, one fp32 buffer per (device, purpose), shared by every layer.

    Layers run one after the other on one stream, so one buffer per purpose serves all of them. Each layer
    reserves, when it is built, what its largest graph-captured batch needs (`reserve`); a forward takes a view
    of the buffer (`take`: a view, no allocation, no kernel). A batch larger than anything reserved (a prefill
    beyond vLLM's largest captured size, which vLLM never captures) gets a fresh tensor from torch's caching
    allocator instead, refused while a CUDA graph is being captured."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}

    def reserve(self, device: torch.device, purpose: str, numel: int) -> None:
        key = (str(device), purpose)
        held = self._buffers.get(key)
        if held is None or held.numel() < numel:
            self._buffers[key] = torch.empty(numel, dtype=torch.float32, device=device)

    def take(self, device: torch.device, purpose: str, shape: tuple[int, ...]) -> torch.Tensor:
        numel = 1
        for size in shape:
            numel *= size
        held = self._buffers.get((str(device), purpose))
        if held is not None and held.numel() >= numel:
            return held[:numel].view(shape)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise InvalidStateError(f"fused Triton workspace {purpose!r}: a captured batch needs {numel} floats, "
                               f"{0 if held is None else held.numel()} were reserved when the layer was built")
        return torch.empty(shape, dtype=torch.float32, device=device)


WORKSPACES = Workspaces()

