"""`vllm-expert-offload bench-kernels`: the JSON keys the issue names, with figures that are rates of the
weights each forward reads (checked for consistency, not for speed: speed lives in docs/benchmarks.md)."""

from __future__ import annotations

import json

from vllm_expert_offload import cli

KEYS = {"cpu_moe_gweights_s", "cpu_kernel_gweights_s", "torch_reference_gweights_s", "dense_matmul_gweights_s"}


def test_bench_kernels_writes_rates_for_one_and_eight_tokens(tmp_path) -> None:
    out = tmp_path / "bench.json"
    tiny = json.dumps({"hidden": 128, "intermediate": 128, "experts": 2, "k": 3})
    assert cli.main(["bench-kernels", "--json", str(out), "--repeats", "1", "--shape", tiny]) == 0
    report = json.loads(out.read_text())
    assert KEYS <= set(report) and set(report["at_8_tokens"]) == KEYS
    assert report["shape"]["experts"] == 2 and report["threads"] >= 1
    assert all(0 < report[k] < 1e3 and 0 < report["at_8_tokens"][k] < 1e3 for k in KEYS)
