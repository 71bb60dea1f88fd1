"""`vllm serve` with the CPU expert tier (issue 41) on the CPU engine, started as users start it (compiled, no
--enforce-eager): three quarters of each layer's experts are host-resident, the tier computes misses, and the
tokens stay HF's greedy tokens on the dense twin, with the tier's reads on vLLM's own /metrics.

TP 1: split "all" (every miss the cache does not fill goes to the CPU) with the expert cache on, cores "auto".
TP 2: split "auto" (the cost model, from the start-up probe), each rank computing its own shard of a miss,
cores given (two ranks bound to the two cores leave "auto" nothing). A tier slower than the device path is
covered in process (tests/integration/test_cpu_tier_step.py): rates cannot be forced on a running engine."""

from __future__ import annotations

import json
import time

import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from vllm_expert_offload.testing.reference import compare_greedy, hf_greedy
from vllm_expert_offload.testing.server import vllm_server
from vllm_expert_offload.testing.tiny_models import build_tiny_model

from support.reference_twin import checked_dense_twin
from support.scrape import plugin_metrics

pytestmark = pytest.mark.engine
MAX_TOKENS = 16
PROMPT = "Serialize obj as a JSON formatted stream to fp."  # test_serve.py: wide reference margins at every step
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
LAYERS = (0, 1)
TIER = {1: {"split": "all"}, 2: {"split": "auto", "cpus": "0-1", "threads": 1}}


def _reads(metrics: dict, layer: int, tier: str) -> float:
    return metrics.get(("vllm_expert_offload_expert_reads_total", (("layer", str(layer)), ("tier", tier))), -1)


def _wait_for_cpu_reads(url: str, timeout_s: float = 60) -> dict:
    """The metrics once the poller has reported CPU-tier reads in every layer."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = plugin_metrics(url)
        if all(_reads(got, layer, "cpu") > 0 for layer in LAYERS):
            return got
        assert time.monotonic() < deadline, f"/metrics shows no CPU-tier reads: {got}"
        time.sleep(0.5)


@pytest.mark.parametrize("tp", [1, 2])
def test_cpu_tier_serves_hf_tokens_and_counts_its_reads(tmp_path, tp: int) -> None:
    model = build_tiny_model(None, "qwen3_moe")
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt_ids = tokenizer(PROMPT).input_ids
    reference = hf_greedy(str(checked_dense_twin(model)), [prompt_ids], MAX_TOKENS)

    offload = {"host_fraction": 0.75, "cpu_tier": TIER[tp]}
    if tp == 1:
        offload["dynamic"] = {"policy": "lru"}
    args = ["--block-size", "64", "--dtype", "float32", "--additional-config",
            json.dumps({"expert_offload": offload})]
    log = tmp_path / "serve.log"
    with vllm_server(model, args, tensor_parallel_size=tp, log_path=log) as server:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        name = client.models.list().data[0].id
        completion = client.completions.create(model=name, prompt=prompt_ids, **GREEDY)
        metrics = _wait_for_cpu_reads(server.url)
    result = compare_greedy(reference, [completion.choices[0].token_ids], min_steps=MAX_TOKENS)
    assert result.matched, str(result)
    text = log.read_text()
    assert text.count("expert_offload.cpu_tier (") == tp, "the tier's start-up line, once per rank"
    assert f"split {TIER[tp]['split']}:" in text and "rates from the start-up probe" in text
    for layer in LAYERS:
        assert metrics[("vllm_expert_offload_cpu_tier_busy_seconds_total", (("layer", str(layer)),))] > 0
