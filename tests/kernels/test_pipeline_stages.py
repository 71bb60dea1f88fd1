"""moe_gate_up's pipeline depth fits the device's shared memory (issue #38 item 5): at Triton's default of 3 stages an
fp32 model's gate/up needs 102,400 B at K = 5 and 126,976 B at K = 8, beyond the 101,376 B an sm_120 block may use
(OutOfResources in vLLM's profile run). Stages are chosen from K, the activation dtype and the device's limit; the
tightest case is compiled ahead of time for sm_120 and its allocation checked against the limit and the model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vllm_expert_offload.kernels import triton_moe
from vllm_expert_offload.kernels.matrix_table import present_key
from vllm_expert_offload.kernels.static_spec import LayerShape
from vllm_expert_offload.kernels.triton_fused import SHARED_PER_BLOCK
from vllm_expert_offload.tools import static_kernels

from support.moe_layers import FULL, placed_moe, routing

SM90, SM120 = SHARED_PER_BLOCK[90], SHARED_PER_BLOCK[120]


@pytest.mark.parametrize(("twice_k", "dot_fp16", "limit", "stages"), [
    (16, True, SM120, 3),  # fp16 at K = 8: 92,160 B
    (8, False, SM120, 3),  # fp32 at K = 4: 94,208 B
    (10, False, SM120, 2),  # fp32 at K = 5: 102,400 B at 3 stages, 1 KiB over; 69,632 B at 2
    (16, False, SM120, 2),  # fp32 at K = 8: 81,920 B at 2
    (7, False, SM120, 3),  # K = 3.5 (half-integer rate)
    (16, False, SM90, 3),
    (16, False, None, 3),  # the interpreter: no limit
    (16, False, 60_000, 1),  # a limit no pipelining fits
])
def test_stages_are_the_deepest_that_fit(twice_k: int, dot_fp16: bool, limit: int | None, stages: int) -> None:
    assert triton_moe.gate_up_stages(twice_k, twice_k, dot_fp16, limit) == stages
    if limit is not None and stages > 1:
        assert triton_moe.gate_up_shared_bytes(twice_k, dot_fp16, stages) <= limit


def test_a_mixed_table_is_sized_for_its_widest_rate() -> None:
    """A mixed table's present_key names its rates: sized as its widest (K = 8 takes 2 stages on sm_120 in fp32,
    K = 4 at most takes 3)."""
    with_k8 = present_key((6, 16))
    assert triton_moe.gate_up_stages(with_k8, 6, False, SM120) == triton_moe.gate_up_stages(16, 16, False, SM120) == 2
    assert triton_moe.gate_up_stages(6, with_k8, False, SM120) == 2
    assert triton_moe.gate_up_stages(present_key((4, 6, 8)), 6, False, SM120) == 3


@pytest.mark.parametrize(("limit", "stages"), [(SM120, 2), (SM90, 3)])
def test_the_launch_takes_the_devices_stages(monkeypatch, limit: int, stages: int) -> None:
    """The fused layer's gate/up launch (fp32, a mixed-rate table) asks Triton for the stages its device fits."""
    from triton.runtime.interpreter import InterpretedFunction

    monkeypatch.setattr(triton_moe, "shared_per_block", lambda device: limit)
    seen = []
    run = InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        if self.__name__ == "moe_gate_up_kernel":
            seen.append(kwargs.get("num_stages"))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording)
    _, fused, _ = placed_moe(FULL, lambda layer: triton_moe.fused_moe(layer, (1, 1)))
    fused.forward(*routing(1, seed=1), False)
    assert seen == [stages]


def test_the_static_report_lists_per_target_stages() -> None:
    """Where the targets' limits take different stages, the report compiles one variant per target."""
    by_target = {}
    for kernel in triton_moe.static_kernels(LayerShape("x", 2048, 768, 128, 8, k_bits=8)):
        if kernel.name == "moe_gate_up[mul1,fp32,decode]":
            by_target.update({cap: kernel.num_stages for cap in SHARED_PER_BLOCK if kernel.launched_on(cap)})
    assert by_target == {90: 3, 120: 2}


def test_sm120_compile_of_the_widest_variant_fits() -> None:
    """fp32 at K = 8 as sm_120 launches it, compiled ahead of time (to LLVM IR: Triton's own allocation): within the
    block limit, and exactly what the stage model predicts (so the model holds for Triton's allocator)."""
    provider = f"{Path(__file__).with_name('pipeline_variants.py')}:widest_gate_up_on_sm120"
    shape = LayerShape("Qwen3-30B-A3B", hidden=2048, intermediate=768, experts=128, top_k=8, k_bits=8)
    sizes = static_kernels.compile_report(provider, [shape], mode="shared")
    assert sizes["sm_90"] == {}
    got = sizes["sm_120"]["Qwen3-30B-A3B/moe_gate_up[mul1,fp32,decode]"]
    assert got <= SM120
    assert got == triton_moe.gate_up_shared_bytes(16, False, 2)
