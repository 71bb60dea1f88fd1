"""A routing-statistics collection run: serve, send representative traffic, save the counts, show what they say.

    .venv/bin/python examples/collect_routing_stats.py --out stats.json                       # tiny model, on a CPU
    python examples/collect_routing_stats.py --model /models/M --tp 2 --prompts prompts.txt --out stats.json

It starts `vllm serve` with `record_stats` (any placement works while counting: half of each layer's experts on
host by default), sends every prompt of --prompts (one per line; default: a few built-in coding-agent turns) at
temperature 0, asks the server for the file with SIGUSR1, as an operator would with `kill -USR1 <pid>`, and
prints how concentrated the routing is plus the `plan` command that uses the file. Counts must come from traffic
like the one the server will serve: the planner keeps on the GPU the experts these prompts select most.
On a server that is already running with `record_stats`, skip this script: send your traffic and `kill -USR1`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time
from pathlib import Path

import numpy as np
from openai import OpenAI

from vllm_expert_offload.placement import RoutingCounts
from vllm_expert_offload.testing.server import vllm_server
from vllm_expert_offload.testing.tiny_models import build_tiny_model

BUILT_IN_PROMPTS = [
    "Write a Python function that merges two sorted lists.",
    "Explain what this does: sorted(set(words), key=len)",
    "Fix the bug: for i in range(len(xs)): xs.remove(xs[i])",
    "Write a unit test for a function that parses ISO dates.",
    "Refactor this loop into a list comprehension: out = []; for x in xs: out.append(x * 2)",
    "Summarize the difference between a process and a thread in three sentences.",
]


def _wait_for(log: Path, text: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{text!r} not in {log} after {timeout_s} s")
        time.sleep(0.1)


def summarize(counts: RoutingCounts, top: int) -> str:
    """Share of each layer's selections that its `top` most selected experts take (uniform routing: top/experts)."""
    share = np.sort(counts.counts, axis=1)[:, ::-1][:, :top].sum(axis=1) / np.maximum(counts.counts.sum(axis=1), 1)
    return (f"{counts.tokens} tokens counted over {len(counts.moe_layers)} MoE layers x {counts.num_experts} "
            f"experts; the top {top} experts of a layer take {share.min():.0%}-{share.max():.0%} of its selections "
            f"(uniform routing: {top / counts.num_experts:.0%})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="EXL3 checkpoint directory (default: the tiny test model)")
    parser.add_argument("--tp", type=int, default=1, help="--tensor-parallel-size for vllm serve")
    parser.add_argument("--host-fraction", type=float, default=0.5, help="placement while counting")
    parser.add_argument("--prompts", type=Path, help="text file, one prompt per line")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt")
    parser.add_argument("--out", type=Path, required=True, help="statistics file to write")
    parser.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                        help="extra vllm serve argument, repeatable (e.g. --serve-arg=--max-model-len=8192)")
    args = parser.parse_args()

    model = args.model or build_tiny_model(None, "qwen3_moe")
    prompts = args.prompts.read_text().splitlines() if args.prompts else BUILT_IN_PROMPTS
    prompts = [p for p in prompts if p.strip()]
    out = args.out.resolve()
    offload = {"expert_offload": {"host_fraction": args.host_fraction, "record_stats": str(out)}}
    log = Path(tempfile.gettempdir()) / "vllm-expert-offload-collect.log"
    serve_args = ["--shutdown-timeout", "30", "--additional-config", json.dumps(offload), *args.serve_arg]
    print(f"[collect] serving {model} (log: {log})")
    with vllm_server(model, serve_args, tensor_parallel_size=args.tp, log_path=log) as server:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        name = client.models.list().data[0].id
        for i, prompt in enumerate(prompts, 1):
            client.chat.completions.create(model=name, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=args.max_tokens, temperature=0)
            print(f"[collect] {i}/{len(prompts)} prompts served", end="\r", flush=True)
        os.kill(server.pid, signal.SIGUSR1)  # the API server's pid only: its engine processes die of SIGUSR1
        _wait_for(log, f"routing statistics saved to ['{out}'] (SIGUSR1)")
    counts = RoutingCounts.load(out)
    print(f"\n[collect] wrote {out}: {summarize(counts, max(1, counts.num_experts // 4))}")
    print(f"[collect] next: vllm-expert-offload plan --model {model} --tp {args.tp} --stats {out} "
          f"--gpu-budget-gib <GiB per GPU for experts> --out plan.json")


if __name__ == "__main__":
    main()
