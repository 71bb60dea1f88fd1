"""gpu-check.sh's step budgets from the compile census (tools/gpu_check_budget.py): a step is given its own seconds
plus the Triton variants it compiles (counted from the backend's meta forwards, priced by the decode copies its
tables hold), so the lent machine never kills a step mid-compile; a variant an earlier step compiled is in Triton's
disk cache."""

from __future__ import annotations

import math
import re

import pytest

from vllm_expert_offload.tools.compile_census import CensusLayer
from vllm_expert_offload.tools.gpu_check_budget import (
    CODEBOOK_COPY,
    CPU_KERNEL_STEP,
    COMPILE_S,
    PRICED_WITH,
    RATE_COPY,
    STEPS,
    TESTS_LAYER,
    Budget,
    StepPlan,
    budgets,
    decode_copies,
    prices_note,
    run_seconds,
    variant_seconds,
)

from support.moe_layers import HIDDEN, INTERMEDIATE, TIERS
from support.moe_layers import UNIFORM as TESTS_RATES
from support.paths import REPO

UNIFORM = CensusLayer("u", 256, 256, 4, 2, ((3.0, "mul1"),), "bf16")
TWO_RATES = CensusLayer("m", 256, 256, 4, 2, ((3.0, "mul1"), (2.0, "mul1")), "bf16")
TWO_CODEBOOKS = CensusLayer("c", 256, 256, 4, 2, ((3.0, "mul1"), (2.0, "3inst")), "bf16")
# Measured side by side (sm_90 AOT compile, CPU-s of Triton and ptxas, fresh cache, 12-04, this 2-core machine):
# a whole layer's startup variants, mixed over uniform K = 3 (Qwen3-30B-A3B-shaped, MUL1, 91.3 / 57.3 s mean of two
# uniform runs), and the slowest variant of a kernel whose tables hold (rates, codebooks), in seconds: gate/up and
# down of that K = 2/3/4 layer (bf16), the dequantize of the every-rate tables (fp16, K 1-3.5 and K 4-8, all
# three codebooks), gate/up of the GPU tests' fp32 K 3 MUL1 / K 2 3INST layer.
MEASURED_LAYER_COPIES = {(3, 1): 1.59, (2, 1): 1.01}
MEASURED_VARIANT_S = {("moe_gate_up_kernel", 3, 1): 24.4, ("moe_down_kernel", 3, 1): 7.4,
                      ("dequantize_kernel", 6, 3): 5.9, ("dequantize_kernel", 5, 3): 6.4,
                      ("moe_gate_up_kernel", 2, 2): 19.9, ("moe_down_kernel", 2, 2): 8.7}


def _compile_s(plans: tuple[StepPlan, ...]) -> list[int]:
    return [row.seconds - row.run_s for row in budgets(plans)]


def test_a_step_pays_for_the_variants_it_compiles_per_decode_copy_held() -> None:
    """At one token a MoE forward launches gate/up, down and the sum once each; a table of two rates compiles a
    second rate's states per call site, one of two codebooks a second codebook branch, so its gate/up and down cost
    1 + RATE_COPY (+ CODEBOOK_COPY) times a uniform one's; the sum decodes nothing."""
    (uniform,) = _compile_s((StepPlan("u", 5, ((UNIFORM, (1,)),)),))
    (mixed,) = _compile_s((StepPlan("m", 5, ((TWO_RATES, (1,)),)),))
    (codebooks,) = _compile_s((StepPlan("c", 5, ((TWO_CODEBOOKS, (1,)),)),))
    one = COMPILE_S["moe_gate_up_kernel"] + COMPILE_S["moe_down_kernel"]
    assert uniform == one + COMPILE_S["moe_sum_kernel"]
    assert mixed == math.ceil(one * (1 + RATE_COPY) + COMPILE_S["moe_sum_kernel"])
    assert codebooks == math.ceil(one * (1 + RATE_COPY + CODEBOOK_COPY) + COMPILE_S["moe_sum_kernel"])


def test_decode_copies_are_priced_no_lower_than_measured() -> None:
    """A uniform variant is its kernel's seconds; a mixed one no cheaper than measured side by side (sm_90 AOT
    CPU-s over a Qwen3-30B-A3B-shaped layer's 11 startup variants, 12-04, MUL1: K = 2/3 and K = 2/3/4 against K = 3;
    the every-rate dequantize table: K 1-3.5, all three codebooks, against K = 3 MUL1) and dearer per rate and
    codebook held."""
    assert variant_seconds("moe_gate_up_kernel") == COMPILE_S["moe_gate_up_kernel"] and decode_copies(1, 1) == 1
    for (rates, codebooks), measured in MEASURED_LAYER_COPIES.items():
        assert decode_copies(rates, codebooks) >= measured, (rates, codebooks)
    for (kernel, rates, codebooks), measured in MEASURED_VARIANT_S.items():
        assert variant_seconds(kernel, rates, codebooks) >= measured, (kernel, rates, codebooks)
    assert decode_copies(3, 1) > decode_copies(2, 1) and decode_copies(2, 3) > decode_copies(2, 2)


def test_what_an_earlier_step_compiled_is_free_and_direct_launches_count() -> None:
    first = StepPlan("a", 1, ((UNIFORM, (1, 300)),))
    again = StepPlan("b", 1, ((UNIFORM, (1,)),), (("dequantize_kernel", 11, 3, 2),))
    every_rate = 2 * variant_seconds("dequantize_kernel", 11, 3)
    assert _compile_s((first, again))[1] == math.ceil(every_rate)
    assert _compile_s((again,))[0] > every_rate


def test_the_gpu_tests_layer_is_the_one_the_tests_build() -> None:
    """TESTS_LAYER prices test_triton_gpu.py's layer: its experts of one rate, UNIFORM (tests/support/moe_layers.py)."""
    assert (TESTS_LAYER.hidden, TESTS_LAYER.intermediate, TESTS_LAYER.experts, TESTS_LAYER.top_k) == (
        HIDDEN, INTERMEDIATE, len(TIERS), 2)
    assert list(TESTS_LAYER.rates) == [tuple(r) for r in TESTS_RATES] and TESTS_LAYER.dtype == "fp32"


def test_side_by_side_steps_compile_for_themselves_and_last_as_their_longest() -> None:
    """Steps started together cannot find each other's kernels in Triton's cache: each pays for what it launches;
    the group lasts as long as its longest, and a step after it finds everything the group compiled."""
    a = StepPlan("a", 5, ((UNIFORM, (1,)),), beside="g")
    b = StepPlan("b", 7, ((UNIFORM, (1,)),), beside="g")
    after = StepPlan("c", 1, ((UNIFORM, (1,)),))
    plan = budgets((StepPlan("s", 3), a, b, after))
    assert _compile_s((a, b, after)) == [_compile_s((a,))[0]] * 2 + [0]
    assert [row[4] for row in plan] == ["", "g", "g", ""]
    assert run_seconds(plan, skip=()) == 3 + plan[2][2] + 1  # b, the longer, stands for the group
    assert run_seconds(plan, skip=("c",)) == 3 + plan[2][2]


def test_a_background_step_runs_beside_what_follows_and_a_step_waiting_for_it_starts_when_it_ends() -> None:
    """The CPU tier's extension is built in the background from the start; the steps after it start at once, the one
    that waits for it starts its own work (and bound) when it has ended, whichever is later, and the run lasts at
    least as long as the background step (every step at its whole budget: one ending early ends nothing later)."""
    build = StepPlan("build", 50, background=True)
    plan = budgets((build, StepPlan("s", 10), StepPlan("a", 20, beside="g"),
                    StepPlan("w", 15, beside="g", waits_for="build"), StepPlan("after", 5)))
    assert [row.seconds for row in plan] == [50, 10, 20, 15, 5]  # a waiting step's budget is its own work's
    assert run_seconds(plan, skip=()) == 50 + 15 + 5  # w starts at the build's end, after a's group has ended
    early = budgets((StepPlan("build", 5, background=True), StepPlan("s", 10),
                     StepPlan("w", 15, beside="g", waits_for="build")))
    assert run_seconds(early, skip=()) == 10 + 15  # the build had ended when the group started
    assert run_seconds(budgets((StepPlan("build", 100, background=True), StepPlan("s", 10))), skip=()) == 100
    with pytest.raises(ValueError):  # only a background step can be waited for
        run_seconds(budgets((StepPlan("s", 10), StepPlan("w", 15, beside="g", waits_for="s"))), skip=())


def test_the_cpu_tier_tests_wait_for_its_extension_built_first_in_the_background() -> None:
    """No GPU test compiles the CPU tier's extension at first use (unpriced, killed mid-compile by its bound): the
    extension's build is the first step, in the background, and the lane of the tests that load it waits for it."""
    assert STEPS[0] == StepPlan(CPU_KERNEL_STEP, STEPS[0].run_s, background=True)
    waiting = [step for step in STEPS if step.waits_for]
    assert [(step.name, step.waits_for) for step in waiting] == [("CPU tier on the GPU", CPU_KERNEL_STEP)]
    script = (REPO / "scripts" / "gpu-check.sh").read_text()
    lane = re.search(r'^gpu_tests "CPU tier on the GPU[^"]*" \\\n\s+(.+)$', script, re.M).group(1).split()
    assert lane == ["tests/kernels/test_stream_host_tier.py"]  # the only GPU tests that build a CpuMoE
    assert "from vllm_expert_offload.kernels.cpu_moe import" in (REPO / lane[0]).read_text()


def test_every_step_of_the_script_has_a_plan() -> None:
    """Each `step "NAME"` of gpu-check.sh (run alone), `beside`/`gpu_tests "NAME"` (side by side), each plan a
    `lanes "PREFIX"` queues (one per plan named PREFIX + its lane) and each engine step begins with exactly one plan's
    name (the script takes a step's budget from the plan its name begins with: two would be a guess), in the
    script's order: the script refuses a step without one."""
    script = (REPO / "scripts" / "gpu-check.sh").read_text()
    engine = re.search(r"ENGINE_STEPS=\(\"([^\"]+)\"\s+\"([^\"]+)\"\)", script).groups()
    names = []
    verbs = r"^\s*(?:step|background|beside|gpu_tests|(lanes))"
    for verb, quoted, bare in re.findall(verbs + r' (?:"([^"]+)"|(\S+)) ', script, re.M):
        name = quoted or bare
        index = re.fullmatch(r"\$\{ENGINE_STEPS\[(\d)\]\}", name)
        if name.startswith("$") and not index:  # gpu_tests and lanes passing their arguments on
            continue
        if verb:
            lanes = [p.name for p in STEPS if p.name.startswith(name)]
            assert len(lanes) >= 2, name
            names += lanes
        else:
            names.append(engine[int(index.group(1))] if index else name)
    plans = []
    for name in names:
        (plan,) = [p.name for p in STEPS if name.startswith(p.name)]
        plans.append(plan)
    assert plans == [p.name for p in STEPS]


def test_a_step_that_compiles_nothing_is_its_own_seconds() -> None:
    rows = budgets((StepPlan("x", 3, ((UNIFORM, (1,)),)), StepPlan("y", 2)))
    assert rows[1] == Budget("y", 2, 2, "run 2 s") and rows[0][2] > rows[0][1] and "census" in rows[0][3]


def test_prices_name_their_toolchain_and_warn_on_another() -> None:
    """The lent machine compiles with Triton 3.6 (ptxas 12.8), the prices were measured with PRICED_WITH: the budget
    says so and warns, without refusing; where the toolchain is the prices' own, no warning. A ptxas alone differing
    warns too (ptxas does most of a compile's work)."""
    same = prices_note(dict(PRICED_WITH))
    assert len(same) == 1 and f"Triton {PRICED_WITH['triton']}, ptxas {PRICED_WITH['ptxas']}" in same[0]
    lent = prices_note({"triton": "3.6.0", "ptxas": "12.8"})
    assert "this Python compiles with Triton 3.6.0, ptxas 12.8" in lent[0] and lent[1].startswith("WARNING")
    assert prices_note({**PRICED_WITH, "ptxas": "12.8"})[1].startswith("WARNING")


def test_step_names_are_words_bash_can_key_its_arrays_by() -> None:
    """gpu-check.sh keys associative arrays by step name: bash 5.2's `unset "A[$key]"` leaves a key holding a quote in
    place (a reaped background step recorded twice when the run is cut short later), and bash <= 5.1 refuses such a
    key inside $(( )), dropping the step. So a name holds letters, digits, spaces, '.', '-' and '+' only."""
    for step in STEPS:
        assert re.fullmatch(r"[A-Za-z0-9 .+-]+", step.name), step.name
