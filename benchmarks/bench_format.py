"""EXL3 format on the CPU: reference dequantization throughput and no-Hessian encoder cost.

The reference decoder is what every kernel is tested against and what the CPU fallback path can use,
so its speed bounds test and conversion times; the encoder's per-tile cost sets how large a test model
can be quantized on a laptop, so its Viterbi search is timed in torch and compiled side by side (and the
two must agree). Prints markdown tables.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_format.py    # PYTHONPATH not needed once pip-installed
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch

from vllm_expert_offload.exl3 import Codebook, Exl3Linear, dequantize
from vllm_expert_offload.exl3.encode import ROW_TARGET_RMS, encode_linear, encode_tiles


def _timed(fn: Callable[[], object], reps: int) -> float:
    """Median wall time over reps after one warm-up call (the warm-up fills codebook and index caches)."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def random_layer(in_features: int, out_features: int, k: int, gen: torch.Generator) -> Exl3Linear:
    """Any bit pattern is a valid trellis (exl3-format.md §2.5), so random bits measure decoding exactly."""
    trellis = torch.randint(-(1 << 15), 1 << 15, (in_features // 16, out_features // 16, 16 * k), generator=gen)
    suh = torch.randn(in_features, generator=gen).half()
    svh = torch.randn(out_features, generator=gen).half()
    return Exl3Linear("bench", trellis.to(torch.int16), suh, svh, Codebook.MUL1, k)


def bench_dequantize(shapes: list[tuple[int, int]], ks: list[int], reps: int) -> list[str]:
    gen = torch.Generator().manual_seed(0)
    rows = ["| in × out | K | time (ms) | Mweights/s |", "|---|---|---|---|"]
    for in_features, out_features in shapes:
        for k in ks:
            layer = random_layer(in_features, out_features, k, gen)
            seconds = _timed(lambda layer=layer: dequantize(layer), reps)
            rate = in_features * out_features / seconds / 1e6
            rows.append(f"| {in_features} × {out_features} | {k} | {seconds * 1e3:.1f} | {rate:.1f} |")
    return rows


def bench_encode(size: int, ks: list[int]) -> list[str]:
    weight = torch.randn(size, size, generator=torch.Generator().manual_seed(0))
    tiles = (size // 16) ** 2
    rows = [
        "| K | tiles | encode (s) | ms/tile | with scale search (s) | rel. MSE |",
        "|---|---|---|---|---|---|",
    ]
    for k in ks:
        start = time.perf_counter()
        encode_linear(weight, k, scale_search=False)
        plain = time.perf_counter() - start
        start = time.perf_counter()
        searched = encode_linear(weight, k)
        with_search = time.perf_counter() - start
        error = float((dequantize(searched) - weight).pow(2).sum() / weight.pow(2).sum())
        rows.append(f"| {k} | {tiles} | {plain:.2f} | {plain / tiles * 1e3:.0f} | {with_search:.2f} | {error:.4f} |")
    return rows


def bench_viterbi(tiles: int, ks: list[int], reps: int) -> list[str]:
    """Both Viterbi encoders on the same Gaussian tiles at the encoder's row scale, in alternating calls, best of
    reps. Wall time is what `quantize` waits; CPU time (all threads) is the work, steadier on a shared machine."""
    targets = torch.randn(tiles, 256, generator=torch.Generator().manual_seed(0)) * ROW_TARGET_RMS
    rows = [
        "| K | tiles | torch wall ms/tile | compiled wall ms/tile | wall speed-up "
        "| torch CPU ms/tile | compiled CPU ms/tile | CPU speed-up | same states |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    backends = ("torch", "compiled")
    for k in ks:
        wall, cpu, states = {b: math.inf for b in backends}, {b: math.inf for b in backends}, {}
        for backend in backends:
            encode_tiles(targets[:1], k, viterbi=backend)  # warm-up: builds or loads the extension
        for _ in range(reps):
            for backend in backends:
                start, start_cpu = time.perf_counter(), time.process_time()
                states[backend] = encode_tiles(targets, k, viterbi=backend)
                wall[backend] = min(wall[backend], (time.perf_counter() - start) / tiles)
                cpu[backend] = min(cpu[backend], (time.process_time() - start_cpu) / tiles)
        same = "yes" if torch.equal(states["torch"], states["compiled"]) else "NO"
        rows.append(
            f"| {k} | {tiles} | {wall['torch'] * 1e3:.1f} | {wall['compiled'] * 1e3:.2f} "
            f"| {wall['torch'] / wall['compiled']:.1f}x | {cpu['torch'] * 1e3:.1f} | {cpu['compiled'] * 1e3:.2f} "
            f"| {cpu['torch'] / cpu['compiled']:.1f}x | {same} |"
        )
    return rows


def _shape(text: str) -> tuple[int, int]:
    in_features, out_features = (int(v) for v in text.lower().split("x"))
    return in_features, out_features


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1024x1024,2048x768", help="dequantize shapes, in x out, comma separated")
    parser.add_argument("--ks", default="2,3,4", help="bits per weight, comma separated integers")
    parser.add_argument("--reps", type=int, default=3, help="timed calls per case (dequantize: median; Viterbi: best)")
    parser.add_argument("--encode-size", type=int, default=128, help="side of the square Gaussian matrix to encode")
    parser.add_argument("--viterbi-tiles", type=int, default=8, help="tiles per Viterbi encoder timing")
    parser.add_argument("--threads", type=int, help="torch and OpenMP threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ks = [int(k) for k in args.ks.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("Reference dequantization (`vllm_expert_offload.exl3.dequantize`, fp32 out, MUL1, random trellis):\n")
    print("\n".join(bench_dequantize([_shape(s) for s in args.shapes.split(",")], ks, args.reps)))
    print(f"\nViterbi search (`encode_tiles`, MUL1, {args.viterbi_tiles} Gaussian tiles), torch vs compiled:\n")
    print("\n".join(bench_viterbi(args.viterbi_tiles, ks, args.reps)))
    size = args.encode_size
    print(f"\nEncoder (`encode_linear`, MUL1, {size}×{size} Gaussian, seed 0, the default Viterbi):\n")
    print("\n".join(bench_encode(args.encode_size, ks)))


if __name__ == "__main__":
    main()
