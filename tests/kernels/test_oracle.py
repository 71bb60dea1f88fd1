"""The backend oracle: one decision per process, refusals with reasons, never a silent replacement."""

from __future__ import annotations

import sys
import types
from dataclasses import replace

import pytest
import torch

from vllm_expert_offload.exl3 import Codebook
from vllm_expert_offload.exl3.naming import PROJECTIONS
from vllm_expert_offload.kernels.contract import ExpertCrop, MoELayer
from vllm_expert_offload.kernels.exllamav3_backend import moe_refusal
from vllm_expert_offload.kernels.oracle import (
    REGISTRY,
    BackendUnavailable,
    KernelChoice,
    build_moe_kernel,
    choose_kernels,
)
from vllm_expert_offload.kernels.pointer_tables import build_pointer_tables, kernel_address, stack_scales
from vllm_expert_offload.kernels.table_moe import TableMoE
from vllm_expert_offload.offload.options import BACKENDS
from vllm_expert_offload.offload.tiers import PlacedExpert, place_expert
from vllm_expert_offload.tools.random_layers import random_linear

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)  # a device object needs no GPU to exist


def test_auto_on_cpu_is_the_compiled_cpu_kernel_for_every_layer() -> None:
    choice = choose_kernels("auto", CPU)
    assert (choice.moe, choice.linear) == ("cpu", "cpu") and "compiled CPU kernel" in choice.reason


def test_without_the_cpu_kernel_auto_says_why_and_asking_for_it_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_expert_offload.kernels import cpu_exl3

    monkeypatch.setattr(cpu_exl3, "cpu_kernel_unavailable", lambda: "building exl3_cpu.cpp failed: no compiler")
    choice = choose_kernels("auto", CPU)
    assert (choice.moe, choice.linear) == ("torch", "dequantized") and not choice.graph_safe
    assert "cpu passed over (building exl3_cpu.cpp failed: no compiler)" in choice.reason
    with pytest.raises(BackendUnavailable, match="kernel='cpu' cannot run: building exl3_cpu.cpp failed"):
        choose_kernels("cpu", CPU)


def test_cpu_kernel_refused_for_layers_on_a_gpu() -> None:
    with pytest.raises(BackendUnavailable, match="kernel='cpu' cannot run: .*computes on CPU tensors"):
        choose_kernels("cpu", CUDA)


@pytest.fixture
def no_exllamav3(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "exllamav3_ext", None)  # makes `import exllamav3_ext` raise ImportError


@pytest.fixture
def fake_exllamav3(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "exllamav3_ext", types.ModuleType("exllamav3_ext"))


def test_auto_on_cuda_passes_over_exllamav3_with_the_reason_and_takes_triton(no_exllamav3) -> None:
    choice = choose_kernels("auto", CUDA)
    assert (choice.moe, choice.linear, choice.fallback) == ("triton", "triton", None)
    assert "exllamav3 passed over (exllamav3's compiled extension exllamav3_ext does not import" in choice.reason
    assert choice.graph_safe


def test_auto_on_cuda_takes_exllamav3_where_it_imports_with_triton_for_layers_it_refuses(fake_exllamav3) -> None:
    choice = choose_kernels("auto", CUDA)
    assert (choice.moe, choice.linear, choice.fallback) == ("exllamav3", "exllamav3", "triton") and choice.graph_safe
    assert "triton for MoE layers its kernels refuse" in choice.reason


def test_exllamav3_asked_for_where_it_imports(fake_exllamav3) -> None:
    choice = choose_kernels("exllamav3", CUDA)
    assert (choice.moe, choice.linear, choice.fallback) == ("exllamav3", "exllamav3", None)


def test_exllamav3_refused_without_cuda_even_where_it_imports(fake_exllamav3) -> None:
    with pytest.raises(BackendUnavailable, match="kernel='exllamav3' cannot run: its kernels are CUDA kernels"):
        choose_kernels("exllamav3", CPU)


def _moe_layer(rates, crop=None):
    """A placed layer (CPU) with per-expert (K, codebook) rates for every projection."""
    gen = torch.Generator().manual_seed(0)
    sets = [{p: replace(random_linear(gen, 128, 128, k), codebook=Codebook(cb)) for p in PROJECTIONS}
            for k, cb in rates]
    placed, scales = stack_scales([place_expert(s, True, None, CPU) for s in sets], CPU)
    tables = build_pointer_tables(placed, kernel_address(None, CPU), CPU)
    return placed, tables, scales, crop or ExpertCrop(128, 128, 0)


@pytest.mark.parametrize(("rates", "crop", "limit", "why"), [
    ([(3, "mul1"), (3, "mcg")], None, None, "one codebook across gate, up and down"),
    ([(3, "3inst")] * 2, None, None, "MCG and MUL1 codebooks only; this layer is 3INST"),
    ([(3, "mul1"), (4, "mul1")], None, None, "one K per projection"),
    ([(3, "mul1")] * 2, ExpertCrop(128, 96, 0), None, "do not fill the 128-aligned cover"),
    ([(3, "mul1")] * 2, None, 7.0, "act_limit clamps SiLU(gate)"),
])
def test_exllamav3_layer_constraints_name_the_reason(rates, crop, limit, why) -> None:
    experts, _, _, crop = _moe_layer(rates, crop)
    assert why in moe_refusal(experts, crop, limit)


def test_exllamav3_takes_one_k_for_gate_and_up() -> None:
    experts, *_, crop = _moe_layer([(3, "mul1")] * 2)
    experts = [PlacedExpert({**e.projections, "up": replace(e.projections["up"], k=4.0)}, True) for e in experts]
    assert "one K for gate and up" in moe_refusal(experts, crop, None)
    assert moe_refusal(_moe_layer([(3, "mul1")] * 2)[0], crop, None) is None


def test_a_layer_exllamav3_refuses_falls_back_in_auto_and_is_refused_when_asked_for(fake_exllamav3) -> None:
    experts, tables, scales, crop = _moe_layer([(3, "mul1"), (4, "mul1")])
    layer = MoELayer(experts, tables, scales, None, crop, torch.float32, CPU)
    auto = KernelChoice("exllamav3", "exllamav3", "test", fallback="torch")
    assert isinstance(build_moe_kernel(auto, layer), TableMoE)
    asked = KernelChoice("exllamav3", "exllamav3", "test")
    with pytest.raises(BackendUnavailable, match=r"kernel='exllamav3' cannot compute random: .*one K per projection"):
        build_moe_kernel(asked, layer)


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
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    with pytest.raises(BackendUnavailable, match="triton does not import"):
        choose_kernels("triton", CUDA)
    assert choose_kernels("auto", CUDA).moe == "torch"  # auto says why in its reason
    assert "triton does not import" in choose_kernels("auto", CUDA).reason


def test_exllamav3_asked_for_is_refused_not_replaced_where_it_does_not_import(no_exllamav3) -> None:
    with pytest.raises(BackendUnavailable, match="kernel='exllamav3' cannot run: .*exllamav3_ext does not import"):
        choose_kernels("exllamav3", CUDA)


def test_unknown_backend_refused() -> None:
    with pytest.raises(BackendUnavailable, match="expected one of"):
        choose_kernels("cutlass", CPU)


def test_the_option_names_exactly_the_registered_backends() -> None:
    assert set(BACKENDS) == {"auto"} | {name for name, _ in REGISTRY}


def test_without_any_usable_backend_auto_refuses_naming_each(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_expert_offload.kernels import cpu_exl3, oracle

    monkeypatch.setattr(oracle, "REGISTRY", (("cpu", "cpu_exl3"),))
    monkeypatch.setattr(cpu_exl3, "cpu_kernel_unavailable", lambda: "no compiler")
    with pytest.raises(BackendUnavailable, match=r"no EXL3 backend can run on cpu: cpu passed over \(no compiler\)"):
        choose_kernels("auto", CPU)
