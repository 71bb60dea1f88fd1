"""The backend oracle: one decision per process, refusals with reasons, never a silent replacement."""

from __future__ import annotations

import pytest
import torch

from vllm_expert_offload.kernels.oracle import BackendUnavailable, choose_kernels

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)  # a device object needs no GPU to exist


def test_auto_on_cpu_is_the_compiled_cpu_kernel_for_every_layer() -> None:
    choice = choose_kernels("auto", CPU)
    assert (choice.moe, choice.linear) == ("cpu", "cpu") and "compiled CPU kernel" in choice.reason


def test_without_the_cpu_kernel_auto_says_why_and_asking_for_it_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_expert_offload.kernels import cpu_exl3

    monkeypatch.setattr(cpu_exl3, "cpu_kernel_unavailable", lambda: "building exl3_cpu.cpp failed: no compiler")
    choice = choose_kernels("auto", CPU)
    assert (choice.moe, choice.linear) == ("torch", "dequantized") and not choice.graph_safe
    assert "compiled CPU kernel is unavailable (building exl3_cpu.cpp failed: no compiler)" in choice.reason
    with pytest.raises(BackendUnavailable, match="kernel='cpu' cannot run: building exl3_cpu.cpp failed"):
        choose_kernels("cpu", CPU)


def test_cpu_kernel_refused_for_layers_on_a_gpu() -> None:
    with pytest.raises(BackendUnavailable, match="kernel='cpu' cannot run: .*computes on CPU tensors"):
        choose_kernels("cpu", CUDA)


def test_auto_on_cuda_passes_over_exllamav3_with_the_reason_and_takes_triton() -> None:
    choice = choose_kernels("auto", CUDA)
    assert (choice.moe, choice.linear) == ("triton", "triton")
    assert "exllamav3 passed over" in choice.reason and choice.graph_safe


def test_dequantize_linears_is_an_explicit_opt_in() -> None:
    choice = choose_kernels("auto", CUDA, dequantize_linears=True)
    assert (choice.moe, choice.linear) == ("triton", "dequantized") and "dequantize_linears" in choice.reason


def test_triton_on_cpu_runs_only_in_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert choose_kernels("triton", CPU).moe == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(BackendUnavailable, match=r"kernel='triton' cannot run: .*TRITON_INTERPRET=1 is not set"):
        choose_kernels("triton", CPU)


def test_triton_refused_when_it_does_not_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "triton", None)  # makes `import triton` raise ImportError
    with pytest.raises(BackendUnavailable, match="triton does not import"):
        choose_kernels("triton", CUDA)
    assert choose_kernels("auto", CUDA).moe == "torch"  # auto says why in its reason
    assert "triton does not import" in choose_kernels("auto", CUDA).reason


def test_exllamav3_asked_for_is_refused_not_replaced() -> None:
    with pytest.raises(BackendUnavailable, match="kernel='exllamav3' cannot run: .*not part of this version"):
        choose_kernels("exllamav3", CUDA)


def test_unknown_backend_refused() -> None:
    with pytest.raises(BackendUnavailable, match="expected one of"):
        choose_kernels("cutlass", CPU)
