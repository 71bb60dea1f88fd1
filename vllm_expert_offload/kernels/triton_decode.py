"""The in-register EXL3 decode every Triton kernel of the plugin shares: `decode_block`.

`decode_block(trellis, k0, n0, size_n, twice_k, codebook, BLOCK_K, BLOCK_N, RATES, CODEBOOKS)` returns
W_hat[k0:k0+BLOCK_K, n0:n0+BLOCK_N] in fp16, bit-exact (tested against `exl3.decode`), for one matrix whose trellis
starts at the int64 address `trellis` (as a pointer table holds it: VRAM or the host arena's UVA alias alike). k0 and
n0 are multiples of 16 (blocks start on tile boundaries); size_n is the matrix's padded output width. K (as 2K, so
1.5/2.5/3.5 stay integers) and the codebook are runtime scalars, uniform across the block, chosen among the values
the constexprs RATES and CODEBOOKS allow (matrix_table.present_key: one value, compiled alone, or the set a mixed
table holds: a branch per value present, of which one runs; no branch is compiled for a value the table lacks). A
rate's branch holds its group states alone; the codebook's branches and the permutation follow it once.

How it decodes (exl3-format.md §2.3-2.7), in ring order rather than tile order:
- A tile's 256 weights sit on a ring: weight p's 16-bit state is the window of the MSB-first bit stream ending at
  S(p) = (p+1)·KA + h·⌊(p+1)/2⌋ (h = 1 for K = KA + ½), tail-biting at 256·K bits. Stored as int32, the stream is
  simply the tile's words in order (unit u sits at int16 u ^ 1, so word i = unit 2i << 16 | unit 2i+1).
- One thread takes a group of 32 consecutive ring positions (p = 32g + q) of one tile: their windows lie in the
  ⌈K⌉+1 words from the group's start on (the word before it too, for the first windows), which the thread loads
  as whole 32-bit words, every lane of a warp a few consecutive words of one contiguous tile stripe. For every q
  the word and bit offset of its window are compile-time constants (a group spans 32·K bits; with half-integer K
  odd groups start half-way into a word, which one funnel shift per word absorbs), so each state costs a shift or
  a funnel shift; all 32 are joined into the thread's registers (`_ring_states`, a static tree of tl.join).
- The codebook runs on those states with 32-bit integer arithmetic: MUL1 as a multiply and a byte sum (one dp4a
  on a GPU) turned into fp16 by one exact fp32 FMA; 3INST and MCG as a multiply-add, LOP3 masks and one fp16
  add of the two halves.
- Ring position p = 32g + q is a bit permutation of the tile element (r, c): g = c mod 8, and q's five bits are
  r0, r3, c3, r1, r2 (p = 8t + j, t = 4(c mod 8) + (r mod 8)//2, j = r mod 2 + 2(r//8) + 4(c//8)), so a reshape
  into single-bit axes, a permute and a reshape put the block in (row, column) order for tl.dot.
Triton's interpreter cannot run inline assembly: there the byte sum is written out in shifts and masks (the same
value), chosen once at import from TRITON_INTERPRET, as Triton itself chooses its mode.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# Compiled for a GPU (else run by Triton's interpreter, which has no inline assembly and multiplies bf16 tensors
# as their integer bit patterns: the kernels use exact fp32 equivalents there).
COMPILED: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")
# The interpreter runs each of a group's 32 windows as separate small numpy ops, which made the CPU tests 2.4x
# slower; there the same windows come from one vectorised gather of 32-bit words (same formulas, same codebook,
# same permutation). VLLM_EXPERT_OFFLOAD_TRITON_REGISTER_DECODE=1 keeps the compiled path's register form in the
# interpreter too.
_REGISTER_WINDOWS: tl.constexpr = tl.constexpr(
    os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("VLLM_EXPERT_OFFLOAD_TRITON_REGISTER_DECODE") == "1")

# __hfma(1024 + bs, fp16(0x1EEE), fp16(0xC931)) = (bs · 1774 + 1024 · 1774 - 2721792) · 2^-18: exact in fp32
# (an integer numerator below 2^21), so one fp32 FMA and one rounding to fp16 give the fp16 FMA's result.
_MUL1_SCALE: tl.constexpr = tl.constexpr(1774 * 2.0**-18)
_MUL1_OFFSET: tl.constexpr = tl.constexpr((1024 * 1774 - 2721792) * 2.0**-18)


@triton.jit
def _halves_sum(x):
    """3INST/MCG: keep sign, low exponent bits and mantissa of both halves, force the exponent to 011xx and add
    the two fp16 halves: both lie in ±[0.125, 2), so the sum rounds once however it is computed (= __hadd)."""
    x = (x & 0x8FFF8FFF) ^ 0x3B603B60
    lo = (x & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
    hi = (x >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
    return lo + hi


@triton.jit
def _mul1(state):
    """MUL1: x = state · 0x83DCD12D (mod 2^32), w = __hfma(fp16(1024 + bytesum(x)), fp16(0x1EEE), fp16(0xC931)).
    On a GPU, two weights at a time: dp4a adds the byte sum to 0x6400 (fp16 1024: its low 10 bits are free and the
    sum is below 1024), prmt packs the pair, one fma.rn.f16x2 finishes both. In the interpreter the same value from
    shifts and masks and one exact fp32 FMA (the numerator is an integer below 2^21)."""
    x = state * 0x83DCD12D
    if COMPILED:
        scale = tl.full(x.shape, 0x1EEE1EEE, tl.uint32)
        offset = tl.full(x.shape, 0xC931C931, tl.uint32)
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 lo, hi, pair;
            dp4a.u32.u32 lo, $1, 16843009, 25600;
            dp4a.u32.u32 hi, $2, 16843009, 25600;
            prmt.b32 pair, lo, hi, 0x5410;
            fma.rn.f16x2 $0, pair, $3, $5;
            }""",
            "=r,r,r,r,r,r,r", [x, scale, offset], dtype=tl.float16, is_pure=True, pack=2)
    else:
        bytesum = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)
        return (bytesum.to(tl.float32) * _MUL1_SCALE + _MUL1_OFFSET).to(tl.float16)


@triton.jit
def _codebook(state, CODEBOOK: tl.constexpr):
    """16-bit states (uint32) -> fp16 weights by one codebook (matrix_table.CODEBOOK_IDS)."""
    if CODEBOOK == 2:
        w = _mul1(state)
    elif CODEBOOK == 0:
        w = _halves_sum(state * 89226354 + 64248484)
    else:
        w = _halves_sum(state * 0xCBAC1FED)
    return w


@triton.constexpr_function
def first_present(key):
    """The smallest value a present_key (matrix_table.py: the value, or minus the bit mask of the values) allows."""
    return key if key >= 0 else ((-key) & key).bit_length() - 1


@triton.constexpr_function
def other_present(key):
    """The present_key of the values `key` allows but its smallest; -1 where it allows only that one."""
    rest = 0 if key >= 0 else (-key) & (-key - 1)  # the mask without its lowest bit
    if rest == 0:
        return -1
    return rest.bit_length() - 1 if rest & (rest - 1) == 0 else -rest


@triton.jit
def _codebook_value(state, codebook, CODEBOOKS: tl.constexpr):
    """16-bit states (uint32) -> fp16 weights by the runtime `codebook`, one of the ids CODEBOOKS (a present_key)
    allows: the last allowed is taken without a test, so a uniform table compiles one path and no branch."""
    FIRST: tl.constexpr = first_present(CODEBOOKS)
    REST: tl.constexpr = other_present(CODEBOOKS)
    if REST == -1:
        w = _codebook(state, FIRST)
    else:
        if codebook == FIRST:
            w = _codebook(state, FIRST)
        else:
            w = _codebook_value(state, codebook, REST)
    return w


@triton.jit
def _window(words, Q: tl.constexpr, TWICE_K: tl.constexpr):
    """State of ring position Q of the thread's group: the 16 bits starting at the window's start, relative to
    the group's start, from `words` (words[0] is the word before the group's first)."""
    END: tl.constexpr = (Q + 1) * (TWICE_K // 2) + (TWICE_K % 2) * ((Q + 1) // 2)
    START: tl.constexpr = END - 16 + 32  # +32: words[0] is the word before the group
    W: tl.constexpr = START // 32
    O: tl.constexpr = START % 32
    if O <= 16:
        return (words[W] >> (16 - O)) & 0xFFFF
    else:
        return ((words[W] << (O - 16)) | (words[W + 1] >> (48 - O))) & 0xFFFF


@triton.jit
def _ring_states(words, Q0: tl.constexpr, N: tl.constexpr, STEP: tl.constexpr, TWICE_K: tl.constexpr):
    """States of ring positions Q0 + STEP·i (i < N) of each thread's group, joined into new minor axes, bit 0 of q
    last: so the pairs fp16 code packs into one register (`_mul1`'s) are q0 = r0, two consecutive rows, which is the
    pair a tensor-core operand register holds, and tl.dot stages the block without re-pairing halves (with q4 = r2
    last, one more PTX instruction per weight in the fused kernels and the fold; the plain dequantize kernel, which
    stores rows instead, re-pairs for its stores: 0.5 more, docs/kernels.md)."""
    if N == 1:
        return _window(words, Q0, TWICE_K)
    else:
        return tl.join(_ring_states(words, Q0, N // 2, 2 * STEP, TWICE_K),
                       _ring_states(words, Q0 + STEP, N // 2, 2 * STEP, TWICE_K))


@triton.constexpr_function
def group_span(twice_k):
    """32-bit words one thread loads per group of 32 ring positions: those its windows touch, from the word before
    the group on (half-integer K: one more, for the shift that aligns odd groups)."""
    return (twice_k + 1) // 2 + 1 + twice_k % 2


@triton.jit
def group_words(trellis, k0, n0, size_n, TWICE_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The trellis reads of one block: a tuple of group_span(TWICE_K) uint32 tensors shaped (tile row, tile
    column, group g): word a of the tuple is the tile's word (first word of group g) - 1 + a, ring-wrapped."""
    TILE_WORDS: tl.constexpr = 4 * TWICE_K  # 16 K int16
    tk = tl.arange(0, BLOCK_K // 16)[:, None, None]
    tn = tl.arange(0, BLOCK_N // 16)[None, :, None]
    g = tl.arange(0, 8)[None, None, :]
    tile = (k0 // 16 + tk) * (size_n // 16) + (n0 // 16 + tn)
    first = (g * 16 * TWICE_K) // 32  # word holding the group's first bit
    base = trellis.to(tl.pointer_type(tl.int32)) + tile * TILE_WORDS
    words = ()
    for a in tl.static_range(group_span(TWICE_K)):
        words = words + (tl.load(base + (first - 1 + a + TILE_WORDS) % TILE_WORDS).to(tl.uint32, bitcast=True),)
    return words


@triton.jit
def _gathered_states(trellis, k0, n0, size_n, TWICE_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The interpreter's form of the group states: (tile row, tile column, g, q4, q3, q2, q1, q0), each window's
    two words gathered at once (the register form's offsets, as tensors)."""
    TILE_WORDS: tl.constexpr = 4 * TWICE_K
    tk = tl.arange(0, BLOCK_K // 16)[:, None, None, None]
    tn = tl.arange(0, BLOCK_N // 16)[None, :, None, None]
    g = tl.arange(0, 8)[None, None, :, None]
    q = tl.arange(0, 32)[None, None, None, :]
    tile = (k0 // 16 + tk) * (size_n // 16) + (n0 // 16 + tn)
    end = g * 16 * TWICE_K + (q + 1) * (TWICE_K // 2) + (TWICE_K % 2) * ((q + 1) // 2)
    start = (end - 16 + 32 * TILE_WORDS) % (32 * TILE_WORDS)
    base = trellis.to(tl.pointer_type(tl.int32)) + tile * TILE_WORDS
    hi = tl.load(base + start // 32).to(tl.uint32, bitcast=True)
    lo = tl.load(base + (start // 32 + 1) % TILE_WORDS).to(tl.uint32, bitcast=True)
    o = (start % 32).to(tl.uint32)
    states = (((hi << o) | ((lo >> 1) >> (31 - o))) >> 16) & 0xFFFF
    return tl.reshape(states, (BLOCK_K // 16, BLOCK_N // 16, 8, 2, 2, 2, 2, 2))


@triton.jit
def _rate_states(trellis, k0, n0, size_n, TWICE_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The block's group states (tile row, tile column, g, q4, q3, q2, q1, q0) for one compile-time K."""
    if not _REGISTER_WINDOWS:
        states = _gathered_states(trellis, k0, n0, size_n, TWICE_K, BLOCK_K, BLOCK_N)
    else:
        words = group_words(trellis, k0, n0, size_n, TWICE_K, BLOCK_K, BLOCK_N)
        if TWICE_K % 2 == 1:
            # Odd groups start 16 bits into their first word: shift the thread's stream left by 16 (funnel shifts).
            odd = (tl.arange(0, 8)[None, None, :] % 2) == 1
            aligned = ()
            for a in tl.static_range(group_span(TWICE_K) - 1):
                aligned = aligned + (tl.where(odd, (words[a] << 16) | (words[a + 1] >> 16), words[a]),)
            states = _ring_states(aligned, 0, 32, 1, TWICE_K)
        else:
            states = _ring_states(words, 0, 32, 1, TWICE_K)
    return states


@triton.jit
def _present_states(trellis, k0, n0, size_n, twice_k, RATES: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """`_rate_states` at the runtime `twice_k`, one of the rates RATES (a present_key) allows: the last allowed is
    taken without a test, so a uniform table compiles one rate and no branch, a mixed one a branch per rate held."""
    FIRST: tl.constexpr = first_present(RATES)
    REST: tl.constexpr = other_present(RATES)
    if REST == -1:
        states = _rate_states(trellis, k0, n0, size_n, FIRST, BLOCK_K, BLOCK_N)
    else:
        if twice_k == FIRST:
            states = _rate_states(trellis, k0, n0, size_n, FIRST, BLOCK_K, BLOCK_N)
        else:
            states = _present_states(trellis, k0, n0, size_n, twice_k, REST, BLOCK_K, BLOCK_N)
    return states


@triton.jit
def matrix_rate(twice_k_ptr, codebook_ptr, TWICE_K: tl.constexpr, CODEBOOK: tl.constexpr):
    """(2K, codebook) of one matrix: the compile-time values where a launch's matrices share them (the present_keys
    TWICE_K, CODEBOOK >= 0), else read from its table entries."""
    if TWICE_K < 0:
        twice_k = tl.load(twice_k_ptr).to(tl.int32)
    else:
        twice_k = TWICE_K
    if CODEBOOK < 0:
        codebook = tl.load(codebook_ptr).to(tl.int32)
    else:
        codebook = CODEBOOK
    return twice_k, codebook


@triton.jit
def decode_block(trellis, k0, n0, size_n, twice_k, codebook, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                 RATES: tl.constexpr, CODEBOOKS: tl.constexpr):
    """fp16 (BLOCK_K, BLOCK_N): W_hat[k0:k0+BLOCK_K, n0:n0+BLOCK_N] of the matrix whose trellis is at `trellis`.
    Rates: K = 1..8 and 1.5, 2.5, 3.5 (exl3/bitrate.py), `twice_k` = 2K one of those RATES (a present_key) allows.
    A mixed table branches per rate it holds for the states alone (`_present_states`); the codebook and the
    permutation into (row, column) order follow the branch, compiled once per call site rather than once per rate:
    each copy is compiled at every call site (gate/up has eight), and a K = 2/3/4 layer's startup variants took
    2.0x a uniform layer's to compile with the whole decode copied per rate (issue #38). The cost, mixed tables
    alone: the 32-bit states live across the branch's join, so a K = 2/3/4 gate/up takes 255 registers and spills
    8-12 B in two of its three startup variants (sm_90 and sm_120); with the codebook inside the branch (fp16 pairs
    cross the join) it took 174-215 and spilled nothing, but compiled no faster than the whole decode per rate."""
    states = _present_states(trellis, k0, n0, size_n, twice_k, RATES, BLOCK_K, BLOCK_N)
    w = _codebook_value(states, codebook, CODEBOOKS)  # (tile row, tile column, g, q4, q3, q2, q1, q0)
    # g = (c2 c1 c0), q = (r0 r3 c3 r1 r2) -> (tile row, r3 r2 r1 r0, tile column, c3 c2 c1 c0)
    w = tl.reshape(w, (BLOCK_K // 16, BLOCK_N // 16, 2, 2, 2, 2, 2, 2, 2, 2))
    w = tl.permute(w, (0, 8, 5, 6, 9, 1, 7, 2, 3, 4))
    return tl.reshape(w, (BLOCK_K, BLOCK_N))
