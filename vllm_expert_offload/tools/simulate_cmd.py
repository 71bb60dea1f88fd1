"""`simulate`: an upper bound on decode tok/s per concurrency for a placement plan, from bytes read per step.

A plan alone says which tier each expert lives in; this turns it into the number people size deployments by,
before a GPU is rented: each step of c streams reads every distinct selected expert once (shared experts are read
once per batch), GPU-tier bytes at HBM speed and host-tier bytes at link speed (placement/cost.py). Attention, KV
reads, compute and launch overhead are left out, so real tok/s is lower.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from ..exl3.checkpoint import Exl3Checkpoint
from ..placement import DecodeCostModel, ModelIdentity, RoutingCounts, StepBound, read_plan, step_bound
from ..placement.planfile import expert_bytes_checksum
from .errors import ToolInputError
from .plan_cmd import expert_sizes

GB = 1e9


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "simulate", help="decode tok/s bound per concurrency for a plan, from bytes each tier reads per step",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("--plan", required=True, type=Path, help="plan file (from `plan`)")
    sizes = parser.add_mutually_exclusive_group(required=True)
    sizes.add_argument("--model", type=Path, help="EXL3 checkpoint the plan was made for (expert sizes from it)")
    sizes.add_argument("--expert-bytes", type=int,
                       help="bytes of every routed expert per GPU, without the model; checked against the plan")
    parser.add_argument("--top-k", required=True, type=int, help="experts each token selects per layer")
    parser.add_argument("--stats", type=Path, help="routing statistics; without them routing is uniform")
    parser.add_argument("--pcie-gbs", type=float, help="host link read bandwidth, GB/s (default 25)")
    parser.add_argument("--hbm-gbs", type=float, help="GPU memory read bandwidth, GB/s (default 1000)")
    parser.add_argument("--gpu-check", type=Path, help="limits.json from scripts/gpu-check.sh (overrides defaults)")
    parser.add_argument("--dense-bytes-per-layer", type=float, default=0.0,
                        help="attention/shared-expert/router bytes read per MoE layer per step (default 0)")
    parser.add_argument("--serial", action="store_true", help="host reads after GPU reads instead of overlapped")
    parser.add_argument("--concurrency", default="1,4,6", help="comma-separated stream counts (default 1,4,6)")
    parser.add_argument("--json", type=Path, help="also write the table as JSON")
    parser.set_defaults(handler=run)


def bandwidths(pcie_gbs: float | None, hbm_gbs: float | None, gpu_check: Path | None) -> tuple[float, float]:
    """(link, HBM) bytes/s: flags win, then gpu-check's largest-read UVA and HBM figures, then the model's defaults.

    The largest read size is used because a routed expert's trellis is megabytes, read in long runs."""
    defaults = DecodeCostModel(top_k=1)
    link, hbm = defaults.link_bytes_per_s, defaults.gpu_bytes_per_s
    if gpu_check is not None:
        limits = json.loads(gpu_check.read_text())
        link, hbm = (_largest_read(limits, key) * GB for key in ("uva_kernel_read_gbs", "hbm_kernel_read_gbs"))
    return (link if pcie_gbs is None else pcie_gbs * GB), (hbm if hbm_gbs is None else hbm_gbs * GB)


def _largest_read(limits: dict, key: str) -> float:
    try:
        by_size = limits[key]
        return float(by_size[max(by_size, key=lambda name: int(name.removesuffix("KiB")))])
    except (KeyError, TypeError, ValueError) as exc:
        raise ToolInputError(f"gpu-check file lacks a usable {key!r} ({{'<n>KiB': GB/s}}): {exc!r}") from None


def plan_sizes(identity: ModelIdentity, model: Path | None, expert_bytes: int | None) -> np.ndarray:
    """[moe layers, experts] per-GPU sizes from the checkpoint or one uniform size; a plan records only their
    checksum, so sizes that do not match it are refused."""
    if model is not None:
        _, sizes, checkpoint_identity = expert_sizes(Exl3Checkpoint.open(model), identity.tp_size)
        if (difference := identity.first_difference(checkpoint_identity)) is not None:
            raise ToolInputError(f"the plan was made for another model than {model}: {difference}")
        return sizes
    sizes = np.full((len(identity.moe_layers), identity.num_experts), expert_bytes, dtype=np.int64)
    if expert_bytes_checksum(sizes) != identity.expert_bytes_sha256:
        raise ToolInputError(f"the plan was made for other expert sizes than {expert_bytes} bytes each "
                         "(expert_bytes_sha256 differs): pass --model, or the per-GPU size `plan` used")
    return sizes


def selections_per_token(identity: ModelIdentity, model: DecodeCostModel, stats: Path | None) -> np.ndarray:
    """Per-token selection probability of each expert: measured counts, or top_k / experts everywhere."""
    if stats is None:
        shape = (len(identity.moe_layers), identity.num_experts)
        return np.full(shape, model.top_k / identity.num_experts)
    return model.selections_per_token(RoutingCounts.load(stats, expected=identity).counts)


def format_table(bounds: list[StepBound]) -> str:
    lines = ["streams  experts/layer  GPU GB/step  host GB/step  step ms  tok/s per stream  tok/s aggregate"]
    lines += [f"{b.concurrency:7d}  {b.distinct_experts_per_layer:13.2f}  {b.gpu_bytes / GB:11.3f}  "
              f"{b.host_bytes / GB:12.3f}  {b.step_s * 1e3:7.3f}  {b.per_stream_tok_s:16.1f}  "
              f"{b.aggregate_tok_s:15.1f}" for b in bounds]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Exit status 2 with one `error:` line for a plan, statistics or limits file that does not fit the flags."""
    try:
        plan, identity = read_plan(args.plan)
        if identity.ep_size > 1:  # each rank reads its own experts, in parallel: not what one step's sum models
            raise ToolInputError(f"{args.plan} is an expert-parallel plan (ep_size {identity.ep_size}); simulate models "
                             "one rank holding a share of every expert, not expert parallelism, yet")
        link, hbm = bandwidths(args.pcie_gbs, args.hbm_gbs, args.gpu_check)
        model = DecodeCostModel(args.top_k, link, hbm, args.dense_bytes_per_layer, overlap=not args.serial)
        sizes = plan_sizes(identity, args.model, args.expert_bytes)
        probabilities = selections_per_token(identity, model, args.stats)
        bounds = [step_bound(model, plan, sizes, probabilities, int(c)) for c in args.concurrency.split(",")]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"plan {args.plan}: {len(identity.moe_layers)} MoE layers x {identity.num_experts} experts, "
          f"{int(plan.sum())} on GPU; link {link / GB:.1f} GB/s, HBM {hbm / GB:.0f} GB/s, "
          f"{'serial' if args.serial else 'overlapped'}; routing {args.stats or 'uniform'}")
    print(format_table(bounds))
    print("upper bound: attention, KV reads, compute and launch overhead are not counted")
    if args.json:
        rows = [{"concurrency": b.concurrency, "distinct_experts_per_layer": b.distinct_experts_per_layer,
                 "gpu_bytes": b.gpu_bytes, "host_bytes": b.host_bytes, "step_s": b.step_s,
                 "per_stream_tok_s": b.per_stream_tok_s, "aggregate_tok_s": b.aggregate_tok_s} for b in bounds]
        settings = {"plan": str(args.plan), "link_bytes_per_s": link, "gpu_bytes_per_s": hbm, "top_k": args.top_k,
                    "stats": None if args.stats is None else str(args.stats), "overlap": not args.serial}
        args.json.write_text(json.dumps({"settings": settings, "concurrency": rows}, indent=2) + "\n")
    return 0
