"""`vllm serve` with the plugin, half of each layer's experts in the host tier, at tensor parallel 2,
queried with the openai client: completions and chat completions give the dense reference's tokens, and routing
statistics arrive while serving (every interval, on SIGUSR1, at shutdown) without vLLM's dev mode."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from vllm_expert_offload.placement import RoutingCounts
from vllm_expert_offload.testing.reference import compare_greedy, hf_greedy
from vllm_expert_offload.testing.server import vllm_server
from vllm_expert_offload.testing.tiny_models import build_tiny_model

from support.reference_twin import checked_dense_twin
from support.router_counts import hf_router_counts

pytestmark = pytest.mark.engine
MAX_TOKENS = 16
# Picked for wide reference margins: every one of the 16 greedy steps of both is decided by a top-1/top-2 logit gap
# of at least 7.2e-2 (72 times compare_greedy's 1e-3 cut-off), so both are compared in full.
COMPLETION_PROMPT = "Serialize obj as a JSON formatted stream to fp."
CHAT_MESSAGES = [{"role": "user", "content": "Tell me about itertools."}]
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
SAVE_EVERY_S = 1


def _next_save(path: Path, after: float, timeout_s: float = 120) -> RoutingCounts:
    """The first statistics file written after time `after` (interval end, unix seconds)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and (counts := RoutingCounts.load(path)).interval[1] > after:
            return counts
        time.sleep(0.05)
    raise AssertionError(f"no statistics written to {path} after {after} within {timeout_s}s")


def _wait_for_line(log: Path, text: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text():
        assert time.monotonic() < deadline, f"{text!r} not logged within {timeout_s}s"
        time.sleep(0.05)


def _no_dev_mode_rpc(base_url: str) -> bool:
    request = urllib.request.Request(f"{base_url}/collective_rpc", b"{}", {"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(request, timeout=30)
    except urllib.error.HTTPError as err:
        return err.code == 404
    return False


def test_serve_completions_and_chat_with_host_tier_at_tp2(tmp_path) -> None:
    model = build_tiny_model(None, "qwen3_moe")
    twin = str(checked_dense_twin(model))
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt_ids = tokenizer(COMPLETION_PROMPT).input_ids
    chat_text = tokenizer.apply_chat_template(CHAT_MESSAGES, add_generation_prompt=True, tokenize=False)
    chat_ids = tokenizer(chat_text, add_special_tokens=False).input_ids  # as vLLM renders, then tokenizes
    reference = hf_greedy(twin, [prompt_ids, chat_ids], MAX_TOKENS)

    stats = tmp_path / "stats.json"
    record = {"record_stats": str(stats), "record_stats_interval_s": SAVE_EVERY_S}
    offload = {"expert_offload": {"host_fraction": 0.5, **record}}
    args = ["--block-size", "64", "--dtype", "float32", "--additional-config", json.dumps(offload)]
    log = tmp_path / "serve.log"
    with vllm_server(model, args, tensor_parallel_size=2, log_path=log) as server:
        assert _no_dev_mode_rpc(server.url)
        before = _next_save(stats, after=0)  # saved while idle: the readiness smoke is not counted
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        name = client.models.list().data[0].id

        def serve_both():
            completion = client.completions.create(model=name, prompt=prompt_ids, **GREEDY)
            return completion, client.chat.completions.create(model=name, messages=CHAT_MESSAGES, **GREEDY)

        reads = []
        with ThreadPoolExecutor(1) as pool:
            requests = pool.submit(serve_both)
            while not requests.done():  # read while requests are in flight: never a partial file
                reads.append(RoutingCounts.load(stats))
                time.sleep(0.02)
            completion, chat = requests.result()
        assert reads, "the statistics file was never read while requests were in flight"
        served = _next_save(stats, after=time.time())
        os.kill(server.pid, signal.SIGUSR1)
        _wait_for_line(log, "routing statistics saved to ['%s'] (SIGUSR1)" % stats)
        stopping = time.time()
        os.kill(server.pid, signal.SIGTERM)  # how docker or kubernetes stop it
        _wait_for_line(log, "routing statistics saved to ['%s'] (at shutdown)" % stats)
    at_shutdown = RoutingCounts.load(stats)
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
    assert before.tokens == 0 and before.counts.sum() == 0
    for earlier, later in zip([before, *reads], [*reads, served]):  # counts accumulate across saves
        assert (later.counts >= earlier.counts).all() and later.interval[0] == before.interval[0]
    assert served.tokens == processed and served.counts.sum() == 2 * 2 * processed
    sequences = [prompt_ids + got[0][:-1], chat_ids + got[1][:-1]]  # the last generated token is never routed
    np.testing.assert_array_equal(served.counts, hf_router_counts(twin, sequences, 8))
    assert at_shutdown.interval[1] >= stopping and np.array_equal(at_shutdown.counts, served.counts)


def test_unwritable_record_stats_refused_before_an_engine_starts(tmp_path) -> None:
    model = build_tiny_model(None, "qwen3_moe")
    path = tmp_path / "no-such-dir" / "stats.json"
    offload = {"expert_offload": {"host_fraction": 0.5, "record_stats": str(path)}}
    log = tmp_path / "serve.log"
    with pytest.raises(RuntimeError, match="did not become healthy"):
        with vllm_server(model, ["--additional-config", json.dumps(offload)], log_path=log):
            pass
    text = log.read_text()
    assert f"--additional-config expert_offload.record_stats: directory {path.parent} of {path} does not exist" in text
    assert "EngineCore" not in text and "expert placement" not in text  # refused in the API server, in seconds
