"""`bench-kernels --json FILE`: EXL3 expert MLPs on this CPU, side by side in one run.

One layer of 8 experts (K=3 MUL1, hidden 2048, intermediate 768, random trellis) with every token routed to all
8, so each forward reads every weight once: the C++ MoE forward (kernels/cpu_moe.py, `cpu_moe`), the compiled
CPU matmul in the rotated torch glue (`cpu_kernel`), the torch reference backend (experts in
the host tier, decoded on each use) and a dense fp32 torch matmul of the same shapes (the speed a decoded copy
would give, at 10x the memory). Reported in billions of weights per second, at 1 and 8 tokens.

The CPU kernel (the C++ MoE forward, which carries the CPU tier) also gets issue #41's keys:
cpu_kernel_gweights_s_1tok / _8tok, and under `cpu_kernel` the same per core (per thread, one per core), the bytes/s
it reads as a fraction of this machine's DRAM read bandwidth (a multithreaded sum over a buffer far larger than the
caches, measured in the same run), and exllamav3 1.6.5's CPU MoE on the same experts, threads and inputs when a
scratch build of it is given (--exllamav3-ext or $VLLM_EXPERT_OFFLOAD_EXL3_CPU_SCRATCH_EXT; tools/exllamav3_cpu.py
builds one), else the reason it is skipped.

With --static, no timing: the Triton backend's kernels compiled for sm_90 and sm_120 (no GPU needed), their
registers, spills, shared memory, trellis load width and decode-loop instructions per weight, the launches of its
forwards counted under Triton's interpreter, and estimates of the decode time per MoE layer and of a prefill's
decode-once kernel per expert (tools/static_report.py), and the compile census: per model shape the kernel
variants vLLM's startup compiles (its capture sizes and profile run), their compile time here and shared memory
against each target's limit (tools/compile_census.py).
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

from ..exl3.decode import dequantize
from ..kernels.activation import silu_and_mul
from ..kernels.cpu_exl3 import CPU_MATMUL
from ..kernels.rotated import rotated_moe
from .exllamav3_cpu import Exllamav3Layer, exllamav3_from
from .random_layers import median_seconds, random_moe

TRITON_KERNELS = "vllm_expert_offload.kernels.triton_exl3:backend_static_kernels"
TRITON_BACKEND = "vllm_expert_offload.kernels.triton_exl3:BACKEND"


def estimate_kernel(shape) -> str:
    """The kernel whose facts the decode-time estimate uses: the MoE gate/up kernel's batch-1 variant."""
    return f"moe_gate_up[{shape.codebook},fp16,decode]"


def dequantize_kernels(shape) -> tuple[str, str]:
    """The decode-once kernel's variants a prefill's dense experts run: (gate and up, folded; down, plain)."""
    return f"dequantize[{shape.codebook},folded]", f"dequantize[{shape.codebook},plain]"


SHAPE = {"hidden": 2048, "intermediate": 768, "experts": 8, "k": 3}
CPU = torch.device("cpu")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench-kernels", help="EXL3 expert MLP speed on this CPU: compiled kernel vs torch reference vs dense fp32",
        description=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("--json", type=Path, required=True, help="where to write the results")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--static", action="store_true",
                        help="compile the Triton kernels for sm_90/sm_120 and report their static facts instead")
    parser.add_argument("--exllamav3-ext", type=Path,
                        help="exllamav3's CPU MoE scratch build (exl3cpu_scratch.so) to measure beside ours")
    parser.add_argument("--dram-mib", type=int, default=512, help="buffer the DRAM read probe sums (MiB)")
    parser.add_argument("--shape", type=json.loads, default=SHAPE, help=argparse.SUPPRESS)  # tests use a tiny one
    parser.set_defaults(handler=run)


def _dense_moe(sets, shape: dict):
    """The same MLP on dense fp32 weights (decoded once here, outside the timing)."""
    h, i = shape["hidden"], shape["intermediate"]
    weights = [(torch.cat([dequantize(s["gate"])[:i, :h], dequantize(s["up"])[:i, :h]]), dequantize(s["down"])[:h, :i])
               for s in sets]

    def forward(x: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e, (w13, w2) in enumerate(weights):
            gate, up = F.linear(x, w13).chunk(2, dim=-1)
            out += F.linear(silu_and_mul(gate, up), w2) * topk_weights[:, e : e + 1]
        return out

    return forward


def dram_read_bytes_s(mib: int, repeats: int) -> float:
    """Bytes/s of a multithreaded sum over `mib` MiB (the read bandwidth the kernel's trellis streaming competes for)."""
    buffer = torch.ones(mib << 18)
    return buffer.nbytes / median_seconds(buffer.sum, repeats, CPU)


def measure(shape: dict, repeats: int, exllamav3=None) -> dict:
    """Gweights/s per kernel at 1 and 8 tokens (exllamav3's CPU MoE too when its module is given), bytes/weight."""
    weights_per_forward = shape["experts"] * 3 * shape["hidden"] * shape["intermediate"]
    cpu = random_moe(**shape, host_share=1.0, backend="cpu", device=CPU, dtype=torch.float32)
    torch_ref = random_moe(**shape, host_share=1.0, backend="torch", device=CPU, dtype=torch.float32)
    dense = _dense_moe(cpu.sets, shape)
    glue = rotated_moe(cpu.layer, CPU_MATMUL)  # the compiled matmul inside the rotated torch glue, same experts
    result = {"bytes_per_weight": cpu.expert_bytes * shape["experts"] / weights_per_forward}
    theirs = Exllamav3Layer(exllamav3, cpu.sets, shape["k"], torch.get_num_threads()) if exllamav3 else None
    for tokens in (1, 8):
        gen = torch.Generator().manual_seed(tokens)
        x = torch.randn(tokens, shape["hidden"], generator=gen)
        ids = torch.arange(shape["experts"]).repeat(tokens, 1)
        weights = torch.rand(tokens, shape["experts"], generator=gen)
        seconds = {
            "cpu_moe": median_seconds(lambda: cpu.kernel.forward(x, weights, ids, False), repeats, CPU),
            "cpu_kernel": median_seconds(lambda: glue.forward(x, weights, ids, False), repeats, CPU),
            "torch_reference": median_seconds(lambda: torch_ref.kernel.forward(x, weights, ids, False), repeats, CPU),
            "dense_matmul": median_seconds(lambda: dense(x, weights), repeats, CPU),
        }
        if theirs is not None:
            x16, weights16 = x.half(), weights.half()
            seconds["exllamav3"] = median_seconds(lambda: theirs.forward(x16, weights16, ids), repeats, CPU)
            theirs.release_caller()  # the next shape's kernels run with this thread unpinned
        result[f"{tokens}_tokens"] = {f"{name}_gweights_s": weights_per_forward / s / 1e9 for name, s in seconds.items()}
    return result


def run_static(path: Path) -> int:
    """The static report: compiles and the launch census each in a child Python (static_kernels.py, launch_census.py)."""
    from . import compile_census, static_kernels, static_report
    from .launch_census import census_report

    targets = static_kernels.compile_report(TRITON_KERNELS, static_report.SHAPES)
    print("counting launches under Triton's interpreter", flush=True)
    launches = census_report(TRITON_BACKEND)
    print("compile census: every variant vLLM's startup compiles, compiled here", flush=True)
    report = {"targets": targets, "launches": launches, "compile_census": compile_census.census_report()}
    report["estimates"] = static_report.estimates(targets, launches, estimate_kernel)
    report["dequantize_estimates"] = static_report.dequantize_estimates(targets, dequantize_kernels)
    report["shapes"] = static_report.shapes_json()
    report["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    path.write_text(json.dumps(report, indent=1) + "\n")
    print("\n".join(static_report.summary_lines(report)))
    return 0


def cpu_kernel_report(measured: dict, threads: int, dram_bytes_s: float, skipped: str) -> dict:
    """Issue #41's CPU kernel keys: the C++ MoE forward's rate at 1/8 tokens, per core, against DRAM and exllamav3."""
    report = {"cpu_kernel_gweights_s_1tok": measured["1_tokens"]["cpu_moe_gweights_s"],
              "cpu_kernel_gweights_s_8tok": measured["8_tokens"]["cpu_moe_gweights_s"]}
    detail = {"kernel": "cpu_moe", "threads": threads, "dram_read_gbytes_s": dram_bytes_s / 1e9,
              "bytes_per_weight": measured["bytes_per_weight"]}
    for tokens, suffix in ((1, "1tok"), (8, "8tok")):
        ours = report[f"cpu_kernel_gweights_s_{suffix}"]
        detail[f"gweights_s_per_core_{suffix}"] = ours / threads
        detail[f"dram_fraction_{suffix}"] = ours * 1e9 * measured["bytes_per_weight"] / dram_bytes_s
        theirs = measured[f"{tokens}_tokens"].pop("exllamav3_gweights_s", None)
        if theirs is not None:
            detail[f"exllamav3_gweights_s_{suffix}"] = theirs
            detail[f"ratio_to_exllamav3_{suffix}"] = ours / theirs
    if skipped:
        detail["exllamav3_skipped"] = skipped
    return {**report, "cpu_kernel": detail}


def run(args: argparse.Namespace) -> int:
    if args.static:
        return run_static(args.json)
    exllamav3, skipped = exllamav3_from(args.exllamav3_ext)
    measured = measure(args.shape, args.repeats, exllamav3)
    threads = torch.get_num_threads()
    cpu_kernel = cpu_kernel_report(measured, threads, dram_read_bytes_s(args.dram_mib, args.repeats), skipped)
    report = {
        **measured["1_tokens"],
        "at_8_tokens": measured["8_tokens"],
        **cpu_kernel,
        "shape": args.shape,
        "threads": threads,
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    for label, row in (("1 token", measured["1_tokens"]), ("8 tokens", measured["8_tokens"])):
        print(f"{label}: " + ", ".join(f"{k.removesuffix('_gweights_s')} {v:.3f} Gweights/s" for k, v in row.items()))
    print("cpu kernel: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                     for k, v in cpu_kernel["cpu_kernel"].items()))
    return 0
