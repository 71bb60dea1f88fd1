"""Time budgets of scripts/gpu-check.sh's steps, derived from the compile census (`python -m` prints them).

A lent GPU machine gives the whole check one command of at most 10 minutes (15 minutes of device time in all), and a
step killed while Triton compiles has measured nothing. So each step's budget is its own work (`run_s`) plus the
compiles it starts: the kernel variants it launches, counted as tools/compile_census.py counts a layer's (the
backend's real forwards on meta tensors, every launch keyed as Triton's JIT keys it), each priced at its kernel's
measured ahead-of-time compile seconds for sm_90 times the decode copies its tables hold (`decode_copies`: a mixed
table compiles the states of each rate present and a codebook branch per codebook present, kernels/triton_decode.py).
Triton keeps compiled kernels on disk, so a variant an earlier step compiled costs a later step nothing: the steps
are priced in the order the script runs them. A step the script starts in the background (the CPU tier's extension,
built ahead of its first use: tools/cpu_kernel_build.py) runs beside the steps that follow; a step that waits for it
starts its own work, and its budget, when that one has ended.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import NamedTuple

from ..kernels.matrix_table import present_values
from .compile_census import LAYERS, CensusLayer, layer_variants

# Seconds one variant of each kernel takes to compile for sm_90 when its tables hold one rate, measured ahead of time on
# the project's CI machine (2 shared vCPUs: no faster than the lent machine's host; Triton 3.9, CUDA 13 ptxas;
# 2026-12-04, tools/compile_census.timed_compile over the Qwen3-30B-A3B census layer, K = 3: gate/up 13-23 s,
# down 4-11 s), the largest seen, rounded up.
# A mixed table's states per further rate and codebook branch per further codebook (`decode_copies`), as a share
# of a uniform variant's seconds, rounded up from a side-by-side run (sm_90 AOT, CPU-s, 12-04, the census's 11
# startup variants of a Qwen3-30B-A3B-shaped layer, MUL1): K = 2/3/4 compiled in 91.3 s against 54.9 / 59.7 s for
# K = 3 (1.59x: 0.30 a further rate), K = 2/3 in 57.9 s (1.01x); the GPU tests' fp32 layer with K 3 MUL1 / K 2 3INST
# in 86.6 s against 91.7 s uniform (a second codebook: nothing measurable).
RATE_COPY, CODEBOOK_COPY = 0.35, 0.1
COMPILE_S = {"moe_gate_up_kernel": 25, "moe_down_kernel": 12, "moe_sum_kernel": 1, "dequantize_kernel": 12,
             "grouped_gate_up_kernel": 10, "grouped_down_kernel": 10, "exl3_matmul_kernel": 8,
             # test_compiled_gpu.py's FusedTritonLinear (512 x 384, K = 4, fp32): 6.3 s (compile_census.timed_compile)
             "linear_kernel": 10}
# The toolchain COMPILE_S was measured with (tools/static_kernels.toolchain, sm_90): compile seconds are that
# Triton's and that ptxas's; the lent GPU machine runs another (Triton 3.6, ptxas 12.8), so the budgets say which.
PRICED_WITH = {"triton": "3.9.0", "ptxas": "13.4"}


@dataclass(frozen=True)
class StepPlan:
    """One step of gpu-check.sh: its name's first words (as the script names it), its own seconds once its kernels
    are compiled, the MoE layers it builds with the token counts it runs them at, and the variants it launches
    outside a MoE forward: (kernel, rates its table holds, codebooks it holds, variants). Steps of one `beside`
    group run side by side (the script starts them together): each compiles what it launches itself, the group takes
    its longest step. A `background` step starts where it stands and the steps after it start at once, beside it;
    a step that `waits_for` one starts its own work when that one has ended."""

    name: str
    run_s: int
    layers: tuple[tuple[CensusLayer, tuple[int, ...]], ...] = ()
    direct: tuple[tuple[str, int, int, int], ...] = ()
    beside: str = ""
    background: bool = False
    waits_for: str = ""


class Budget(NamedTuple):
    """A step's row of the plan: its name, own seconds, budget seconds, where the budget comes from, its side-by-side
    group, whether it runs in the background, and the background step it waits for."""

    name: str
    run_s: int
    seconds: int
    source: str
    beside: str = ""
    background: bool = False
    waits_for: str = ""


# The GPU tests' layers (tests/support/moe_layers.py: six experts, fp32, top-2, 128 x 256): UNIFORM wherever a test is
# not about mixed rates, at tests/kernels/test_triton_gpu.py's token counts (one per launch class the census tells
# apart); TWO_RATES (its tables hold two rates and codebooks) in its one mixed-rate test. The exllamav3 tests' Triton
# cross-check (tests/kernels/test_exllamav3_gpu.py: random_moe 512 x 256, 16 experts, top-4, K = 3 MUL1, fp16). The
# benchmark's (benchmarks/bench_gpu_kernels.py --models qwen3_30b_a3b: the census's Qwen3 layer, K = 3 MUL1, bf16).
TESTS_LAYER = CensusLayer("gpu-tests", 128, 256, 6, 2, ((3, "mul1"),), "fp32")
MIXED_LAYER = CensusLayer("gpu-tests-mixed", 128, 256, 6, 2, ((3, "mul1"), (2, "3inst")), "fp32")
EXLLAMAV3_LAYER = CensusLayer("exllamav3-tests", 512, 256, 16, 4, ((3, "mul1"),), "fp16")
DECODE_TOKENS, PREFILL_TOKENS, GRAPH_TOKENS, MIXED_TOKENS = (1, 33), (300,), (4, 33), (1,)
BENCH_LAYERS = LAYERS[:1]
# assert_dequantize_every_rate's tables, in the one fold form the device launches: every K (1, 1.5, ..., 3.5, 4-8) and
# codebook, in lanes of two consecutive Ks, each table with every codebook its Ks come in (tests/kernels/
# test_triton_gpu.py's EVERY_RATE_LANES): (lane, rates, codebooks).
EVERY_RATE_LANES = (("k1-1.5", 2, 3), ("k2-2.5", 2, 3), ("k3-3.5", 2, 3), ("k4-5", 2, 3), ("k6-7", 2, 3), ("k8", 1, 3))
EVERY_RATE_STEP = "Triton every rate "  # + the lane: the step's name, as gpu-check.sh names it
# A lent machine's whole run: one command of at most 600 s, with margin; the device time of its start counts too.
RUN_LIMIT_S = 480
MACHINE_START_S = 120  # "a minute or more" (the device README), twice; the command's own bound is GPU_CHECK_TOTAL_S
# The CPU tier's extension (kernels/cpu_exl3.py: one C++ unit, three ISA copies, g++ -O3 on one core), built by
# tools/cpu_kernel_build.py on this project's 2-core CI machine: 98 s (12-03), 72.2 s (12-04, 74 s wall with the
# interpreter's start); priced with the slower's margin.
CPU_KERNEL_STEP = "CPU tier extension"  # no quote: gpu-check.sh keys bash arrays by it

STEPS = (
    # First, in the background: the GPU tests of the CPU tier wait for it instead of compiling it at first use.
    StepPlan(CPU_KERNEL_STEP, 110, background=True),
    # Measured in a dry run on the 2-core CI machine: machine 1 s, versions 2 s, imports 13 s, topology 3 s.
    StepPlan("machine", 10),
    StepPlan("versions", 20),
    # Then side by side (the lent machine's 16 cores compile, its GPU holds them all): the essentials, arena (UVA),
    # pointer tables, host tier, the Triton MoE against the torch reference and its CUDA-graph replay, and the rest
    # of the GPU tests.
    StepPlan("imports without vLLM", 30, beside="GPU tests"),
    StepPlan("topology", 10, beside="GPU tests"),
    StepPlan("mapped host memory", 40, beside="GPU tests"),
    # Split from the arena's lane so that a failed extension build costs only these two tests (a CpuMoE's jobs in
    # stream order, a graph replay of them): 30 s, an estimate (the three files had 40 s together).
    StepPlan("CPU tier on the GPU", 30, beside="GPU tests", waits_for=CPU_KERNEL_STEP),
    StepPlan("Triton MoE vs torch reference", 40, ((TESTS_LAYER, DECODE_TOKENS + GRAPH_TOKENS),),
             (("exl3_matmul_kernel", 1, 1, 1),), beside="GPU tests"),
    StepPlan("Triton prefill", 30, ((TESTS_LAYER, PREFILL_TOKENS),), (("exl3_matmul_kernel", 1, 1, 1),),
             beside="GPU tests"),
    StepPlan("Triton mixed rates", 20, ((MIXED_LAYER, MIXED_TOKENS),), beside="GPU tests"),
    *(StepPlan(EVERY_RATE_STEP + lane, 20, direct=(("dequantize_kernel", rates, codebooks, 1),), beside="GPU tests")
      for lane, rates, codebooks in EVERY_RATE_LANES),
    StepPlan("exllamav3 kernels", 60, ((EXLLAMAV3_LAYER, (1,)),), beside="GPU tests"),
    StepPlan("compiled Triton forwards", 60, ((TESTS_LAYER, (4,)),), (("linear_kernel", 1, 1, 1),), beside="GPU tests"),
    StepPlan("compiled exllamav3 forwards", 45, beside="GPU tests"),
    # Then the benchmarks, alone on the machine (their timings must not share it).
    StepPlan("bandwidth probe", 50),
    StepPlan("kernel benchmark", 75, tuple((layer, (1, 8, 64)) for layer in BENCH_LAYERS)),
    StepPlan("install the plugin", 60),
    StepPlan("tiny EXL3 MoE", 300),
    StepPlan("tiny mixed pack", 150),
)
ENGINE_STEPS = ("install the plugin", "tiny EXL3 MoE", "tiny mixed pack")  # run only where vLLM is installed


def _held(key: tuple) -> tuple[int, int]:
    """(rates, codebooks) the widest table of a recorded launch holds ((1, 1) for a kernel that decodes none)."""
    rates = codebooks = 1
    for param, kind, value in key[1]:
        if kind == "constexpr" and param.startswith("TWICE_K"):  # a table's present_key (TWICE_K_GATE, ...)
            rates = max(rates, len(present_values(value)))
        elif kind == "constexpr" and param.startswith("CODEBOOK"):
            codebooks = max(codebooks, len(present_values(value)))
    return rates, codebooks


def decode_copies(rates: int, codebooks: int) -> float:
    """A variant's compile seconds over a uniform one's, for tables holding `rates` rates and `codebooks` codebooks:
    each further rate adds its states (RATE_COPY), each further codebook its branch of the codebook walk
    (CODEBOOK_COPY), at every call site of the decode."""
    return 1 + RATE_COPY * (rates - 1) + CODEBOOK_COPY * (codebooks - 1)


def variant_seconds(kernel: str, rates: int = 1, codebooks: int = 1) -> float:
    """Seconds one variant of `kernel` takes to compile for sm_90, its tables holding `rates` rates and `codebooks`
    codebooks: the pricing every step's budget is made of."""
    return COMPILE_S[kernel] * decode_copies(rates, codebooks)


def budgets(steps: tuple[StepPlan, ...] = STEPS, capability: int = 90) -> list[Budget]:
    """Each step's Budget, in order."""
    compiled: set[tuple] = set()  # compiled before the step (or its group) starts
    group, group_compiled = "", set()
    out = []
    for step in steps:
        if step.beside != group:
            compiled |= group_compiled
            group, group_compiled = step.beside, set()
        known = set(compiled)
        priced: dict[str, list[float]] = {}  # kernel -> [variants new to this step, their seconds]
        for layer, tokens in step.layers:
            for key in layer_variants(layer, capability, tokens):
                if key not in known:
                    known.add(key)
                    entry = priced.setdefault(key[0], [0, 0.0])
                    entry[0] += 1
                    entry[1] += variant_seconds(key[0], *_held(key))
        for kernel, rates, codebooks, variants in step.direct:
            entry = priced.setdefault(kernel, [0, 0.0])
            entry[0] += variants
            entry[1] += variants * variant_seconds(kernel, rates, codebooks)
        (group_compiled.update if step.beside else compiled.update)(known)
        compile_s = math.ceil(sum(seconds for _, seconds in priced.values()))
        source = f"run {step.run_s} s"
        if priced:
            parts = ", ".join(f"{kernel} {n:.0f} x {seconds / n:.1f} s" for kernel, (n, seconds) in sorted(priced.items()))
            source += f" + compile {compile_s} s (census: variants x s each, decode copies held priced in: {parts})"
        out.append(Budget(step.name, step.run_s, step.run_s + compile_s, source, step.beside, step.background,
                          step.waits_for))
    return out


def _timeline(plan: list[Budget], skip: tuple[str, ...] = ()) -> tuple[dict[str, int], int]:
    """Each step's start in a run that takes every step its whole budget, and that run's end: steps one after another,
    a side-by-side group starting together and ending with its longest, a background step beside whatever follows it,
    a step that waits for one starting when it ends (`skip`: steps that do not run). A step ending early never makes
    another end later, so this end bounds every run."""
    starts: dict[str, int] = {}
    clock = end = 0  # when the next step (or group) starts; when the last step ends
    group, group_start = "", 0
    for row in plan:
        if row.name in skip:
            continue
        if row.background:
            starts[row.name] = clock
            end = max(end, clock + row.seconds)
            continue
        if row.beside != group:
            group, group_start = row.beside, clock
        starts[row.name] = group_start if row.beside else clock
        if row.waits_for:
            (awaited,) = [r for r in plan if r.name == row.waits_for and r.background]
            starts[row.name] = max(starts[row.name], starts[awaited.name] + awaited.seconds)
        clock = max(clock, starts[row.name] + row.seconds)
        end = max(end, clock)
    return starts, end


def run_seconds(plan: list[Budget], skip: tuple[str, ...] = ENGINE_STEPS) -> int:
    """The whole run's budget: its steps one after another, a side-by-side group as long as its longest step, a
    background step as long as it lasts beside those after it (`skip`: steps that do not run, by default the engine's,
    as on a lent machine without vLLM)."""
    return _timeline(plan, skip)[1]


def prices_note(running: dict[str, str]) -> list[str]:
    """Which toolchain measured the prices, and a warning (not a refusal: the check is worth running, its budgets
    are then an estimate) when `running` (this machine's, tools/static_kernels.toolchain) is another."""
    lines = [f"compile prices measured with Triton {PRICED_WITH['triton']}, ptxas {PRICED_WITH['ptxas']} (sm_90); "
             f"this Python compiles with Triton {running['triton']}, ptxas {running['ptxas']}"]
    if running != PRICED_WITH:
        lines.append("WARNING: another toolchain than the prices' compiles at another speed; each step's compile "
                     "budget is an estimate for it (tools/compile_census.py measures it: bench-kernels --static)")
    return lines


if __name__ == "__main__":
    from .static_kernels import toolchain

    print("\n".join(prices_note(toolchain(90))), file=sys.stderr, flush=True)
    _plan = budgets()
    for _row in _plan:  # tab-separated for gpu-check.sh's `read`, which runs empty fields together: "-" for none
        print("\t".join(str(_field) for _field in (
            _row.name, _row.run_s, _row.seconds, _row.source, _row.beside or "-", _row.waits_for or "-",
            "background" if _row.background else "-")))
    _total = run_seconds(_plan)
    print(f"whole run\t{_total}\t{_total + MACHINE_START_S}\t{_total} s of steps without vLLM's (a side-by-side "
          f"group at its longest, a background step beside what follows) + {MACHINE_START_S} s machine start, of "
          f"{RUN_LIMIT_S} s\t-\t-\t-")
