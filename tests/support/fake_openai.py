"""An in-process OpenAI-compatible streaming server whose chunk timing and token grouping a test scripts.

vLLM's API server merges tokens the client has not yet taken into one chunk when it falls behind its engine; this
fake reproduces that (and servers without per-chunk counts, and a /metrics counter that disagrees) on a thread of
the test process, in milliseconds, with no engine.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from aiohttp import web

# (seconds to wait before the chunk, tokens it carries) for a request of `max_tokens` tokens.
Script = Callable[[int], list[tuple[float, int]]]


def steady(first_s: float, gap_s: float) -> Script:
    """One token per chunk: the first after `first_s`, then one every `gap_s`."""
    return lambda n: [(first_s, 1)] + [(gap_s, 1)] * (n - 1)


def backlog_first(first_s: float, burst: int, gap_s: float) -> Script:
    """The server fell behind before its first chunk: `burst` tokens arrive together, then single ones."""
    return lambda n: [(first_s, min(burst, n))] + [(gap_s, 1)] * max(0, n - burst)


def stall_mid_stream(gap_s: float, stall_s: float, burst: int) -> Script:
    """Steady chunks, then a stall after which `burst` tokens come as one chunk (what issue 40 saw), then steady."""
    def script(n: int) -> list[tuple[float, int]]:
        half = (n - burst) // 2
        return [(gap_s, 1)] * half + [(stall_s, burst)] + [(gap_s, 1)] * (n - burst - half)
    return script


def alternating(*scripts: Script) -> Script:
    """Each request takes the next script in turn: one session's turns can then differ."""
    turn = iter(range(1 << 30))
    return lambda n: scripts[next(turn) % len(scripts)](n)


@dataclass
class FakeServer:
    script: Script
    continuous_usage: bool = True  # honours stream_options.continuous_usage_stats
    logprobs: bool = True  # honours logprobs
    counter_factor: float = 1.0  # /metrics reports generated tokens times this
    final_usage_extra: int = 0  # the closing usage claims this many tokens more than the chunks carried
    metrics: bool = True  # False: no /metrics page, as on a non-vLLM server
    finish_after_s: float | None = None  # a closing chunk with the finish reason and no tokens, this long after
    error_after: int | None = None  # an error event in place of the chunk after this many (vLLM's mid-stream error)
    status: int = 200  # any other: the completion refused with this HTTP status and an error body
    generated: int = 0
    url: str = ""

    def _chunk(self, text: str, usage: dict | None, logprobs: dict | None, finish: str | None = None) -> bytes:
        choices = [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}] if text or finish else []
        body = {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": "fake", "choices": choices,
                "usage": usage}
        return f"data: {json.dumps(body)}\n\n".encode()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if self.status != 200:
            return web.json_response({"error": {"message": "scripted refusal", "code": self.status}},
                                     status=self.status)
        prompt_tokens, max_tokens = len(body["prompt"].split()), body["max_tokens"]
        options = body.get("stream_options") or {}
        per_chunk_usage = self.continuous_usage and options.get("continuous_usage_stats")
        with_logprobs = self.logprobs and body.get("logprobs") is not None
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        sent = 0
        for index, (wait_s, tokens) in enumerate(self.script(max_tokens)):
            await asyncio.sleep(wait_s)
            if index == self.error_after:
                await response.write(b'data: {"error": {"message": "scripted failure", "code": 500}}\n\n')
                return response
            sent += tokens
            self.generated += tokens
            usage = ({"prompt_tokens": prompt_tokens, "completion_tokens": sent,
                      "total_tokens": prompt_tokens + sent} if per_chunk_usage else None)
            logprobs = ({"tokens": [" t"] * tokens, "token_logprobs": [-0.1] * tokens, "top_logprobs": None,
                         "text_offset": [0] * tokens} if with_logprobs else None)
            await response.write(self._chunk(" t" * tokens, usage, logprobs))
        if self.finish_after_s is not None:
            await asyncio.sleep(self.finish_after_s)
            usage = ({"prompt_tokens": prompt_tokens, "completion_tokens": sent,
                      "total_tokens": prompt_tokens + sent} if per_chunk_usage else None)
            empty = {"tokens": [], "token_logprobs": [], "top_logprobs": None, "text_offset": []}
            await response.write(self._chunk("", usage, empty if with_logprobs else None, "length"))
        if options.get("include_usage"):
            total = sent + self.final_usage_extra
            await response.write(self._chunk("", {"prompt_tokens": prompt_tokens, "completion_tokens": total,
                                                  "total_tokens": prompt_tokens + total}, None))
        await response.write(b"data: [DONE]\n\n")
        return response

    async def metrics_page(self, _: web.Request) -> web.Response:
        """The page as vLLM 0.32 writes it: the counter per engine (two here, as with data parallelism, splitting
        the count) and beside it the `_created` gauge, a timestamp that must not be summed with it."""
        if not self.metrics:
            return web.Response(status=404)
        value = self.generated * self.counter_factor
        text = "".join(
            f"# HELP vllm:{name} Number of generation tokens processed.\n# TYPE vllm:{name} {kind}\n"
            + "".join(f'vllm:{name}{{engine="{engine}",model_name="fake"}} {sample}\n'
                      for engine, sample in enumerate(samples))
            for name, kind, samples in (
                ("generation_tokens_total", "counter", (value / 4, value * 3 / 4)),
                ("generation_tokens_created", "gauge", (1.7963656157809968e09, 1.7963656157809968e09)),
            ))
        return web.Response(text=text)

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": "fake", "object": "model", "created": 0, "owned_by": "test"}]})

    async def version(self, _: web.Request) -> web.Response:
        return web.json_response({"version": "0.0-fake"})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/version", self.version)
        app.router.add_get("/metrics", self.metrics_page)
        return app


@contextmanager
def serving(server: FakeServer) -> Iterator[FakeServer]:
    """Run `server` on 127.0.0.1 at a free port on its own thread and event loop; set its url."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(server.app())
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    server.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.run_until_complete(runner.cleanup())
        loop.close()
