"""Our C++ MoE forward (kernels/cpu_moe.py) against exllamav3 1.6.5's CPU MoE, in one process, same inputs.

Why: issue #41's anchor is exllamav3's CPU MoE (exllamav3_ext/cpu/moe_mul1.cpp); a figure measured on another
machine says nothing about ours here. Both run the same layer (MUL1 experts from tools/random_layers.py, the same
trellis/suh/svh bytes), the same threads, the same tokens routed to every expert, so each forward reads every
weight once; reported in billions of weights per second per K (1-8) at 1 and 8 tokens (medians), with the ratio
(the median over forwards timed back to back in alternating order, so a shared machine's load hits both), plus the
largest relative difference of the two outputs (a check that both compute the same MLP: exllamav3 takes fp16
rows, so it agrees to fp16 rounding, not bit for bit).

exllamav3's kernel is not vendored: `--build DIR` downloads the 1.6.5 wheel with pip, writes a small pybind
binding and compiles moe_mul1.cpp into DIR with torch.utils.cpp_extension (about 5 minutes on 2 cores);
`--ext PATH` (or $VLLM_EXPERT_OFFLOAD_EXL3_CPU_SCRATCH_EXT) loads an earlier build. Without either, its column is
skipped with the reason. Nothing of it is ever committed.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_cpu_moe_vs_exllamav3.py --ext /tmp/exl3cpu/exl3cpu_scratch.so
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from vllm_expert_offload.tools.exllamav3_cpu import Exllamav3Layer, build_exllamav3, exllamav3_from
from vllm_expert_offload.tools.random_layers import median_seconds, random_moe

CPU = torch.device("cpu")


def paired_seconds(ours: Callable[[], object], theirs: Callable[[], object], repeats: int,
                   after_theirs: Callable[[], None]) -> tuple[float, float, float]:
    """Median seconds of each and the median of their per-pair ratio (theirs / ours): the two run back to back,
    in alternating order, `repeats` times after a warm-up, so load from other jobs on a shared machine falls on
    both alike instead of on whichever ran during it. `after_theirs` runs untimed after each of their calls
    (exllamav3 pins the calling thread to one core: Exllamav3Layer.release_caller)."""
    ours()
    theirs()
    after_theirs()
    times: dict[str, list[float]] = {"ours": [], "theirs": []}
    for i in range(repeats):
        order = (("ours", ours), ("theirs", theirs)) if i % 2 == 0 else (("theirs", theirs), ("ours", ours))
        for name, fn in order:
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
            if name == "theirs":
                after_theirs()
    ratios = [t / o for o, t in zip(times["ours"], times["theirs"])]
    return statistics.median(times["ours"]), statistics.median(times["theirs"]), statistics.median(ratios)


def measure(module, shape: dict, k: int, repeats: int, threads: int) -> list[dict]:
    """Gweights/s of ours (and exllamav3's when `module`) for one K at 1 and 8 tokens, same layer and inputs."""
    moe = random_moe(**shape, k=k, host_share=1.0, backend="cpu", device=CPU, dtype=torch.float32)
    layer = Exllamav3Layer(module, moe.sets, k, threads) if module is not None else None
    weights_per_forward = shape["experts"] * 3 * shape["hidden"] * shape["intermediate"]
    rows = []
    for tokens in (1, 8):
        gen = torch.Generator().manual_seed(tokens)
        # fp16-representable inputs, so both kernels see the same numbers
        x = torch.randn(tokens, shape["hidden"], generator=gen).half()
        ids = torch.arange(shape["experts"]).repeat(tokens, 1)
        weights = torch.rand(tokens, shape["experts"], generator=gen).half()
        ours = moe.kernel.forward(x.float(), weights.float(), ids, False)

        def run_ours() -> object:
            return moe.kernel.forward(x.float(), weights.float(), ids, False)

        row = {"k": k, "tokens": tokens}
        if layer is None:
            row["ours"] = weights_per_forward / median_seconds(run_ours, repeats, CPU) / 1e9
        else:
            theirs = layer.forward(x, weights, ids)
            ours_s, theirs_s, row["ratio"] = paired_seconds(run_ours, lambda: layer.forward(x, weights, ids), repeats,
                                                            layer.release_caller)
            row["ours"] = weights_per_forward / ours_s / 1e9
            row["exllamav3"] = weights_per_forward / theirs_s / 1e9
            row["max_rel_diff"] = float((ours - theirs).abs().max() / theirs.abs().max())
        rows.append(row)
    if layer is not None:
        module.free_layer(layer.handle)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ext", type=Path, help="an earlier --build's exl3cpu_scratch.so")
    parser.add_argument("--build", type=Path, help="download and compile exllamav3's CPU MoE into this directory")
    parser.add_argument("--ks", type=lambda s: [int(k) for k in s.split(",")], default=list(range(1, 9)))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    module, reason = exllamav3_from(build_exllamav3(args.build) if args.build else args.ext)
    if module is None:
        print(f"exllamav3 skipped: {reason}")
    threads = torch.get_num_threads()
    shape = {"hidden": args.hidden, "intermediate": args.intermediate, "experts": args.experts}
    print(f"threads {threads}, hidden {args.hidden}, intermediate {args.intermediate}, experts {args.experts}, MUL1")
    print(f"{'K':>2} {'tok':>3} {'ours':>8} {'exl3':>8} {'ratio':>6} {'rel.diff':>9}  (Gweights/s)")
    rows = []
    for k in args.ks:
        for row in measure(module, shape, k, args.repeats, threads):
            rows.append(row)
            if module is None:
                print(f"{k:>2} {row['tokens']:>3} {row['ours']:8.3f} {'-':>8} {'-':>6} {'-':>9}")
            else:
                print(f"{k:>2} {row['tokens']:>3} {row['ours']:8.3f} {row['exllamav3']:8.3f} {row['ratio']:6.2f} "
                      f"{row['max_rel_diff']:9.2e}")
    if args.json:
        args.json.write_text(json.dumps({"threads": threads, "shape": shape, "exllamav3_skipped": reason,
                                         "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
