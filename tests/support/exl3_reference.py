"""An independent, deliberately naive EXL3 decoder written from docs (exl3-format.md §1.3, §2.1-2.8).

Nothing here imports or copies `vllm_expert_offload`: the tests compare the library against this module.
Everything is plain Python integers and `fractions.Fraction` (fp16 rounding is done by hand, round to
nearest even), bit by bit and position by position. It is slow on purpose; use it on small tensors.

Conventions: fp16 values are passed around as their 16-bit patterns (Python ints 0..65535) so that
comparisons are bit-exact, including the sign of zero.
"""

from __future__ import annotations

import math
from fractions import Fraction
from functools import lru_cache

import numpy as np

# §1.3 / §2.6 constants, written as in the spec.
MUL1_MULTIPLIER = 0x83DCD12D
MCG_MULTIPLIER = 0xCBAC1FED
INST3_MULTIPLIER = 89226354
INST3_ADDEND = 64248484
MUL1_MARKER_INT32 = -2082680531
MCG_MARKER_INT32 = -877912083
CODEBOOKS = ("3inst", "mcg", "mul1")
HALF_KS = (1.5, 2.5, 3.5)


# ---------------------------------------------------------------------------------------------------------------
# fp16 by hand
# ---------------------------------------------------------------------------------------------------------------


def fp16_value(bits: int) -> Fraction:
    """Exact value of an fp16 bit pattern (finite only)."""
    sign = -1 if bits & 0x8000 else 1
    exp = (bits >> 10) & 0x1F
    man = bits & 0x3FF
    if exp == 0x1F:
        raise ValueError(f"fp16 {bits:#06x} is inf/nan")
    if exp == 0:
        return sign * Fraction(man, 1 << 24)
    return sign * Fraction(1024 + man, 1 << 10) * Fraction(2) ** (exp - 15)


def rne_fp16_bits(q: Fraction) -> int:
    """Round an exact rational to fp16, round-to-nearest-even; returns the bit pattern."""
    q = Fraction(q)
    sign = 0x8000 if q < 0 else 0
    a = abs(q)
    if a == 0:
        return sign
    # Exponent e with 2^e <= a < 2^(e+1).
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    assert Fraction(2) ** e <= a < Fraction(2) ** (e + 1)
    e = max(e, -14)  # subnormals share the exponent of the smallest normal
    scaled = a / Fraction(2) ** (e - 10)  # in units of the ulp at exponent e
    m = math.floor(scaled)
    rem = scaled - m
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and m % 2 == 1):
        m += 1
    if e == -14 and m < 1024:
        bits = m  # subnormal (m == 1024 would be the smallest normal, handled below)
    else:
        bits = ((e + 15) << 10) + (m - 1024)  # m == 2048 carries into the exponent correctly
    if bits >= 0x7C00:
        bits = 0x7C00  # overflow -> inf
    return sign | bits


# ---------------------------------------------------------------------------------------------------------------
# §2.6 codebooks: 16-bit state -> fp16 bit pattern
# ---------------------------------------------------------------------------------------------------------------


def _lop3(x: int) -> int:
    return (x & 0x8FFF8FFF) ^ 0x3B603B60


def _two_half_sum(x: int) -> int:
    """__hadd of the two fp16 halves of a 32-bit word: exact sum, one RNE rounding."""
    return rne_fp16_bits(fp16_value(x & 0xFFFF) + fp16_value((x >> 16) & 0xFFFF))


def inst3_bits(state: int) -> int:
    x = (state * INST3_MULTIPLIER + INST3_ADDEND) % (1 << 32)
    return _two_half_sum(_lop3(x))


def mcg_bits(state: int) -> int:
    x = (state * MCG_MULTIPLIER) % (1 << 32)
    return _two_half_sum(_lop3(x))


def mul1_bytesum(state: int) -> int:
    x = (state * MUL1_MULTIPLIER) % (1 << 32)
    return sum((x >> (8 * i)) & 0xFF for i in range(4))


def mul1_bits(state: int) -> int:
    """The closed form: RNE_fp16(((1024 + bs)·1774 − 2721792)·2^−18)."""
    bs = mul1_bytesum(state)
    return rne_fp16_bits(Fraction((1024 + bs) * 1774 - 2721792, 1 << 18))


def mul1_bits_hfma(state: int) -> int:
    """The kernel's definition: __hfma(fp16 bits 0x6400 + bs, fp16(0x1EEE), fp16(0xC931)), one rounding."""
    h = fp16_value(0x6400 + mul1_bytesum(state))
    return rne_fp16_bits(h * fp16_value(0x1EEE) + fp16_value(0xC931))


_CODEBOOK_FN = {"3inst": inst3_bits, "mcg": mcg_bits, "mul1": mul1_bits}


@lru_cache(maxsize=None)
def codebook_bits(codebook: str, state: int) -> int:
    return _CODEBOOK_FN[codebook](state)


# ---------------------------------------------------------------------------------------------------------------
# §2.3-2.5 bit ring and states
# ---------------------------------------------------------------------------------------------------------------


def position_bits(p: int, k: float) -> int:
    """D(p): K for integer K; KA + bit (p mod 16) of 0xAAAA for K = KA + 1/2."""
    if k in HALF_KS:
        return int(k - 0.5) + ((0xAAAA >> (p % 16)) & 1)
    assert k == int(k)
    return int(k)


@lru_cache(maxsize=None)
def _position_ends(k: float) -> tuple[int, ...]:
    ends, total = [], 0
    for p in range(256):
        total += position_bits(p, k)
        ends.append(total)
    return tuple(ends)


def position_end(p: int, k: float) -> int:
    """S(p) = D(0) + ... + D(p)."""
    return _position_ends(k)[p]


def ring_length(k: float) -> int:
    r = position_end(255, k)
    assert r == 256 * k
    return r


def tile_to_ring_bits(tile_int16) -> list[int]:
    """One tile's 16K int16 -> R ring bits. word[j] = u16[2j] | u16[2j+1] << 16; bit b = bit 31 - b%32 of word b//32."""
    u16 = [int(v) & 0xFFFF for v in tile_int16]
    words = [u16[2 * j] | (u16[2 * j + 1] << 16) for j in range(len(u16) // 2)]
    return [(words[b // 32] >> (31 - b % 32)) & 1 for b in range(32 * len(words))]


def ring_bits_to_tile(bits: list[int]) -> list[int]:
    """Inverse of tile_to_ring_bits: R bits -> 16K signed int16 values."""
    assert len(bits) % 32 == 0
    out = []
    for j in range(len(bits) // 32):
        word = 0
        for i in range(32):
            word = (word << 1) | bits[32 * j + i]
        for half in (word & 0xFFFF, word >> 16):
            out.append(half - 0x10000 if half >= 0x8000 else half)
    return out


def tile_states(tile_int16, k: float) -> list[int]:
    """256 states: state_p = Σ_m bit[(S(p) − 16 + m) mod R] << (15 − m)."""
    bits = tile_to_ring_bits(tile_int16)
    r = len(bits)
    assert r == ring_length(k), (r, k)
    states = []
    for p in range(256):
        s = position_end(p, k)
        state = 0
        for m in range(16):
            state |= bits[(s - 16 + m) % r] << (15 - m)
        states.append(state)
    return states


def states_to_tile(states: list[int], k: float) -> list[int]:
    """Store the low D(p) bits of each state at ring bits [S(p) − D(p), S(p)), MSB first."""
    r = ring_length(k)
    bits = [0] * r
    for p in range(256):
        d, s = position_bits(p, k), position_end(p, k)
        code = states[p] & ((1 << d) - 1)
        for m in range(d):
            bits[s - d + m] = (code >> (d - 1 - m)) & 1
    return ring_bits_to_tile(bits)


def set_ring_bit(k: float, b: int) -> list[int]:
    """A tile whose ring is all zero except ring bit b, built from the layout rules in §2.3 alone."""
    tile = [0] * int(16 * k)
    word, bit_in_word = b // 32, 31 - b % 32
    index = 2 * word + (1 if bit_in_word >= 16 else 0)  # int16 2j = low half of word j
    u16 = 1 << (bit_in_word % 16)
    tile[index] = u16 - 0x10000 if u16 >= 0x8000 else u16
    return tile


# ---------------------------------------------------------------------------------------------------------------
# §2.7 tile permutation
# ---------------------------------------------------------------------------------------------------------------


def perm_formula(p: int) -> tuple[int, int]:
    t, j = p // 8, p % 8
    r = 2 * (t % 4) + (j & 1) + 8 * ((j >> 1) & 1)
    c = t // 4 + 8 * ((j >> 2) & 1)
    return r, c


def perm_listing() -> list[tuple[int, int]]:
    """The explicit listing: positions 8t..8t+7 with r0 = 2(t%4), c0 = t//4."""
    out = []
    for t in range(32):
        r0, c0 = 2 * (t % 4), t // 4
        out += [(r0, c0), (r0 + 1, c0), (r0 + 8, c0), (r0 + 9, c0),
                (r0, c0 + 8), (r0 + 1, c0 + 8), (r0 + 8, c0 + 8), (r0 + 9, c0 + 8)]
    return out


def identity_perm(p: int) -> tuple[int, int]:
    """Row-major placement; used only as a negative control."""
    return p // 16, p % 16


# ---------------------------------------------------------------------------------------------------------------
# §2.1 Hadamard and whole-layer decode
# ---------------------------------------------------------------------------------------------------------------


def hadamard_128() -> np.ndarray:
    """H[i][j] = (−1)^popcount(i & j) / √128, float64."""
    h = np.empty((128, 128), dtype=np.float64)
    for i in range(128):
        for j in range(128):
            h[i, j] = -1.0 if bin(i & j).count("1") % 2 else 1.0
    return h / math.sqrt(128)


def block_hadamard(n: int) -> np.ndarray:
    """Block-diagonal n×n matrix of 128×128 Hadamard blocks."""
    assert n % 128 == 0
    out = np.zeros((n, n), dtype=np.float64)
    h = hadamard_128()
    for b in range(n // 128):
        out[128 * b : 128 * (b + 1), 128 * b : 128 * (b + 1)] = h
    return out


def rotated_weight_bits(trellis: np.ndarray, k: float, codebook: str, perm=perm_formula) -> np.ndarray:
    """W_hat (16·tk, 16·tn) as uint16 fp16 bit patterns; tile (i, j) covers rows 16i.., columns 16j.."""
    tk, tn, width = trellis.shape
    assert width == 16 * k
    out = np.zeros((16 * tk, 16 * tn), dtype=np.uint16)
    for i in range(tk):
        for j in range(tn):
            states = tile_states(trellis[i, j].tolist(), k)
            for p in range(256):
                r, c = perm(p)
                out[16 * i + r, 16 * j + c] = codebook_bits(codebook, states[p])
    return out


def bits_to_float64(bits: np.ndarray) -> np.ndarray:
    return bits.astype(np.uint16).view(np.float16).astype(np.float64)


def dequantize_kn(w_hat_bits: np.ndarray, suh: np.ndarray, svh: np.ndarray) -> np.ndarray:
    """W (in, out) = diag(suh) · Hk · W_hat · Hn · diag(svh) in float64."""
    k, n = w_hat_bits.shape
    w_hat = bits_to_float64(w_hat_bits)
    return np.diag(np.asarray(suh, np.float64)) @ block_hadamard(k) @ w_hat @ block_hadamard(n) @ np.diag(
        np.asarray(svh, np.float64)
    )


def pack_sign_bits(signs: np.ndarray) -> np.ndarray:
    """Legacy su/sv: ±1 vector -> int16 words, bit j of word i = element 16i + j, bit 1 = −1.0."""
    words = []
    for i in range(len(signs) // 16):
        w = 0
        for j in range(16):
            if signs[16 * i + j] < 0:
                w |= 1 << j
        words.append(w - 0x10000 if w >= 0x8000 else w)
    return np.array(words, dtype=np.int16)


def random_trellis(rng: np.random.Generator, tk: int, tn: int, k: float) -> np.ndarray:
    """Any bit pattern is a valid tile (§2.5), so uniform random int16 is a valid trellis."""
    return rng.integers(-32768, 32768, size=(tk, tn, int(16 * k)), dtype=np.int32).astype(np.int16)
