"""Time budgets of scripts/gpu-check.sh's steps, derived from the compile census (`python -m` prints them).

A lent GPU machine gives the whole check one command of at most 10 minutes (15 minutes of device time in all), and a
step killed while Triton compiles has measured nothing. So each step's budget is its own work (`run_s`) plus the
compiles it starts: the kernel variants it launches, counted as tools/compile_census.py counts a layer's (the
backend's real forwards on meta tensors, every launch keyed as Triton's JIT keys it), each priced at its kernel's
measured ahead-of-time compile seconds for sm_90 times the decode copies it compiles (`decode_copies`). Triton keeps
compiled kernels on disk, so a variant an earlier step compiled costs a later step nothing: the steps are priced in
the order the script runs them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..kernels.matrix_table import present_values
from .compile_census import LAYERS, CensusLayer, layer_variants

# Seconds one variant of each kernel takes to compile for sm_90 per rate its tables hold, measured ahead of time on
# the project's CI machine (2 shared vCPUs: no faster than the lent machine's host; Triton 3.9, CUDA 13 ptxas;
# 2026-12-04, tools/compile_census.timed_compile over the Qwen3-30B-A3B census layer, K = 3: gate/up 13-23 s,
# down 4-11 s), the largest seen, rounded up.
# A mixed table's decode compiles one copy of the register decode per rate present (kernels/triton_decode.py), each
# with a branch per codebook present, at every call site of every table it reads. Measured, one moe_gate_up variant
# whose gate and up hold K = 2/3/4 (MUL1): 94.3 s for sm_90 (12-04), against COMPILE_S x 3 rates = 75 s: a copy in a
# mixed variant costs MIXED_COPY_S_RATIO times a uniform variant's (the branches' shared register allocation).
MIXED_COPY_S_RATIO = 1.3
COMPILE_S = {"moe_gate_up_kernel": 25, "moe_down_kernel": 12, "moe_sum_kernel": 1, "dequantize_kernel": 12,
             "grouped_gate_up_kernel": 10, "grouped_down_kernel": 10, "exl3_matmul_kernel": 8}


@dataclass(frozen=True)
class StepPlan:
    """One step of gpu-check.sh: its name's first words (as the script names it), its own seconds once its kernels
    are compiled, the MoE layers it builds with the token counts it runs them at, and the variants it launches
    outside a MoE forward: (kernel, rates its table holds, codebooks it holds, variants)."""

    name: str
    run_s: int
    layers: tuple[tuple[CensusLayer, tuple[int, ...]], ...] = ()
    direct: tuple[tuple[str, int, int, int], ...] = ()


# The GPU tests' layer (tests/support/moe_layers.py: six experts over RATES, fp32, top-2; its gate tables hold 2K
# 4, 5, 6, 8, 10 and all three codebooks), at the tokens test_triton_gpu.py and test_compiled_gpu.py run; and the
# benchmark's (benchmarks/bench_gpu_kernels.py: the census's two models, K = 3 MUL1, bf16, at 1, 8 and 64 tokens).
TESTS_LAYER = CensusLayer("gpu-tests", 128, 256, 6, 2, ((3, "mul1"), (2.5, "mul1"), (4, "mcg"), (2, "3inst"),
                                                        (3, "mul1"), (5, "mul1")), "fp32")
BENCH_LAYERS = LAYERS[:2]
EVERY_RATE = (11, 3)  # assert_dequantize_every_rate's table: every K (11) and codebook (3)

STEPS = (
    StepPlan("machine", 20),
    StepPlan("versions", 30),
    StepPlan("imports without vLLM", 45),
    StepPlan("topology", 30),
    StepPlan("bandwidth probe", 50),
    StepPlan("kernel benchmark", 145, tuple((layer, (1, 8, 64)) for layer in BENCH_LAYERS)),
    StepPlan("GPU tests", 60, ((TESTS_LAYER, (1, 4, 8, 9, 32, 64, 300)),),
             # the every-rate decode-once check (plain, split and whole folds; fp32 and fp16) and the glue's matmul
             (("dequantize_kernel", *EVERY_RATE, 6), ("exl3_matmul_kernel", 5, 3, 1))),
    StepPlan("compiled forwards", 90, ((TESTS_LAYER, (4, 32)),)),
    StepPlan("install the plugin", 60),
    StepPlan("tiny EXL3 MoE", 300),
    StepPlan("tiny mixed pack", 150),
)


def table_copies(rates: int, codebooks: int) -> float:
    """Decode copies one table compiles, in uniform variants' units: one per rate present, each with a branch per
    codebook present (counted as a whole copy: an upper bound), a mixed table's at MIXED_COPY_S_RATIO."""
    copies = rates * codebooks
    return copies if copies == 1 else copies * MIXED_COPY_S_RATIO


def decode_copies(key: tuple) -> float:
    """A recorded launch's compile cost in its kernel's uniform variants: the mean over the tables it reads (gate/up
    reads two, so its cost grows with rates(gate) + rates(up)) of `table_copies`; 1 for a kernel that decodes none."""
    constexprs = {param: value for param, kind, value in key[1] if kind == "constexpr"}
    tables = [(len(present_values(value)), len(present_values(constexprs[param.replace("TWICE_K", "CODEBOOK")])))
              for param, value in constexprs.items() if param.startswith("TWICE_K")]
    return sum(table_copies(*t) for t in tables) / len(tables) if tables else 1


def budgets(steps: tuple[StepPlan, ...] = STEPS, capability: int = 90) -> list[tuple[str, int, int, str]]:
    """(step name, its own seconds, budget seconds, where the budget comes from) for each step, in order."""
    compiled: set[tuple] = set()
    out = []
    for step in steps:
        units: dict[str, float] = {}  # kernel -> its uniform variants' worth of compiling new to this run
        for layer, tokens in step.layers:
            for key in layer_variants(layer, capability, tokens):
                if key not in compiled:
                    compiled.add(key)
                    units[key[0]] = units.get(key[0], 0) + decode_copies(key)
        for kernel, rates, codebooks, variants in step.direct:
            units[kernel] = units.get(kernel, 0) + table_copies(rates, codebooks) * variants
        compile_s = math.ceil(sum(COMPILE_S[kernel] * n for kernel, n in units.items()))
        source = f"run {step.run_s} s"
        if units:
            parts = ", ".join(f"{kernel} {n:g} x {COMPILE_S[kernel]} s" for kernel, n in sorted(units.items()))
            source += f" + compile {compile_s} s (census: variants x decode copies x s each: {parts})"
        out.append((step.name, step.run_s, step.run_s + compile_s, source))
    return out


if __name__ == "__main__":
    for name, run_s, seconds, source in budgets():
        print(f"{name}\t{run_s}\t{seconds}\t{source}")
