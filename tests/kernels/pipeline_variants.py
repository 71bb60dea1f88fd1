"""Kernel variants test_pipeline_stages.py compiles ahead of time (a provider for tools/static_kernels.py, loaded in
a child Python by path): moe_gate_up's widest variant, fp32 at K = 8, as sm_120 launches it."""

from __future__ import annotations

import dataclasses

from vllm_expert_offload.kernels import triton_moe
from vllm_expert_offload.kernels.static_spec import LayerShape, StaticKernel


def widest_gate_up_on_sm120(shape: LayerShape) -> list[StaticKernel]:
    """The fp32 decode gate/up sm_120 launches, listed for sm_120 alone (one compile)."""
    return [dataclasses.replace(k, launched_on=lambda capability: capability == 120)
            for k in triton_moe.static_kernels(shape)
            if k.name == f"moe_gate_up[{shape.codebook},fp32,decode]" and (k.launched_on is None or k.launched_on(120))]
