"""`vllm serve` with the plugin, half of each layer's experts in the host tier, at tensor parallel 2,
queried with the openai client: completions and chat completions give the dense reference's tokens."""

from __future__ import annotations

import json
import urllib.request

import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from reference_twin import checked_dense_twin
from vllm_expert_offload.integration.startup.worker_rpc import SAVE_STATS
from vllm_expert_offload.placement import RoutingCounts
from vllm_expert_offload.testing.reference import compare_greedy, hf_greedy
from vllm_expert_offload.testing.server import vllm_server
from vllm_expert_offload.testing.tiny_models import build_tiny_model

pytestmark = pytest.mark.engine
MAX_TOKENS = 16
# Picked for wide reference margins: every one of the 16 greedy steps of both is decided by a top-1/top-2 logit gap
# of at least 7.2e-2 (72 times compare_greedy's 1e-3 cut-off), so both are compared in full.
COMPLETION_PROMPT = "Serialize obj as a JSON formatted stream to fp."
CHAT_MESSAGES = [{"role": "user", "content": "Tell me about itertools."}]
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}


def test_serve_completions_and_chat_with_host_tier_at_tp2(tmp_path) -> None:
    model = build_tiny_model(None, "qwen3_moe")
    twin = str(checked_dense_twin(model))
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt_ids = tokenizer(COMPLETION_PROMPT).input_ids
    chat_text = tokenizer.apply_chat_template(CHAT_MESSAGES, add_generation_prompt=True, tokenize=False)
    chat_ids = tokenizer(chat_text, add_special_tokens=False).input_ids  # as vLLM renders, then tokenizes
    reference = hf_greedy(twin, [prompt_ids, chat_ids], MAX_TOKENS)

    stats = tmp_path / "stats.json"
    offload = {"expert_offload": {"host_fraction": 0.5, "record_stats": str(tmp_path / "at-exit.json")}}
    args = ["--block-size", "64", "--dtype", "float32", "--additional-config", json.dumps(offload)]
    log = tmp_path / "serve.log"
    dev_mode = {"VLLM_SERVER_DEV_MODE": "1"}  # exposes vLLM's /collective_rpc, to save statistics on request
    with vllm_server(model, args, tensor_parallel_size=2, log_path=log, extra_env=dev_mode) as base_url:
        client = OpenAI(base_url=f"{base_url}/v1", api_key="unused")
        name = client.models.list().data[0].id
        completion = client.completions.create(model=name, prompt=prompt_ids, **GREEDY)
        chat = client.chat.completions.create(model=name, messages=CHAT_MESSAGES, **GREEDY)
        body = json.dumps({"method": SAVE_STATS, "args": [str(stats)]}).encode()
        request = urllib.request.Request(f"{base_url}/collective_rpc", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert json.loads(response.read())["results"] == [str(stats), None]  # TP rank 0 writes, rank 1 not

    got = [completion.choices[0].token_ids, chat.choices[0].token_ids]
    result = compare_greedy(reference, got, min_steps=MAX_TOKENS)
    print(f"serve: {result}; smallest reference margin per prompt {[f'{min(m):.2e}' for m in reference.margins]}")
    assert result.matched, str(result)
    assert chat.choices[0].message.content == tokenizer.decode(got[1], skip_special_tokens=True)
    placements = [line for line in log.read_text().splitlines() if "expert placement" in line]
    assert len(placements) == 2 and all("8 of 16 routed experts in the host tier" in p for p in placements)
    # Each processed token (prompt, then every generated token but the last) picks 2 experts in each of 2 layers;
    # the readiness smoke ran before and is not counted.
    processed = len(prompt_ids) + len(chat_ids) + 2 * (MAX_TOKENS - 1)
    assert RoutingCounts.load(stats).counts.sum() == 2 * 2 * processed
