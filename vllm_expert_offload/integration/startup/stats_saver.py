"""Routing statistics from a running `vllm serve`, every `record_stats_interval_s` seconds and on SIGUSR1.

No HTTP endpoint is opened (vLLM's /collective_rpc needs VLLM_SERVER_DEV_MODE=1, which lets anyone who reaches
the port call any worker method with any arguments). The API server process asks the workers to write through
the engine client's own `collective_rpc`, the utility-call path vLLM itself uses, with the same signature on
0.32 and 0.33. Why here rather than a timer thread in each worker:

- the engine core handles a utility call between two engine steps, and each worker runs it on its main thread
  in order with `execute_model`, so the device-to-host copy of the counts never lands inside a forward pass or a
  CUDA-graph capture (a worker thread touching CUDA during vLLM's global-mode capture would break the capture),
  and the forward path pays nothing but one stream sync per save;
- the API server is the process whose PID users know, so SIGUSR1 needs no forwarding of its own.

At shutdown the API server saves once more before the engine stops: vLLM's launcher answers SIGTERM/SIGINT by
calling the engine client's `shutdown` from a thread-pool thread, and with the default `--shutdown-timeout 0` that
kills the engine core and its workers at once, so they never reach their own exit save (placement_state.py; it
still covers `LLM(...)` and workers that exit on their own). Requests that finish while `--shutdown-timeout`
drains them are not in that last file.

Workers write the file atomically, so readers never see half of it. Only the first API server (client index 0)
saves when vLLM runs several. A save that fails (the engine is gone, the disk is full) is logged and never takes
the server down.

Under data parallelism each engine counts only its own tokens and its first worker returns them instead of writing
(offload/engine_stats.py); the saver asks every engine through the engine client's `call_utility_all_async` (the
per-engine form of the same utility call; `collective_rpc` answers with the first engine's result only), merges
the reports and writes the file itself, once. That needs one API server that manages every engine (vLLM's default
internal load balancing); with external or hybrid load balancing an API server sees only some engines, and the
save is refused with the ranks it got.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import signal
import threading
from collections.abc import AsyncIterator, Callable

from vllm.engine.protocol import EngineClient

from ...offload.engine_stats import merge_engine_reports
from ...offload.options import OffloadOptions
from .worker_rpc import SAVE_STATS, ask_every_worker

logger = logging.getLogger("vllm.expert_offload.stats")
SAVE_SIGNAL = signal.SIGUSR1
FINAL_SAVE_TIMEOUT_S = 30.0  # a save waits for the engine step in progress; this bounds a hung engine


class StatsSaver:
    """Saves through `client.collective_rpc`, or under data parallelism (`options.record_stats` written here) by
    merging every engine's report; `tasks` holds the saves started by signals until they finish."""

    def __init__(self, client: EngineClient, options: OffloadOptions, dp_size: int = 1) -> None:
        self.client = client
        self.options = options
        self.dp_size = dp_size
        self.tasks: set[asyncio.Task] = set()

    async def save(self, reason: str) -> None:
        try:
            written = await (self._merge_engines() if self.dp_size > 1 else self.client.collective_rpc(SAVE_STATS))
        except Exception as exc:  # noqa: BLE001 - a statistics save must never stop serving
            logger.warning("routing statistics not saved (%s): %s: %s", reason, type(exc).__name__, exc)
            return
        logger.info("routing statistics saved to %s (%s)", [w for w in written if w is not None], reason)

    async def _merge_engines(self) -> list[str]:
        """Every engine's report (one per engine, from its first worker), summed and written once."""
        reports = [report for report in await ask_every_worker(self.client, SAVE_STATS, self.dp_size)
                   if report is not None]
        merged = merge_engine_reports(reports, self.dp_size)
        await asyncio.to_thread(merged.save, self.options.record_stats)
        shares = " + ".join(str(r["counts"].get("tokens")) for r in sorted(reports, key=lambda r: r["dp_rank"]))
        return [f"{self.options.record_stats} (the sum of {self.dp_size} data-parallel engines' tokens, by DP rank: "
                f"{shares} = {merged.tokens})"]

    async def every(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.save("every %gs" % interval_s)

    def on_signal(self) -> None:
        task = asyncio.get_running_loop().create_task(self.save(SAVE_SIGNAL.name))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


def save_before_shutdown(shutdown: Callable[..., None], saver: StatsSaver,
                         loop: asyncio.AbstractEventLoop) -> Callable[..., None]:
    """The serving client's `shutdown`, preceded by a final save when it is called off the event loop's thread
    (vLLM's launcher calls it from a thread pool; waiting for the loop from its own thread would deadlock).
    Applied to the one client while it serves (vllm_hooks.SERVING_SHUTDOWN)."""
    loop_thread = threading.get_ident()  # called on the loop's thread, from saving_stats

    @functools.wraps(shutdown)
    def save_then_shutdown(*args, **kwargs) -> None:
        if threading.get_ident() != loop_thread:
            future = asyncio.run_coroutine_threadsafe(saver.save("at shutdown"), loop)
            try:
                future.result(timeout=FINAL_SAVE_TIMEOUT_S)
            except concurrent.futures.TimeoutError:
                logger.warning("routing statistics not saved at shutdown: no answer in %gs", FINAL_SAVE_TIMEOUT_S)
        shutdown(*args, **kwargs)

    return save_then_shutdown


def _add_signal_handler(loop: asyncio.AbstractEventLoop, saver: StatsSaver) -> bool:
    try:
        loop.add_signal_handler(SAVE_SIGNAL, saver.on_signal)
    except (ValueError, RuntimeError, NotImplementedError) as exc:  # not the main thread, or no signals here
        logger.warning("routing statistics: %s cannot be handled here (%s); saving every interval only",
                       SAVE_SIGNAL.name, exc)
        return False
    return True


@contextlib.asynccontextmanager
async def saving_stats(client: EngineClient, options: OffloadOptions, client_index: int = 0,
                       dp_size: int = 1) -> AsyncIterator[None]:
    """While the body runs (the server serves), save routing statistics periodically and on SIGUSR1, and once
    more when the engine client is shut down; `dp_size` engines' counts are merged here (module docstring)."""
    if options.record_stats is None or client_index != 0:
        yield
        return
    loop = asyncio.get_running_loop()
    saver = StatsSaver(client, options, dp_size)
    periodic = loop.create_task(saver.every(options.record_stats_interval_s))
    handled = _add_signal_handler(loop, saver)
    logger.info("routing statistics: %s is rewritten every %gs%s", options.record_stats,
                options.record_stats_interval_s, f" and on {SAVE_SIGNAL.name}" if handled else "")
    from ..vllm_hooks import SERVING_SHUTDOWN  # declares this module's wrapper: imported at use

    try:
        with SERVING_SHUTDOWN.applied(client, saver, loop):  # on this client object only, while it serves
            yield
    finally:
        if handled:
            loop.remove_signal_handler(SAVE_SIGNAL)
        for task in (periodic, *saver.tasks):
            task.cancel()
