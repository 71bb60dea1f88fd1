"""The compiled CPU kernels pick their instruction set at run time: the choice is reported and matches the CPU,
and every path the CPU supports decodes bit-exactly and encodes the torch encoder's states."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_expert_offload.exl3 import Codebook, parse_linear
from vllm_expert_offload.exl3.encode import ROW_TARGET_RMS, encode_tiles
from vllm_expert_offload.exl3.hadamard import hadamard_last
from vllm_expert_offload.kernels import cpu_exl3
from vllm_expert_offload.kernels.cpu_exl3 import CPU_MATMUL
from vllm_expert_offload.kernels.expert_blocks import per_row_blocks
from vllm_expert_offload.kernels.matrix_table import matrix_table, own_addresses

from support import exl3_reference as ref
from support.cpu_isa import ISAS, use_isa
from support.layers import make_layer
from support.moe_layers import ALL_RATES, decode_with_kernel
from support.torch_rounding import torch_addcmul_fuses

# __builtin_cpu_supports("x86-64-v3" / "x86-64-v4") in /proc/cpuinfo's names.
LEVEL_FLAGS = {
    # the AVX-512 copy also needs VBMI's byte permutes and VNNI's byte sums; without them the AVX2 copy runs
    "avx512": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512vbmi", "avx512_vnni"},
    "avx2": {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"},
}


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.fixture(scope="module")
def extension() -> Iterator[object]:
    why = cpu_exl3.cpu_kernel_unavailable()
    if why is not None:
        pytest.skip(f"compiled extension unavailable: {why}")
    module = cpu_exl3.extension()
    chosen = module.exl3_cpu_isa()
    yield module
    module.exl3_set_cpu_isa(chosen)


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="reads the CPU flags from /proc/cpuinfo")
def test_chosen_isa_is_the_best_the_cpu_has(extension: object) -> None:
    flags = _cpu_flags()
    best = next((isa for isa in ("avx512", "avx2") if LEVEL_FLAGS["avx2"] <= flags and LEVEL_FLAGS[isa] <= flags),
                "baseline")
    assert cpu_exl3.cpu_kernel_isa() == best


def _decode_one_row_blocks(layers: list) -> list[torch.Tensor]:
    """W_hat of each matrix from identity rows, each row in a block of its own (as MoE decode launches them)."""
    size_k = layers[0].in_features
    table = matrix_table(layers, own_addresses(layers), torch.device("cpu"))
    eye = torch.eye(size_k).repeat(len(layers), 1)
    out = torch.full((eye.shape[0], table.out_features), float("nan"))
    matrix_of_row = torch.arange(len(layers)).repeat_interleave(size_k)
    CPU_MATMUL.launch(eye, *per_row_blocks(matrix_of_row, CPU_MATMUL.block_m), table, out)
    return list(out.split(size_k))


@pytest.mark.parametrize("isa", ISAS)
def test_every_supported_isa_decodes_exactly_and_encodes_like_torch(extension, isa: str) -> None:
    use_isa(extension, isa)
    assert cpu_exl3.cpu_kernel_isa() == isa
    cases = ALL_RATES
    layers = [parse_linear(make_layer(k, cb, 128, 128, seed=i)) for i, (k, cb) in enumerate(cases)]
    # Blocks of many rows (a tile decoded once into a buffer) and of one row each (the decode path: each tile row
    # multiplied straight from registers) are separate code in the SIMD copies; both must give W_hat exactly.
    decoded = {"grouped": decode_with_kernel(layers, CPU_MATMUL), "one row per block": _decode_one_row_blocks(layers)}
    for how, results in decoded.items():
        for (k, cb), layer, got in zip(cases, layers, results):
            expected = ref.rotated_weight_bits(layer.trellis.numpy(), k, cb).astype(np.int64)
            bits = got.half().view(torch.int16).numpy().astype(np.int64) & 0xFFFF
            assert np.array_equal(bits, expected), (how, k, cb)
    if not torch_addcmul_fuses():
        return  # the torch encoder rounds differently on this CPU (see test_encode_compiled)
    targets = torch.randn(2, 256, generator=torch.Generator().manual_seed(3)) * ROW_TARGET_RMS
    targets[1] = targets[1].sign() * 3e38  # the NaN-tracking steps too
    for k in (2, 3.5):
        compiled = encode_tiles(targets, k, Codebook.MUL1, viterbi="compiled")
        assert torch.equal(compiled, encode_tiles(targets, k, Codebook.MUL1, viterbi="torch")), k


@pytest.mark.parametrize("isa", ISAS)
def test_every_state_of_every_codebook_decodes_to_the_table_on_every_isa(extension, isa: str) -> None:
    """The SIMD copies compute the codebooks (byte sums, two ways of rounding to fp16) instead of reading the
    tables: all 65536 states, so the rare byte sums and fp16 ties no random trellis reaches are covered too."""
    use_isa(extension, isa)
    values = cpu_exl3.codebook_values()
    for code, table in enumerate(values):
        got = extension.exl3_codebook_states(code, values)
        assert torch.equal(got.view(torch.int32), table.view(torch.int32)), (isa, code)
        assert torch.equal(got.half().float(), got), (isa, code)  # fp16 values, as decode.py's
    with pytest.raises(RuntimeError, match="unknown codebook id 3"):
        extension.exl3_codebook_states(3, values)


@pytest.mark.parametrize("isa", ISAS)
def test_every_isa_rotates_rows_to_the_baseline_bits(extension, isa: str) -> None:
    """The MoE forward's rotation (hadamard_row): the AVX-512 copy runs the stages h < 16 as shuffles in registers,
    the others as plain loops. The same butterflies in the same order must give the same bits, and equal
    exl3/hadamard.py's matrix product to fp32 rounding. Three blocks (not a power of two), each scale on and off."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(3, 384, generator=gen)
    suh, svh, none = torch.randn(384, generator=gen), torch.randn(384, generator=gen), torch.empty(0)
    for scale_in, scale_out in ((none, none), (suh, none), (none, svh), (suh, svh)):
        use_isa(extension, "baseline")
        want = x.clone()
        extension.exl3_hadamard_rows(want, scale_in, scale_out)
        use_isa(extension, isa)
        got = x.clone()
        extension.exl3_hadamard_rows(got, scale_in, scale_out)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (isa, scale_in.numel(), scale_out.numel())
        rotated = hadamard_last(x * (scale_in if scale_in.numel() else 1.0))
        torch.testing.assert_close(got, rotated * (scale_out if scale_out.numel() else 1.0), rtol=1e-5, atol=1e-5)


def test_unknown_isa_refused(extension) -> None:
    with pytest.raises(RuntimeError, match="unknown ISA 'sse9'"):
        extension.exl3_set_cpu_isa("sse9")
