"""The packed trellis: tiles of 256 positions stored as an MSB-first bit ring (exl3-format.md §2.3-2.5).

`unpack_states` and `pack_states` are exact inverses on consistent state sequences; any bit pattern
unpacks to a valid tile (tail-biting: the first positions borrow bits from the end of the ring).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .bitrate import POSITIONS, position_bits, position_ends, ring_bits

_TILE_CHUNK = 8192  # tiles unpacked at once; bounds the (tiles, 256, 16) index temporary


def _int16_to_words(trellis: torch.Tensor) -> torch.Tensor:
    """(..., 2W) int16 -> (..., W) int64 32-bit words; int16 2j is the low half of word j."""
    u16 = trellis.to(torch.int64) & 0xFFFF
    return u16[..., 0::2] | (u16[..., 1::2] << 16)


def _words_to_int16(words: torch.Tensor) -> torch.Tensor:
    lo = words & 0xFFFF
    hi = (words >> 16) & 0xFFFF
    u16 = torch.stack((lo, hi), dim=-1).flatten(-2)
    return torch.where(u16 >= 0x8000, u16 - 0x10000, u16).to(torch.int16)


def _ring_to_bits(trellis: torch.Tensor) -> torch.Tensor:
    """(T, 16K) int16 -> (T, 256K) uint8 ring bits, bit b = bit 31 - b%32 of word b//32."""
    words = _int16_to_words(trellis)
    shifts = torch.arange(31, -1, -1, device=trellis.device)
    return ((words[..., :, None] >> shifts) & 1).flatten(-2).to(torch.uint8)


@lru_cache(maxsize=None)
def _window_index(k: float) -> torch.Tensor:
    """(256, 16) ring indices of each position's 16-bit state window, MSB first, wrapped mod R."""
    r = ring_bits(k)
    ends = position_ends(k)
    return (ends[:, None] - 16 + torch.arange(16)[None, :]) % r


def unpack_states(trellis: torch.Tensor, k: float) -> torch.Tensor:
    """Packed tiles (..., 16K) int16 -> 16-bit states (..., 256) int64 in ring position order."""
    lead = trellis.shape[:-1]
    flat = trellis.reshape(-1, trellis.shape[-1])
    weights = (1 << torch.arange(15, -1, -1, device=trellis.device)).to(torch.int64)
    index = _window_index(k).to(trellis.device)
    out = torch.empty(flat.shape[0], POSITIONS, dtype=torch.int64, device=trellis.device)
    for start in range(0, flat.shape[0], _TILE_CHUNK):
        bits = _ring_to_bits(flat[start : start + _TILE_CHUNK])
        windows = bits[:, index].to(torch.int64)  # (T, 256, 16)
        out[start : start + _TILE_CHUNK] = (windows * weights).sum(-1)
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
