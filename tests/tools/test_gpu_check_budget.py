"""gpu-check.sh's step budgets from the compile census (tools/gpu_check_budget.py): a step is given its own seconds
plus the Triton variants it compiles (counted from the backend's meta forwards, priced per rate its tables hold), so
the lent machine never kills a step mid-compile; a variant an earlier step compiled is in Triton's disk cache."""

from __future__ import annotations

import re

from vllm_expert_offload.tools.compile_census import CensusLayer
from vllm_expert_offload.tools.gpu_check_budget import (
    COMPILE_S,
    PRICED_WITH,
    STEPS,
    TESTS_LAYER,
    StepPlan,
    budgets,
    prices_note,
    run_seconds,
)

from support.moe_layers import HIDDEN, INTERMEDIATE, TIERS
from support.moe_layers import UNIFORM as TESTS_RATES
from support.paths import REPO

UNIFORM = CensusLayer("u", 256, 256, 4, 2, ((3.0, "mul1"),), "bf16")
TWO_RATES = CensusLayer("m", 256, 256, 4, 2, ((3.0, "mul1"), (2.0, "mul1")), "bf16")


def _compile_s(plans: tuple[StepPlan, ...]) -> list[int]:
    return [seconds - run for _, run, seconds, _, _ in budgets(plans)]


def test_a_step_pays_for_the_variants_it_compiles_per_rate_held() -> None:
    """At one token a MoE forward launches gate/up, down and the sum once each; a table of two rates compiles two
    decodes per variant, so its gate/up and down cost twice; the sum decodes nothing."""
    (uniform,) = _compile_s((StepPlan("u", 5, ((UNIFORM, (1,)),)),))
    (mixed,) = _compile_s((StepPlan("m", 5, ((TWO_RATES, (1,)),)),))
    one = COMPILE_S["moe_gate_up_kernel"] + COMPILE_S["moe_down_kernel"]
    assert uniform == one + COMPILE_S["moe_sum_kernel"]
    assert mixed == 2 * one + COMPILE_S["moe_sum_kernel"]


def test_what_an_earlier_step_compiled_is_free_and_direct_launches_count() -> None:
    first = StepPlan("a", 1, ((UNIFORM, (1, 300)),))
    again = StepPlan("b", 1, ((UNIFORM, (1,)),), (("dequantize_kernel", 11, 2),))
    assert _compile_s((first, again))[1] == 22 * COMPILE_S["dequantize_kernel"]
    assert _compile_s((again,))[0] > 22 * COMPILE_S["dequantize_kernel"]


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


def test_every_step_of_the_script_has_a_plan() -> None:
    """Each `step "NAME"` of gpu-check.sh (run alone), `beside`/`gpu_tests "NAME"` (side by side) and each engine step
    begins with one plan's name, in the script's order: the script refuses a step without one."""
    script = (REPO / "scripts" / "gpu-check.sh").read_text()
    engine = re.search(r"ENGINE_STEPS=\(\"([^\"]+)\"\s+\"([^\"]+)\"\)", script).groups()
    names = []
    for quoted, bare in re.findall(r'^\s*(?:step|beside|gpu_tests) (?:"([^"]+)"|(\S+)) ', script, re.M):
        name = quoted or bare
        if name == "$name":  # gpu_tests passing its own argument on to beside
            continue
        index = re.fullmatch(r"\$\{ENGINE_STEPS\[(\d)\]\}", name)
        names.append(engine[int(index.group(1))] if index else name)
    plans = [next(p.name for p in STEPS if name.startswith(p.name)) for name in names]
    assert plans == [p.name for p in STEPS]


def test_a_step_that_compiles_nothing_is_its_own_seconds() -> None:
    rows = budgets((StepPlan("x", 3, ((UNIFORM, (1,)),)), StepPlan("y", 2)))
    assert rows[1] == ("y", 2, 2, "run 2 s", "") and rows[0][2] > rows[0][1] and "census" in rows[0][3]


def test_prices_name_their_toolchain_and_warn_on_another() -> None:
    """The lent machine compiles with Triton 3.6 (ptxas 12.8), the prices were measured with PRICED_WITH: the budget
    says so and warns, without refusing; where the toolchain is the prices' own, no warning. A ptxas alone differing
    warns too (ptxas does most of a compile's work)."""
    same = prices_note(dict(PRICED_WITH))
    assert len(same) == 1 and f"Triton {PRICED_WITH['triton']}, ptxas {PRICED_WITH['ptxas']}" in same[0]
    lent = prices_note({"triton": "3.6.0", "ptxas": "12.8"})
    assert "this Python compiles with Triton 3.6.0, ptxas 12.8" in lent[0] and lent[1].startswith("WARNING")
    assert prices_note({**PRICED_WITH, "ptxas": "12.8"})[1].startswith("WARNING")
