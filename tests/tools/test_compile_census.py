"""The compile census (tools/compile_census.py): the kernel variants the Triton backend compiles when vLLM starts,
recorded from its real forwards on meta tensors at vLLM's default capture sizes and the profile run, keyed as Triton's
JIT keys them. Issue #38 item 2: SLOTS_P2 at every power of two, FINISH, DEDUP and Triton's `% 16` specialisation of
num_slots / first made 27 variants per layer (8 gate/up, 8 down); the target is at most 8 for the gate/up + down pair
per (K, codebook) across every capture size."""

from __future__ import annotations

import pytest
import torch

from vllm_expert_offload.tools import compile_census
from vllm_expert_offload.tools.compile_census import LAYERS, PROFILE_TOKENS, VLLM_CAPTURE_SIZES

from support.lent_toolchain import LENT, pretend_lent_toolchain

TOKENS = (*VLLM_CAPTURE_SIZES, PROFILE_TOKENS)


@pytest.mark.parametrize("layer", LAYERS, ids=[layer.model for layer in LAYERS])
@pytest.mark.parametrize("capability", [90, 120])
def test_startup_compiles_few_variants_per_layer(layer, capability: int) -> None:
    variants = compile_census.layer_variants(layer, capability, TOKENS)
    by_kernel = {}
    for key in variants:
        by_kernel[key[0]] = by_kernel.get(key[0], 0) + 1
    assert by_kernel["moe_gate_up_kernel"] + by_kernel["moe_down_kernel"] <= 8, by_kernel
    assert by_kernel == {"moe_gate_up_kernel": 3, "moe_down_kernel": 3, "moe_sum_kernel": 1, "dequantize_kernel": 2,
                         "grouped_gate_up_kernel": 1, "grouped_down_kernel": 1}


def test_launch_key_follows_tritons_specialisation() -> None:
    """An int argument equal to 1 is a constant, a multiple of 16 gets the divisibility hint, a parameter marked
    do_not_specialize gets neither; a constexpr keys by value."""
    from vllm_expert_offload.kernels.triton_moe import moe_sum_kernel

    def key(**changes):
        args = dict(y_ptr=torch.empty(4, device="meta"), ids_ptr=torch.empty(4, dtype=torch.int64, device="meta"),
                    stride_i0=8, stride_i1=1, parts=1, num_slots=16, size_n=2048, hidden=2048,
                    out_ptr=torch.empty(4, device="meta"), stride_om=2048) | changes
        return dict((name, (kind, spec)) for name, kind, spec in
                    compile_census.launch_key(moe_sum_kernel, tuple(args.values()), {"TOP_K": 8, "BLOCK": 256})[1])

    base = key()
    assert base["stride_i1"] == ("constexpr", 1) and base["stride_i0"] == ("i32", "")
    assert base["size_n"] == ("i32", "D") and key(size_n=2040)["size_n"] == ("i32", "")
    assert base["parts"] == key(parts=3)["parts"] == ("i32", None)  # do_not_specialize
    assert base["TOP_K"] == ("constexpr", 8)


def test_a_recorded_variant_compiles_as_launched() -> None:
    """A recorded key becomes the StaticKernel tools/static_kernels.py compiles: runtime types, the constants Triton
    made (constexprs and ints equal to 1), the 16-aligned arguments."""
    from vllm_expert_offload.kernels.triton_moe import moe_sum_kernel

    args = (torch.empty(4, device="meta"), torch.empty(4, dtype=torch.int64, device="meta"), 8, 1, 1, 16, 2048, 2048,
            torch.empty(4, device="meta"), 2048)
    kernel = compile_census.static_kernel(compile_census.launch_key(moe_sum_kernel, args, {"TOP_K": 8, "BLOCK": 256}),
                                          moe_sum_kernel)
    assert kernel.constexprs == {"stride_i1": 1, "TOP_K": 8, "BLOCK": 256}
    assert kernel.signature["parts"] == "i32" and kernel.signature["y_ptr"] == "*fp32"
    assert set(kernel.aligned) == {"y_ptr", "ids_ptr", "size_n", "hidden", "out_ptr", "stride_om"}


def test_every_codebook_and_mixed_rates_census() -> None:
    """A layer mixing K and all three codebooks (the GPU tests' layer, fp32): its table is mixed, so gate/up and
    down compile their mixed-rate variants, as many as a uniform layer's, each keyed by the rates and codebooks the
    layer holds (2K 4, 5, 6, 8, 10; all three codebooks), whose decode branches alone it compiles."""
    layer = compile_census.CensusLayer("mixed", 128, 256, 6, 2, ((3, "mul1"), (2.5, "mul1"), (4, "mcg"),
                                                                 (2, "3inst"), (5, "mul1")), "fp32")
    variants = compile_census.layer_variants(layer, 120, (1, 8, 9, 64, 300))
    gate_up = [dict((p, spec) for p, _, spec in key[1]) for key in variants if key[0] == "moe_gate_up_kernel"]
    rates, codebooks = -(1 << 4 | 1 << 5 | 1 << 6 | 1 << 8 | 1 << 10), -(1 | 2 | 4)
    assert len(gate_up) == 3 and all(v["TWICE_K_GATE"] == rates and v["CODEBOOK_GATE"] == codebooks for v in gate_up)


def test_census_says_which_triton_and_ptxas_measured_it(monkeypatch) -> None:
    """The count is the running Triton's launch keys, the compile facts its ptxas's: each layer's entry names them
    per target (the lent machine's Triton 3.6 takes ptxas 12.8 for sm_90, 12.9 for sm_120), no ptxas where nothing
    was compiled."""
    pretend_lent_toolchain(monkeypatch)
    layer = compile_census.CensusLayer("tiny", 128, 256, 4, 2, ((3, "mul1"),), "fp16")
    counted = compile_census.census((layer,), (1,))
    assert {target: c["tiny"]["toolchain"] for target, c in counted.items()} == {
        "sm_90": {"triton": "3.6.0"}, "sm_120": {"triton": "3.6.0"}}
    facts = {"seconds": 1.0, "shared_bytes": 0, "spills": 0, "registers": 32}
    compiled = compile_census.census((layer,), (1,), compile_variants=lambda kernel, capability: facts)
    assert compiled["sm_90"]["tiny"]["toolchain"] == LENT[90]
    assert compiled["sm_120"]["tiny"]["toolchain"] == LENT[120]
