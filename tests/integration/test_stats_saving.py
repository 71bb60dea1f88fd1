"""When routing statistics are saved: every interval and on SIGUSR1 while serving (API server side), and when a
worker process ends, forked ones included."""

from __future__ import annotations

import asyncio
import atexit
import functools
import logging
import multiprocessing
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from vllm_expert_offload.integration.startup.stats_saver import saving_stats
from vllm_expert_offload.integration.startup.worker_rpc import SAVE_STATS
from vllm_expert_offload.offload.engine_stats import engine_report
from vllm_expert_offload.offload.options import OffloadOptions
from vllm_expert_offload.offload.process import at_process_exit
from vllm_expert_offload.placement import RoutingCounts


class FakeClient:
    """AsyncLLM's collective_rpc as the saver uses it: TP rank 0 answers with the path it wrote."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[str] = []
        self.fail = fail

    async def collective_rpc(self, method: str) -> list[str | None]:
        self.calls.append(method)
        if self.fail:
            raise RuntimeError("EngineDeadError")
        return ["/stats.json", None]

    def shutdown(self, timeout: float | None = None) -> None:
        self.calls.append("shutdown")


def _serve(client: FakeClient, options: OffloadOptions, seconds: float, client_index: int = 0,
           signal_at: float | None = None) -> None:
    async def main() -> None:
        async with saving_stats(client, options, client_index):
            if signal_at is not None:
                await asyncio.sleep(signal_at)
                os.kill(os.getpid(), signal.SIGUSR1)
                await asyncio.sleep(seconds - signal_at)
            else:
                await asyncio.sleep(seconds)
        stopped_with = len(client.calls)
        await asyncio.sleep(0.3)
        assert len(client.calls) == stopped_with, "saving went on after the server stopped"

    asyncio.run(main())


def test_saves_every_interval_until_the_server_stops(tmp_path) -> None:
    client = FakeClient()
    _serve(client, OffloadOptions(record_stats=tmp_path / "s.json", record_stats_interval_s=0.2), seconds=0.7)
    assert client.calls in ([SAVE_STATS] * 3, [SAVE_STATS] * 2)  # at 0.2, 0.4 and 0.6 s (the last may be late)
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # handler gone with the server


def test_sigusr1_saves_at_once(tmp_path) -> None:
    client = FakeClient()
    _serve(client, OffloadOptions(record_stats=tmp_path / "s.json", record_stats_interval_s=3600), seconds=0.3,
           signal_at=0.1)
    assert client.calls == [SAVE_STATS]


def test_nothing_saved_without_record_stats_or_from_a_second_api_server(tmp_path) -> None:
    client = FakeClient()
    _serve(client, OffloadOptions(record_stats_interval_s=0.05), seconds=0.2)
    _serve(client, OffloadOptions(record_stats=tmp_path / "s.json", record_stats_interval_s=0.05), seconds=0.2,
           client_index=1)
    assert client.calls == []


def test_a_failed_save_is_logged_and_serving_goes_on(tmp_path, caplog) -> None:
    client = FakeClient(fail=True)
    _serve(client, OffloadOptions(record_stats=tmp_path / "s.json", record_stats_interval_s=0.1), seconds=0.45)
    assert len(client.calls) >= 2
    assert "routing statistics not saved (every 0.1s): RuntimeError: EngineDeadError" in caplog.text


def test_saved_before_the_launcher_shuts_the_engine_down(tmp_path) -> None:
    """vLLM's launcher calls shutdown from a thread pool on SIGTERM; a call on the loop's own thread cannot wait
    for a save and must not deadlock."""
    client = FakeClient()

    async def main() -> None:
        options = OffloadOptions(record_stats=tmp_path / "s.json", record_stats_interval_s=3600)
        async with saving_stats(client, options):
            await asyncio.get_running_loop().run_in_executor(None, functools.partial(client.shutdown, timeout=0))
            client.shutdown()
        assert "shutdown" not in vars(client)  # the wrapper lived on this object only while serving

    asyncio.run(main())
    assert client.calls == [SAVE_STATS, "shutdown", "shutdown"]


def _child(done: Path, skipped: Path) -> None:
    at_process_exit(done.write_text, "saved")
    atexit.register(skipped.write_text, "saved")


def test_saved_when_a_forked_worker_process_ends(tmp_path) -> None:
    """vLLM forks its workers on GPU machines; a forked child ends with os._exit, where atexit never runs."""
    done, skipped = tmp_path / "finalizer.txt", tmp_path / "atexit.txt"
    process = multiprocessing.get_context("fork").Process(target=_child, args=(done, skipped))
    process.start()
    process.join(timeout=60)
    assert process.exitcode == 0 and done.read_text() == "saved"
    assert not skipped.exists()  # why not atexit


class FakeDataParallelClient:
    """AsyncLLM under --data-parallel-size 2, as the saver uses it: `engine_core.call_utility_all_async` answers
    per engine with each worker's return; each engine's first worker reports its own counts (worker_rpc)."""

    def __init__(self, engines: list[list[dict | None]]) -> None:
        self.engines = engines
        self.calls: list[tuple] = []
        self.engine_core = self

    async def call_utility_all_async(self, method: str, *args) -> list[list[dict | None]]:
        self.calls.append((method, *args))
        return self.engines

    def shutdown(self, timeout: float | None = None) -> None:
        pass


def _engine_counts(seed: int) -> RoutingCounts:
    return RoutingCounts(np.random.default_rng(seed).integers(0, 9, size=(2, 8)), (0, 1), None, 5 + seed,
                         (10.0 + seed, 20.0 + seed))


def _save_once(client, path: Path) -> None:
    async def main() -> None:
        options = OffloadOptions(record_stats=path, record_stats_interval_s=0.1)
        async with saving_stats(client, options, dp_size=2):
            await asyncio.sleep(0.15)

    asyncio.run(main())


def test_data_parallel_engines_are_merged_and_written_once(tmp_path) -> None:
    path = tmp_path / "s.json"
    first, second = _engine_counts(0), _engine_counts(1)
    client = FakeDataParallelClient([[engine_report(0, first), None], [engine_report(1, second), None]])
    _save_once(client, path)
    assert client.calls == [("collective_rpc", SAVE_STATS, None, (), None)]  # every engine, every worker asked once
    saved = RoutingCounts.load(path)
    np.testing.assert_array_equal(saved.counts, first.counts + second.counts)
    assert (saved.tokens, saved.interval) == (11, (10.0, 21.0))


def test_the_log_names_each_engines_share(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="vllm.expert_offload.stats")
    engines = [[engine_report(0, _engine_counts(0))], [None, engine_report(1, _engine_counts(1))]]
    _save_once(FakeDataParallelClient(engines), tmp_path / "s.json")
    assert "the sum of 2 data-parallel engines' tokens, by DP rank: 5 + 6 = 11" in caplog.text


def test_a_save_missing_an_engine_writes_nothing(tmp_path, caplog) -> None:
    path = tmp_path / "s.json"
    caplog.set_level(logging.WARNING, logger="vllm.expert_offload.stats")
    _save_once(FakeDataParallelClient([[engine_report(0, _engine_counts(0))], [None]]), path)
    assert not path.exists()
    assert "one report from each rank 0..1, got ranks [0]" in caplog.text


def test_llm_under_data_parallelism_with_record_stats_is_refused_before_the_engine(tmp_path) -> None:
    """No API server merges the engines' counts there, and no worker writes alone under DP: refused, not silent."""
    from vllm_expert_offload.integration.startup.engine_hooks import wrap_engine_factory
    from vllm_expert_offload.offload.options import OffloadOptionError

    built = []
    factory = wrap_engine_factory(lambda cls, engine_args: built.append(engine_args))
    offload = {"expert_offload": {"host_fraction": 0.5, "record_stats": str(tmp_path / "s.json")}}
    with pytest.raises(OffloadOptionError, match="record_stats: under data parallelism .* Record with vllm serve"):
        factory(None, SimpleNamespace(additional_config=offload, data_parallel_size=2))
    assert built == []
