"""`vllm serve` with the GPU tier as an expert cache (issue 26) on the CPU engine: a quarter of each layer's experts
fit in the slots, so serving a prompt must fill and evict, and the tokens stay HF's greedy tokens on the dense twin;
the fills arrive on vLLM's own /metrics. At TP 2 the rank check (VLLM_EXPERT_OFFLOAD_CHECK_RANKS) compares the
two ranks' caches after every layer's forward, so a divergence would fail the request."""

from __future__ import annotations

import json
import time

import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from vllm_expert_offload.integration.methods.rank_check import CHECK_RANKS_ENV
from vllm_expert_offload.testing.reference import compare_greedy, hf_greedy
from vllm_expert_offload.testing.server import vllm_server
from vllm_expert_offload.testing.tiny_models import build_tiny_model

from support.reference_twin import checked_dense_twin
from support.scrape import plugin_metrics

pytestmark = pytest.mark.engine
MAX_TOKENS = 16
PROMPT = "Serialize obj as a JSON formatted stream to fp."  # test_serve.py: wide reference margins at every step
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
EXPERTS, SLOTS, LAYERS = 8, 2, (0, 1)  # per layer


def _reads(metrics: dict, layer: int) -> float:
    """Token x expert reads of `layer`, both tiers; -1 before the first poll has reported."""
    keys = [("vllm_expert_offload_expert_reads_total", (("layer", str(layer)), ("tier", t))) for t in ("gpu", "host")]
    return sum(metrics[k] for k in keys) if all(k in metrics for k in keys) else -1


def _wait_for_reads(url: str, reads: list[float], timeout_s: float = 60) -> dict:
    """The metrics once the poller has seen at least reads[i] token x expert reads in layer i."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = plugin_metrics(url)
        seen = [_reads(got, layer) for layer in LAYERS]
        if all(s >= r for s, r in zip(seen, reads)):
            return got
        assert time.monotonic() < deadline, f"/metrics reads {seen} stayed below {reads}"
        time.sleep(0.5)


@pytest.mark.parametrize("tp", [1, 2])
def test_expert_cache_serves_hf_tokens_while_filling(tmp_path, tp: int) -> None:
    model = build_tiny_model(None, "qwen3_moe")
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt_ids = tokenizer(PROMPT).input_ids
    reference = hf_greedy(str(checked_dense_twin(model)), [prompt_ids], MAX_TOKENS)

    offload = {"expert_offload": {"host_fraction": 1 - SLOTS / EXPERTS,
                                  "dynamic": {"policy": "decayed-lfu", "half_life_tokens": 4}}}
    args = ["--block-size", "64", "--dtype", "float32", "--additional-config", json.dumps(offload)]
    log = tmp_path / "serve.log"
    env = {CHECK_RANKS_ENV: "1"} if tp > 1 else {}
    with vllm_server(model, args, tensor_parallel_size=tp, log_path=log, extra_env=env) as server:
        before = _wait_for_reads(server.url, [0] * len(LAYERS))  # the readiness smoke's reads, once polled
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        name = client.models.list().data[0].id
        completion = client.completions.create(model=name, prompt=prompt_ids, **GREEDY)
        processed = len(prompt_ids) + MAX_TOKENS - 1  # the last generated token is never routed
        after = _wait_for_reads(server.url, [_reads(before, layer) + 2 * processed * tp for layer in LAYERS])
    got = [completion.choices[0].token_ids]
    result = compare_greedy(reference, got, min_steps=MAX_TOKENS)
    assert result.matched, str(result)
    text = log.read_text()
    assert text.count("dynamic: the GPU tier is 4 expert slots") == tp  # 2 per layer, 2 layers, each rank
    for layer in map(str, LAYERS):
        key = (("layer", layer),)
        fills, evictions = (after[(f"vllm_expert_offload_cache_{what}_total", key)]
                            - before[(f"vllm_expert_offload_cache_{what}_total", key)]
                            for what in ("fills", "evictions"))
        assert fills > 0 and evictions > 0, f"layer {layer}: {fills} fills, {evictions} evictions while serving"
        reads = {t: after[("vllm_expert_offload_expert_reads_total", (("layer", layer), ("tier", t)))]
                 for t in ("gpu", "host")}
        assert reads["host"] > 0 and reads["gpu"] > 0
        assert after[("vllm_expert_offload_host_read_bytes_total", key)] > 0
        rate = after[("vllm_expert_offload_cache_hit_rate", key)]
        assert rate == pytest.approx(reads["gpu"] / (reads["gpu"] + reads["host"]))
    assert after[("vllm_expert_offload_tier_bytes", (("tier", "gpu"),))] > 0
    assert after[("vllm_expert_offload_tier_bytes", (("tier", "host"),))] > after[
        ("vllm_expert_offload_tier_bytes", (("tier", "gpu"),))]  # every expert has a host record
