"""What the plugin does around vLLM's engine construction in the API (or `LLM`) process.

In order: refuse bad `expert_offload` options before any engine process starts (a path that cannot be written
fails in seconds, not after loading the model); run the readiness smoke (readiness.py) before anyone gets the
engine; then, under `vllm serve`, save routing statistics periodically and on SIGUSR1 (stats_saver.py) and keep
the `vllm_expert_offload_*` metrics of /metrics current (metrics.py) while the server serves. Engine-core and
worker processes import neither factory and are not touched.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

from ...offload.options import OffloadOptionError, OffloadOptions, parse_offload_options
from .metrics import exporting_metrics
from .readiness import run_async, run_sync
from .stats_saver import saving_stats


def checked_options(engine_args) -> OffloadOptions:
    """The options, parsed here too (workers parse them again) so a refusal comes before any engine process."""
    return parse_offload_options(getattr(engine_args, "additional_config", None))


def wrap_engine_factory(original: Callable) -> Callable:
    """LLMEngine.from_engine_args(engine_args, ...): what `LLM(...)` builds its engine with."""

    @functools.wraps(original)
    def from_engine_args(cls, engine_args, *args, **kwargs):
        options = checked_options(engine_args)
        if options.record_stats is not None and engine_args.data_parallel_size > 1:
            raise OffloadOptionError(
                "--additional-config expert_offload.record_stats: under data parallelism the API server of vllm "
                f"serve merges every engine's counts and writes them; LLM(...) with data_parallel_size="
                f"{engine_args.data_parallel_size} has none, and no worker writes alone. Record with vllm serve")
        engine = original(cls, engine_args, *args, **kwargs)
        run_sync(engine)
        return engine

    return from_engine_args


def wrap_async_builder(original: Callable) -> Callable:
    """build_async_engine_client_from_engine_args(engine_args, *, usage_context, client_config): `vllm serve`'s
    engine client, alive exactly as long as the server serves."""

    @functools.wraps(original)  # __wrapped__: vLLM's function, whose parameters the hook checked
    @contextlib.asynccontextmanager
    async def build_async_engine_client_from_engine_args(engine_args, *args, **kwargs):
        options = checked_options(engine_args)
        client_index = (kwargs.get("client_config") or {}).get("client_index", 0)
        async with original(engine_args, *args, **kwargs) as client:
            await run_async(client, client_index)
            async with saving_stats(client, options, client_index, engine_args.data_parallel_size), \
                    exporting_metrics(client, options.offloads, client_index,
                                      engine_args.data_parallel_size):
                yield client

    return build_async_engine_client_from_engine_args
