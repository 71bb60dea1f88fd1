"""`plan`: make a per-expert placement plan for a checkpoint and explain every byte of it.

Runs on any machine (headers only, no weights, no GPU), so a plan can be made and reviewed before a
300 GB model is ever loaded; serve it with `--additional-config '{"expert_offload": {"plan": FILE}}'`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from ..exl3 import deepseek_v4 as dsv4
from ..exl3.checkpoint import Exl3Checkpoint, split_name
from ..exl3.validate import CheckpointSummary, validate_checkpoint
from ..offload.options import OffloadOptions
from ..offload.rank_plan import ExpertGeometry, make_plan, model_identity, record_bytes_matrix
from ..placement import Ledger, ModelIdentity, save_plan
from ..units import GIB
from .inspect_cmd import nbytes

DEQUANTIZED_BYTES_PER_WEIGHT = 2  # fp16/bf16, for expert_offload.dequantize_linears


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
    parser.add_argument("--kv-cache-gib", type=float, default=0.0, help="KV cache per GPU, for the ledger")
    parser.add_argument("--gpu-memory-gib", type=float, help="GPU capacity; refuses a plan that does not fit")
    parser.add_argument("--margin", type=float, default=0.03, help="share of GPU memory kept free (default 0.03)")
    parser.add_argument("--dequantize-linears", action="store_true",
                        help="count dense EXL3 linears decoded to fp16, as serving with expert_offload."
                             "dequantize_linears holds them (default: their quantized size, as the GPU kernels read them)")
    parser.add_argument("--out", required=True, type=Path, help="plan file to write")
    parser.set_defaults(handler=run)


def _non_expert_device_bytes(ckpt: Exl3Checkpoint, summary: CheckpointSummary, tp: int, dequantized: bool) -> int:
    """Everything on each GPU besides routed-expert trellises: unquantized and delegated tensors (a mixed pack's
    FP8 or BF16 layers) at their stored size, dense EXL3 linears as serving holds them (quantized, as the GPU
    kernels read them, or decoded to fp16 under dequantize_linears and where vLLM reads a plain weight, as
    DeepSeek-V4's compressors, wo_a and head), and every expert's suh/svh (they stay on
    the GPU). Split evenly over TP: an estimate, since norms and routers are replicated."""
    expert_prefixes = {
        summary.layout.expert_prefix(layer, e, p)
        for layer in summary.layout.moe_layers for e in range(summary.layout.num_experts)
        for p in ("gate", "up", "down")
    }
    total = 0
    shapes = ckpt.header_shapes()
    for name, (shape, dtype) in shapes.items():
        prefix, suffix = split_name(name)
        if prefix in summary.linears:
            lin = summary.linears[prefix]
            read_plain = dsv4.decoded_at_load(prefix, ckpt.hf_config)
            if prefix not in expert_prefixes:
                if not (dequantized or read_plain):
                    total += nbytes(shapes, name)
                elif suffix == "trellis":  # held decoded, 2 bytes a weight (fp16/bf16)
                    total += lin.in_features * lin.out_features * DEQUANTIZED_BYTES_PER_WEIGHT
            elif suffix in ("suh", "svh"):
                total += 2 * shape[0]
            continue
        total += nbytes(shapes, name)
    return total // tp


def _layout_line(summary: CheckpointSummary, dequantized: bool) -> str:
    """Which weights the plan places per expert and which are counted as non-expert weights."""
    contract = summary.contract
    if contract is None:
        how = "decoded to fp16 (dequantize_linears)" if dequantized else "at their quantized size"
        return f"pack: exllamav3-native; routed experts placed per expert, other EXL3 linears counted {how}"
    return (f"pack: mixed; EXL3 routed experts placed per expert, non-routed linears ({contract.dense_method()}) "
            f"counted as non-expert weights at their stored size")


def expert_sizes(ckpt: Exl3Checkpoint, tp: int) -> tuple[CheckpointSummary, np.ndarray, ModelIdentity]:
    """The checkpoint's summary, per-rank bytes of each routed expert [moe layers, experts] and the identity a
    plan records for them; ValueError when there is nothing to place or `tp` does not split the experts."""
    summary = validate_checkpoint(ckpt)
    if summary.layout is None:
        raise ValueError(f"{ckpt.path}: no routed experts of a supported architecture to place")
    layout = summary.layout
    if layout.intermediate_size % tp:
        raise ValueError(f"--tp {tp} does not divide the expert intermediate size {layout.intermediate_size}")
    geometry = ExpertGeometry(layout.hidden_size, layout.intermediate_size, layout.intermediate_size // tp, 0, tp)
    sizes = record_bytes_matrix(summary, geometry)
    return summary, sizes, model_identity(summary, tp, sizes)


def run(args: argparse.Namespace) -> int:
    ckpt = Exl3Checkpoint.open(args.model)
    try:
        summary, sizes, identity = expert_sizes(ckpt, args.tp)
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    options = OffloadOptions(gpu_budget_gib=args.gpu_budget_gib, host_fraction=args.host_fraction, stats=args.stats)
    plan, source = make_plan(options, sizes, identity)
    ledger = Ledger.from_plan(
        plan, sizes, non_expert_bytes=_non_expert_device_bytes(ckpt, summary, args.tp, args.dequantize_linears),
        kv_cache_bytes=int(args.kv_cache_gib * GIB),
    )
    capacity = None if args.gpu_memory_gib is None else int(args.gpu_memory_gib * GIB)
    print(f"plan for {args.model} (TP {args.tp}, per GPU), from {source}")
    print(_layout_line(summary, args.dequantize_linears))
    print(ledger.format_table(capacity, args.margin))
    if capacity is not None:
        ledger.check_fits(capacity, args.margin)
    budget = None if args.gpu_budget_gib is None else int(args.gpu_budget_gib * GIB)
    save_plan(args.out, plan, identity, budget_bytes=budget)
    print(f"wrote {args.out}: serve with --additional-config '{{\"expert_offload\": {{\"plan\": \"{args.out}\"}}}}'")
    return 0
