"""EXL3 kernels on a GPU, per backend, side by side in one run, each beside its roofline.

    python3 benchmarks/bench_gpu_kernels.py --json gpu-kernels.json [--limits limits.json]
    python3 benchmarks/bench_gpu_kernels.py --smoke --json out.json      # CPU, Triton interpreter, tiny shapes

- One Qwen3-30B-A3B-shaped MoE layer (hidden 2048, intermediate 768, 128 experts, top-8, K=3 MUL1, random
  trellis) at 1, 8 and 64 tokens with 0/25/50/100 % of the experts in the mapped host arena, for the triton and
  torch backends. Bytes read per forward = the trellises (+ scales) of the experts the batch selects, split by tier;
  roofline = GPU-tier bytes / HBM bandwidth + host-tier bytes / zero-copy read bandwidth (serialised; perfect
  overlap would be the max), bandwidths from `--limits` (../shared/tools/gpu-limits output) when given.
- One dense 4096 x 4096 K=4 linear (triton) beside fp16 `torch.matmul` of the same shape, at 1, 8 and 64 rows.
Timing: CUDA events around each forward, median of the repeats after one warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone

import torch

from vllm_expert_offload.exl3 import Codebook, Exl3Linear
from vllm_expert_offload.exl3.naming import PROJECTIONS
from vllm_expert_offload.kernels.linear import LinearShard
from vllm_expert_offload.kernels.oracle import KernelChoice, build_linear_kernel, build_moe_kernel
from vllm_expert_offload.kernels.pointer_tables import (
    build_pointer_tables,
    host_record_bytes,
    kernel_address,
    place_expert,
    stack_scales,
)
from vllm_expert_offload.kernels.table_moe import ExpertCrop
from vllm_expert_offload.memory import HostArena

FULL = {"hidden": 2048, "intermediate": 768, "experts": 128, "top_k": 8, "k": 3, "tokens": (1, 8, 64),
        "host_shares": (0.0, 0.25, 0.5, 1.0), "dense": 4096, "dense_k": 4, "repeats": 3}
SMOKE = {"hidden": 128, "intermediate": 128, "experts": 8, "top_k": 2, "k": 3, "tokens": (1, 9),
         "host_shares": (0.0, 1.0), "dense": 128, "dense_k": 4, "repeats": 1}
BACKENDS = ("triton", "torch")


def random_linear(gen: torch.Generator, in_features: int, out_features: int, k: int, device) -> Exl3Linear:
    trellis = torch.randint(-(1 << 15), 1 << 15, (in_features // 16, out_features // 16, 16 * k), generator=gen,
                            dtype=torch.int16)
    suh = ((torch.rand(in_features, generator=gen) + 0.5) * (torch.randint(0, 2, (in_features,), generator=gen) * 2 - 1))
    svh = torch.rand(out_features, generator=gen) * 0.02 + 0.01
    return Exl3Linear("bench", trellis.to(device), suh.half().to(device), svh.half().to(device), Codebook.MUL1, k)


def timed(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median seconds of `fn` after one warm-up (CUDA events on a GPU, wall clock on a CPU)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def moe_layer(shape: dict, host_share: float, backend: str, device: torch.device):
    """(kernel, per-expert bytes, GPU-tier mask) for one layer with the last `host_share` of experts on host."""
    gen = torch.Generator().manual_seed(0)
    h, i, k = shape["hidden"], shape["intermediate"], shape["k"]
    sets = [{"gate": random_linear(gen, h, i, k, "cpu"), "up": random_linear(gen, h, i, k, "cpu"),
             "down": random_linear(gen, i, h, k, "cpu")} for _ in range(shape["experts"])]
    n_host = round(host_share * len(sets))
    gpu_tier = [e < len(sets) - n_host for e in range(len(sets))]
    host_bytes = sum(host_record_bytes(s) for s, gpu in zip(sets, gpu_tier) if not gpu)
    arena = HostArena(host_bytes, device=device) if host_bytes else None
    placed = [place_expert(s, gpu, arena, device) for s, gpu in zip(sets, gpu_tier)]
    experts, scales = stack_scales(placed, device)
    tables = build_pointer_tables(experts, kernel_address(arena, device), device)
    choice = KernelChoice(backend, backend, "benchmark")
    kernel = build_moe_kernel(choice, experts, tables, scales, arena, ExpertCrop(h, i, 0), torch.float16, device)
    expert_bytes = sum(s[p].nbytes() for p in PROJECTIONS for s in sets[:1])
    return kernel, expert_bytes, torch.tensor(gpu_tier)


def bench_moe(shape: dict, limits: dict, device: torch.device) -> list[dict]:
    rows = []
    for host_share in shape["host_shares"]:
        for backend in BACKENDS:
            kernel, expert_bytes, gpu_tier = moe_layer(shape, host_share, backend, device)
            for tokens in shape["tokens"]:
                gen = torch.Generator().manual_seed(tokens)
                x = torch.randn(tokens, shape["hidden"], generator=gen).half().to(device)
                ids = torch.stack([torch.randperm(shape["experts"], generator=gen)[: shape["top_k"]]
                                   for _ in range(tokens)])
                weights = torch.rand(tokens, shape["top_k"], generator=gen).to(device)
                device_ids = ids.to(device)
                seconds = timed(lambda: kernel.forward(x, weights, device_ids, False), shape["repeats"], device)
                selected = torch.unique(ids)
                host_read = int((~gpu_tier[selected]).sum()) * expert_bytes
                gpu_read = int(gpu_tier[selected].sum()) * expert_bytes
                roofline = _roofline(gpu_read, host_read, limits)
                rows.append({"backend": backend, "host_share": host_share, "tokens": tokens, "seconds": seconds,
                             "gpu_bytes": gpu_read, "host_bytes": host_read, "roofline_s": roofline,
                             "fraction_of_roofline": None if roofline is None else roofline / seconds})
            del kernel
    return rows


def _roofline(gpu_bytes: int, host_bytes: int, limits: dict) -> float | None:
    hbm, uva = limits.get("hbm_gbs"), limits.get("uva_gbs")
    if hbm is None or uva is None:
        return None
    return gpu_bytes / (hbm * 1e9) + host_bytes / (uva * 1e9)


def bench_dense(shape: dict, device: torch.device) -> list[dict]:
    n, k = shape["dense"], shape["dense_k"]
    layer = random_linear(torch.Generator().manual_seed(1), n, n, k, "cpu")
    triton = build_linear_kernel(KernelChoice("triton", "triton", "benchmark"),
                                 [LinearShard(layer, 0, n, n, 0, n)], torch.float16, device)
    dense = torch.randn(n, n, device=device).half() / n**0.5
    rows = []
    for tokens in shape["tokens"]:
        x = torch.randn(tokens, n, device=device).half()
        exl3_s = timed(lambda: triton.forward(x), shape["repeats"], device)
        fp16_s = timed(lambda: x @ dense if device.type == "cuda" else x.float() @ dense.float(), shape["repeats"],
                       device)
        rows.append({"tokens": tokens, "exl3_triton_s": exl3_s, "fp16_matmul_s": fp16_s,
                     "exl3_bytes": layer.nbytes(), "fp16_bytes": 2 * n * n, "ratio_to_fp16": fp16_s / exl3_s})
    return rows


def _limits(path: str | None) -> dict:
    """HBM and zero-copy read bandwidths (GB/s) from gpu-limits' JSON: the largest-read figures."""
    if path is None:
        return {}
    raw = json.loads(open(path).read())
    return {"hbm_gbs": max(raw["hbm_kernel_read_gbs"].values()), "uva_gbs": max(raw["uva_kernel_read_gbs"].values()),
            "h2d_copy_gbs": raw.get("h2d_copy_gbs")}


def _print_table(result: dict) -> None:
    print(f"{'backend':8s} {'host':>5s} {'tokens':>6s} {'ms':>9s} {'roofline ms':>12s} {'fraction':>9s}")
    for r in result["moe"]:
        roof = "-" if r["roofline_s"] is None else f"{r['roofline_s'] * 1e3:.3f}"
        frac = "-" if r["fraction_of_roofline"] is None else f"{r['fraction_of_roofline']:.2f}"
        print(f"{r['backend']:8s} {r['host_share']:5.2f} {r['tokens']:6d} {r['seconds'] * 1e3:9.3f} {roof:>12s} {frac:>9s}")
    for r in result["dense"]:
        print(f"dense {result['shape']['dense']}^2 K={result['shape']['dense_k']} x{r['tokens']}: triton "
              f"{r['exl3_triton_s'] * 1e3:.3f} ms, fp16 matmul {r['fp16_matmul_s'] * 1e3:.3f} ms "
              f"(triton at {r['ratio_to_fp16']:.2f}x fp16 speed)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--limits", help="JSON from ../shared/tools/gpu-limits/limits.py, for the rooflines")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    args = parser.parse_args(argv)
    if args.smoke:
        device, shape = torch.device("cpu"), SMOKE
        if os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("--smoke runs Triton on the CPU: set TRITON_INTERPRET=1")
    elif torch.cuda.is_available():
        device, shape = torch.device("cuda", 0), FULL
    else:
        parser.error("no CUDA device (use --smoke for the CPU code path)")
    limits = _limits(args.limits)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "shape": shape, "limits": limits,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
              "torch": torch.__version__, "moe": bench_moe(shape, limits, device), "dense": bench_dense(shape, device)}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    _print_table(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
