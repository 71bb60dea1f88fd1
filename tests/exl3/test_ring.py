"""Bit ring, tail-biting states and packing (exl3-format.md §2.3-2.5) against tests/support/exl3_reference.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_expert_offload.exl3 import pack_states, unpack_states
from vllm_expert_offload.exl3 import ring as ring_module

from support import exl3_reference as ref

ALL_K = [1, 2, 3, 4, 5, 6, 7, 8, 1.5, 2.5, 3.5]


def seed_of(k: float) -> int:
    return int(k * 10)


def lib_states(tile: list[int], k: float) -> list[int]:
    return unpack_states(torch.tensor(tile, dtype=torch.int16), k).tolist()


@pytest.mark.parametrize("k", ALL_K)
def test_unpack_matches_naive_reference(k):
    trellis = ref.random_trellis(np.random.default_rng(seed_of(k)), 2, 3, k)
    states = unpack_states(torch.from_numpy(trellis), k)
    assert states.shape == (2, 3, 256) and states.dtype == torch.int64
    assert int(states.min()) >= 0 and int(states.max()) <= 0xFFFF
    for i in range(2):
        for j in range(3):
            assert states[i, j].tolist() == ref.tile_states(trellis[i, j].tolist(), k), (i, j)


@pytest.mark.parametrize("k", ALL_K)
def test_pack_unpack_roundtrip_bit_exact(k):
    trellis = torch.from_numpy(ref.random_trellis(np.random.default_rng(100 + seed_of(k)), 4, 5, k))
    states = unpack_states(trellis, k)
    packed = pack_states(states, k)
    assert packed.dtype == torch.int16 and packed.shape == trellis.shape
    assert torch.equal(packed, trellis)
    assert torch.equal(unpack_states(packed, k), states)


@pytest.mark.parametrize("k", ALL_K)
def test_pack_arbitrary_states_keeps_low_bits_like_reference(k):
    """pack_states stores only each position's low D(p) bits (the naive packer does the same)."""
    rng = np.random.default_rng(200 + seed_of(k))
    states = rng.integers(0, 65536, size=(3, 256))
    packed = pack_states(torch.from_numpy(states), k)
    for t in range(3):
        assert packed[t].tolist() == ref.states_to_tile(states[t].tolist(), k)
    # A random state sequence is not a trellis path, so the round trip must change it (negative control) ...
    assert not torch.equal(unpack_states(packed, k), torch.from_numpy(states))
    # ... but each position's own code (low D(p) bits) survives.
    d = torch.tensor([ref.position_bits(p, k) for p in range(256)])
    mask = (1 << d) - 1
    assert torch.equal(unpack_states(packed, k) & mask, torch.from_numpy(states) & mask)


@pytest.mark.parametrize("k", ALL_K)
def test_single_set_bit_decodes_to_predicted_states(k):
    """All-zero ring except bit b: state_p = 1 << ((S(p) − 1 − b) mod R) if that offset is < 16, else 0."""
    r = int(256 * k)
    ends = [ref.position_end(p, k) for p in range(256)]
    for b in (0, 1, 17, 31, 32, r // 2 + 3, r - 17, r - 2, r - 1):
        tile = ref.set_ring_bit(k, b)
        assert sum(ref.tile_to_ring_bits(tile)) == 1 and ref.tile_to_ring_bits(tile)[b] == 1
        predicted = []
        for p in range(256):
            offset = (ends[p] - 1 - b) % r
            predicted.append(1 << offset if offset < 16 else 0)
        assert lib_states(tile, k) == predicted, b
        assert ref.tile_states(tile, k) == predicted, b


@pytest.mark.parametrize("k", ALL_K)
def test_tail_biting(k):
    """Positions whose window starts before ring bit 0 (S(p) < 16) read the ring's last bits."""
    r = int(256 * k)
    ends = [ref.position_end(p, k) for p in range(256)]
    wrapping = [p for p in range(256) if ends[p] < 16]
    assert wrapping == list(range(len(wrapping))) and len(wrapping) >= 1
    # Ring bit R−1 alone: it is the LSB of the last state and sits at offset S(p) in the wrapping windows.
    states = lib_states(ref.set_ring_bit(k, r - 1), k)
    assert states[255] == 1
    assert states[0] == 1 << ref.position_bits(0, k)
    nonzero = sorted(p for p in range(256) if states[p])
    assert nonzero == wrapping + [255]
    for p in wrapping:
        assert states[p] == 1 << ends[p]
    # The tail bits of a random tile appear in the top bits of state_0.
    tile = ref.random_trellis(np.random.default_rng(seed_of(k)), 1, 1, k)[0, 0].tolist()
    bits = ref.tile_to_ring_bits(tile)
    d0 = ref.position_bits(0, k)
    tail = 0
    for b in bits[r - (16 - d0):]:
        tail = (tail << 1) | b
    assert lib_states(tile, k)[0] >> d0 == tail


@pytest.mark.parametrize("k", ALL_K)
def test_state_recurrence_cyclic(k):
    """state_p = ((state_{p−1} << D(p)) | code_p) & 0xFFFF for all p (p − 1 taken mod 256), code_p read from the ring."""
    rng = np.random.default_rng(300 + seed_of(k))
    for _ in range(3):
        tile = ref.random_trellis(rng, 1, 1, k)[0, 0].tolist()
        bits = ref.tile_to_ring_bits(tile)
        states = lib_states(tile, k)
        for p in range(256):
            d, s = ref.position_bits(p, k), ref.position_end(p, k)
            code = 0
            for b in bits[s - d : s]:
                code = (code << 1) | b
            assert states[p] == ((states[p - 1] << d) | code) & 0xFFFF, p


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6, 7, 8])
def test_integer_k_shortcut(k):
    """state_p = (Σ_j code_{(p−j) mod 256} << (j·K)) & 0xFFFF."""
    tile = ref.random_trellis(np.random.default_rng(400 + k), 1, 1, k)[0, 0].tolist()
    states = lib_states(tile, k)
    codes = [s & ((1 << k) - 1) for s in states]
    for p in range(256):
        acc = 0
        for j in range(-(-16 // k)):
            acc |= codes[(p - j) % 256] << (j * k)
        assert states[p] == acc & 0xFFFF


@pytest.mark.parametrize("k", [2, 2.5, 8])
def test_flipping_one_bit_changes_exactly_the_covering_windows(k):
    """Negative control: a one-bit change in the trellis is visible in every state whose window covers it."""
    rng = np.random.default_rng(500 + seed_of(k))
    tile = ref.random_trellis(rng, 1, 1, k)[0, 0]
    r = int(256 * k)
    ends = [ref.position_end(p, k) for p in range(256)]
    base = lib_states(tile.tolist(), k)
    for b in (0, 77, r - 1):
        flip = np.array(ref.set_ring_bit(k, b), dtype=np.int16)
        flipped = lib_states((tile ^ flip).tolist(), k)
        for p in range(256):
            offset = (ends[p] - 1 - b) % r
            assert base[p] ^ flipped[p] == (1 << offset if offset < 16 else 0)


def test_half_integer_position_bits():
    """D(p) alternates KA, KA+1 (even p adds KA); S(255) = 256·K."""
    for k in (1.5, 2.5, 3.5):
        ka = int(k)
        assert [ref.position_bits(p, k) for p in range(4)] == [ka, ka + 1, ka, ka + 1]
        for p in range(1, 256, 2):
            assert ref.position_end(p, k) == (p + 1) // 2 * (2 * ka + 1)
        assert ref.position_end(255, k) == 256 * k


def test_unpack_in_chunks(monkeypatch):
    """The library decodes tiles in chunks; chunk boundaries must not matter."""
    trellis = torch.from_numpy(ref.random_trellis(np.random.default_rng(7), 3, 3, 3))
    whole = unpack_states(trellis, 3)
    monkeypatch.setattr(ring_module, "_TILE_CHUNK", 2)
    assert torch.equal(unpack_states(trellis, 3), whole)
    assert whole[2, 2].tolist() == ref.tile_states(trellis[2, 2].tolist(), 3)
