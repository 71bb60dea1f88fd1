"""`predict-decode`: decode tok/s per stream of a described machine, zero-copy / cache / cache + CPU tier.

The routing stream and the cache replay are simulate-cache's (tools/cache_workloads.py, cache_replay.py); the
time of each step is tools/decode_prediction.py's model, whose CPU-tier split is the server's own rule
(placement/cost.py `balanced_cpu_split`). Rates are the user's: the tool predicts for the machine it is told about.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from ..placement.cost import TierRates
from ..placement.errors import PlacementError
from ..units import GIB, MIB
from .decode_prediction import MODES, DescribedModel, Machine, MachineDescriptionError, data_budget, data_slots, predict
from .simulate_cache_cmd import add_stream_arguments, fail, load_stream

# flag -> (what it is, lower bound, whether the bound itself is allowed)
_RATES = {
    "--gpu-gbs": ("GPU memory read rate, GB/s (1e9 bytes/s)", 0.0, False),
    "--link-gbs": ("rate at which GPU kernels read host-resident experts in place (zero-copy), GB/s", 0.0, False),
    "--cpu-gbs": ("CPU tier's rate on one expert with one token, GB/s of expert record", 0.0, False),
    "--cpu-overhead-us": ("fixed cost of a step that gives the CPU tier any expert, microseconds", 0.0, True),
    "--gpu-budget-gib": ("GPU memory for routed experts (plan or cache slots), GiB", 0.0, True),
    "--expert-mib": ("one routed expert's record, MiB", 0.0, False),
    "--dense-gib": ("non-routed weights read from GPU memory per token, GiB", 0.0, True),
}
_COUNTS = {
    "--model-layers": "MoE layers of the described model",
    "--model-experts": "routed experts per layer of the described model",
    "--model-top-k": "experts a token selects per layer in the described model",
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "predict-decode", help="decode tok/s per stream of a described machine on routing data (3 modes)",
        description=__doc__.splitlines()[0],
    )
    add_stream_arguments(parser)
    for flag, (what, _, _) in _RATES.items():
        parser.add_argument(flag, required=flag not in ("--cpu-overhead-us", "--dense-gib"), default="0",
                            help=what + (" (default 0)" if flag in ("--cpu-overhead-us", "--dense-gib") else ""))
    for flag, what in _COUNTS.items():
        parser.add_argument(flag, required=True, help=what)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.set_defaults(handler=run)


def _number(args: argparse.Namespace, flag: str) -> float:
    raw = getattr(args, flag[2:].replace("-", "_"))
    _, lo, inclusive = _RATES[flag]
    try:
        value = float(raw)
    except ValueError:
        raise MachineDescriptionError(f"{flag}: {raw!r} is not a number") from None
    if not math.isfinite(value) or value < lo or (value == lo and not inclusive):
        raise MachineDescriptionError(f"{flag}: {raw!r} must be a finite number {'>=' if inclusive else '>'} {lo:g}")
    return value


def _count(args: argparse.Namespace, flag: str) -> int:
    raw = getattr(args, flag[2:].replace("-", "_"))
    if not raw.isdigit() or int(raw) < 1:
        raise MachineDescriptionError(f"{flag}: {raw!r} must be an integer >= 1")
    return int(raw)


def describe(args: argparse.Namespace) -> tuple[Machine, DescribedModel]:
    """The machine and model of the flags, each value checked and refused by its flag."""
    numbers = {flag: _number(args, flag) for flag in _RATES}
    counts = {flag: _count(args, flag) for flag in _COUNTS}
    tier = TierRates(((1, numbers["--cpu-gbs"] * 1e9),), numbers["--link-gbs"] * 1e9,
                     numbers["--cpu-overhead-us"] * 1e-6)
    machine = Machine(numbers["--gpu-gbs"] * 1e9, tier, numbers["--gpu-budget-gib"] * GIB)
    model = DescribedModel(counts["--model-layers"], counts["--model-experts"], counts["--model-top-k"],
                           numbers["--expert-mib"] * MIB, numbers["--dense-gib"] * GIB)
    return machine, model


def run(args: argparse.Namespace) -> int:
    try:
        machine, model = describe(args)
        settings, workload = load_stream(args)
        totals = predict(machine, model, workload, settings, progress=sys.stderr.isatty())
    except (PlacementError, ValueError) as exc:
        return fail(str(exc))
    tokens, layers, _ = workload.shape
    slots, fraction = data_budget(machine, model)
    reads = tokens * layers * model.top_k
    result = {
        "data": str(args.data),
        "stream": workload.description,
        "tokens": tokens,
        "data_layers": layers,
        "data_experts": workload.num_experts,
        "policy": settings.policy,
        "half_life_tokens": settings.half_life_tokens,
        "machine": {"gpu_gbs": machine.gpu_bytes_per_s / 1e9, "link_gbs": machine.link_bytes_per_s / 1e9,
                    "cpu_gbs": machine.cpu.cpu_points[0][1] / 1e9, "cpu_overhead_us": machine.cpu.cpu_overhead_s * 1e6,
                    "gpu_budget_gib": machine.gpu_budget_bytes / GIB},
        "model": {"layers": model.layers, "experts": model.experts, "top_k": model.top_k,
                  "expert_mib": model.expert_bytes / MIB, "dense_gib": model.dense_bytes_per_token / GIB},
        "slots_per_layer": slots,
        "budget_fraction": fraction,
        "data_slots_per_layer": data_slots(machine, model, workload),
        "modes": {},
    }
    for mode in MODES:
        t = totals[mode]
        bound = t.bound_by / t.bound_by.sum()
        result["modes"][mode] = {
            "tok_s": tokens / t.seconds,
            "ms_per_token": 1e3 * t.seconds / tokens,
            "gpu_read_share": t.gpu_reads / reads,
            "per_layer": {"gpu": t.gpu_reads / (tokens * layers), "link": t.link_reads / (tokens * layers),
                          "cpu": t.cpu_reads / (tokens * layers), "fills": t.fills / (tokens * layers)},
            "layers_bound_by": {"gpu_memory": float(bound[0]), "link": float(bound[1]), "cpu": float(bound[2])},
        }
    print(f"{args.data.name}, {slots} slots per layer ({100 * fraction:.1f} % of the experts; "
          f"{result['data_slots_per_layer']} of {workload.num_experts} in the data): decode tok/s per stream "
          + ", ".join(f"{mode.replace('_', ' ')} {m['tok_s']:.2f} (GPU reads {100 * m['gpu_read_share']:.1f} %)"
                      for mode, m in result["modes"].items()))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0
