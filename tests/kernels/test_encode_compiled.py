"""The compiled Viterbi (vllm_expert_offload/csrc/exl3_viterbi.inc) against the torch one in exl3/encode.py: same states, bit for bit.

Encoded checkpoints must not depend on whether the machine that quantized them had a compiler, so every K and
codebook is compared on tiles that stress the float details: ties (codebook values repeat, exact-hit and
coarse targets), zeros, large values, and overflow to inf and NaN costs.
"""

from __future__ import annotations

import logging

import pytest
import torch

from vllm_expert_offload.exl3 import Codebook, codebook_table, encode
from vllm_expert_offload.exl3.bitrate import HALF_K, INTEGER_K
from vllm_expert_offload.exl3.encode import ROW_TARGET_RMS, VITERBI_ENV, encode_tiles
from vllm_expert_offload.exl3.errors import Exl3FormatError
from vllm_expert_offload.kernels import cpu_exl3

from support.torch_rounding import torch_addcmul_fuses

CASES = [(k, Codebook.MUL1) for k in (*INTEGER_K, *HALF_K)] + [
    (k, codebook) for codebook in (Codebook.INST3, Codebook.MCG) for k in INTEGER_K
]


def _stress_tiles(codebook: Codebook, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    gaussian = torch.randn(256, generator=gen)
    on_codebook = codebook_table(codebook)[torch.randint(0, 1 << 16, (256,), generator=gen)].float()
    coarse = torch.randint(-2, 3, (256,), generator=gen) * 0.5
    return torch.stack([
        gaussian * ROW_TARGET_RMS,
        torch.zeros(256),
        on_codebook,  # a zero-error path exists, and many states tie with it
        coarse,
        gaussian * 1e29,  # huge but finite costs, below the compiled encoder's no-NaN bound of 1e30
        gaussian * 1e31,  # above it: the NaN-tracking path, though the costs stay finite
        gaussian.sign() * 3e38,  # -2x overflows: inf costs, inf - inf = NaN
    ])


@pytest.fixture(scope="module", autouse=True)
def _compiled_available() -> None:
    why = cpu_exl3.cpu_kernel_unavailable()
    if why is not None:
        pytest.skip(f"compiled extension unavailable: {why}")


@pytest.mark.parametrize(("k", "codebook"), CASES, ids=[f"{c.value}-k{k}" for k, c in CASES])
def test_compiled_states_equal_torch(k: float, codebook: Codebook) -> None:
    if not torch_addcmul_fuses():
        pytest.skip(f"torch.addcmul rounds twice at CPU capability {torch.backends.cpu.get_cpu_capability()}")
    targets = _stress_tiles(codebook, seed=int(10 * k))
    compiled = encode_tiles(targets, k, codebook, viterbi="compiled")
    reference = encode_tiles(targets, k, codebook, viterbi="torch")
    assert torch.equal(compiled, reference), (compiled != reference).any(1).nonzero().flatten().tolist()


def test_compiled_reports_progress_per_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(encode, "COMPILED_TILES_PER_THREAD", 1)
    done: list[int] = []
    targets = torch.randn(2 * torch.get_num_threads() + 1, 256)
    encode_tiles(targets, 2, progress=done.append)
    assert done[-1] == targets.shape[0] and done == sorted(done) and len(done) == 3


def test_forced_torch_and_unavailable_compiled_are_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="vllm.expert_offload")
    encode._log_torch_encoder.cache_clear()
    monkeypatch.setenv(VITERBI_ENV, "torch")
    assert encode.compiled_viterbi() is None and encode.compiled_viterbi() is None
    assert [r.getMessage() for r in caplog.records] == [
        f"EXL3 encoder: the torch Viterbi runs, far slower than the compiled one ({VITERBI_ENV}=torch)"
    ]

    def unavailable() -> None:
        raise cpu_exl3.CpuKernelUnavailable("building csrc/ failed: no compiler")

    monkeypatch.setattr(cpu_exl3, "extension", unavailable)
    monkeypatch.delenv(VITERBI_ENV)
    assert encode.compiled_viterbi() is None
    assert ("compiled encoder is unavailable: the compiled CPU kernels: building csrc/ failed: no compiler"
            in caplog.records[-1].getMessage())
    monkeypatch.setenv(VITERBI_ENV, "compiled")
    with pytest.raises(Exl3FormatError, match=f"{VITERBI_ENV}=compiled, but the compiled encoder is not"):
        encode.compiled_viterbi()
    monkeypatch.setattr(encode, "_COMPILED_VITERBI", {})  # nothing registered: said so, not guessed at
    with pytest.raises(Exl3FormatError, match="none is registered"):
        encode.compiled_viterbi()
    with pytest.raises(ValueError, match="viterbi=fast: expected one of auto, compiled, torch"):
        encode.compiled_viterbi("fast")
