"""Readiness smoke: before an EXL3 engine is handed to anyone, it serves one real request.

A benchmark of short prompts can pass on a configuration that dies on the first ordinary long prefill
(a lazily allocated buffer, a page-geometry bug, an unreachable host-tier expert). So, before `LLM(...)`
returns and before `vllm serve` starts listening, the engine prefills more than two KV blocks and decodes
a few tokens; a failure stops startup with its cause. The prefill is as long as one scheduler step
allows (`max_num_batched_tokens`, within `max_model_len`). Afterwards the prefix cache is reset, and the routing
counts of startup (vLLM's warm-up runs and the smoke, with the smoke on or off) are dropped, once, so startup leaves
no trace in what users see. Off with VLLM_EXPERT_OFFLOAD_READINESS_SMOKE=0.
"""

from __future__ import annotations

import logging
import os

from vllm import SamplingParams

from ...errors import ExpertOffloadError, InvalidValueError
from .worker_rpc import END_OF_STARTUP

logger = logging.getLogger("vllm.expert_offload.readiness")
ENV = "VLLM_EXPERT_OFFLOAD_READINESS_SMOKE"
REQUEST_ID = "vllm-expert-offload-readiness"
DECODE_STEPS = 4


class ReadinessError(ExpertOffloadError, RuntimeError):
    pass


def smoke_enabled() -> bool:
    value = os.environ.get(ENV, "1")
    if value not in ("0", "1"):
        raise InvalidValueError(f"{ENV}={value!r}: expected 0 or 1")
    return value == "1"


def _serves_exl3(vllm_config) -> bool:
    return vllm_config.model_config.quantization == "exl3"


def smoke_request(vllm_config) -> tuple[dict, SamplingParams] | None:
    """The prompt (token ids spanning more than two blocks) and greedy params, or None when not ours."""
    if not _serves_exl3(vllm_config) or not smoke_enabled():
        return None
    block = vllm_config.cache_config.block_size
    vocab = vllm_config.model_config.get_vocab_size()
    # One full scheduler step of prefill (the largest forward the server will run: its activations, the
    # MoE's widest expert grouping), and never less than two blocks and one token.
    wanted = max(2 * block + 1, vllm_config.scheduler_config.max_num_batched_tokens)
    length = min(wanted, vllm_config.model_config.max_model_len - DECODE_STEPS)
    prompt = {"prompt_token_ids": [(i * 7919 + 13) % vocab for i in range(length)]}
    params = SamplingParams(max_tokens=DECODE_STEPS, temperature=0.0, ignore_eos=True, detokenize=False)
    return prompt, params


def _failed(exc: BaseException, prompt_tokens: int) -> ReadinessError:
    return ReadinessError(
        f"readiness smoke failed: one request of {prompt_tokens} prompt tokens and "
        f"{DECODE_STEPS} decode steps did not complete ({type(exc).__name__}: {exc}); the server would have failed "
        f"on its first long request. Set {ENV}=0 only to debug."
    )


def _check_generated(final_output) -> None:
    generated = len(final_output.outputs[0].token_ids) if final_output is not None else 0
    if generated != DECODE_STEPS:
        raise ReadinessError(f"generated {generated} tokens instead of {DECODE_STEPS}")


def _passed(request: tuple[dict, SamplingParams]) -> None:
    logger.info("readiness smoke passed (%d prompt tokens, %d decode steps)", len(request[0]["prompt_token_ids"]),
                DECODE_STEPS)


def run_sync(engine) -> None:
    """LLMEngine: step the request to completion."""
    if not _serves_exl3(engine.vllm_config):
        return
    request = smoke_request(engine.vllm_config)
    if request is not None:
        try:
            engine.add_request(REQUEST_ID, *request)
            final = None
            while engine.has_unfinished_requests():
                final = next((o for o in engine.step() if o.finished), final)
            _check_generated(final)
            engine.reset_prefix_cache()
        except Exception as exc:
            raise _failed(exc, len(request[0]["prompt_token_ids"])) from exc
        _passed(request)
    engine.collective_rpc(END_OF_STARTUP)


async def run_async(client, client_index: int = 0) -> None:
    """AsyncLLM (vllm serve): the same request through the async client, before the server listens. Where vLLM
    runs several API servers (`--api-server-count`, by default one per engine under data parallelism) all share
    the engines, so only the first (client index 0) runs the smoke and drops the startup counts: a second drop is
    refused by every worker, and another server's smoke could land after the drop and be counted as traffic."""
    if not _serves_exl3(client.vllm_config) or client_index != 0:
        return
    request = smoke_request(client.vllm_config)
    if request is not None:
        try:
            final = None
            async for output in client.generate(request[0], request[1], REQUEST_ID):
                final = output
            _check_generated(final)
            await client.reset_prefix_cache()
        except Exception as exc:
            raise _failed(exc, len(request[0]["prompt_token_ids"])) from exc
        _passed(request)
    await client.collective_rpc(END_OF_STARTUP)
