"""`bench-kernels --static` must compile the backend's kernels as the GPU does: Triton's JIT makes an int argument
equal to 1 a constant and gives 16-divisible ints and 16-aligned pointers `tt.divisibility` 16, so a static variant
typed plainly i32/*T measures registers, spills and load widths of a kernel that never runs. Compared with the
compile census's launch key (what Triton's JIT keys the real forward by): the fused decode kernels at 1 token, and
every kernel a layer launches at startup (decode, the sum, a prefill's dequantize and grouped GEMMs)."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_expert_offload.kernels import triton_exl3, triton_moe
from vllm_expert_offload.kernels.static_spec import LayerShape
from vllm_expert_offload.tools import compile_census


def _compiled_as(kernel) -> tuple[dict, dict, set]:
    runtime = {p: t for p, t in kernel.signature.items() if p not in kernel.constexprs}
    return runtime, dict(kernel.constexprs), set(kernel.aligned)


def _shape(layer: compile_census.CensusLayer) -> LayerShape:
    (k_bits, codebook), = layer.rates
    return LayerShape(layer.model, layer.hidden, layer.intermediate, layer.experts, layer.top_k, k_bits, codebook)


@pytest.mark.parametrize("capability", [90, 120])
@pytest.mark.parametrize("layer", compile_census.LAYERS[:2], ids=lambda layer: layer.model)
def test_fused_decode_variants_equal_the_census_launch_key(layer: compile_census.CensusLayer, capability: int) -> None:
    """Qwen3 (K steps 16 of gate/up: aligned) and DeepSeek-V4.1 TP 2 (40; split 10 on sm_90, 20 on sm_120)."""
    census = {key[0]: _compiled_as(compile_census.static_kernel(key, fn))
              for key, fn in compile_census.layer_variants(layer, capability, (1,)).items()}
    static = {k.fn.__name__: _compiled_as(k) for k in triton_moe.static_kernels(_shape(layer))
              if k.name.endswith(f",{layer.dtype},decode]") and (k.launched_on is None or k.launched_on(capability))}
    assert set(static) == {"moe_gate_up_kernel", "moe_down_kernel"}
    for name, (signature, constexprs, aligned) in static.items():
        want_signature, want_constexprs, want_aligned = census[name]
        assert signature == want_signature, name
        assert constexprs == want_constexprs, name
        assert aligned == want_aligned, name


@pytest.mark.parametrize("capability", [90, 120])
@pytest.mark.parametrize("layer", compile_census.LAYERS[:2], ids=lambda layer: layer.model)
def test_every_kernel_a_layer_launches_is_in_the_static_report_as_launched(layer: compile_census.CensusLayer,
                                                                             capability: int) -> None:
    """Each variant an fp16 layer's forwards launch at 1 token and at the profile run's 8192 (gate/up, down, the sum,
    the dequantize in the target's fold form, the grouped GEMMs) is one the static report compiles on that target,
    with the same runtime signature, constants and 16-aligned arguments."""
    half = dataclasses.replace(layer, dtype="fp16")
    static = [_compiled_as(k) for k in triton_exl3.backend_static_kernels(_shape(half))
              if k.launched_on is None or k.launched_on(capability)]
    launched = compile_census.layer_variants(half, capability, (1, compile_census.PROFILE_TOKENS))
    assert {key[0] for key in launched} == {"moe_gate_up_kernel", "moe_down_kernel", "moe_sum_kernel",
                                            "dequantize_kernel", "grouped_gate_up_kernel", "grouped_down_kernel"}
    for key, fn in launched.items():
        assert _compiled_as(compile_census.static_kernel(key, fn)) in static, key[0]
