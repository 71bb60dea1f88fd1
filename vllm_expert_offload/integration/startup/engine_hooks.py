"""What the plugin does around vLLM's engine construction in the API (or `LLM`) process.

In order: refuse bad `expert_offload` options before any engine process starts (a path that cannot be written
fails in seconds, not after loading the model); run the readiness smoke (readiness.py) before anyone gets the
engine; then, under `vllm serve`, save routing statistics periodically and on SIGUSR1 (stats_saver.py) while
the server serves. Engine-core and worker processes import neither factory and are not touched.
"""

from __future__ import annotations

import contextlib
import functools
import sys

from ...offload.options import OffloadOptions, parse_offload_options
from ..patching import SENTINEL, require_checked_version
from .readiness import run_async, run_sync
from .stats_saver import saving_stats

CHECKED_ON = ("0.32", "0.33")


def checked_options(engine_args) -> OffloadOptions:
    """The options, parsed here too (workers parse them again) so a refusal comes before any engine process."""
    return parse_offload_options(getattr(engine_args, "additional_config", None))


def _wrap_engine_factory(llm_engine_cls) -> bool:
    """LLMEngine.from_engine_args(engine_args, ...): what `LLM(...)` builds its engine with."""
    original = llm_engine_cls.__dict__["from_engine_args"].__func__
    if getattr(original, SENTINEL, False):
        return False

    @functools.wraps(original)
    def from_engine_args(cls, engine_args, *args, **kwargs):
        checked_options(engine_args)
        engine = original(cls, engine_args, *args, **kwargs)
        run_sync(engine)
        return engine

    setattr(from_engine_args, SENTINEL, True)
    llm_engine_cls.from_engine_args = classmethod(from_engine_args)
    return True


def _wrap_async_builder(entry) -> bool:
    """build_async_engine_client_from_engine_args(engine_args, *, usage_context, client_config): `vllm serve`'s
    engine client, alive exactly as long as the server serves."""
    original = entry.build_async_engine_client_from_engine_args
    if getattr(original, SENTINEL, False):
        return False

    @contextlib.asynccontextmanager
    async def build_async_engine_client_from_engine_args(engine_args, *args, **kwargs):
        options = checked_options(engine_args)
        client_index = (kwargs.get("client_config") or {}).get("client_index", 0)
        async with original(engine_args, *args, **kwargs) as client:
            await run_async(client)
            async with saving_stats(client, options, client_index):
                yield client

    setattr(build_async_engine_client_from_engine_args, SENTINEL, True)
    entry.build_async_engine_client_from_engine_args = build_async_engine_client_from_engine_args
    return True


def install() -> int:
    """Wrap the engine factories already imported in this process (the API/LLM process imports them before
    plugins load); engine-core and worker processes have neither."""
    require_checked_version("the engine construction hooks", CHECKED_ON)
    wrapped = 0
    llm_engine = sys.modules.get("vllm.v1.engine.llm_engine")
    if llm_engine is not None:
        wrapped += _wrap_engine_factory(llm_engine.LLMEngine)
    entry = sys.modules.get("vllm.entrypoints.launchers.api_server.entry")
    if entry is not None:
        wrapped += _wrap_async_builder(entry)
    return wrapped
