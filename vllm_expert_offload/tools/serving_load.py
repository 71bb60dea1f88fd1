"""Load generation for `bench`: agent-like streamed completions against any OpenAI-compatible server.

Agents send one long system prefix (tools, instructions) shared by every session plus short per-turn text, so the
prefix cache and concurrent decode are what decide how many of them a server carries. Prompts are sized in the
server's own tokens: one probe measures tokens per filler word, so no tokenizer is needed on the client.

Completions are streamed with aiohttp, the client vLLM's own `vllm bench serve` streams with, their server-sent
events parsed here: client work before a request is sent and after a chunk arrives lies inside each TTFT, and on the
tiny CPU server, requests interleaved with vLLM's client, the OpenAI SDK measured a median TTFT of 39 ms where vLLM's
client measured 32 (httpx 47 where aiohttp 43 under more load); no server made its user wait that time.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Literal

import aiohttp
import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from .errors import ToolInputError, ToolRunError

_WORDS = ("read the file then call the tool with its path and report each error found in the output "
          "before you change any line of code or write a test").split()


def filler(words: int, offset: int = 0) -> str:
    """`words` words of plain agent-like text (deterministic, so a shared prefix is byte-identical)."""
    return " ".join(itertools.islice(itertools.cycle(_WORDS), offset, offset + words))


@dataclass(frozen=True)
class Timing:
    """One streamed request as its user saw it: each chunk's arrival time and the tokens that chunk carried.

    Tokens are counted per chunk (from the chunk's own usage or logprobs), never as the final usage over the chunks'
    times: vLLM's output collector merges tokens the client has not yet taken into one chunk, and counting a
    burst's tokens against the gaps between single chunks makes a stream look faster than it was."""

    ttft_s: float
    total_s: float  # from sending the request to its last chunk
    chunk_tokens: tuple[int, ...]
    decode_s: float  # first chunk to last chunk
    prompt_tokens: int

    @property
    def tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def decode_tokens(self) -> int:
        """Tokens that arrived after the first chunk: the ones the decode time was spent on."""
        return self.tokens - self.chunk_tokens[0]

    @property
    def decode_tok_s(self) -> float | None:
        """Per-stream decode speed, TTFT excluded: tokens after the first chunk / (t_last - t_first)."""
        return self.decode_tokens / self.decode_s if self.decode_tokens > 0 and self.decode_s > 0 else None

    @property
    def end_to_end_tok_s(self) -> float:
        """What the stream's user got: every token over the time since the request was sent."""
        return self.tokens / self.total_s

    @property
    def merged_chunks(self) -> int:
        """Chunks carrying several tokens: the server fell behind its engine and sent a backlog at once."""
        return sum(1 for n in self.chunk_tokens if n > 1)


TokenCounting = Literal["usage", "logprobs"]


def _chunk_tokens(chunk: dict, counting: TokenCounting, previous_total: int) -> int:
    """Tokens one chunk carries: the growth of its cumulative usage, or the number of logprob entries."""
    if counting == "usage":
        if chunk.get("usage") is None:
            raise ToolInputError("the server sent a token chunk without usage although continuous_usage_stats "
                                 "was requested: tokens per chunk cannot be counted")
        return chunk["usage"]["completion_tokens"] - previous_total
    logprobs = chunk["choices"][0].get("logprobs")
    if logprobs is None or logprobs.get("tokens") is None:
        raise ToolInputError("the server sent a token chunk without the requested logprobs: tokens per chunk "
                             "cannot be counted")
    return len(logprobs["tokens"])


async def _events(session: aiohttp.ClientSession, base_url: str, body: dict) -> AsyncIterator[dict]:
    """The JSON events of one streamed completion; an HTTP error status or an error event is refused with the
    server's message."""
    async with session.post(f"{base_url}/v1/completions", json=body) as response:
        if response.status != 200:
            raise ToolRunError(f"the server answered a completion with HTTP {response.status}: "
                               f"{(await response.text(errors='replace'))[:500]}")
        async for raw in response.content:  # one line at a time
            line = raw.decode().strip()
            if not line.startswith("data:") or (data := line[5:].strip()) == "[DONE]":
                continue
            event = json.loads(data)
            if "error" in event:
                raise ToolRunError(f"the server ended a completion with an error: {event['error']}")
            yield event


async def timed_completion(session: aiohttp.ClientSession, base_url: str, model: str, prompt: str, max_tokens: int,
                           counting: TokenCounting = "usage") -> Timing:
    """Stream one completion, counting each chunk's tokens the way `counting` says (see `probe_token_counting`)."""
    per_chunk = ({"stream_options": {"include_usage": True, "continuous_usage_stats": True}} if counting == "usage"
                 else {"stream_options": {"include_usage": True}, "logprobs": 0})
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, **per_chunk}
    first = last = None
    counts: list[int] = []
    usage = None
    start = time.perf_counter()
    # aclosing: a chunk refused mid-stream closes the connection at once
    async with contextlib.aclosing(_events(session, base_url, body)) as events:
        async for chunk in events:
            if chunk.get("choices") and (count := _chunk_tokens(chunk, counting, sum(counts))) > 0:
                last = time.perf_counter()  # a chunk without tokens (a finish reason alone) is no token event
                first = first or last
                counts.append(count)
            usage = chunk.get("usage") or usage
    if first is None or not counts or usage is None:
        raise ToolRunError("the server streamed no tokens or no usage (stream_options include_usage)")
    if sum(counts) != usage["completion_tokens"]:
        raise ToolRunError(f"the chunks carried {sum(counts)} tokens but the final usage says "
                           f"{usage['completion_tokens']}: tokens per chunk cannot be trusted")
    return Timing(first - start, last - start, tuple(counts), last - first, usage["prompt_tokens"])


async def probe_token_counting(session: aiohttp.ClientSession, base_url: str, model: str, prompt: str
                               ) -> tuple[TokenCounting, Timing]:
    """How this server lets a client count tokens per chunk: vLLM's continuous usage, else logprobs, else refused.

    Without either, a chunk's token count is a guess, and a per-stream speed built on guesses can be impossible."""
    reasons = []
    for counting in ("usage", "logprobs"):
        try:
            return counting, await timed_completion(session, base_url, model, prompt, 4, counting)
        except ToolInputError as error:
            reasons.append(f"{counting}: {error}")
    raise ToolInputError("bench cannot count tokens per chunk on this server, so it would report speeds it cannot "
                         "stand behind; it offers neither stream_options.continuous_usage_stats nor logprobs "
                         f"({'; '.join(reasons)})")


@dataclass(frozen=True)
class ServerCheck:
    """The level's per-stream decode rates summed, against the server's own generated-token counter."""

    streams_tok_s: float  # sessions x the median request's decode rate: the per-stream figure summed
    server_tok_s: float  # vllm:generation_tokens_total's growth over the level's decode time
    server_tokens: float
    client_tokens: int

    @property
    def ok(self) -> bool:
        """Streams cannot together decode faster than the server generated, nor receive more than it generated."""
        return (self.streams_tok_s <= self.server_tok_s * (1 + SERVER_CHECK_TOLERANCE)
                and self.client_tokens <= self.server_tokens)


# Sessions' decode windows and the level's decode time are measured on the client a few ms apart; beyond this
# share the streams claim speed the server did not generate.
SERVER_CHECK_TOLERANCE = 0.15
GENERATION_COUNTER = "vllm:generation_tokens_total"


async def generated_tokens(base_url: str) -> float | None:
    """The server's vllm:generation_tokens_total (summed over its label sets), None if /metrics has no such counter."""
    async with httpx.AsyncClient(timeout=10) as http:
        response = await http.get(f"{base_url}/metrics")
    if response.status_code != 200:
        return None
    values = [sample.value for family in text_string_to_metric_families(response.text)
              for sample in family.samples if sample.name == GENERATION_COUNTER]
    return sum(values) if values else None


@dataclass(frozen=True)
class LevelResult:
    concurrency: int
    median_tok_s: float | None  # decode rate; None when no request decoded after its first chunk
    p5_tok_s: float | None
    median_end_to_end_tok_s: float
    p5_end_to_end_tok_s: float
    ttft_median_s: float
    ttft_p95_s: float
    aggregate_tok_s: float
    merged_chunks: int
    chunks: int
    mean_prompt_tokens: float
    server_check: ServerCheck | None  # None when the server exposes no generated-token counter

    @property
    def failed(self) -> str | None:
        """Why this level's figures are not a result, or None when they are."""
        if self.median_tok_s is None:
            return "no request received a token after its first chunk: the decode rate is unmeasured"
        if self.server_check is not None and not self.server_check.ok:
            check = self.server_check
            return (f"streams claim {check.streams_tok_s:.1f} tok/s together and received {check.client_tokens} "
                    f"tokens; the server generated {check.server_tok_s:.1f} tok/s ({check.server_tokens:.0f} tokens)")
        return None


class AgentLoad:
    """Sessions sharing one system prefix of about `prefix_tokens` server tokens, each turn adding unique text."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str, prefix_tokens: int,
                 output_tokens: int, on_request: Callable[[], None] = lambda: None) -> None:
        self.session, self.base_url, self.model, self.output_tokens = session, base_url, model, output_tokens
        self.prefix_tokens, self.on_request = prefix_tokens, on_request
        self.tokens_per_word = 1.0
        self.prefix = ""
        self.counting: TokenCounting = "usage"

    async def warm_up(self) -> None:
        """Find how the server lets tokens be counted per chunk and measure tokens per filler word with one request
        (it also warms the server); build and send the prefix."""
        probe_words = 200
        self.counting, timing = await probe_token_counting(self.session, self.base_url, self.model, filler(probe_words))
        self.tokens_per_word = timing.prompt_tokens / probe_words
        self.prefix = filler(self.words(self.prefix_tokens))
        self.on_request()
        await self._request(self.prefix, 2)  # every session starts with the prefix cached, as a serving agent's would

    def words(self, tokens: int) -> int:
        return max(1, int(tokens / self.tokens_per_word))

    async def _request(self, prompt: str, max_tokens: int) -> Timing:
        timing = await timed_completion(self.session, self.base_url, self.model, prompt, max_tokens, self.counting)
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
        counter_before = await generated_tokens(self.base_url)
        start = time.perf_counter()
        sessions = (self._session(f"session {concurrency}.{i}", turns) for i in range(concurrency))
        runs = await asyncio.gather(*sessions)
        wall = time.perf_counter() - start
        counter_after = await generated_tokens(self.base_url)
        timings = [t for run in runs for t in run]
        speeds = np.array([t.decode_tok_s for t in timings if t.decode_tok_s is not None])
        end_to_end = np.array([t.end_to_end_tok_s for t in timings])
        ttft = np.array([t.ttft_s for t in timings])
        check = None
        if counter_before is not None and counter_after is not None:
            check = server_check(runs, wall, counter_after - counter_before)
        return LevelResult(
            concurrency, float(np.median(speeds)) if speeds.size else None,
            float(np.percentile(speeds, 5)) if speeds.size else None,
            float(np.median(end_to_end)), float(np.percentile(end_to_end, 5)),
            float(np.median(ttft)), float(np.percentile(ttft, 95)), sum(t.tokens for t in timings) / wall,
            sum(t.merged_chunks for t in timings), sum(len(t.chunk_tokens) for t in timings),
            float(np.mean([t.prompt_tokens for t in timings])), check,
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


def server_check(runs: list[list[Timing]], wall_s: float, server_tokens: float) -> ServerCheck:
    """The level's printed per-stream figure summed over its streams (sessions x the median request's decode rate)
    against the server's counter over the level's decode time.

    The median request, not each session's tokens over its decode time: a session's total hides one request that
    got its tokens in a burst, and the median request's rate is the figure `bench` prints. The decode time is the
    level's wall time less the median session's wait for single-token first chunks (prefill). A first chunk carrying
    several tokens means decode steps ran during that wait, so that wait stays in: a stream that got a backlog at
    once cannot push the server's rate up by the time the backlog hid."""
    rates = [t.decode_tok_s for timings in runs for t in timings if t.decode_tok_s is not None]
    waits = [sum(t.ttft_s for t in timings if t.chunk_tokens[0] == 1) for timings in runs]
    decode_wall = wall_s - float(np.median(waits))
    return ServerCheck(len(runs) * float(np.median(rates)) if rates else 0.0, server_tokens / decode_wall,
                       server_tokens, sum(t.tokens for timings in runs for t in timings))
