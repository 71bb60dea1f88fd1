"""Routing statistics recorded while serving equal what the reference router selects on the same batch."""

from __future__ import annotations

import random

import numpy as np
import pytest

from vllm_expert_offload.exl3.checkpoint import Exl3Checkpoint
from vllm_expert_offload.integration.startup.worker_rpc import MEMORY_REPORT, SAVE_STATS
from vllm_expert_offload.placement import RoutingCounts
from vllm_expert_offload.testing.engine import EngineSpec, generate_report
from vllm_expert_offload.testing.tiny_models import build_tiny_model

from support.reference_twin import checked_dense_twin
from support.router_counts import hf_router_counts

pytestmark = pytest.mark.engine


def test_recorded_counts_equal_reference_router(tmp_path) -> None:
    model = build_tiny_model(None, "qwen3_moe")
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 700) for _ in range(n)] for n in (13, 77, 150)]
    path = tmp_path / "stats.json"
    offload = {"expert_offload": {"host_fraction": 0.5, "record_stats": str(path)}}
    rpc = [(SAVE_STATS, []), (MEMORY_REPORT, [])]
    result = generate_report(EngineSpec(str(model), prompts, max_tokens=1, additional_config=offload, rpc_after=rpc))
    assert result["rpc"][0] == [str(path)]  # the save on request wrote the configured file (and the exit save again)

    # The memory report splits exactly the checkpoint's routed-expert trellises (int16) between the tiers, about
    # half on host (suh/svh stay on the device and are not placed).
    (report,) = result["rpc"][1]
    shapes = Exl3Checkpoint.open(model).header_shapes()
    total = sum(2 * int(np.prod(shape)) for name, (shape, _) in shapes.items()
                if ".mlp.experts." in name and name.endswith(".trellis"))
    assert report["gpu_tier_expert_bytes"] + report["host_tier_expert_bytes"] == total
    assert 0.3 * total < report["host_tier_expert_bytes"] < 0.7 * total
    assert report["loading_peak_bytes"] == 0 and report["model_memory_usage"] is None  # the CPU runner measures neither

    reference = hf_router_counts(str(checked_dense_twin(model)), prompts, 8)  # a max_tokens=1 request: the prompt
    saved = RoutingCounts.load(path)
    assert saved.moe_layers == (0, 1) and saved.model.architecture == "Qwen3MoeForCausalLM"
    assert saved.counts.sum() == 2 * 2 * sum(map(len, prompts)), "each prompt token picks 2 experts per layer"
    assert saved.tokens == sum(map(len, prompts)) and saved.interval[0] <= saved.interval[1]
    np.testing.assert_array_equal(saved.counts, reference)
