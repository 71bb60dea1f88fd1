"""`vllm_expert_offload_*` metrics on vLLM's own Prometheus `/metrics` (docs/placement.md lists them).

The counts live on each worker's device (offload/counters.py), in processes other than the API server that
answers `/metrics`. vLLM's own worker-side numbers reach the API server through the engine core's outputs, a path
a plugin cannot extend; prometheus_client's multiprocess mode needs PROMETHEUS_MULTIPROC_DIR set before
prometheus_client is imported in every process, which vLLM does only with several API servers and never for its
workers. So the API server asks: every POLL_INTERVAL_S it calls the workers through the engine client's
`collective_rpc` (the path the statistics saver uses, stats_saver.py; under data parallelism its per-engine form,
so every engine's workers answer), which the engine core runs between two steps, so a device counter is read at
most once per step boundary and never stalls a forward; the ranks' answers are summed and kept, and a
prometheus_client custom collector on the default registry (the one vLLM's /metrics serves with a single API
server) reports the latest. With --api-server-count above 1 vLLM serves a multiprocess registry instead and these
metrics are not exported (docs/placement.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator, Sequence

import numpy as np
from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ...offload.counters import CPU_READS, EVICTIONS, FILLS, GPU_READS, HOST_READ_BYTES, HOST_READS
from .worker_rpc import TIER_COUNTERS, ask_every_worker

logger = logging.getLogger("vllm.expert_offload.metrics")
POLL_INTERVAL_S = 2.0
PREFIX = "vllm_expert_offload_"


def summed(reports: Sequence[dict | None]) -> dict | None:
    """The ranks' reports added up (every rank has the same MoE layers); None when no rank has EXL3 experts."""
    reports = [r for r in reports if r is not None]
    if not reports:
        return None
    return {
        "layers": reports[0]["layers"],
        "counts": np.sum([np.asarray(r["counts"], dtype=np.int64) for r in reports], axis=0),
        "cpu_busy_s": np.sum([np.asarray(r["cpu_busy_s"], dtype=np.float64) for r in reports], axis=0),
        "gpu_tier_bytes": sum(r["gpu_tier_bytes"] for r in reports),
        "host_tier_bytes": sum(r["host_tier_bytes"] for r in reports),
    }


def families(total: dict) -> Iterator[Metric]:
    """The metric families of one summed report."""
    reads = CounterMetricFamily(PREFIX + "expert_reads", "Token x expert reads of routed experts by the tier that "
                                "computed them (gpu: from GPU memory; host: read by the device from the host tier; "
                                "cpu: computed by the CPU tier from the host tier), summed over TP ranks",
                                labels=["layer", "tier"])
    host_bytes = CounterMetricFamily(PREFIX + "host_read_bytes", "Trellis bytes of the distinct host-tier experts "
                                     "each forward read over the link, summed over TP ranks", labels=["layer"])
    fills = CounterMetricFamily(PREFIX + "cache_fills", "Experts written through into a GPU cache slot as they were "
                                "read from the host, summed over TP ranks", labels=["layer"])
    evictions = CounterMetricFamily(PREFIX + "cache_evictions", "Experts that left a GPU cache slot for another, "
                                    "summed over TP ranks", labels=["layer"])
    hit_rate = GaugeMetricFamily(PREFIX + "cache_hit_rate", "Share of token x expert reads served from GPU "
                                 "memory since the server started", labels=["layer"])
    busy = CounterMetricFamily(PREFIX + "cpu_tier_busy_seconds", "Seconds the CPU tier spent computing its experts, "
                               "summed over TP ranks", labels=["layer"])
    for layer, row, busy_s in zip(total["layers"], total["counts"], total["cpu_busy_s"]):
        name = str(layer)
        reads.add_metric([name, "gpu"], int(row[GPU_READS]))
        reads.add_metric([name, "host"], int(row[HOST_READS]))
        reads.add_metric([name, "cpu"], int(row[CPU_READS]))
        busy.add_metric([name], float(busy_s))
        host_bytes.add_metric([name], int(row[HOST_READ_BYTES]))
        fills.add_metric([name], int(row[FILLS]))
        evictions.add_metric([name], int(row[EVICTIONS]))
        all_reads = int(row[GPU_READS] + row[HOST_READS] + row[CPU_READS])  # a CPU-tier read is a miss too
        hit_rate.add_metric([name], row[GPU_READS] / all_reads if all_reads else 0.0)
    held = GaugeMetricFamily(PREFIX + "tier_bytes", "Routed-expert bytes each tier holds (GPU: the plan's experts or "
                             "the cache's slots; host: the arena's records), summed over TP ranks", labels=["tier"])
    held.add_metric(["gpu"], total["gpu_tier_bytes"])
    held.add_metric(["host"], total["host_tier_bytes"])
    yield from (reads, host_bytes, fills, evictions, hit_rate, busy, held)


class TierMetrics:
    """A prometheus_client collector reporting the latest summed worker counters."""

    def __init__(self) -> None:
        self.latest: dict | None = None

    def describe(self) -> list[Metric]:
        return []  # registered without a collect() at registration; names are checked per scrape

    def collect(self) -> Iterator[Metric]:
        if self.latest is not None:
            yield from families(self.latest)

    async def poll(self, client, interval_s: float, dp_size: int = 1) -> None:
        while True:
            try:
                self.latest = summed(await ask_every_worker(client, TIER_COUNTERS, dp_size))
            except Exception as exc:  # noqa: BLE001 - metrics must never stop serving
                logger.warning("expert offload metrics not updated: %s: %s", type(exc).__name__, exc)
            await asyncio.sleep(interval_s)


@contextlib.asynccontextmanager
async def exporting_metrics(client, offloads: bool, client_index: int = 0, dp_size: int = 1,
                            interval_s: float = POLL_INTERVAL_S) -> AsyncIterator[TierMetrics | None]:
    """While the body runs (the server serves), keep the collector on the default registry up to date with the
    counters of every worker of the `dp_size` engines."""
    if not offloads or client_index != 0:
        yield None
        return
    metrics = TierMetrics()
    REGISTRY.register(metrics)
    task = asyncio.get_running_loop().create_task(metrics.poll(client, interval_s, dp_size))
    try:
        yield metrics
    finally:
        task.cancel()
        REGISTRY.unregister(metrics)
