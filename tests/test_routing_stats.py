"""Routing statistics recorded while serving equal what the reference router selects on the same batch."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from reference_twin import checked_dense_twin
from vllm_expert_offload.integration.startup.worker_rpc import SAVE_STATS
from vllm_expert_offload.placement import RoutingCounts
from vllm_expert_offload.testing.engine import EngineSpec, generate_greedy
from vllm_expert_offload.testing.tiny_models import build_tiny_model

pytestmark = pytest.mark.engine


def _reference_counts(twin: str, prompts: list[list[int]], num_layers: int, num_experts: int) -> np.ndarray:
    """HF's own router top-k over every prompt token (a max_tokens=1 request processes exactly the prompt)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    counts = np.zeros((num_layers, num_experts), dtype=np.int64)
    hooks = []
    for index, layer in enumerate(model.model.layers):
        def count(_module, _inputs, output, row=index):
            indices = output[2]  # (router_logits, router_scores, router_indices)
            counts[row] += np.bincount(indices.reshape(-1).numpy(), minlength=num_experts)

        hooks.append(layer.mlp.gate.register_forward_hook(count))
    with torch.no_grad():
        for prompt in prompts:
            model(torch.tensor([prompt]))
    for hook in hooks:
        hook.remove()
    return counts


def test_recorded_counts_equal_reference_router(tmp_path) -> None:
    model = build_tiny_model(None, "qwen3_moe")
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 700) for _ in range(n)] for n in (13, 77, 150)]
    at_exit, on_request = tmp_path / "stats.json", tmp_path / "requested.json"
    offload = {"expert_offload": {"host_fraction": 0.5, "record_stats": str(at_exit)}}
    rpc = [(SAVE_STATS, [str(on_request)])]
    generate_greedy(EngineSpec(str(model), prompts, max_tokens=1, additional_config=offload, rpc_after=rpc))

    reference = _reference_counts(str(checked_dense_twin(model)), prompts, 2, 8)
    for path in (on_request, at_exit):
        saved = RoutingCounts.load(path)
        assert saved.moe_layers == (0, 1) and saved.model.architecture == "Qwen3MoeForCausalLM"
        assert saved.counts.sum() == 2 * 2 * sum(map(len, prompts)), "each prompt token picks 2 experts per layer"
        np.testing.assert_array_equal(saved.counts, reference)
