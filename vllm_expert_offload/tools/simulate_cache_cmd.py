"""`simulate-cache`: replay real routing through the engine's expert cache policy and compare it with static plans.

The same `ExpertCache` code the engine runs (offload/cache_policy.py), on CPU tensors, token by token over a stream
built from one routing-data folder (tools/cache_workloads.py); the static baselines are the planner's plans from
counts gathered elsewhere and from the evaluated tokens themselves (tools/cache_replay.py says how each is counted).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..offload.cache_policy import DEFAULT_HALF_LIFE_TOKENS, POLICIES, CacheSettings
from ..placement.errors import PlacementError
from .cache_replay import STATIC, replay_cache, slots_per_layer, static_host_share
from .cache_workloads import Workload, load_workload
from .errors import ToolInputError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "simulate-cache", help="host-read share of the dynamic expert cache vs static plans on routing data",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("--budget", required=True, type=float,
                        help="GPU budget as a fraction of the routed experts (0-1), the same for every layer")
    add_stream_arguments(parser)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.set_defaults(handler=run)


def add_stream_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that pick a routing stream and the cache policy replayed over it (shared with predict-decode)."""
    parser.add_argument("--data", required=True, type=Path,
                        help="one routing-data folder, e.g. ../shared/data/routing/moe-beyond")
    parser.add_argument("--policy", default="decayed-lfu", choices=POLICIES)
    parser.add_argument("--half-life-tokens", type=float, default=DEFAULT_HALF_LIFE_TOKENS)
    parser.add_argument("--subset", help="only the routing sets whose name ends with this (moe-interp: base, chat, "
                                         "olmoe or qwen picks the model)")
    parser.add_argument("--top-k", type=int, help="experts a token selects per layer (needed for count data)")
    parser.add_argument("--block-tokens", type=int, default=10_000,
                        help="tokens sampled from each count set (count data; default 10000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the count sampling (default 0)")
    parser.add_argument("--max-tokens", type=int, help="replay only the stream's first N tokens (a quick look)")


def load_stream(args: argparse.Namespace) -> tuple[CacheSettings, Workload]:
    """The cache settings and the routing stream the stream flags describe; PlacementError/ValueError name the
    flag or file at fault."""
    settings = CacheSettings(args.policy, args.half_life_tokens)
    workload = load_workload(args.data, subset=args.subset, top_k=args.top_k, block_tokens=args.block_tokens,
                             seed=args.seed)
    if args.max_tokens is not None:
        if args.max_tokens < 1:
            raise ToolInputError(f"--max-tokens: {args.max_tokens} is below 1")
        workload = workload.prefix(args.max_tokens)
    return settings, workload


def run(args: argparse.Namespace) -> int:
    if not 0.0 <= args.budget <= 1.0:
        return fail(f"--budget: {args.budget} is outside [0, 1]")
    try:
        settings, workload = load_stream(args)
    except (PlacementError, ValueError) as exc:
        return fail(str(exc))
    replay = replay_cache(workload, settings, args.budget, progress=sys.stderr.isatty())
    tokens, layers, k = workload.shape
    result = {
        "data": str(args.data),
        "stream": workload.description,
        "blocks": [block.name for block in workload.blocks],
        "tokens": tokens,
        "layers": layers,
        "experts": workload.num_experts,
        "top_k": k,
        "budget": args.budget,
        "slots_per_layer": slots_per_layer(args.budget, workload.num_experts),
        "policy": settings.policy,
        "half_life_tokens": settings.half_life_tokens,
        "seed": args.seed,
        "host_read_share": replay.host_read_share,
        "reads": int(replay.hits.sum() + replay.misses.sum()),
        "host_reads": int(replay.misses.sum()),
        "fills": replay.fills,
        "evictions": replay.evictions,
        "moves_per_1k_tokens": 1000.0 * replay.fills / tokens,
        "host_read_share_per_layer": (replay.misses / (replay.hits + replay.misses)).tolist(),
        "static": {plan: static_host_share(workload, args.budget, plan) for plan in STATIC},
    }
    print(f"{args.data.name} at {args.budget:.0%}: {settings.policy} {100 * result['host_read_share']:.1f} % host "
          f"reads ({result['moves_per_1k_tokens']:.0f} fills per 1k tokens); static plans: "
          + ", ".join(f"{plan.replace('_', ' ')} {100 * share:.1f} %" for plan, share in result["static"].items()))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def fail(message: str) -> int:
    """Exit status 2 with one `error:` line (the message names the flag or file at fault)."""
    print(f"error: {message}", file=sys.stderr)
    return 2
