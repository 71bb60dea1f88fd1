"""End to end on the real vLLM CPU engine: EXL3 checkpoints served by the plugin must produce the same
greedy tokens as HF transformers running the dequantized dense twin in float32."""

from __future__ import annotations

import json

import numpy as np
import pytest

from vllm_expert_offload import cli
from vllm_expert_offload.placement import ModelIdentity, RoutingCounts
from vllm_expert_offload.testing.engine import EngineSpec, generate_greedy
from vllm_expert_offload.testing.tiny_models import build_tiny_model

from support.engine_model import CROP_OVERRIDES, CROP_PROMPT_SEED, MAX_TOKENS, PROMPT_SEED, Model, prompts_for
from support.reference_twin import checked_dense_twin

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def model(request) -> Model:
    return Model.get(request.param)


def _offload(host_fraction: float | None) -> dict:
    return {} if host_fraction is None else {"additional_config": {"expert_offload": {"host_fraction": host_fraction}}}


@pytest.mark.inductor
@pytest.mark.parametrize(("block_size", "host_fraction", "enforce_eager"),
                         [(64, 1.0, False), (128, 0.5, False), (128, None, True)])
def test_greedy_tokens_match_dense_reference(model: Model, block_size: int, host_fraction: float | None,
                                             enforce_eager: bool) -> None:
    """Placement must never change results: all experts on host, half, and none give the reference tokens, in
    vLLM's default compiled mode and (one run per architecture) with --enforce-eager."""
    model.check(block_size=block_size, enforce_eager=enforce_eager, **_offload(host_fraction))


@pytest.mark.parametrize("block_size", [32, 256])
def test_other_block_sizes_with_every_expert_in_host_tier(block_size: int) -> None:
    """The longest prompt spans more than three blocks at every size."""
    Model.get("qwen3_moe").check(block_size=block_size, **_offload(1.0))


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["compiled", "eager"])
def test_deepseek_v3_matches_stock_vllm_on_dense_twin(enforce_eager: bool) -> None:
    """DeepSeek-V3 style: shared experts, a dense first layer, sigmoid routing with a correction bias and a
    routed scaling factor. The reference here is stock vLLM on the dense twin, not HF: vLLM's own DeepSeek
    model and HF's already disagree on this tiny config at the first token, plugin or not (measured), so
    only vLLM-vs-vLLM isolates what the plugin does. vLLM's CPU MLA backend takes only head size 576
    (kv_lora_rank 512 + rope 64), far too big for a tiny fixture; with MLA disabled vLLM runs the same
    weights through plain attention (kv_b_proj expanded).

    Compiled, Dynamo traces the model (the plugin's ops stay opaque) and vLLM's CPU CI backend runs the graph
    without Inductor: vLLM 0.32's Inductor graph for this model schedules the router gate's `_C.onednn_mm`, an
    out-variant op, after the sigmoid that reads its output once the plugin's MoE op is in the graph (read from
    TORCH_LOGS=output_code; garbage routing, different tokens each run), a vLLM CPU bug that no GPU graph has
    (docs/troubleshooting.md)."""
    exl3 = str(build_tiny_model(None, "deepseek_v3"))
    env = {"VLLM_MLA_DISABLE": "1", **({} if enforce_eager else {"VLLM_CPU_CI_ENV": "1"})}
    offload = {"expert_offload": {"host_fraction": 0.5}}
    prompts = prompts_for(PROMPT_SEED)
    mode = {"extra_env": env, "enforce_eager": enforce_eager}  # both in the same mode: vLLM against vLLM
    reference = generate_greedy(EngineSpec(str(checked_dense_twin(exl3)), prompts, MAX_TOKENS, **mode))
    got = generate_greedy(EngineSpec(exl3, prompts, MAX_TOKENS, additional_config=offload, **mode))
    assert got == reference


@pytest.mark.inductor
def test_tensor_parallel_2_matches_tensor_parallel_1() -> None:
    model = Model.get("qwen3_moe")
    tp1 = model.check(block_size=64, **_offload(1.0))
    assert model.generate(block_size=64, tensor_parallel_size=2, **_offload(1.0)) == tp1


@pytest.mark.parametrize("block_size", [128, 256])
def test_tensor_parallel_2_other_block_sizes_with_every_expert_in_host_tier(block_size: int) -> None:
    """The seeds' crash sizes and above at TP 2 (64 is the TP 1 comparison's; 32 is served at TP 1 above: a TP 2
    start there cost 43 s of CI's 45 minutes and guarded nothing the two others do not)."""
    Model.get("qwen3_moe").check(block_size=block_size, tensor_parallel_size=2, **_offload(1.0))


def test_expert_share_cutting_through_a_128_block_at_tensor_parallel_2() -> None:
    """Rank 1's 160 expert channels start at 160, inside the block [128, 256): it keeps blocks [128, 384) of each
    expert and crops at offset 32, short of the padding; half the experts are in the host tier."""
    Model.get("qwen3_moe", CROP_OVERRIDES, CROP_PROMPT_SEED).check(block_size=64, tensor_parallel_size=2,
                                                                   **_offload(0.5))


def test_plan_from_the_plan_command_serves_reference_tokens(tmp_path) -> None:
    """plan --gpu-budget-gib with routing statistics -> plan file -> serving with it: the hottest experts
    (by the statistics) fill the budget, and tokens stay those of the reference."""
    model = Model.get("qwen3_moe")
    stats, plan = tmp_path / "stats.json", tmp_path / "plan.json"
    # Statistics carry the routing geometry (TP size and byte sizes do not matter for them); layer 1's experts
    # are all hotter than layer 0's.
    identity = ModelIdentity("Qwen3MoeForCausalLM", 2, 8, (0, 1), 1, "")
    RoutingCounts(np.arange(16).reshape(2, 8), (0, 1), identity).save(stats)
    record_bytes = 3 * 8 * 16 * 48 * 2  # one expert: three K=3 trellises of 8x16 tiles, 48 int16 each, page-aligned
    budget_gib = 5 * record_bytes / 2**30
    assert cli.main(["plan", "--model", model.exl3, "--gpu-budget-gib", repr(budget_gib), "--stats", str(stats),
                     "--out", str(plan)]) == 0
    assert json.loads(plan.read_text())["gpu_experts"] == {"0": [], "1": [3, 4, 5, 6, 7]}
    model.check(block_size=128, additional_config={"expert_offload": {"plan": str(plan)}})
