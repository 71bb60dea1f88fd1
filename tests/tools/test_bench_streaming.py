"""`bench` against an in-process fake OpenAI streaming server: per-chunk token counts, bursts, the /metrics check.

Issue 40: a stream whose tokens arrived in a few bursts printed 3,544 tok/s per stream beside 127 tok/s in total,
because chunk times were set against the final usage's token count. Each case below scripts the chunk timing a real
server produced (or one that makes a figure impossible) and checks `bench` reports it right or flags it.
"""

from __future__ import annotations

import json

import pytest

from tests.support.fake_openai import FakeServer, alternating, backlog_first, serving, stall_mid_stream, steady
from vllm_expert_offload.cli import main

OUTPUT_TOKENS = 24
GAP_S = 0.01  # 100 tok/s per stream, the tiny server's steady rate in issue 40


def _bench(url: str, tmp_path, capsys, concurrency: str = "1,2", turns: int = 1) -> tuple[int, dict | None, str]:
    out = tmp_path / "bench.json"
    code = main(["bench", "--url", url, "--concurrency", concurrency, "--output-tokens", str(OUTPUT_TOKENS),
                 "--prefix-tokens", "40", "--turns", str(turns), "--ttft-repeats", "1", "--target-tok-s", "20",
                 "--json", str(out)])
    result = json.loads(out.read_text()) if out.exists() else None
    return code, result, capsys.readouterr()


def test_steady_stream_reports_its_rate_and_passes_the_server_check(tmp_path, capsys) -> None:
    with serving(FakeServer(steady(0.02, GAP_S))) as server:
        code, result, out = _bench(server.url, tmp_path, capsys)
    assert code == 0 and result["settings"]["token_counting"] == "usage"
    for row in result["concurrency"]:
        assert row["failed"] is None and row["merged_chunks"] == 0 and row["chunks"] == row["concurrency"] * 24
        # sleeps only overshoot: at most the scripted 100 tok/s; a loaded CI machine slows it
        assert 20 < row["median_tok_s"] <= 1 / GAP_S * 1.02
        assert row["median_end_to_end_tok_s"] < row["median_tok_s"]  # the wait for the first token counts there
        check = row["server_check"]
        assert check["client_tokens"] == check["server_tokens"] == row["concurrency"] * OUTPUT_TOKENS
        assert check["streams_tok_s"] <= check["server_tok_s"] * 1.15
    assert result["capacity_at_target"] == 2
    assert "FAILED" not in out.out and "server generated" in out.out


def test_backlog_in_the_first_chunk_is_flagged_not_printed_as_a_speed(tmp_path, capsys) -> None:
    """The 3,544 tok/s case: 12 tokens come at once after a stall, the rest 1 ms apart.

    Counted the old way (usage tokens over chunk times) this stream decodes at ~2,000 tok/s; counted per chunk, its
    decode rate is the remaining tokens' 1,000 tok/s, which the server's counter (24 tokens in ~0.15 s) refutes."""
    with serving(FakeServer(backlog_first(0.12, 12, 0.001))) as server:
        code, result, out = _bench(server.url, tmp_path, capsys)
    assert code == 0
    for row in result["concurrency"]:
        assert row["failed"] is not None and "server generated" in row["failed"]
        assert row["merged_chunks"] == row["concurrency"]
        # the burst's tokens do not count toward the decode window they arrived before: 12 tokens over 12 gaps
        assert row["median_tok_s"] <= 12 / (12 * 0.001) * 1.05
        assert row["median_end_to_end_tok_s"] < 1 / GAP_S * 2  # what the user got: 24 tokens in ~0.14 s
    assert result["capacity_at_target"] is None
    assert out.out.count("FAILED, not a result") == 2 and "fell behind" in out.out


def test_a_closing_chunk_without_tokens_is_no_token_event(tmp_path, capsys) -> None:
    """The finish reason alone, after the last token (vLLM may send it so): not a chunk that carried tokens."""
    with serving(FakeServer(steady(0.02, GAP_S), finish_after_s=0.005)) as server:
        code, result, _ = _bench(server.url, tmp_path, capsys, concurrency="1,2")
    for row in result["concurrency"]:
        assert code == 0 and row["chunks"] == row["concurrency"] * OUTPUT_TOKENS and row["merged_chunks"] == 0


def test_tails_are_taken_from_the_slow_side(tmp_path, capsys) -> None:
    """Two turns, one fast and early (20 ms to the first token, 100 tok/s), one slow (120 ms, 50 tok/s): p5 of the
    speeds lies near the slow turn, below the median, and p95 of TTFT near the slow one's, above the median."""
    script = alternating(steady(0.02, GAP_S), steady(0.12, 2 * GAP_S))
    with serving(FakeServer(script)) as server:
        code, result, _ = _bench(server.url, tmp_path, capsys, concurrency="1", turns=2)
    (row,) = result["concurrency"]
    assert code == 0 and row["failed"] is None
    assert row["p5_tok_s"] < row["median_tok_s"] and row["p5_end_to_end_tok_s"] < row["median_end_to_end_tok_s"]
    assert row["p5_tok_s"] <= 1 / (2 * GAP_S) * 1.1  # within a tenth of the slow side's 50 tok/s
    assert row["ttft_p95_s"] > row["ttft_median_s"] and row["ttft_p95_s"] >= 0.11


def test_one_bursty_turn_of_a_session_is_flagged(tmp_path, capsys) -> None:
    """What the tiny CPU server did at 1 stream (4,339 tok/s per stream printed beside 334 generated): one turn's
    tokens came as a backlog, the other's steadily. The session's tokens over its decode time look plausible; the
    median request's rate, the figure printed per stream, does not, and the level is flagged on it."""
    script = alternating(steady(0.02, GAP_S), backlog_first(0.2, 20, 0.001))
    with serving(FakeServer(script)) as server:
        code, result, out = _bench(server.url, tmp_path, capsys, concurrency="1", turns=2)
    (row,) = result["concurrency"]
    assert code == 0 and row["merged_chunks"] == 1 and row["failed"] is not None
    assert result["capacity_at_target"] is None


def test_a_stall_mid_stream_comes_out_right_with_its_merged_chunk_counted(tmp_path, capsys) -> None:
    """Steady 10 ms chunks, then 12 tokens as one chunk after a 130 ms stall: the rate is tokens over the time."""
    with serving(FakeServer(stall_mid_stream(GAP_S, 0.13, 12))) as server:
        code, result, out = _bench(server.url, tmp_path, capsys, concurrency="1")
    (row,) = result["concurrency"]
    assert code == 0 and row["failed"] is None and row["merged_chunks"] == 1 and row["chunks"] == 13
    # 23 tokens after the first over 11 gaps and the stall: at most 23 / 0.24 s
    assert 20 < row["median_tok_s"] <= 23 / (11 * GAP_S + 0.13) * 1.02
    assert "1 of 13 chunks carried several tokens" in out.out


@pytest.mark.parametrize("factor", [0.9, 0.5])
def test_metrics_counter_below_the_streamed_tokens_fails_the_level(tmp_path, capsys, factor: float) -> None:
    """At 0.9 the summed rate is still within the tolerance: the token count alone fails the level."""
    with serving(FakeServer(steady(0.02, GAP_S), counter_factor=factor)) as server:
        code, result, out = _bench(server.url, tmp_path, capsys, concurrency="1")
    (row,) = result["concurrency"]
    assert code == 0 and row["failed"] is not None and result["capacity_at_target"] is None
    check = row["server_check"]
    assert check["server_tokens"] == pytest.approx(factor * check["client_tokens"])
    assert "FAILED, not a result" in out.out


def test_server_without_metrics_is_reported_unchecked(tmp_path, capsys) -> None:
    with serving(FakeServer(steady(0.02, GAP_S), metrics=False)) as server:
        code, result, out = _bench(server.url, tmp_path, capsys, concurrency="1")
    (row,) = result["concurrency"]
    assert code == 0 and row["failed"] is None and row["server_check"] is None
    assert "not checked" in out.out and result["capacity_at_target"] == 1


def test_logprobs_count_tokens_when_continuous_usage_is_missing(tmp_path, capsys) -> None:
    with serving(FakeServer(stall_mid_stream(GAP_S, 0.05, 5), continuous_usage=False)) as server:
        code, result, _ = _bench(server.url, tmp_path, capsys, concurrency="1")
    (row,) = result["concurrency"]
    assert code == 0 and result["settings"]["token_counting"] == "logprobs"
    assert row["merged_chunks"] == 1 and row["chunks"] == OUTPUT_TOKENS - 4 and row["failed"] is None


def test_server_with_neither_continuous_usage_nor_logprobs_is_refused(tmp_path, capsys) -> None:
    with serving(FakeServer(steady(0.0, 0.0), continuous_usage=False, logprobs=False)) as server:
        code, result, out = _bench(server.url, tmp_path, capsys, concurrency="1")
    assert code == 2 and result is None
    lines = [line for line in out.err.splitlines() if line and not line.startswith("requests:")]  # tqdm's bar
    assert len(lines) == 1 and lines[0].startswith("error: ") and "continuous_usage_stats" in lines[0] and "logprobs" in lines[0]


def test_chunks_that_disagree_with_the_final_usage_are_refused(tmp_path, capsys) -> None:
    with serving(FakeServer(steady(0.0, 0.0), final_usage_extra=3)) as server:
        code, result, out = _bench(server.url, tmp_path, capsys, concurrency="1")
    assert code == 2 and result is None
    assert "the chunks carried 4 tokens but the final usage says 7" in out.err


@pytest.mark.parametrize(("server", "said"), [
    (FakeServer(steady(0.0, 0.0), status=400), "HTTP 400: {\"error\": {\"message\": \"scripted refusal\""),
    (FakeServer(steady(0.0, 0.0), error_after=2), "ended a completion with an error: {'message': 'scripted failure'"),
])
def test_a_refused_or_failed_completion_is_one_line_naming_the_servers_message(tmp_path, capsys, server, said) -> None:
    with serving(server):
        code, result, out = _bench(server.url, tmp_path, capsys, concurrency="1")
    assert code == 2 and result is None
    assert said in out.err and "Traceback" not in out.err

