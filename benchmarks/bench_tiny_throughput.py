"""Decode throughput of a tiny EXL3 MoE served by the plugin vs its dequantized dense twin on stock vLLM,
side by side in one run on the CPU engine.

    .venv/bin/python benchmarks/bench_tiny_throughput.py [--arch qwen3_moe] [--prompts 8] [--tokens 128]

Each configuration runs in a fresh engine process; the time measured is `LLM.generate` alone. On a CPU the
plugin's compiled kernel decodes every trellis tile on every use (GPU and host tier alike; the tiers only
matter for accounting there), beside the torch reference backend, so these ratios are the cost of decoding
on a CPU, not a prediction of GPU behaviour.
"""

from __future__ import annotations

import argparse
import platform
import random
import subprocess
from datetime import datetime, timezone

from vllm_expert_offload.testing.engine import EngineSpec, generate_timed
from vllm_expert_offload.testing.tiny_models import build_dense_twin, build_tiny_model


def _cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen3_moe")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    exl3 = str(build_tiny_model(None, args.arch))
    twin = str(build_dense_twin(exl3))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 700) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    configs = {
        "dense twin, stock vLLM (bf16)": (twin, None),
        "EXL3 plugin, CPU kernel, all experts GPU tier (bf16)": (exl3, None),
        "EXL3 plugin, CPU kernel, all experts host tier (bf16)": (exl3, {"expert_offload": {"host_fraction": 1.0}}),
        "EXL3 plugin, torch reference, all experts host tier (bf16)":
            (exl3, {"expert_offload": {"host_fraction": 1.0, "kernel": "torch"}}),
    }
    rates: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.repeats):  # interleaved, so drift in machine load hits every configuration alike
        for name, (model, extra) in configs.items():
            spec = EngineSpec(model, prompts, args.tokens, dtype="bfloat16", additional_config=extra)
            _, seconds = generate_timed(spec)
            rates[name].append(args.prompts * args.tokens / seconds)
    base = max(rates["dense twin, stock vLLM (bf16)"])
    print(f"\n{args.arch}: {args.prompts} prompts x {args.prompt_len} tokens, {args.tokens} new tokens each; "
          f"best of {args.repeats}; {_cpu_name()}, {platform.python_version()}; "
          f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC\n")
    print("| configuration | generated tok/s (best) | runs | vs dense twin |")
    print("|---|---|---|---|")
    for name, values in rates.items():
        runs = ", ".join(f"{v:.0f}" for v in values)
        print(f"| {name} | {max(values):.0f} | {runs} | {max(values) / base:.2f}x |")


if __name__ == "__main__":
    main()
