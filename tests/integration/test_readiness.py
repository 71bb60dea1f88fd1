"""Readiness smoke: one long request before an EXL3 engine is handed out; failures stop startup."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from vllm_expert_offload.integration.startup import readiness


def _config(quantization: str = "exl3", block: int = 64, max_len: int = 1024, batched: int = 64):
    model = SimpleNamespace(quantization=quantization, max_model_len=max_len, get_vocab_size=lambda: 1000)
    return SimpleNamespace(model_config=model, cache_config=SimpleNamespace(block_size=block),
                           scheduler_config=SimpleNamespace(max_num_batched_tokens=batched))


class FakeEngine:
    def __init__(self, fail_at_step: int | None = None, tokens: int = readiness.DECODE_STEPS) -> None:
        self.vllm_config = _config()
        self.fail_at_step, self.tokens = fail_at_step, tokens
        self.steps, self.calls, self.pending = 0, [], False

    def add_request(self, request_id, prompt, params) -> None:
        self.calls.append(("add", len(prompt["prompt_token_ids"]), params.max_tokens))
        self.pending = True

    def has_unfinished_requests(self) -> bool:
        return self.pending

    def step(self):
        self.steps += 1
        if self.steps == self.fail_at_step:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if self.steps < 3:
            return []
        self.pending = False
        return [SimpleNamespace(finished=True, outputs=[SimpleNamespace(token_ids=list(range(self.tokens)))])]

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache",))

    def collective_rpc(self, method: str) -> None:
        self.calls.append(("rpc", method))


def test_prompt_spans_more_than_two_blocks() -> None:
    prompt, params = readiness.smoke_request(_config(block=128))
    assert len(prompt["prompt_token_ids"]) == 2 * 128 + 1
    assert all(0 <= t < 1000 for t in prompt["prompt_token_ids"])
    assert params.max_tokens == readiness.DECODE_STEPS and params.temperature == 0.0


def test_prompt_fills_one_scheduler_step() -> None:
    """On a GPU the default step is thousands of tokens: the smoke runs the largest forward the server will."""
    prompt, _ = readiness.smoke_request(_config(block=16, max_len=8192, batched=2048))
    assert len(prompt["prompt_token_ids"]) == 2048


def test_prompt_capped_by_max_model_len() -> None:
    prompt, _ = readiness.smoke_request(_config(block=256, max_len=300))
    assert len(prompt["prompt_token_ids"]) == 300 - readiness.DECODE_STEPS


def test_not_our_model_no_smoke() -> None:
    assert readiness.smoke_request(_config(quantization="fp8")) is None


def test_switch(monkeypatch) -> None:
    monkeypatch.setenv(readiness.ENV, "0")
    assert readiness.smoke_request(_config()) is None
    monkeypatch.setenv(readiness.ENV, "no")
    with pytest.raises(ValueError, match=readiness.ENV):
        readiness.smoke_request(_config())


def test_success_resets_prefix_cache_and_routing_counts() -> None:
    engine = FakeEngine()
    readiness.run_sync(engine)
    assert engine.calls == [("add", 129, 4), ("reset_prefix_cache",), ("rpc", readiness.END_OF_STARTUP)]


def test_startup_counts_dropped_with_the_smoke_off_too(monkeypatch) -> None:
    """The one reset is spent before the engine is handed out whatever the switch says (a later caller, a
    dev-mode client, finds it spent); a model that is not ours is left alone."""
    monkeypatch.setenv(readiness.ENV, "0")
    engine = FakeEngine()
    readiness.run_sync(engine)
    assert engine.calls == [("rpc", readiness.END_OF_STARTUP)]
    other = FakeEngine()
    other.vllm_config = _config(quantization="fp8")
    readiness.run_sync(other)
    assert other.calls == []


def test_failure_stops_startup_with_its_cause() -> None:
    with pytest.raises(readiness.ReadinessError, match="illegal memory access") as err:
        readiness.run_sync(FakeEngine(fail_at_step=2))
    assert "129 prompt tokens" in str(err.value)


def test_short_generation_is_a_failure() -> None:
    with pytest.raises(readiness.ReadinessError, match="generated 1 tokens instead of 4"):
        readiness.run_sync(FakeEngine(tokens=1))


class FakeAsyncClient:
    """AsyncLLM as run_async uses it: a generate that finishes, and the two calls after it."""

    def __init__(self) -> None:
        self.vllm_config = _config()
        self.calls = []

    async def generate(self, prompt, params, request_id):
        self.calls.append(("generate", len(prompt["prompt_token_ids"])))
        yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(range(readiness.DECODE_STEPS)))])

    async def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache",))

    async def collective_rpc(self, method: str) -> None:
        self.calls.append(("rpc", method))


def test_only_the_first_of_several_api_servers_runs_the_smoke_and_drops_the_counts() -> None:
    """Several API servers share the engines (data parallelism's default is one per engine); a second drop would
    be refused by every worker, and a second smoke could be counted after the first server's drop."""
    first, second = FakeAsyncClient(), FakeAsyncClient()
    asyncio.run(readiness.run_async(first, client_index=0))
    asyncio.run(readiness.run_async(second, client_index=1))
    assert first.calls == [("generate", 129), ("reset_prefix_cache",), ("rpc", readiness.END_OF_STARTUP)]
    assert second.calls == []
