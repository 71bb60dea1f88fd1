"""`bench`'s figures from hand-made timings, without a server: a stream's rates, the server check's arithmetic and
its tolerance, a level that could not be measured, the capacity of a level exactly on the target, the printed line.

The streaming tests (test_bench_streaming.py) take scripted servers through the whole command; these take each
rule's boundary cases, which those scripts never produce: several sessions whose median request differs from every
session's own rate, a backlog in a first chunk beside single-token ones, a summed rate on the tolerance's edge."""

from __future__ import annotations

import pytest

from vllm_expert_offload.tools.bench_cmd import capacity, level_line, level_row
from vllm_expert_offload.tools.serving_load import LevelResult, ServerCheck, Timing, server_check


def _steady(ttft_s: float, after_first: int, tok_s: float, first: int = 1) -> Timing:
    """A request whose first chunk carries `first` tokens, then `after_first` single tokens at `tok_s`."""
    decode_s = after_first / tok_s
    return Timing(ttft_s, ttft_s + decode_s, (first,) + (1,) * after_first, decode_s, 10)


def _level(concurrency: int, median_tok_s: float | None, check: ServerCheck | None = None,
           merged: int = 0) -> LevelResult:
    return LevelResult(concurrency, median_tok_s, median_tok_s, 5.0, 4.0, 0.1, 0.2, 50.0, merged, 40, 100.0, check)


def test_a_stream_decodes_the_tokens_after_its_first_chunk_and_ends_to_end_all_of_them() -> None:
    timing = Timing(ttft_s=0.1, total_s=1.1, chunk_tokens=(3, 1, 2, 1), decode_s=1.0, prompt_tokens=10)
    assert (timing.tokens, timing.decode_tokens, timing.merged_chunks) == (7, 4, 2)
    assert timing.decode_tok_s == 4.0  # the first chunk's backlog arrived before the decode window
    assert timing.end_to_end_tok_s == pytest.approx(7 / 1.1)  # the user got all 7 in 1.1 s
    assert Timing(0.1, 0.1, (5,), 0.0, 10).decode_tok_s is None  # one chunk: no decode rate, not an infinite one


@pytest.mark.parametrize(("streams_tok_s", "ok"), [(114.9, True), (115.1, False)])
def test_the_server_check_allows_15_percent_over_the_servers_rate_and_no_more(streams_tok_s: float,
                                                                              ok: bool) -> None:
    assert ServerCheck(streams_tok_s, 100.0, 500.0, 500).ok is ok


def test_streams_that_received_more_tokens_than_the_server_generated_fail_however_slow() -> None:
    assert ServerCheck(10.0, 100.0, 500.0, 500).ok
    assert not ServerCheck(10.0, 100.0, 499.0, 500).ok


def test_server_check_sums_the_median_request_over_sessions_and_keeps_backlog_waits_in() -> None:
    # session A: decode rates 10 and 20, prefill waits 0.2 + 0.4; session B: rates 30 and 40, the second request's
    # first chunk a 5-token backlog, so only B's 0.1 s wait is prefill (decode steps ran during the other)
    a = [_steady(0.2, 10, 10.0), _steady(0.4, 10, 20.0)]
    b = [_steady(0.1, 30, 30.0), _steady(0.3, 40, 40.0, first=5)]
    check = server_check([a, b], wall_s=5.0, server_tokens=186.0)
    assert check.streams_tok_s == pytest.approx(2 * 25.0)  # two sessions x the median request (rates 10..40)
    assert check.server_tok_s == pytest.approx(186.0 / (5.0 - (0.6 + 0.1) / 2))  # median wait of the sessions
    assert (check.server_tokens, check.client_tokens) == (186.0, 11 + 11 + 31 + 45)


def test_a_level_without_a_decode_rate_is_a_failure_not_a_result() -> None:
    level = _level(1, None)
    assert "decode rate is unmeasured" in level.failed
    assert capacity([level], 0.0) is None
    assert "FAILED, not a result: no request received a token after its first chunk" in level_line(level_row(level))


def test_capacity_counts_a_level_exactly_on_the_target_and_takes_the_largest() -> None:
    assert capacity([_level(1, 40.0), _level(2, 40.0), _level(4, 39.9)], 40.0) == 2
    failing = ServerCheck(200.0, 100.0, 500.0, 500)
    assert capacity([_level(1, 40.0), _level(2, 45.0, failing)], 40.0) == 1  # a failed level carries no capacity


def test_the_printed_line_names_backlogs_only_when_chunks_carried_several_tokens() -> None:
    check = ServerCheck(80.0, 100.0, 500.0, 500)
    steady_line = level_line(level_row(_level(2, 40.0, check)))
    assert "carried several tokens" not in steady_line and "server generated 100.0 tok/s" in steady_line
    assert "3 of 40 chunks carried several tokens" in level_line(level_row(_level(2, 40.0, check, merged=3)))
    assert "not checked: the server exposes no vllm:generation_tokens_total" in level_line(level_row(_level(2, 40.0)))
