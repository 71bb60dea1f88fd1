"""The torch reference (host syncs) is refused exactly where vLLM would capture CUDA graphs, and nowhere else:
torch.compile alone is fine, because every EXL3 forward is one opaque op."""

from __future__ import annotations

import pytest
import torch

from vllm_expert_offload.kernels.oracle import BackendUnavailable, KernelChoice

TORCH = KernelChoice("torch", "dequantized", "asked for", graph_safe=False)
TRITON = KernelChoice("triton", "triton", "asked for", graph_safe=True)


def _check(choice: KernelChoice, device: str, cudagraph_mode: str) -> None:
    from vllm.config import CUDAGraphMode, VllmConfig, set_current_vllm_config

    from vllm_expert_offload.integration.methods.moe_method import _require_eager_if_not_graph_safe

    config = VllmConfig()
    config.compilation_config.cudagraph_mode = CUDAGraphMode[cudagraph_mode]  # as vLLM resolves it on a GPU
    with set_current_vllm_config(config):
        _require_eager_if_not_graph_safe(choice, torch.device(device))


@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "PIECEWISE", "FULL"])
def test_torch_reference_refused_where_graphs_are_captured(mode: str) -> None:
    with pytest.raises(BackendUnavailable, match="'torch' backend .* cannot be captured in CUDA graphs"):
        _check(TORCH, "cuda", mode)


@pytest.mark.parametrize(("choice", "device", "mode"), [
    (TORCH, "cuda", "NONE"),  # --enforce-eager (or a cudagraph mode of NONE): nothing is captured
    (TORCH, "cpu", "FULL_AND_PIECEWISE"),  # the CPU engine compiles but never captures graphs
    (TRITON, "cuda", "FULL_AND_PIECEWISE"),
])
def test_allowed_where_nothing_is_captured_or_the_backend_is_graph_safe(choice, device: str, mode: str) -> None:
    _check(choice, device, mode)
