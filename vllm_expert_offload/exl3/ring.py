"""The packed trellis: tiles of 256 positions stored as an MSB-first bit ring (exl3-format.md §2.3-2.5).

`unpack_states` and `pack_states` are exact inverses on consistent state sequences; any bit pattern
unpacks to a valid tile (tail-biting: the first positions borrow bits from the end of the ring).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .bitrate import POSITIONS, position_bits, position_ends, ring_bits

_TILE_CHUNK = 16384  # tiles unpacked at once; bounds the (tiles, 256) int64 temporaries


def _int16_to_words(trellis: torch.Tensor) -> torch.Tensor:
    """(..., 2W) int16 -> (..., W) int64 32-bit words; int16 2j is the low half of word j."""
    u16 = trellis.to(torch.int64) & 0xFFFF
    return u16[..., 0::2] | (u16[..., 1::2] << 16)


def _words_to_int16(words: torch.Tensor) -> torch.Tensor:
    lo = words & 0xFFFF
    hi = (words >> 16) & 0xFFFF
    u16 = torch.stack((lo, hi), dim=-1).flatten(-2)
    return torch.where(u16 >= 0x8000, u16 - 0x10000, u16).to(torch.int16)


@lru_cache(maxsize=None)
def _window_words(k: float, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each position: the two ring words its 16-bit window spans, and the right shift that aligns it.

    The window [S(p) - 16, S(p)) mod R starts at bit `off` of word `a`; since 16 <= 32 it ends in word
    a or a+1 (mod the word count), so one 64-bit merge and one shift extract it. Cached per device.
    """
    if torch.device(device) != torch.device("cpu"):
        return tuple(t.to(device) for t in _window_words(k))
    r = ring_bits(k)
    start = (position_ends(k) - 16) % r
    first = start // 32
    second = (first + 1) % (r // 32)
    shift = 48 - start % 32
    return first, second, shift


def unpack_states(trellis: torch.Tensor, k: float) -> torch.Tensor:
    """Packed tiles (..., 16K) int16 -> 16-bit states (..., 256) int64 in ring position order."""
    lead = trellis.shape[:-1]
    words = _int16_to_words(trellis.reshape(-1, trellis.shape[-1]))
    first, second, shift = _window_words(k, trellis.device)
    out = torch.empty(words.shape[0], POSITIONS, dtype=torch.int64, device=trellis.device)
    for start in range(0, words.shape[0], _TILE_CHUNK):
        chunk = words[start : start + _TILE_CHUNK]
        # int64 wraps on the left shift; the arithmetic right shift only smears bits the mask drops.
        merged = (chunk[:, first] << 32) | chunk[:, second]
        out[start : start + _TILE_CHUNK] = (merged >> shift) & 0xFFFF
    return out.reshape(*lead, POSITIONS)


def pack_states(states: torch.Tensor, k: float) -> torch.Tensor:
    """16-bit states (..., 256) -> packed tiles (..., 16K) int16.

    Only the low D(p) bits of each state are stored; the high bits are implied by the previous
    positions, so a state sequence that is not a valid trellis path packs to the nearest one that is.
    """
    lead = states.shape[:-1]
    flat = states.reshape(-1, POSITIONS).to(torch.int64)
    d = position_bits(k).to(states.device)
    ends = position_ends(k).to(states.device)
    r = ring_bits(k)
    # Bit m (0 = MSB) of position p's code lands at ring index S(p) - D(p) + m.
    max_d = int(d.max())
    m = torch.arange(max_d, device=states.device)
    valid = m[None, :] < d[:, None]  # (256, max_d)
    ring_index = (ends[:, None] - d[:, None] + m[None, :])[valid]  # (R,)
    shift = (d[:, None] - 1 - m[None, :])[valid]
    pos = torch.arange(POSITIONS, device=states.device)[:, None].expand(-1, max_d)[valid]
    code_bits = (flat[:, pos] >> shift) & 1  # (T, R) in ring_index order
    bits = torch.empty(flat.shape[0], r, dtype=torch.int64, device=states.device)
    bits[:, ring_index] = code_bits
    words = (bits.reshape(-1, r // 32, 32) << torch.arange(31, -1, -1, device=states.device)).sum(-1)
    return _words_to_int16(words).reshape(*lead, r // 16)
