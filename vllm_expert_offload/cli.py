"""The `vllm-expert-offload` console script: argument parsing and dispatch only (commands live in tools/)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .errors import ExpertOffloadError
from .tools import (
    bench_cmd,
    bench_kernels_cmd,
    check_kv_cmd,
    inspect_cmd,
    plan_cmd,
    predict_decode_cmd,
    quantize_cmd,
    simulate_cache_cmd,
    simulate_cmd,
    topology_cmd,
)

COMMANDS = (inspect_cmd, quantize_cmd, plan_cmd, topology_cmd, check_kv_cmd, bench_kernels_cmd, simulate_cmd,
            simulate_cache_cmd, predict_decode_cmd, bench_cmd)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-expert-offload", description="Tools for serving EXL3 MoE checkpoints with vllm-expert-offload."
    )
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of a refusal instead of its one-line message")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status 2 with one `error:` line for anything the plugin refuses (a bad checkpoint, flag or file, the
    same checks serving applies): the message already names the tensor, file or flag at fault, so a traceback
    would only bury it; `--debug` shows it. Exit status 2 is also argparse's for a malformed command line."""
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except ExpertOffloadError as exc:
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
