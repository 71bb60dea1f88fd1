"""Load generation for `bench`: agent-like streamed completions against any OpenAI-compatible server.

Agents send one long system prefix (tools, instructions) shared by every session plus short per-turn text, so the
prefix cache and concurrent decode are what decide how many of them a server carries. Prompts are sized in the
server's own tokens: one probe measures tokens per filler word, so no tokenizer is needed on the client.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from openai import AsyncOpenAI

_WORDS = ("read the file then call the tool with its path and report each error found in the output "
          "before you change any line of code or write a test").split()


def filler(words: int, offset: int = 0) -> str:
    """`words` words of plain agent-like text (deterministic, so a shared prefix is byte-identical)."""
    return " ".join(itertools.islice(itertools.cycle(_WORDS), offset, offset + words))


@dataclass(frozen=True)
class Timing:
    """One streamed request: time to first token, tokens generated, and first-to-last token time."""

    ttft_s: float
    tokens: int
    decode_s: float
    prompt_tokens: int

    @property
    def decode_tok_s(self) -> float | None:
        """Per-stream decode speed, TTFT excluded: (tokens - 1) / (t_last - t_first)."""
        return (self.tokens - 1) / self.decode_s if self.tokens > 1 and self.decode_s > 0 else None


async def timed_completion(client: AsyncOpenAI, model: str, prompt: str, max_tokens: int) -> Timing:
    """Stream one completion; each chunk with a choice is a token event, usage gives the token counts."""
    start = time.perf_counter()
    first = last = None
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    usage = None
    async for chunk in stream:
        if chunk.choices:
            last = time.perf_counter()
            first = first or last
        usage = chunk.usage or usage
    if first is None or usage is None:
        raise RuntimeError("the server streamed no tokens or no usage (stream_options include_usage)")
    return Timing(first - start, usage.completion_tokens, last - first, usage.prompt_tokens)


@dataclass(frozen=True)
class LevelResult:
    concurrency: int
    median_tok_s: float
    p5_tok_s: float
    ttft_median_s: float
    ttft_p95_s: float
    aggregate_tok_s: float
    mean_prompt_tokens: float


class AgentLoad:
    """Sessions sharing one system prefix of about `prefix_tokens` server tokens, each turn adding unique text."""

    def __init__(self, client: AsyncOpenAI, model: str, prefix_tokens: int, output_tokens: int,
                 on_request: Callable[[], None] = lambda: None) -> None:
        self.client, self.model, self.output_tokens = client, model, output_tokens
        self.prefix_tokens, self.on_request = prefix_tokens, on_request
        self.tokens_per_word = 1.0
        self.prefix = ""

    async def warm_up(self) -> None:
        """Measure tokens per filler word with one request (it also warms the server); build and send the prefix."""
        probe_words = 200
        timing = await timed_completion(self.client, self.model, filler(probe_words), 2)
        self.tokens_per_word = timing.prompt_tokens / probe_words
        self.prefix = filler(self.words(self.prefix_tokens))
        self.on_request()
        await self._request(self.prefix, 2)  # every session starts with the prefix cached, as a serving agent's would

    def words(self, tokens: int) -> int:
        return max(1, int(tokens / self.tokens_per_word))

    async def _request(self, prompt: str, max_tokens: int) -> Timing:
        timing = await timed_completion(self.client, self.model, prompt, max_tokens)
        self.on_request()
        return timing

    async def _session(self, name: str, turns: int) -> list[Timing]:
        timings = []
        for turn in range(turns):
            text = f"{self.prefix}\n\n[{name} turn {turn}] {filler(self.words(24), offset=turn + len(name))}"
            timings.append(await self._request(text, self.output_tokens))
        return timings

    async def level(self, concurrency: int, turns: int) -> LevelResult:
        """`concurrency` sessions of `turns` sequential requests each, all sessions at once."""
        start = time.perf_counter()
        sessions = (self._session(f"session {concurrency}.{i}", turns) for i in range(concurrency))
        runs = await asyncio.gather(*sessions)
        wall = time.perf_counter() - start
        timings = [t for run in runs for t in run]
        speeds = np.array([t.decode_tok_s for t in timings if t.decode_tok_s is not None])
        if speeds.size == 0:
            raise RuntimeError("no request produced two tokens: raise --output-tokens")
        ttft = np.array([t.ttft_s for t in timings])
        return LevelResult(
            concurrency, float(np.median(speeds)), float(np.percentile(speeds, 5)), float(np.median(ttft)),
            float(np.percentile(ttft, 95)), sum(t.tokens for t in timings) / wall,
            float(np.mean([t.prompt_tokens for t in timings])),
        )

    async def cold_and_cached_ttft(self, prefix_tokens: int, repeats: int) -> tuple[float, float, int]:
        """Median TTFT of a unique long prompt sent the first time (cold) and again (prefix cache hit).

        A random tag starts each prompt so its first block, and so every block after it, is new to the cache."""
        cold, cached, prompt_tokens = [], [], 0
        for _ in range(repeats):
            prompt = f"[{uuid.uuid4().hex}] {filler(self.words(prefix_tokens))}"
            first = await self._request(prompt, 1)
            cold.append(first.ttft_s)
            cached.append((await self._request(prompt, 1)).ttft_s)
            prompt_tokens = first.prompt_tokens
        return float(np.median(cold)), float(np.median(cached)), prompt_tokens
