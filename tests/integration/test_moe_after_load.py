"""An EXL3 MoE layer's after-load check: an expert tensor the loader never delivered is named, not a KeyError later.

The checkpoint is validated before vLLM loads it, so a missing tensor in the file never reaches this check; what
does is a tensor that is in the file but that vLLM's weight mapping never routes to the layer. No engine can be
made to do that on purpose, so the layer's loading runs on a bare layer, fed through its own loader callback.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from vllm_expert_offload.exl3.checkpoint import Exl3Checkpoint
from vllm_expert_offload.exl3.errors import Exl3FormatError
from vllm_expert_offload.exl3.validate import validate_checkpoint
from vllm_expert_offload.integration.methods.expert_loading import ExpertLoading
from vllm_expert_offload.kernels.oracle import KernelChoice
from vllm_expert_offload.testing.tiny_models import build_tiny_model

LAYER, EXPERT, EXPERTS = 1, 5, 8
SHARDS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}  # checkpoint projection -> vLLM shard id


@pytest.fixture(scope="module")
def checkpoint():
    model = build_tiny_model(None, "qwen3_moe")
    return validate_checkpoint(Exl3Checkpoint.open(model)), load_file(model / "model.safetensors")


def _loading(summary) -> tuple[ExpertLoading, torch.nn.Module]:
    """Layer 1's loading after create_weights, every expert but EXPERT already placed."""
    layer = torch.nn.Module()
    layer.expert_map = None
    layer._map_global_expert_id_to_local_expert_id = lambda expert: expert
    loading = ExpertLoading(
        layer=layer, op_name="model.layers.1.mlp.experts.exl3", layer_index=LAYER, geometry=None,
        device=torch.device("cpu"), kernels=None, params_dtype=torch.float32, num_local_experts=EXPERTS, top_k=2,
        swiglu_limit=None, summary=summary, placement=None, capture_rows=(),
        placed={e: object() for e in range(EXPERTS) if e != EXPERT},
    )
    loading.register()
    return loading, layer


def _deliver(layer: torch.nn.Module, tensors: dict[str, torch.Tensor], skip: str | None) -> None:
    """Hand EXPERT's checkpoint tensors to the layer's collectors as vLLM's loader would, except `skip`."""
    root = f"model.layers.{LAYER}.mlp.experts.{EXPERT}."
    for name, tensor in tensors.items():
        if not name.startswith(root) or name == skip:
            continue
        projection, suffix = name.removeprefix(root).split(".")
        shard = SHARDS[projection]
        param = getattr(layer, f"{'w2' if shard == 'w2' else 'w13'}_{suffix}")
        param.weight_loader(param, tensor, name, shard, EXPERT)


@pytest.mark.parametrize(
    ("skip", "message"),
    [
        ("down_proj.svh", r"down_proj\.svh: not delivered by the loader \(received \['mul1', 'suh', 'trellis'\]\)"),
        ("gate_proj.trellis", r"gate_proj\.trellis: not delivered by the loader \(received \['mul1', 'suh', 'svh'\]\)"),
    ],
)
def test_undelivered_expert_tensor_is_named(checkpoint, skip: str, message: str) -> None:
    summary, tensors = checkpoint
    loading, layer = _loading(summary)
    _deliver(layer, tensors, f"model.layers.{LAYER}.mlp.experts.{EXPERT}.{skip}")
    with pytest.raises(Exl3FormatError, match=f"model.layers.{LAYER}.mlp.experts.{EXPERT}.{message}"):
        loading.finish()


def test_expert_never_delivered_is_named(checkpoint) -> None:
    summary, _ = checkpoint
    loading, _ = _loading(summary)
    with pytest.raises(Exl3FormatError, match=rf"experts\.{EXPERT}\.gate_proj\.mul1: not delivered by the loader "
                                              r"\(received nothing\)"):
        loading.finish()


def test_the_placement_is_bounded_by_the_gpus_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the worker hands its GPU's size down, so a budget or plan the GPU cannot hold is refused by name
    before anything is loaded (tests/offload/test_process_placement.py); off CUDA there is no bound."""
    from vllm_expert_offload.integration.methods import moe_method

    made = []
    monkeypatch.setattr(moe_method, "ProcessPlacement", lambda *args: made.append(args) or SimpleNamespace(
        options=SimpleNamespace(min_free_fraction=0.03), gpu_tier_sizes=lambda: []))
    monkeypatch.setattr(moe_method, "install_crash_line", lambda *args: None)
    monkeypatch.setattr(moe_method.torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=96 << 30))
    for device, gpu_bytes in ((torch.device("cuda", 0), 96 << 30), (torch.device("cpu"), None)):
        process = SimpleNamespace(placement=None, options=SimpleNamespace(caches=False))
        quant_config = SimpleNamespace(process=process, summary=None)
        parallel = SimpleNamespace(use_ep=False, dp_rank=0, dp_size=1)
        moe_method._process_placement(quant_config, None, None, parallel, 2, device, KernelChoice("cpu", "cpu", "auto"))
        assert made.pop()[5] == gpu_bytes  # ProcessPlacement(options, summary, geometry, top_k, device, gpu_bytes, ...)
