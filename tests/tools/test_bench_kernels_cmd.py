"""`vllm-expert-offload bench-kernels`: the JSON keys the issue names, with figures that are rates of the
weights each forward reads (checked for consistency, not for speed: speed lives in docs/benchmarks.md)."""

from __future__ import annotations

import json

import pytest

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


def test_bench_kernels_reports_the_cpu_kernel_keys_against_dram_and_names_why_exllamav3_is_absent(tmp_path) -> None:
    out = tmp_path / "bench.json"
    tiny = json.dumps({"hidden": 128, "intermediate": 128, "experts": 2, "k": 3})
    missing = tmp_path / "exl3cpu_scratch.so"
    assert cli.main(["bench-kernels", "--json", str(out), "--repeats", "1", "--shape", tiny, "--dram-mib", "4",
                     "--exllamav3-ext", str(missing)]) == 0
    report = json.loads(out.read_text())
    detail = report["cpu_kernel"]
    for suffix in ("1tok", "8tok"):
        ours = report[f"cpu_kernel_gweights_s_{suffix}"]
        row = report if suffix == "1tok" else report["at_8_tokens"]
        assert ours == row["cpu_moe_gweights_s"]
        assert detail[f"gweights_s_per_core_{suffix}"] == ours / detail["threads"]
        assert detail[f"dram_fraction_{suffix}"] == pytest.approx(
            ours * detail["bytes_per_weight"] / detail["dram_read_gbytes_s"], rel=1e-9)
    # K=3 trellis is 3/8 byte per weight; the scales add a little on top
    assert 3 / 8 < detail["bytes_per_weight"] < 0.5
    assert str(missing) in detail["exllamav3_skipped"] and "exllamav3_gweights_s_1tok" not in detail
