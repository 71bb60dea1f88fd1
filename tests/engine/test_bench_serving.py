"""`bench` against a live `vllm serve` of the tiny EXL3 MoE on the CPU, with short settings: the JSON has every
key, tokens are counted per chunk from vLLM's continuous usage, no level's per-stream speeds add up to more than the
server's own generated-token counter (a level that would is flagged, never a result), p5 <= median per level, and a
long prefix's TTFT is lower from the prefix cache than cold.

The cold prompt (about 850 of the server's 1024 positions) is long enough that prefilling it on the CPU takes
clearly longer than prefilling only its last partial block after a cache hit."""

from __future__ import annotations

import json

import pytest

from vllm_expert_offload.cli import main
from vllm_expert_offload.testing.server import vllm_server
from vllm_expert_offload.testing.tiny_models import build_tiny_model
from vllm_expert_offload.tools.bench_cmd import plot

pytestmark = pytest.mark.engine
LEVEL_KEYS = {"concurrency", "median_tok_s", "p5_tok_s", "median_end_to_end_tok_s", "p5_end_to_end_tok_s",
              "ttft_median_s", "ttft_p95_s", "aggregate_tok_s", "merged_chunks", "chunks", "server_check", "failed"}


def test_bench_against_a_live_server(tmp_path) -> None:
    model = build_tiny_model(None, "qwen3_moe")
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    args = ["--concurrency", "1,2", "--output-tokens", "8", "--prefix-tokens", "128", "--turns", "2",
            "--cold-prefix-tokens", "850", "--ttft-repeats", "3", "--json", str(out)]
    with vllm_server(model, log_path=tmp_path / "serve.log") as server:
        assert main(["bench", "--url", server.url, *args]) == 0
    result = json.loads(out.read_text())

    assert [row["concurrency"] for row in result["concurrency"]] == [1, 2]
    for row in result["concurrency"]:
        assert set(row) == LEVEL_KEYS
        check = row["server_check"]
        assert check["client_tokens"] <= check["server_tokens"]
        if row["failed"] is None:  # a failed level says why and is left out of the capacity; bench_cmd's tests
            assert check["streams_tok_s"] <= check["server_tok_s"] * 1.15  # hold the flagging itself
            assert 0 < row["p5_tok_s"] <= row["median_tok_s"]
        assert 0 < row["p5_end_to_end_tok_s"] <= row["median_end_to_end_tok_s"]
        assert 0 < row["ttft_median_s"] <= row["ttft_p95_s"]
        assert row["aggregate_tok_s"] > 0
    settings = result["settings"]
    assert settings["token_counting"] == "usage"
    assert settings["model"] == str(model) and settings["server_version"].startswith("0.")
    assert settings["output_tokens"] == 8 and settings["prefix_tokens"] == 128 and settings["date"]
    assert 600 < settings["cold_prompt_tokens"] < 1024
    assert 0 < result["ttft_cached_s"] < result["ttft_cold_s"]

    pytest.importorskip("matplotlib")  # the plot is drawn from the stored result, so no second run is needed
    plot(result, png)
    assert png.read_bytes().startswith(b"\x89PNG")
