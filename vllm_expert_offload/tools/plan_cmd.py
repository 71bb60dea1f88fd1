"""`plan`: make a per-expert placement plan for a checkpoint and explain every byte of it.

Runs on any machine (headers only, no weights, no GPU), so a plan can be made and reviewed before a
300 GB model is ever loaded; serve it with `--additional-config '{"expert_offload": {"plan": FILE}}'`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from ..exl3.checkpoint import Exl3Checkpoint
from ..exl3.residency import Residency, ResidencyOptions, residency
from ..exl3.validate import CheckpointSummary, validate_checkpoint
from ..offload.options import OPTION_KEY, OffloadOptionError, OffloadOptions, parse_offload_options
from ..offload.rank_plan import ExpertGeometry, RankExperts, make_plan, model_identity, record_bytes_matrix
from ..placement import Ledger, ModelIdentity, save_plan
from ..units import GIB
from ..validation import finite_number
from .errors import ToolInputError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan", help="place each routed expert in the GPU or host tier and print the memory ledger",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("--model", required=True, type=Path, help="EXL3 checkpoint directory")
    how = parser.add_mutually_exclusive_group(required=True)
    how.add_argument("--gpu-budget-gib", type=float, help="GiB of GPU memory for routed experts, per GPU")
    how.add_argument("--host-fraction", type=float, help="share of each layer's experts to put on host")
    parser.add_argument("--stats", type=Path, help="routing statistics (from record_stats) to weigh host reads")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size the plan is for")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel size the plan is for (vLLM's "
                        "--data-parallel-size: experts split over TP x DP ranks, or placed whole with --ep)")
    parser.add_argument("--ep", action="store_true",
                        help="expert parallelism (vLLM's --enable-expert-parallel): the TP x DP ranks each hold whole "
                             "experts, vLLM's linear placement; the budget is per rank, a ledger per rank")
    parser.add_argument("--kv-cache-gib", type=float, default=0.0, help="KV cache per GPU, for the ledger")
    parser.add_argument("--gpu-memory-gib", type=float, help="GPU capacity; refuses a plan that does not fit")
    parser.add_argument("--margin", type=float, default=0.03, help="share of GPU memory kept free (default 0.03; "
                        "serving's expert_offload.min_free_fraction, checked the same way)")
    parser.add_argument("--dequantize-linears", action="store_true",
                        help="count dense EXL3 linears decoded to fp16, as serving with expert_offload."
                             "dequantize_linears holds them (default: their quantized size, as the GPU kernels read them)")
    parser.add_argument("--speculative", action="store_true",
                        help="count the draft layers (mtp.*): a speculative-decoding drafter loads them")
    parser.add_argument("--engram-on-gpu", action="store_true",
                        help="count DeepSeek-V4.1's engram tables on the GPUs (vLLM's --engram-config cpu_offload "
                             "false; default: pinned host memory, as vLLM keeps them)")
    parser.add_argument("--embedding-host", action="store_true",
                        help="count the token embedding in the host arena (a per-token row gather over UVA; the plan counts it, serving does not place it yet)")
    parser.add_argument("--mm-encoder-tp-mode", choices=("weights", "data"), default="weights",
                        help="vLLM's option of the same name: the vision tower split over TP (weights, vLLM's "
                             "default) or replicated on every rank (data)")
    parser.add_argument("--summary-json", type=Path, help="also write the ledger's totals as JSON to this file")
    parser.add_argument("--out", required=True, type=Path, help="plan file to write")
    parser.set_defaults(handler=run)


def _layout_line(summary: CheckpointSummary, dequantized: bool) -> str:
    """Which weights the plan places per expert and which are counted as non-expert weights."""
    contract = summary.contract
    if contract is None:
        how = "decoded to fp16 (dequantize_linears)" if dequantized else "at their quantized size"
        return f"pack: exllamav3-native; routed experts placed per expert, other EXL3 linears counted {how}"
    return (f"pack: mixed; EXL3 routed experts placed per expert, non-routed linears ({contract.dense_method()}) "
            f"counted as non-expert weights at their stored size")


def summary_json(ledger: Ledger, weights: Residency, tp: int) -> dict[str, object]:
    """The ledger's totals for scripts: weights per GPU (no KV cache or headroom), the node's host memory, the
    experts on each side, and every line."""
    return {
        "tp": tp,
        "gpu_weight_bytes_per_rank": ledger.gpu_weight_bytes,
        "gpu_expert_bytes_per_rank": ledger.gpu_expert_bytes,
        "non_expert_bytes_per_rank": ledger.non_expert_bytes,
        "device_bytes_per_rank": ledger.device_bytes,
        "host_bytes": ledger.host_bytes,
        "host_experts": ledger.host_experts,
        "gpu_experts": ledger.gpu_experts,
        "total_experts": ledger.host_experts + ledger.gpu_experts,
        "device_lines_per_rank": dict(ledger.weight_lines),
        "host_lines": {row.item: row.nbytes for row in ledger.rows() if row.tier == "host"},
        "not_loaded_per_rank": weights.not_loaded,
    }


def expert_sizes(ckpt: Exl3Checkpoint, tp: int, summary: CheckpointSummary | None = None, ep_size: int = 1,
                 ) -> tuple[CheckpointSummary, np.ndarray, ModelIdentity]:
    """The checkpoint's summary (validated here unless given), per-rank bytes of each routed expert [moe layers,
    experts] (`tp`: the MoE layers' TP size, 1 for whole experts under expert parallelism over `ep_size` ranks) and
    the identity a plan records for them; ToolInputError when there is nothing to place or `tp` does not split the
    experts."""
    summary = validate_checkpoint(ckpt) if summary is None else summary
    if summary.layout is None:
        raise ToolInputError(f"{ckpt.path}: no routed experts of a supported architecture to place")
    layout = summary.layout
    if layout.intermediate_size % tp:
        raise ToolInputError(f"--tp {tp} does not divide the expert intermediate size {layout.intermediate_size}")
    if ep_size > layout.num_experts:
        raise ToolInputError(f"--ep over {ep_size} ranks: the model has only {layout.num_experts} routed experts per layer")
    geometry = ExpertGeometry(layout.hidden_size, layout.intermediate_size, layout.intermediate_size // tp, 0, tp)
    sizes = record_bytes_matrix(summary, geometry)
    return summary, sizes, model_identity(summary, tp, sizes, ep_size)


def plan_ledger(ckpt: Exl3Checkpoint, summary: CheckpointSummary, plan: np.ndarray, sizes: np.ndarray,
                where: ResidencyOptions, kv_cache_bytes: int = 0, rank: RankExperts | None = None,
                ) -> tuple[Ledger, Residency]:
    """The ledger of GPU mask `plan`: every stored tensor where serving keeps it (exl3/residency.py); with `rank`
    (expert parallelism) that rank's: its experts on its GPU, its host tier."""
    weights = residency(summary, ckpt.header_shapes(), ckpt.hf_config, where)
    owned = None if rank is None else rank.mask
    ledger = Ledger.from_plan(plan, sizes, non_expert_bytes=weights.device, kv_cache_bytes=kv_cache_bytes,
                              host_bytes=weights.host, ranks=where.tp if rank is None else 1, owned=owned)
    return ledger, weights


def _size(nbytes: int) -> str:
    return f"{nbytes:,} bytes ({nbytes / GIB:.3f} GiB)"


def _rank_lines(ledgers: list[Ledger], ranks: list[RankExperts]) -> str:
    """One line per expert-parallel rank: its experts and bytes on each side."""
    lines = []
    for ledger, rank in zip(ledgers, ranks):
        lines.append(f"  {rank.label()}: GPU tier {ledger.gpu_experts} experts {_size(ledger.gpu_expert_bytes)}, "
                     f"host tier {ledger.host_experts} experts {_size(ledger.host_expert_bytes)}, "
                     f"device total {_size(ledger.device_bytes)}")
    return "\n".join(lines)


# The flags that are serving options, by the expert_offload key serving's reader names in its refusals.
SERVING_FLAGS = {"gpu_budget_gib": "--gpu-budget-gib", "host_fraction": "--host-fraction", "stats": "--stats",
                 "min_free_fraction": "--margin"}


def serving_options(args: argparse.Namespace) -> OffloadOptions:
    """The placement flags read by serving's own reader (offload/options.py), so `plan` accepts exactly what
    `vllm serve` would: --host-fraction 1.5 or a --gpu-budget-gib of -1 is refused here as it is there, with
    serving's message after the flag."""
    values = {"gpu_budget_gib": args.gpu_budget_gib, "host_fraction": args.host_fraction,
              "stats": None if args.stats is None else str(args.stats), "min_free_fraction": args.margin}
    try:
        return parse_offload_options({OPTION_KEY: {k: v for k, v in values.items() if v is not None}})
    except OffloadOptionError as exc:
        flag = next((f for key, f in SERVING_FLAGS.items() if f"{OPTION_KEY}.{key}" in str(exc)), "plan")
        raise ToolInputError(f"{flag}: {exc}") from None


def check_layout_flags(args: argparse.Namespace) -> None:
    """The flags only `plan` has: rank counts of at least one, memory sizes that are finite and not negative."""
    for flag, ranks in (("--tp", args.tp), ("--dp", args.dp)):
        if ranks < 1:
            raise ToolInputError(f"{flag}: {ranks} ranks; expected at least 1")
    finite_number(args.kv_cache_gib, "--kv-cache-gib", ToolInputError, 0.0)
    if args.gpu_memory_gib is not None:
        finite_number(args.gpu_memory_gib, "--gpu-memory-gib", ToolInputError, 0.0)


def run(args: argparse.Namespace) -> int:
    options = serving_options(args)
    check_layout_flags(args)
    ckpt = Exl3Checkpoint.open(args.model)
    ranks_total = args.tp * args.dp
    moe_tp, ep_size = (1, ranks_total) if args.ep else (ranks_total, 1)  # vLLM's FusedMoEParallelConfig.make
    summary, sizes, identity = expert_sizes(ckpt, moe_tp, ep_size=ep_size)
    ranks = [RankExperts.linear(sizes.shape[1], r, ep_size) for r in range(ep_size)] if args.ep else [None]
    parts = [make_plan(options, sizes, identity, rank=rank) for rank in ranks]
    plan, source = np.logical_or.reduce([part for part, _ in parts]), parts[0][1]
    where = ResidencyOptions(tp=args.tp, speculative=args.speculative, engram_on_host=not args.engram_on_gpu,
                             embedding_on_host=args.embedding_host, dequantized=args.dequantize_linears,
                             vision_replicated=args.mm_encoder_tp_mode == "data", moe_tp=moe_tp, ep=ep_size)
    kv = int(args.kv_cache_gib * GIB)
    ledgers = [plan_ledger(ckpt, summary, plan, sizes, where, kv, rank) for rank in ranks]
    ledger, weights = max(ledgers, key=lambda pair: pair[0].device_bytes)  # EP: the rank with the most on its GPU
    capacity = None if args.gpu_memory_gib is None else int(args.gpu_memory_gib * GIB)
    parallel = f"TP {args.tp}" + (f" x DP {args.dp}" if args.dp > 1 else "") + (f", EP {ep_size}" if args.ep else "")
    print(f"plan for {args.model} ({parallel}: device rows per GPU, host rows for the node), from {source}")
    print(_layout_line(summary, args.dequantize_linears))
    if args.ep:
        print("expert parallelism: each rank places its own experts (budget per rank); per rank:")
        print(_rank_lines([pair[0] for pair in ledgers], ranks))
        print(f"host tier, all ranks: {sum(pair[0].host_bytes for pair in ledgers) / GIB:.3f} GiB; the ledger of "
              f"the rank with the most device bytes (host rows: that rank's):")
    print(ledger.format_table(capacity, args.margin))
    if weights.not_loaded:
        print("not loaded: " + ", ".join(f"{item} {amount / GIB:.3f} GiB per GPU" for item, amount in
                                         weights.not_loaded.items()) + " (--speculative counts them)")
    if args.summary_json is not None:
        doc = summary_json(ledger, weights, args.tp)
        if args.ep:
            doc["ep_ranks"] = [{"ep_rank": rank.ep_rank, "experts": list(rank.local),
                                "gpu_expert_bytes": part.gpu_expert_bytes, "host_expert_bytes": part.host_expert_bytes,
                                "device_bytes": part.device_bytes} for (part, _), rank in zip(ledgers, ranks)]
        args.summary_json.write_text(json.dumps(doc, indent=1) + "\n")
    if capacity is not None:
        for part, _ in ledgers:
            part.check_fits(capacity, args.margin)
    budget = None if args.gpu_budget_gib is None else int(args.gpu_budget_gib * GIB)
    save_plan(args.out, plan, identity, budget_bytes=budget)
    print(f"wrote {args.out}: serve with --additional-config '{{\"expert_offload\": {{\"plan\": \"{args.out}\"}}}}'")
    return 0
