"""Data parallelism on the CPU engine (issue 27): `vllm serve --data-parallel-size 2 --enable-expert-parallel`, one
rank per engine, half of each engine's experts in the host tier. Both engines serve HF's greedy tokens, each engine
places only the experts vLLM's expert map gives it (its log line; the two lines add up to the model's experts,
each once), and the statistics written once equal HF's router top-k over every token both engines routed.

vLLM 0.32's CPU build cannot run an MoE layer under data parallelism by itself: its CPU communicator has no
`all_gatherv` / `reduce_scatterv`, which vLLM's naive MoE dispatch needs, and it calls the MoE layer inside the
compiled graph, where those collectives cannot be traced. tests/support/cpu_gatherv.py is a test-only stand-in for
what a GPU build has (NCCL's all_gatherv and reduce_scatterv, the MoE layer as one opaque op), put into every
process of this `vllm serve` through its PYTHONPATH; the plugin never installs it.

Marked `inductor`: the compiled warm-up forward of a full batch runs first. Without it (vLLM's CPU CI backend) an
engine's first forward can be a 1-token dummy batch (it steps with the other engine during the readiness smoke),
and Dynamo then specializes the graph to one token.

One engine start (two engines, ~3 minutes on two busy cores)."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from vllm_expert_offload.placement import RoutingCounts
from vllm_expert_offload.testing.reference import compare_greedy
from vllm_expert_offload.testing.server import vllm_server

from support import cpu_gatherv
from support.engine_model import MAX_TOKENS, Model
from support.reference_twin import checked_dense_twin
from support.router_counts import hf_router_counts

pytestmark = [pytest.mark.engine, pytest.mark.inductor]

PLACEMENT_LINE = re.compile(r"expert placement \(dp rank (\d) of 2, ep rank (\d) of 2, experts (\d+)-(\d+)\): (\d+) of "
                            r"(\d+) routed experts in the host tier")
MERGED_SAVE = re.compile(r"the sum of 2 data-parallel engines' tokens, by DP rank: (\d+) \+ (\d+) = (\d+)")
SAVE_EVERY_S = 1


def _complete(url: str, model: str, prompt: list[int]) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.load(response)["choices"][0]["token_ids"]


def _save_covering(path: Path, log: Path, tokens: int, timeout_s: float = 120) -> tuple[RoutingCounts, list[int]]:
    """The first merged save of at least `tokens` tokens (counts only grow: one that counted more is wrong at once),
    read once the next save is logged, and each engine's share of it from its log line."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        shares = [list(map(int, m)) for m in MERGED_SAVE.findall(log.read_text())]
        covering = [share for share in shares if share[2] >= tokens]
        if len(covering) >= 2:  # the file now holds the second of them, which must equal the first
            assert covering[0] == covering[1], f"counts changed with no traffic: {covering[:2]}"
            return RoutingCounts.load(path), covering[0][:2]
        time.sleep(0.1)
    raise AssertionError(f"no merged save of {tokens} tokens in {timeout_s}s; saves so far: {shares}")


def test_data_parallel_2_with_expert_parallelism(tmp_path) -> None:
    model = Model.get("qwen3_moe")
    stats, log = tmp_path / "stats.json", tmp_path / "serve.log"
    offload = {"expert_offload": {"host_fraction": 0.5, "record_stats": str(stats),
                                  "record_stats_interval_s": SAVE_EVERY_S}}
    args = ["--enable-expert-parallel", "--block-size", "64", "--dtype", "float32", "--shutdown-timeout", "30",
            "--additional-config", json.dumps(offload)]
    with vllm_server(model.exl3, args, data_parallel_size=2, log_path=log, extra_env=cpu_gatherv.serve_env()) as server:
        # Three prompts at once: vLLM's balancer sends them to the less loaded engine, so both engines get some.
        with ThreadPoolExecutor(len(model.prompts)) as pool:
            tokens = list(pool.map(lambda prompt: _complete(server.url, model.exl3, prompt), model.prompts))
        routed = [prompt + generated[:-1] for prompt, generated in zip(model.prompts, tokens)]  # the last: never fed
        saved, shares = _save_covering(stats, log, sum(map(len, routed)))
    comparison = compare_greedy(model.reference, tokens, min_steps=MAX_TOKENS)
    assert comparison.matched, str(comparison)

    # Each engine places only its own 4 experts (2 layers x 2 of them in the host tier); together, every expert once.
    text = log.read_text()
    assert "Local/global number of experts: 4/8" in text  # vLLM's own EP split over the 2 engines
    lines = sorted(set(PLACEMENT_LINE.findall(text)))
    assert lines == [("0", "0", "0", "3", "4", "8"), ("1", "1", "4", "7", "4", "8")], lines

    # Both engines served, each counted only its own tokens (not the other's, gathered into its MoE layers, nor the
    # dummy batches it ran for the other's collectives), and the one file holds their sum: HF's router top-k over
    # every token routed.
    assert min(shares) > 0 and sum(shares) == sum(map(len, routed)), shares
    assert saved.model.ep_size == 2 and saved.tokens == sum(map(len, routed))
    np.testing.assert_array_equal(saved.counts, hf_router_counts(str(checked_dense_twin(model.exl3)), routed, 8))
