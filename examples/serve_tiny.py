"""The main job, end to end on a CPU: build a tiny EXL3 Qwen3-MoE checkpoint, serve it with `vllm serve`
and this plugin (half of each layer's routed experts in the host tier), ask one question, print the answer.

    .venv/bin/python examples/serve_tiny.py [--arch qwen3_moe|mixtral] [--host-fraction 0.5]

The model has random weights, so the answer is fluent nonsense; what matters is that every step of
the real serving path ran: checkpoint validation, EXL3 loading, expert placement, generation.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from openai import OpenAI

from vllm_expert_offload.testing.server import vllm_server
from vllm_expert_offload.testing.tiny_models import build_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen3_moe", choices=["qwen3_moe", "mixtral"])
    parser.add_argument("--host-fraction", type=float, default=0.5, help="share of each layer's experts on host")
    parser.add_argument("--block-size", type=int, default=128)
    args = parser.parse_args()

    model_dir = build_tiny_model(None, args.arch)
    print(f"[serve_tiny] checkpoint: {model_dir}")
    offload = {"expert_offload": {"host_fraction": args.host_fraction}}
    log = Path(tempfile.gettempdir()) / "vllm-expert-offload-serve_tiny.log"
    extra = ["--block-size", str(args.block_size), "--additional-config", json.dumps(offload)]
    print(f"[serve_tiny] starting vllm serve (log: {log}); the first start takes about a minute")
    with vllm_server(model_dir, extra, log_path=log) as server:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Name a prime number."}],
            max_tokens=24, temperature=0,
        )
        print(f"[serve_tiny] answer: {reply.choices[0].message.content!r}")
    placement = [line for line in log.read_text().splitlines() if "expert placement" in line]
    print("[serve_tiny] " + (placement[-1].split("] ", 1)[-1] if placement else "no placement line logged"))


if __name__ == "__main__":
    main()
