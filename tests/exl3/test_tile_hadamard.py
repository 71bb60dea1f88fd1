"""Tile permutation (exl3-format.md §2.7) and the 128-block Hadamard (§2.1)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from vllm_expert_offload.exl3 import rotated_weight
from vllm_expert_offload.exl3.hadamard import HADAMARD_SCALE, hadamard_128, hadamard_last, hadamard_rows
from vllm_expert_offload.exl3.tile import (
    positions_to_tiles,
    tile_permutation,
    tile_permutation_inverse,
    tiles_to_positions,
)

from support import exl3_reference as ref

# ------------------------------------------------------------------ tile permutation


def test_permutation_matches_formula_and_listing():
    perm = tile_permutation().tolist()
    listing = ref.perm_listing()
    assert len(perm) == 256
    for p in range(256):
        r, c = ref.perm_formula(p)
        assert listing[p] == (r, c), p
        assert perm[p] == 16 * r + c, p


def test_permutation_first_positions_explicitly():
    """Positions 0..15 from the §2.7 listing with t = 0 (r0 = 0, c0 = 0) and t = 1 (r0 = 2, c0 = 0)."""
    expected = [(0, 0), (1, 0), (8, 0), (9, 0), (0, 8), (1, 8), (8, 8), (9, 8),
                (2, 0), (3, 0), (10, 0), (11, 0), (2, 8), (3, 8), (10, 8), (11, 8)]
    perm = tile_permutation().tolist()
    assert [divmod(perm[p], 16) for p in range(16)] == expected
    # t = 4 starts the next column: r0 = 0, c0 = 1.
    assert divmod(perm[32], 16) == (0, 1)
    assert divmod(perm[255], 16) == (15, 15)


def test_permutation_is_bijection_with_inverse():
    perm = tile_permutation()
    inv = tile_permutation_inverse()
    assert sorted(perm.tolist()) == list(range(256))
    assert torch.equal(perm[inv], torch.arange(256))
    assert torch.equal(inv[perm], torch.arange(256))
    assert not torch.equal(perm, torch.arange(256))  # it is not the identity


def test_positions_to_tiles_places_by_formula():
    tk, tn = 2, 3
    values = torch.arange(tk * tn * 256).reshape(tk, tn, 256)
    matrix = positions_to_tiles(values)
    assert matrix.shape == (16 * tk, 16 * tn)
    for i in range(tk):
        for j in range(tn):
            for p in range(256):
                r, c = ref.perm_formula(p)
                assert matrix[16 * i + r, 16 * j + c] == values[i, j, p]


def test_positions_tiles_roundtrip():
    values = torch.randn(3, 2, 256, generator=torch.Generator().manual_seed(0))
    assert torch.equal(tiles_to_positions(positions_to_tiles(values)), values)
    matrix = torch.randn(48, 32, generator=torch.Generator().manual_seed(1))
    assert torch.equal(positions_to_tiles(tiles_to_positions(matrix)), matrix)


def test_dropping_permutation_gives_different_matrix():
    """Negative control: the naive decoder with the permutation dropped disagrees with the library."""
    trellis = ref.random_trellis(np.random.default_rng(11), 8, 8, 2)
    layer = {"trellis": torch.from_numpy(trellis), "suh": torch.ones(128, dtype=torch.float16),
             "svh": torch.ones(128, dtype=torch.float16), "mul1": torch.tensor(ref.MUL1_MARKER_INT32, dtype=torch.int32)}
    lib = rotated_weight(layer).view(torch.int16).numpy().astype(np.int64) & 0xFFFF
    with_perm = ref.rotated_weight_bits(trellis[:1, :2], 2, "mul1")
    no_perm = ref.rotated_weight_bits(trellis[:1, :2], 2, "mul1", perm=ref.identity_perm)
    np.testing.assert_array_equal(lib[:16, :32], with_perm)
    assert not np.array_equal(lib[:16, :32], no_perm)
    assert (lib[:16, :32] != no_perm).mean() > 0.5


# ------------------------------------------------------------------ Hadamard


@pytest.fixture(scope="module")
def h_ref():
    return ref.hadamard_128()


def test_hadamard_entries_by_popcount(h_ref):
    h = hadamard_128(torch.float64).numpy()
    np.testing.assert_array_equal(h, h_ref)
    for i in (0, 1, 3, 64, 127):
        for j in range(128):
            sign = -1 if bin(i & j).count("1") % 2 else 1
            assert h[i, j] == sign / math.sqrt(128)
    assert abs(HADAMARD_SCALE - 1 / math.sqrt(128)) < 1e-12
    np.testing.assert_allclose(hadamard_128(torch.float32).numpy(), h_ref, rtol=0, atol=1e-8)


def test_hadamard_symmetric_orthonormal():
    h = hadamard_128(torch.float64)
    assert torch.equal(h, h.T)
    assert torch.allclose(h @ h, torch.eye(128, dtype=torch.float64), atol=1e-12)
    h32 = hadamard_128(torch.float32)
    assert torch.allclose(h32 @ h32, torch.eye(128), atol=1e-6)
    # Sylvester natural order: first row and column all positive, row 1 alternates.
    assert (h[0] > 0).all() and (h[:, 0] > 0).all()
    assert torch.equal(torch.sign(h[1, :4]), torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64))


def test_hadamard_negative_control_reordered_rows_differ(h_ref):
    """The comparison is order-sensitive: a row-reordered (bit-reversed index) Hadamard is also orthonormal
    and symmetric-looking in its stats, but it is not the natural-order matrix."""
    rev = [int(f"{i:07b}"[::-1], 2) for i in range(128)]
    reordered = h_ref[rev]
    np.testing.assert_allclose(reordered @ reordered.T, np.eye(128), atol=1e-12)
    assert not np.array_equal(hadamard_128(torch.float64).numpy(), reordered)


@pytest.mark.parametrize("rows", [128, 384])
def test_blockwise_rows_equals_block_diagonal_product(rows):
    x = torch.randn(rows, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(rows))
    expected = ref.block_hadamard(rows) @ x.numpy()
    np.testing.assert_allclose(hadamard_rows(x).numpy(), expected, rtol=0, atol=1e-12)
    # Negative control: blocks are independent, so changing input block 1 leaves output blocks 0 and 2 alone.
    if rows == 384:
        y = x.clone()
        y[128:256] += 1.0
        assert torch.equal(hadamard_rows(y)[:128], hadamard_rows(x)[:128])
        assert torch.equal(hadamard_rows(y)[256:], hadamard_rows(x)[256:])
        assert not torch.equal(hadamard_rows(y)[128:256], hadamard_rows(x)[128:256])


@pytest.mark.parametrize("cols", [128, 256])
def test_blockwise_last_equals_block_diagonal_product(cols):
    x = torch.randn(2, 3, cols, dtype=torch.float64, generator=torch.Generator().manual_seed(cols))
    expected = x.numpy() @ ref.block_hadamard(cols)
    np.testing.assert_allclose(hadamard_last(x).numpy(), expected, rtol=0, atol=1e-12)
    # Blocks are independent: changing block 0 of the input leaves block 1 of the output alone.
    if cols == 256:
        y = x.clone()
        y[..., :128] += 1.0
        assert torch.equal(hadamard_last(y)[..., 128:], hadamard_last(x)[..., 128:])
        assert not torch.equal(hadamard_last(y)[..., :128], hadamard_last(x)[..., :128])


def test_hadamard_float32_blockwise():
    x = torch.randn(256, 7, generator=torch.Generator().manual_seed(3))
    expected = ref.block_hadamard(256) @ x.double().numpy()
    np.testing.assert_allclose(hadamard_rows(x).double().numpy(), expected, rtol=0, atol=1e-5)
    np.testing.assert_allclose(hadamard_last(x.T.contiguous()).double().numpy(), expected.T, rtol=0, atol=1e-5)


def test_decoder_constants_are_cached_per_device() -> None:
    """A forward pass must not copy the reference decoder's constants to the device on every call (a CUDA graph
    cannot record such copies): each device gets its copy once. The meta device stands in for a GPU."""
    from vllm_expert_offload.exl3.codebook import Codebook, codebook_table
    from vllm_expert_offload.exl3.ring import _window_words
    from vllm_expert_offload.exl3.tile import tile_permutation, tile_permutation_inverse

    meta = torch.device("meta")
    for make in (lambda d: hadamard_128(torch.float32, d), lambda d: codebook_table(Codebook.MUL1, d),
                 lambda d: tile_permutation(d), lambda d: tile_permutation_inverse(d), lambda d: _window_words(3, d)[0]):
        first = make(meta)
        assert first.device == meta and make(meta) is first
        assert make("cpu").device == torch.device("cpu")


def test_codebook_marker_stays_on_the_cpu_under_a_device_context() -> None:
    from vllm_expert_offload.exl3 import Codebook, Exl3Linear

    layer = Exl3Linear("x", torch.zeros(8, 8, 48, dtype=torch.int16), torch.ones(128, dtype=torch.float16),
                       torch.ones(128, dtype=torch.float16), Codebook.MUL1, 3)
    with torch.device("meta"):  # as vLLM builds layers under `with torch.device("cuda")`
        marker = layer.tensors()["mul1"]
    assert marker.device == torch.device("cpu") and int(marker) == Codebook.MUL1.marker_value
