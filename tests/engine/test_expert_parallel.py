"""Expert parallelism on the CPU engine (issue 27): `--tensor-parallel-size 2 --enable-expert-parallel` with half of
each rank's experts in the host tier serves HF's greedy tokens, each rank places only the experts vLLM's expert map
gives it (its log line, its memory report: the two ranks' experts and bytes add up to the model's, each expert
once), and the statistics one rank writes equal HF's router top-k over every token the engine routed.

One engine start (~1-2 minutes on two busy cores)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from vllm_expert_offload.exl3.checkpoint import Exl3Checkpoint
from vllm_expert_offload.integration.startup.worker_rpc import MEMORY_REPORT, SAVE_STATS
from vllm_expert_offload.placement import RoutingCounts
from vllm_expert_offload.testing.engine import EngineSpec, generate_report
from vllm_expert_offload.testing.reference import compare_greedy

from support.engine_model import MAX_TOKENS, Model
from support.reference_twin import checked_dense_twin
from support.router_counts import hf_router_counts

pytestmark = pytest.mark.engine

PLACEMENT_LINE = re.compile(r"expert placement \(ep rank (\d) of 2, experts (\d+)-(\d+)\): (\d+) of (\d+) "
                            r"routed experts in the host tier")


def test_tensor_parallel_2_with_expert_parallelism(tmp_path) -> None:
    model = Model.get("qwen3_moe")
    stats = tmp_path / "stats.json"
    offload = {"expert_offload": {"host_fraction": 0.5, "record_stats": str(stats)}}
    spec = EngineSpec(model.exl3, model.prompts, MAX_TOKENS, block_size=64, tensor_parallel_size=2,
                      enable_expert_parallel=True, additional_config=offload,
                      rpc_after=[(MEMORY_REPORT, []), (SAVE_STATS, [])])
    result = generate_report(spec)
    comparison = compare_greedy(model.reference, result["tokens"], min_steps=MAX_TOKENS)
    assert comparison.matched, str(comparison)
    assert "Local/global number of experts: 4/8" in result["log"]  # vLLM's own EP split, which the plugin follows

    # Each rank's placement line names its EP rank and only its 4 experts: 2 layers x 2 of them in the host tier.
    lines = sorted(PLACEMENT_LINE.findall(result["log"]))
    assert lines == [("0", "0", "3", "4", "8"), ("1", "4", "7", "4", "8")], lines

    # The two ranks hold every routed expert's whole trellises exactly once between them, half of it on host.
    reports = result["rpc"][0]
    assert sorted(r["ep_rank"] for r in reports) == [0, 1]
    assert sorted(e for r in reports for e in r["local_experts"]) == list(range(8))
    shapes = Exl3Checkpoint.open(model.exl3).header_shapes()
    total = sum(2 * int(np.prod(shape)) for name, (shape, _) in shapes.items()
                if ".mlp.experts." in name and name.endswith(".trellis"))
    assert sum(r["gpu_tier_expert_bytes"] + r["host_tier_expert_bytes"] for r in reports) == total
    assert sum(r["host_tier_expert_bytes"] for r in reports) == total // 2  # equal-sized experts

    # One rank writes; its counts are global and equal HF's router over every token routed: each prompt and every
    # generated token but the last (never fed back).
    assert sorted(map(str, result["rpc"][1])) == sorted([str(stats), "None"])
    saved = RoutingCounts.load(stats)
    assert saved.model.ep_size == 2 and saved.model.tp_size == 1
    routed = [prompt + tokens[:-1] for prompt, tokens in zip(model.prompts, result["tokens"])]
    np.testing.assert_array_equal(saved.counts, hf_router_counts(str(checked_dense_twin(model.exl3)), routed, 8))
