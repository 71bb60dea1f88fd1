"""`bench-kernels --static` must compile the fused MoE kernels as the GPU does: Triton's JIT makes an int argument
equal to 1 a constant and gives 16-divisible ints and 16-aligned pointers `tt.divisibility` 16, so a static variant
typed plainly i32/*T measures registers, spills and load widths of a kernel that never runs. Compared with the
compile census's launch key (what Triton's JIT keys the real forward by) at 1 token."""

from __future__ import annotations

import pytest

from vllm_expert_offload.kernels import triton_moe
from vllm_expert_offload.kernels.static_spec import LayerShape
from vllm_expert_offload.tools import compile_census

def _compiled_as(kernel) -> tuple[dict, dict, set]:
    runtime = {p: t for p, t in kernel.signature.items() if p not in kernel.constexprs}
    return runtime, dict(kernel.constexprs), set(kernel.aligned)


@pytest.mark.parametrize("capability", [90, 120])
@pytest.mark.parametrize("layer", compile_census.LAYERS[:2], ids=lambda layer: layer.model)
def test_fused_decode_variants_equal_the_census_launch_key(layer: compile_census.CensusLayer, capability: int) -> None:
    """Qwen3 (K steps 16 of gate/up: aligned) and DeepSeek-V4.1 TP 2 (40; split 10 on sm_90, 20 on sm_120)."""
    (k_bits, codebook), = layer.rates
    shape = LayerShape(layer.model, layer.hidden, layer.intermediate, layer.experts, layer.top_k, k_bits, codebook)
    census = {key[0]: _compiled_as(compile_census.static_kernel(key, fn))
              for key, fn in compile_census.layer_variants(layer, capability, (1,)).items()}
    static = {k.fn.__name__: _compiled_as(k) for k in triton_moe.static_kernels(shape)
              if k.name.endswith(f",{layer.dtype},decode]") and (k.launched_on is None or k.launched_on(capability))}
    assert set(static) == {"moe_gate_up_kernel", "moe_down_kernel"}
    for name, (signature, constexprs, aligned) in static.items():
        want_signature, want_constexprs, want_aligned = census[name]
        assert signature == want_signature, name
        assert constexprs == want_constexprs, name
        assert aligned == want_aligned, name
