"""A mixed pack served through `vllm serve` (its validation and planning are tested without an engine in
tests/exl3/test_mixed_packs.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_expert_offload.testing.tiny_models import build_tiny_model

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def mixed() -> Path:
    return build_tiny_model(None, "qwen3_moe", layer_bits={1: 2})  # as tests/exl3/test_mixed_packs.py's LAYER_BITS


def test_mixed_pack_serves_reference_tokens_with_experts_on_host(mixed: Path, tmp_path: Path) -> None:
    """`vllm serve` with the plugin, every routed expert in the host tier: the tiny mixed pack (EXL3 experts at
    K=3 and K=2, BF16 attention and lm_head) gives HF's greedy tokens on its dequantized twin."""
    import random

    from openai import OpenAI

    from vllm_expert_offload.testing.reference import compare_greedy, hf_greedy
    from vllm_expert_offload.testing.server import vllm_server

    from support.reference_twin import checked_dense_twin

    rng = random.Random(1234)
    prompts = [[rng.randrange(3, 700) for _ in range(n)] for n in (7, 90, 400)]
    max_tokens = 24
    reference = hf_greedy(str(checked_dense_twin(mixed)), prompts, max_tokens)
    offload = {"expert_offload": {"host_fraction": 1.0}}
    args = ["--block-size", "128", "--dtype", "float32", "--additional-config", json.dumps(offload)]
    log = tmp_path / "serve.log"
    with vllm_server(mixed, args, log_path=log) as server:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        name = client.models.list().data[0].id
        got = [
            client.completions.create(model=name, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0].token_ids
            for prompt in prompts
        ]
    result = compare_greedy(reference, got, min_steps=max_tokens)
    print(f"mixed pack via vllm serve: {result}")
    assert result.matched, str(result)
    text = log.read_text()
    assert "16 of 16 routed experts in the host tier" in text
