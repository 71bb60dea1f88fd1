"""The in-register EXL3 decode every Triton kernel of the plugin shares: `decode_block`.

`decode_block(trellis, k0, n0, size_n, twice_k, codebook, BLOCK_K, BLOCK_N)` returns W_hat[k0:k0+BLOCK_K,
n0:n0+BLOCK_N] in fp16, bit-exact (tested against `exl3.decode`), for one matrix whose trellis starts at the
int64 address `trellis` (as a pointer table holds it: VRAM or the host arena's UVA alias alike). k0 and n0
are multiples of 16 (blocks start on tile boundaries); size_n is the matrix's padded output width. Kernels
call it inside their K loop; what it loads and how is its own business (exl3-format.md §2.3-2.7):
- ring position p of tile element (r, c) inverts the tensor-core permutation arithmetically;
- its 16-bit state is the ring window ending at S(p) = (p+1)·KA + h·⌊(p+1)/2⌋ (h = 1 for K = KA + ½),
  wrapped mod R = 256·K (tail-biting); the window spans two 16-bit units of the MSB-first stream, and
  unit u is stored at int16 index u ^ 1 (each 32-bit word is stored as two little-endian halves);
- the codebook turns the state into fp16 (3INST, MCG, MUL1 with the kernels' roundings).
K (as 2K, so 1.5/2.5/3.5 stay integers) and the codebook (a constexpr or a runtime scalar) come per matrix.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
def decode_block(trellis, k0, n0, size_n, twice_k, codebook, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """fp16 (BLOCK_K, BLOCK_N): W_hat[k0:k0+BLOCK_K, n0:n0+BLOCK_N] of the matrix whose trellis is at `trellis`."""
    k_int = twice_k // 2
    k_half = twice_k % 2
    units = 16 * k_int + 8 * k_half  # int16 per tile = 16 K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    first, second, shift = _ring_units(tl.arange(0, BLOCK_K), offs_n, k_int, k_half)
    base = trellis.to(tl.pointer_type(tl.int16))
    tile = ((offs_k // 16)[:, None] * (size_n // 16) + (offs_n // 16)[None, :]).to(tl.int64) * units
    hi = tl.load(base + tile + first).to(tl.int64) & 0xFFFF
    lo = tl.load(base + tile + second).to(tl.int64) & 0xFFFF
    state = (((hi << 16) | lo) >> shift) & 0xFFFF
    return _codebook_value(state, codebook)
