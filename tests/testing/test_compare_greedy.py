"""compare_greedy, the judge of every engine test: it must fail whatever a broken engine could return."""

from __future__ import annotations

import pytest

from vllm_expert_offload.testing.reference import ReferenceRun, compare_greedy

STEPS = 24
WIDE = 0.5  # a margin far above the cut-off


def _reference(prompts: int = 3) -> ReferenceRun:
    tokens = [[100 * p + s for s in range(STEPS)] for p in range(prompts)]
    return ReferenceRun(tokens, [[WIDE] * STEPS for _ in range(prompts)])


def test_identical_outputs_match_with_every_step_of_every_prompt_compared() -> None:
    ref = _reference()
    result = compare_greedy(ref, [list(t) for t in ref.tokens], min_steps=STEPS)
    assert result.matched and result.steps == [STEPS] * 3 and result.failures == []


@pytest.mark.parametrize(
    ("broken", "why"),
    [
        (lambda toks: toks[:1], "2 of 3 prompts missing"),
        (lambda toks: toks + [toks[0]], "an extra prompt"),
        (lambda toks: [t[:8] for t in toks], "every output cut to 8 tokens"),
        (lambda toks: [[] for _ in toks], "every output empty"),
        (lambda toks: [toks[0], toks[1], toks[2] + [7]], "one output too long"),
        (lambda toks: [toks[0], toks[1][:5] + [-1] + toks[1][6:], toks[2]], "one token wrong"),
    ],
)
def test_broken_engine_outputs_do_not_match(broken, why: str) -> None:
    ref = _reference()
    result = compare_greedy(ref, broken([list(t) for t in ref.tokens]), min_steps=1)
    assert not result.matched, why


def test_minimum_is_per_prompt_not_a_sum() -> None:
    """One prompt stopping on a tiny margin at step 2 fails a floor of 8 even though the others compare 48."""
    ref = _reference()
    ref.margins[1][2] = 1e-5
    result = compare_greedy(ref, [list(t) for t in ref.tokens], min_steps=8)
    assert result.steps == [STEPS, 2, STEPS]
    assert not result.matched
    assert result.failures == ["prompt 1: 2 steps compared, at least 8 required"]
    assert result.stopped_early == ["prompt 1: step 2 margin 1.00e-05 < 0.001, stopped"]


def test_a_margin_stop_past_the_minimum_still_matches() -> None:
    """Past the floor, a step whose margin is below the cut-off ends that prompt's comparison without failing:
    either token is then a legitimate greedy choice, so the differing token after it is not checked."""
    ref = _reference()
    ref.margins[0][10] = 1e-5
    got = [list(t) for t in ref.tokens]
    got[0][10] = -1
    result = compare_greedy(ref, got, min_steps=8)
    assert result.matched and result.steps == [10, STEPS, STEPS]
    assert "prompt 0: step 10" in result.stopped_early[0]
    assert "steps per prompt=[10, 24, 24]" in str(result)
