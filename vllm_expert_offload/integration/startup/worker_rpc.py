"""Worker methods reachable by name through vLLM's collective_rpc.

They are added (never replacing anything) to vLLM's WorkerBase, because collective_rpc with a function
object needs VLLM_ALLOW_INSECURE_SERIALIZATION once workers live in other processes (TP 2, vllm serve):

    llm.collective_rpc("vllm_expert_offload_save_expert_stats")            # counts so far -> record_stats file
    llm.collective_rpc("vllm_expert_offload_memory_report")               # per rank: placed bytes, loading peak
    llm.collective_rpc("vllm_expert_offload_tier_counters")               # per rank: reads by tier, fills (/metrics)

Whatever is reachable by name is reachable by anyone who reaches vLLM's dev-mode `/collective_rpc` endpoint, with
arguments of their choosing. So the save takes no path (it writes the configured `record_stats` file and nothing
else), and nothing here zeroes the counts on request: the one reset, of what startup itself routed, is spent by
the plugin before the engine is handed out (`END_OF_STARTUP`).
"""

from __future__ import annotations

from ...offload.engine_stats import engine_report
from ...offload.options import OffloadOptionError

END_OF_STARTUP = "vllm_expert_offload_end_of_startup"
SAVE_STATS = "vllm_expert_offload_save_expert_stats"
MEMORY_REPORT = "vllm_expert_offload_memory_report"
TIER_COUNTERS = "vllm_expert_offload_tier_counters"


async def ask_every_worker(client, method: str, dp_size: int = 1) -> list:
    """Every worker's answer to the worker method `method`, from every engine. The engine client's `collective_rpc`
    answers with the first engine's workers only; under data parallelism the engine core client's per-engine
    form of the same utility call (`call_utility_all_async`) asks each engine, between two of its steps."""
    if dp_size == 1:
        return await client.collective_rpc(method)
    per_engine = await client.engine_core.call_utility_all_async("collective_rpc", method, None, (), None)
    return [answer for workers in per_engine for answer in workers]


def _placement(worker):
    """The process's ProcessPlacement (shared by all EXL3 MoE layers): the declared field of the model's EXL3
    quant config (vLLM builds every layer from `vllm_config.quant_config`); None for a model without them."""
    from ..methods.quant_config import Exl3Config

    quant_config = worker.vllm_config.quant_config
    return quant_config.process.placement if isinstance(quant_config, Exl3Config) else None


def end_of_startup(worker) -> bool:
    """Drop what startup routed (vLLM's warm-up runs, the readiness smoke): once per process, refused after."""
    placement = _placement(worker)
    if placement is not None:
        placement.discard_startup_counts()
    return placement is not None


def save_expert_stats(worker) -> str | dict | None:
    """Write this process's routing counts to the configured record_stats file; every rank of an engine sees the
    same routing (TP and EP ranks compute the same router), so only its first rank writes
    (`ProcessPlacement.writes_stats`). Returns the path written (None on other ranks and without EXL3 experts).
    Under data parallelism nothing is written here: each engine's first worker returns its engine's own counts
    (offload/engine_stats.py `engine_report`) for the API server to merge and write once (stats_saver.py)."""
    placement = _placement(worker)
    if placement is None or not (placement.writes_stats or placement.reports_engine_counts):
        return None
    target = placement.options.record_stats
    if target is None:
        raise OffloadOptionError(f"{SAVE_STATS}: serve with expert_offload.record_stats to save routing statistics")
    if placement.reports_engine_counts:
        return engine_report(placement.dp_rank, placement.routing_counts())
    placement.save_stats(target)
    return str(target)


def memory_report(worker) -> dict[str, int | None] | None:
    """This rank's placed expert bytes and loading peak, with the weight memory vLLM measured for the model
    (the GPU runner's `model_memory_usage`; None on runners that do not measure it, as the CPU one)."""
    placement = _placement(worker)
    if placement is None:
        return None
    return placement.memory_report() | {"model_memory_usage": getattr(worker.model_runner, "model_memory_usage", None)}


def tier_counters(worker) -> dict | None:
    """This rank's per-layer read counters (offload/counters.py COLUMNS) and the bytes each tier holds, for
    /metrics (startup/metrics.py). Runs between engine steps, like every utility call: the one device-to-host
    copy here waits for the steps already queued, never inside a forward."""
    placement = _placement(worker)
    if placement is None:
        return None
    return {
        "layers": list(placement.moe_layers),
        "counts": placement.tier_counters.snapshot().tolist(),
        "cpu_busy_s": placement.tier_counters.cpu_busy_s.tolist(),
        "gpu_tier_bytes": placement.gpu_tier_bytes(),
        "host_tier_bytes": placement.host_tier_bytes(),
    }


# What vllm_hooks.WORKER_METHODS adds to vLLM's WorkerBase, by name.
METHODS = {END_OF_STARTUP: end_of_startup, SAVE_STATS: save_expert_stats, MEMORY_REPORT: memory_report,
           TIER_COUNTERS: tier_counters}
