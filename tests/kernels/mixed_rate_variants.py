"""Kernel variants test_mixed_rates.py reads the front-end IR of (a provider for tools/static_kernels.py, loaded in a
child Python by path): what the fused backend launches for a layer whose experts mix K = 2 (MUL1) and K = 3 (MCG),
recorded from its real forwards on meta tensors (tools/compile_census.py) at a decode batch and a prefill whose
experts are dequantized, so the constexprs are the ones the launches pass."""

from __future__ import annotations

import dataclasses

from vllm_expert_offload.kernels.static_spec import LayerShape, StaticKernel
from vllm_expert_offload.tools import compile_census

LAYER = compile_census.CensusLayer("mixed-2-3", 256, 256, 4, 2, ((2.0, "mul1"), (3.0, "mcg")), "bf16")


def mixed_layer_variants(shape: LayerShape) -> list[StaticKernel]:
    """Every variant LAYER's forwards at 1 and 8192 tokens launch on sm_90 (`shape` unused: the layer is fixed),
    named kernel#index (the report keys variants by name), listed for sm_90 alone."""
    recorded = compile_census.layer_variants(LAYER, 90, (1, 8192))
    return [dataclasses.replace(compile_census.static_kernel(key, fn), name=f"{key[0]}#{i}",
                                launched_on=lambda capability: capability == 90)
            for i, (key, fn) in enumerate(recorded.items())]
