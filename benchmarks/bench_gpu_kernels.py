"""EXL3 kernels on a GPU, per backend, side by side in one run, each beside its roofline.

    python3 benchmarks/bench_gpu_kernels.py --json gpu-kernels.json [--limits limits.json]
    python3 benchmarks/bench_gpu_kernels.py --smoke --json out.json      # CPU, Triton interpreter, tiny shapes

- One Qwen3-30B-A3B-shaped MoE layer (hidden 2048, intermediate 768, 128 experts, top-8, K=3 MUL1, random
  trellis) at 1, 8 and 64 tokens with 0/25/50/100 % of the experts in the mapped host arena, for each backend that
  can run here (exllamav3 where its compiled extension imports, triton, torch; the others are listed with why not). Bytes read per forward = the trellises (+ scales) of the experts the batch selects, split by tier;
  roofline = GPU-tier bytes / HBM bandwidth + host-tier bytes / zero-copy read bandwidth (serialised; perfect
  overlap would be the max), bandwidths from `--limits` (../shared/tools/gpu-limits output) when given.
- One dense 4096 x 4096 K=4 linear (exllamav3's exl3_gemm, triton) beside fp16 `torch.matmul` of the same shape, at
  1, 8 and 64 rows.
Timing: CUDA events around each forward, median of the repeats after one warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import datetime, timezone

import torch

from vllm_expert_offload.kernels.contract import LinearLayer
from vllm_expert_offload.kernels.linear import LinearShard
from vllm_expert_offload.kernels.oracle import KernelChoice, build_linear_kernel, why_unavailable
from vllm_expert_offload.tools.random_layers import median_seconds, random_linear, random_moe

FULL = {"hidden": 2048, "intermediate": 768, "experts": 128, "top_k": 8, "k": 3, "tokens": (1, 8, 64),
        "host_shares": (0.0, 0.25, 0.5, 1.0), "dense": 4096, "dense_k": 4, "repeats": 3}
SMOKE = {"hidden": 128, "intermediate": 128, "experts": 8, "top_k": 2, "k": 3, "tokens": (1, 9),
         "host_shares": (0.0, 1.0), "dense": 128, "dense_k": 4, "repeats": 1}
BACKENDS = ("exllamav3", "triton", "torch")


def usable_backends(device: torch.device) -> tuple[list[str], dict[str, str]]:
    """The backends that can run on `device`, and why each other one cannot."""
    why_not = {b: why_unavailable(b, device) for b in BACKENDS}
    return [b for b in BACKENDS if why_not[b] is None], {b: why for b, why in why_not.items() if why is not None}


def bench_moe(shape: dict, limits: dict, device: torch.device, backends: list[str]) -> list[dict]:
    rows = []
    for host_share in shape["host_shares"]:
        for backend in backends:
            layer = random_moe(shape["hidden"], shape["intermediate"], shape["experts"], shape["k"], host_share,
                               backend, device)
            kernel, expert_bytes, gpu_tier = layer.kernel, layer.expert_bytes, layer.gpu_tier
            for tokens in shape["tokens"]:
                gen = torch.Generator().manual_seed(tokens)
                x = torch.randn(tokens, shape["hidden"], generator=gen).half().to(device)
                ids = torch.stack([torch.randperm(shape["experts"], generator=gen)[: shape["top_k"]]
                                   for _ in range(tokens)])
                weights = torch.rand(tokens, shape["top_k"], generator=gen).to(device)
                device_ids = ids.to(device)
                seconds = median_seconds(lambda: kernel.forward(x, weights, device_ids, False), shape["repeats"], device)
                selected = torch.unique(ids)
                host_read = int((~gpu_tier[selected]).sum()) * expert_bytes
                gpu_read = int(gpu_tier[selected].sum()) * expert_bytes
                roofline = _roofline(gpu_read, host_read, limits)
                rows.append({"backend": backend, "host_share": host_share, "tokens": tokens, "seconds": seconds,
                             "gpu_bytes": gpu_read, "host_bytes": host_read, "roofline_s": roofline,
                             "fraction_of_roofline": None if roofline is None else roofline / seconds})
            del kernel, layer
    return rows


def _roofline(gpu_bytes: int, host_bytes: int, limits: dict) -> float | None:
    hbm, uva = limits.get("hbm_gbs"), limits.get("uva_gbs")
    if hbm is None or uva is None:
        return None
    return gpu_bytes / (hbm * 1e9) + host_bytes / (uva * 1e9)


def bench_dense(shape: dict, device: torch.device, backends: list[str]) -> list[dict]:
    """Per row count: fp16 matmul and each trellis-reading backend (`exl3_<backend>_s`, `<backend>_ratio_to_fp16`)."""
    n, k = shape["dense"], shape["dense_k"]
    layer = random_linear(torch.Generator().manual_seed(1), n, n, k)
    spec = LinearLayer([LinearShard(layer, 0, n, n, 0, n)], torch.float16, device)
    kernels = {b: build_linear_kernel(KernelChoice(b, b, "benchmark"), spec) for b in backends if b != "torch"}
    dense = torch.randn(n, n, device=device).half() / n**0.5
    rows = []
    for tokens in shape["tokens"]:
        x = torch.randn(tokens, n, device=device).half()
        fp16_s = median_seconds(lambda: x @ dense if device.type == "cuda" else x.float() @ dense.float(), shape["repeats"],
                       device)
        row = {"tokens": tokens, "fp16_matmul_s": fp16_s, "exl3_bytes": layer.nbytes(), "fp16_bytes": 2 * n * n}
        for name, kernel in kernels.items():
            seconds = median_seconds(lambda: kernel.forward(x), shape["repeats"], device)
            row.update({f"exl3_{name}_s": seconds, f"{name}_ratio_to_fp16": fp16_s / seconds})
        rows.append(row)
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
        exl3 = ", ".join(f"{b} {r[f'exl3_{b}_s'] * 1e3:.3f} ms ({r[f'{b}_ratio_to_fp16']:.2f}x fp16 speed)"
                         for b in result["backends"] if f"exl3_{b}_s" in r)
        print(f"dense {result['shape']['dense']}^2 K={result['shape']['dense_k']} x{r['tokens']}: {exl3}, "
              f"fp16 matmul {r['fp16_matmul_s'] * 1e3:.3f} ms")
    for backend, why in result["skipped_backends"].items():
        print(f"{backend}: not run ({why})")


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
    backends, skipped = usable_backends(device)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "shape": shape, "limits": limits,
              "backends": backends, "skipped_backends": skipped,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
              "torch": torch.__version__, "moe": bench_moe(shape, limits, device, backends),
              "dense": bench_dense(shape, device, backends)}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    _print_table(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
