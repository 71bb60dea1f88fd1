"""Codebook tables (exl3-format.md §2.6) against exact arithmetic from tests/support/exl3_reference.py."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from vllm_expert_offload.exl3 import MCG_MARKER, MUL1_MARKER, Codebook, codebook_table, codebook_values

from support import exl3_reference as ref

SAMPLE_STATES = sorted(set(range(0, 65536, 7)) | {0, 1, 2, 0x7FFF, 0x8000, 65534, 65535})
REF_NAME = {Codebook.INST3: "3inst", Codebook.MCG: "mcg", Codebook.MUL1: "mul1"}


def table_bits(codebook: Codebook) -> np.ndarray:
    t = codebook_table(codebook)
    assert t.dtype == torch.float16 and tuple(t.shape) == (65536,)
    return t.view(torch.int16).numpy().astype(np.int64) & 0xFFFF


# ------------------------------------------------------------------ the hand-written fp16 rounding itself


def test_reference_rne_matches_numpy_float16():
    """The reference's RNE agrees with numpy's float16 cast on exactly representable float64 inputs, incl. ties."""
    rng = np.random.default_rng(0)
    values = [Fraction(int(n), 1 << 18) for n in rng.integers(-(1 << 21), 1 << 21, 3000)]
    values += [Fraction(2049, 2048), Fraction(2051, 2048), Fraction(1, 1 << 25), Fraction(3, 1 << 25),
               Fraction(-4097, 4096), Fraction(65519), Fraction(65520), Fraction(0)]
    for v in values:
        with np.errstate(over="ignore"):  # 65520 rounds to inf
            expect = int(np.array(float(v)).astype(np.float16).view(np.uint16))
        assert ref.rne_fp16_bits(v) == expect, v
    # Ties round to even: 1 + 2^-11 is halfway between 1 and 1 + 2^-10 -> 1.0; 1 + 3·2^-11 -> 1 + 2^-9.
    assert ref.rne_fp16_bits(Fraction(2049, 2048)) == 0x3C00
    assert ref.rne_fp16_bits(Fraction(2051, 2048)) == 0x3C02


def test_fp16_constants_of_mul1():
    assert ref.fp16_value(0x1EEE) == Fraction(1774, 1 << 18)
    assert ref.fp16_value(0xC931) == Fraction(-2721792, 1 << 18) == Fraction(-10.3828125)
    assert ref.fp16_value(0x6400 + 37) == 1024 + 37


# ------------------------------------------------------------------ MUL1: all 65,536 states


def test_mul1_all_states_bit_exact():
    lib = table_bits(Codebook.MUL1)
    closed_form = np.array([ref.mul1_bits(s) for s in range(65536)], dtype=np.int64)
    np.testing.assert_array_equal(lib, closed_form)
    # The closed form is the kernel's __hfma with one rounding (spot-check every 13th state from the definition).
    for s in range(0, 65536, 13):
        assert ref.mul1_bits_hfma(s) == closed_form[s], s
    # Independent route: float64 is exact for N·2^-18, numpy float16 rounds to nearest even.
    x = (np.arange(65536, dtype=np.uint64) * np.uint64(ref.MUL1_MULTIPLIER)) % np.uint64(1 << 32)
    bs = sum(((x >> np.uint64(8 * i)) & np.uint64(0xFF)).astype(np.int64) for i in range(4))
    via_numpy = ((((1024 + bs) * 1774 - 2721792).astype(np.float64) * 2.0**-18).astype(np.float16)
                 .view(np.uint16).astype(np.int64))
    np.testing.assert_array_equal(lib, via_numpy)


def test_mul1_negative_control_unrounded_cpu_kernel_value_differs():
    """exllamav3's CPU kernel uses (bs − 510)·k_inv without rounding; the exact table must not equal that."""
    lib = codebook_table(Codebook.MUL1).double().numpy()
    x = (np.arange(65536, dtype=np.uint64) * np.uint64(ref.MUL1_MULTIPLIER)) % np.uint64(1 << 32)
    bs = sum(((x >> np.uint64(8 * i)) & np.uint64(0xFF)).astype(np.int64) for i in range(4))
    approx = (bs - 510) * (1774 * 2.0**-18)
    assert not np.array_equal(lib, approx)
    assert np.abs(lib - approx).max() < 0.01


# ------------------------------------------------------------------ 3INST and MCG: sampled states


@pytest.mark.parametrize("codebook", [Codebook.INST3, Codebook.MCG])
def test_lop3_codebooks_sampled_states_bit_exact(codebook):
    lib = table_bits(codebook)
    name = REF_NAME[codebook]
    mismatches = [(s, int(lib[s]), ref.codebook_bits(name, s)) for s in SAMPLE_STATES
                  if int(lib[s]) != ref.codebook_bits(name, s)]
    assert not mismatches, mismatches[:5]


def test_codebooks_differ_from_each_other():
    """Negative control: the three maps are distinct, so a swapped codebook would be caught."""
    bits = {cb: table_bits(cb) for cb in Codebook}
    assert not np.array_equal(bits[Codebook.INST3], bits[Codebook.MCG])
    assert not np.array_equal(bits[Codebook.INST3], bits[Codebook.MUL1])
    assert not np.array_equal(bits[Codebook.MCG], bits[Codebook.MUL1])
    # ...and the reference distinguishes them too on the sample.
    for s in (1, 7, 12345):
        assert len({ref.inst3_bits(s), ref.mcg_bits(s), ref.mul1_bits(s)}) == 3


def test_lop3_halves_range():
    """Each half lies in ±[0.125, 2), so every 3INST/MCG value lies in (−4, 4)."""
    for s in SAMPLE_STATES[::50]:
        for x in ((s * ref.INST3_MULTIPLIER + ref.INST3_ADDEND) % (1 << 32), (s * ref.MCG_MULTIPLIER) % (1 << 32)):
            x = (x & 0x8FFF8FFF) ^ 0x3B603B60
            for half in (x & 0xFFFF, x >> 16):
                assert Fraction(1, 8) <= abs(ref.fp16_value(half)) < 2


# ------------------------------------------------------------------ statistics of the full tables


@pytest.mark.parametrize(
    "codebook, std, distinct, lo, hi",
    [
        (Codebook.INST3, 1.24372, 10598, -3.957, 3.973),
        (Codebook.MCG, 1.2441, 10746, -3.949, 3.949),
        (Codebook.MUL1, 1.0003, 913, -3.453, 3.348),
    ],
)
def test_table_statistics(codebook, std, distinct, lo, hi):
    t = codebook_table(codebook).double().numpy()
    assert abs(t.std() - std) < 1e-4
    assert len(np.unique(t)) == distinct
    assert abs(t.min() - lo) < 1e-3 and abs(t.max() - hi) < 1e-3
    assert np.isfinite(t).all()


def test_3inst_std_matches_codebook_scale():
    assert abs(codebook_table(Codebook.INST3).double().std().item() - 1.24371088) < 2e-5


# ------------------------------------------------------------------ markers and lookup


def test_marker_constants():
    assert MUL1_MARKER == ref.MUL1_MARKER_INT32 == -2082680531
    assert MCG_MARKER == ref.MCG_MARKER_INT32 == -877912083
    # Same bit patterns as the multipliers, as int32.
    assert torch.tensor(MUL1_MARKER, dtype=torch.int32).item() & 0xFFFFFFFF == 0x83DCD12D
    assert torch.tensor(MCG_MARKER, dtype=torch.int32).item() & 0xFFFFFFFF == 0xCBAC1FED
    assert Codebook.MUL1.marker_value == MUL1_MARKER and Codebook.MUL1.marker_suffix == "mul1"
    assert Codebook.MCG.marker_value == MCG_MARKER and Codebook.MCG.marker_suffix == "mcg"
    assert Codebook.INST3.marker_value is None and Codebook.INST3.marker_suffix is None


@pytest.mark.parametrize("codebook", list(Codebook))
def test_codebook_values_lookup(codebook):
    states = torch.tensor([[0, 1, 65535], [7, 0x8000, 4242]])
    out = codebook_values(codebook, states)
    assert out.dtype == torch.float16 and out.shape == states.shape
    got = (out.view(torch.int16).numpy().astype(np.int64) & 0xFFFF).ravel().tolist()
    assert got == [ref.codebook_bits(REF_NAME[codebook], int(s)) for s in states.ravel()]
