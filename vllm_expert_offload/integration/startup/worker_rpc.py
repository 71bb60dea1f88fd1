"""Worker methods reachable by name through vLLM's collective_rpc.

They are added (never replacing anything) to vLLM's WorkerBase, because collective_rpc with a function
object needs VLLM_ALLOW_INSECURE_SERIALIZATION once workers live in other processes (TP 2, vllm serve):

    llm.collective_rpc("vllm_expert_offload_save_expert_stats")            # counts so far -> record_stats file
    llm.collective_rpc("vllm_expert_offload_save_expert_stats", args=("/tmp/stats.json",))
    llm.collective_rpc("vllm_expert_offload_memory_report")               # per rank: placed bytes, loading peak
"""

from __future__ import annotations

from pathlib import Path

from ..patching import HookError

RESET_COUNTS = "vllm_expert_offload_reset_expert_counts"
SAVE_STATS = "vllm_expert_offload_save_expert_stats"
MEMORY_REPORT = "vllm_expert_offload_memory_report"


def _placement(worker):
    """The process's ProcessPlacement (shared by all EXL3 MoE layers): the declared field of the model's EXL3
    quant config (vLLM builds every layer from `vllm_config.quant_config`); None for a model without them."""
    from ..methods.quant_config import Exl3Config

    quant_config = worker.vllm_config.quant_config
    return quant_config.placement if isinstance(quant_config, Exl3Config) else None


def reset_expert_counts(worker) -> bool:
    placement = _placement(worker)
    if placement is not None:
        placement.reset_counts()
    return placement is not None


def save_expert_stats(worker, path: str | None = None) -> str | None:
    """Write this process's routing counts; TP ranks see the same routing, so only rank 0 writes."""
    placement = _placement(worker)
    if placement is None or placement.geometry.tp_rank != 0:
        return None
    target = Path(path) if path is not None else placement.options.record_stats
    if target is None:
        raise ValueError(f"{SAVE_STATS}: give a path, or serve with expert_offload.record_stats")
    placement.save_stats(target)
    return str(target)


def memory_report(worker) -> dict[str, int | None] | None:
    """This rank's placed expert bytes and loading peak, with the weight memory vLLM measured for the model
    (the GPU runner's `model_memory_usage`; None on runners that do not measure it, as the CPU one)."""
    placement = _placement(worker)
    if placement is None:
        return None
    return placement.memory_report() | {"model_memory_usage": getattr(worker.model_runner, "model_memory_usage", None)}


def install() -> None:
    from vllm.v1.worker.worker_base import WorkerBase

    methods = ((RESET_COUNTS, reset_expert_counts), (SAVE_STATS, save_expert_stats), (MEMORY_REPORT, memory_report))
    for name, method in methods:
        existing = getattr(WorkerBase, name, None)
        if existing is not None and existing is not method:
            raise HookError(f"vllm.v1.worker.worker_base.WorkerBase already has a {name!r} attribute")
        setattr(WorkerBase, name, method)
