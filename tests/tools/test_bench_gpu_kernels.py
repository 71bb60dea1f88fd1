"""The GPU bandwidth probe's and kernel benchmark's code paths, run on the CPU at tiny shapes (Triton interpreter), so
what a lent GPU runs has been executed before: rows by read size and pattern, rooflines from the probe's own summary,
bytes by tier, the Zipf fit of the routing the project carries, and a host arena this runtime refuses reported as such
with the host-tier rows skipped. The figures themselves mean nothing here."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from support import fake_cudart
from support.paths import REPO


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


probe_module = _load("gpu_bandwidth_probe")
bench_module = _load("bench_gpu_kernels")


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory) -> tuple[list[dict], list[dict]]:
    out = tmp_path_factory.mktemp("bench")
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    try:
        assert probe_module.main(["--smoke", "--out", str(out / "probe.jsonl")]) == 0
        # No time budget cuts the rows short: the smoke run interpreted takes ~120 s (Triton 3.9) to ~145 s (3.6, the
        # lent machine's) on a shared 2-core machine, past the default 140 s after which rows are written as skipped
        assert bench_module.main(["--smoke", "--out", str(out / "bench.jsonl"), "--rooflines",
                                  str(out / "probe.jsonl"), "--budget-s", "3600"]) == 0
    finally:
        mp.undo()
    return _rows(out / "probe.jsonl"), _rows(out / "bench.jsonl")


def test_probe_rows_by_read_size_and_pattern_and_a_summary_of_their_best(smoke_run) -> None:
    probe, _ = smoke_run
    kinds = [r["probe"] for r in probe]
    assert kinds[0] == "setup" and kinds[-1] == "rooflines" and "host_arena" in kinds
    sizes = probe_module.SMOKE["read_sizes"]
    for tier in ("hbm", "host"):
        reads = [r for r in probe if r["probe"] == f"{tier}_read"]
        assert [r["read_bytes"] for r in reads] == sizes
        for r in reads:
            assert r["total_bytes"] == r["chunks"] * r["read_bytes"] and r["gbs"] == pytest.approx(
                r["total_bytes"] / r["seconds"] / 1e9)
    summary = probe[-1]
    assert summary["hbm_gbs"] == max(r["gbs"] for r in probe if r["probe"] == "hbm_read")
    assert summary["host_read_gbs"] == max(r["gbs"] for r in probe if r["probe"] == "host_read")
    patterns = {(r["backend"], r["tier"]): r["gbs"] for r in probe if r["probe"] == "pattern"}
    assert summary["host_pattern_gbs"] == {"triton": patterns[("triton", "host")],
                                           "exllamav3": patterns[("exllamav3", "host")],
                                           "torch": summary["h2d_copy_gbs"]}
    assert summary["host"] == "host_arena"


def test_bench_rows_cover_every_point_with_bytes_by_tier_and_the_probes_rooflines(smoke_run) -> None:
    probe, bench = smoke_run
    setup, summary = bench[0], probe[-1]
    assert setup["row"] == "setup" and setup["rooflines"] == summary and setup["backends"] == ["triton", "torch"]
    assert "its kernels are CUDA kernels" in setup["skipped_backends"]["exllamav3"]
    moe = [r for r in bench if r["row"] == "moe"]
    cfg = bench_module.SMOKE
    assert sorted((r["backend"], r["tokens"], r["host_share"]) for r in moe) == sorted(
        (b, t, s) for b in ("triton", "torch") for t in cfg["tokens"] for s in cfg["host_shares"])
    assert [r["backend"] for r in moe][-4:] == ["torch"] * 4  # the slow eager reference goes last
    model = bench_module.SMOKE_MODEL
    # per expert, 3 projections of 128 x 128 at K=3: trellis (128/16)^2 tiles x 16 x 3 int16 from the expert's tier;
    # suh and svh (128 fp16 each) from HBM in both tiers (offload/tiers.py keeps them on the GPU)
    trellis, scales = 3 * (128 // 16) ** 2 * 16 * 3 * 2, 3 * (2 * 128 + 2 * 128)
    for r in moe:
        distinct = r["distinct_experts_median"]
        assert 0 < distinct <= min(r["tokens"] * model["top_k"], model["experts"])
        on_host = {0.0: 0, 1.0: distinct}[r["host_share"]]  # the smoke shares: every expert in one tier
        want = ((distinct - on_host) * trellis + distinct * scales, on_host * trellis)
        assert (r["hbm_bytes_median"], r["host_bytes_median"]) == want
        assert r["timing"] == "eager" and r["p90_s"] >= r["median_s"] > 0
        host_rate = summary["host_pattern_gbs"][r["backend"]]
        assert (r["roofline_hbm_gbs"], r["roofline_host_gbs"]) == (summary["hbm_gbs"], host_rate)
        if r["host_share"] in (0.0, 1.0):  # bytes grow with the distinct experts: the median's bytes over the rates
            want = r["hbm_bytes_median"] / (summary["hbm_gbs"] * 1e9) + r["host_bytes_median"] / (host_rate * 1e9)
            assert r["roofline_s"] == pytest.approx(want)
        assert r["fraction_of_roofline"] == pytest.approx(r["roofline_s"] / r["median_s"])
    dense = [r for r in bench if r["row"] == "moe_fp16_dense"]
    assert [r["tokens"] for r in dense] == list(cfg["tokens"]) and all(r["distinct_experts"] >= 1 for r in dense)
    linear = [r for r in bench if r["row"] == "linear"]
    assert sorted((r["backend"], r["rows"]) for r in linear) == sorted(
        (b, n) for b in ("fp16_matmul", "triton") for n in cfg["dense_rows"])


def test_a_refused_host_registration_is_a_row_not_a_crash(monkeypatch, tmp_path: Path) -> None:
    """Where the runtime refuses cudaHostRegister (or MADV_DONTFORK), the probe says so and reads a torch pinned buffer
    instead; the benchmark says so and skips the host-tier rows, measuring the rest. The real HostArena registers
    through a fake libcudart that refuses (801) and keeps the runtime's last error, and every timed launch runs
    torch's launch check first: an error the refusal left pending would kill the first kernel after the fallback."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cudart = fake_cudart.install(monkeypatch, {"cudaHostRegister": 801})
    arena_type = probe_module.HostArena

    def cuda_arena(nbytes: int, device: torch.device) -> object:  # --smoke runs on the CPU: register as on a GPU
        return arena_type(nbytes, device="cuda")

    times = probe_module.Clock.times

    def checked_times(clock, *args, **kwargs) -> list[float]:
        cudart.launch_check()  # the L2 flush's fill_ is a torch kernel: C10_CUDA_KERNEL_LAUNCH_CHECK after it
        return times(clock, *args, **kwargs)

    monkeypatch.setattr(probe_module, "HostArena", cuda_arena)
    monkeypatch.setattr(bench_module, "HostArena", cuda_arena)
    monkeypatch.setattr(probe_module.Clock, "times", checked_times)
    monkeypatch.setitem(probe_module.SMOKE, "read_sizes", [4096])
    monkeypatch.setattr(bench_module, "SMOKE", {**bench_module.SMOKE, "tokens": (1,), "dense_rows": ()})
    assert probe_module.main(["--smoke", "--out", str(tmp_path / "probe.jsonl")]) == 0
    probe = _rows(tmp_path / "probe.jsonl")
    failed = [r for r in probe if r["probe"] == "host_arena"]
    assert [(r["status"], r["fallback"]) for r in failed] == [("failed", "torch pinned memory (cudaHostAlloc)")]
    refusal = r"CudaError: cudaHostRegister\(0x[0-9a-f]+, 1048576, 0x3\) failed: cudaError 801 \(cudaErrorNotSupported"
    assert re.match(refusal, failed[0]["error"]), failed[0]["error"]
    assert {r["host"] for r in probe if r["probe"] in ("host_read", "h2d_copy")} == {"torch_pinned"}
    assert probe[-1]["probe"] == "rooflines" and probe[-1]["host"] == "torch_pinned"
    assert bench_module.main(["--smoke", "--out", str(tmp_path / "bench.jsonl")]) == 0
    bench = _rows(tmp_path / "bench.jsonl")
    assert [r["status"] for r in bench if r["row"] == "host_arena"] == ["failed"]
    moe = [r for r in bench if r["row"] == "moe"]
    assert all("median_s" in r for r in moe if r["host_share"] == 0.0)
    hosted = [r for r in moe if r["host_share"] > 0]
    assert hosted and all(r["skipped"].startswith("no host arena on this machine (CudaError: cudaHostRegister")
                          for r in hosted)
    assert [c[0] for c in cudart.calls] == ["cudaHostRegister"] * 2 and cudart.drains == 2


def test_zipf_fit_recovers_a_power_law_and_the_projects_routing_is_skewed() -> None:
    ranks = np.arange(1, 65, dtype=float)
    law = np.stack([1e6 / ranks**1.3, 1e6 / ranks[::-1] ** 1.3])  # order of experts does not matter
    assert bench_module.zipf_exponent(law) == pytest.approx(1.3, abs=1e-6)
    assert bench_module.zipf_exponent(np.full((2, 64), 50)) == pytest.approx(0.0, abs=1e-9)  # uniform: no skew
    counts, source = bench_module.routing_counts(None)
    assert "routing_fixtures" in source and 0.7 < bench_module.zipf_exponent(counts) < 1.6  # drawn at 1.1
    with pytest.raises(ValueError, match="nothing to fit"):
        bench_module.zipf_exponent(np.zeros((1, 8)))


def test_routing_draws_distinct_experts_by_popularity_and_the_host_tier_takes_the_coldest() -> None:
    popularity = np.array([0.5, 0.2, 0.1, 0.1, 0.05, 0.05])
    draws = bench_module.draw_routing(popularity, tokens=200, top_k=2, draws=3, seed=0, device=torch.device("cpu"))
    ids = draws.ids
    assert ids.shape == (3, 200, 2) and bool((ids[..., 0] != ids[..., 1]).all())
    assert torch.allclose(draws.weights.sum(-1), torch.ones(3, 200))
    frequency = np.bincount(ids.reshape(-1).numpy(), minlength=6)
    assert frequency[0] == frequency.max() and frequency[0] > 2 * frequency[4]
    assert [list(u) for u in draws.unique] == [sorted(set(d.reshape(-1).tolist())) for d in ids]
    assert bench_module.host_experts(popularity, 0.5).tolist() == [False, False, False, True, True, True]
    assert not bench_module.host_experts(popularity, 0.0).any() and bench_module.host_experts(popularity, 1.0).all()


def test_model_shapes_are_one_ranks_layer_from_the_carried_configs() -> None:
    assert bench_module.model_shape("qwen3_30b_a3b", 1) == {"hidden": 2048, "intermediate": 768, "experts": 128,
                                                            "top_k": 8, "tp": 1}
    assert bench_module.model_shape("deepseek_v41_flash", 2) == {"hidden": 5120, "intermediate": 1152,
                                                                 "experts": 384, "top_k": 6, "tp": 2}


H200_PROGRAMS = 2 * 132  # fill_target on an H200 (132 SMs): the decode split the lent GPU gets


@pytest.mark.parametrize(("model", "ranks"), [("qwen3_30b_a3b", 1), ("deepseek_v41_flash", 2)])
def test_the_benchs_layers_reserve_every_workspace_its_graph_captures_take(model: str, ranks: int) -> None:
    """Issue 38 item 1: the rows capture CUDA graphs at 1, 8 and 64 tokens x the model's top_k; a Workspaces.take
    beyond the reservation raises inside a capture. The reservation is computed from the layer the bench describes
    (its top_k and capture rows), the need from the forward's own view shapes: no GPU needed."""
    from vllm_expert_offload.kernels.triton_moe import decode_split, workspace_floats, workspace_shapes

    shape = bench_module.model_shape(model, ranks)
    tokens = bench_module.FULL["tokens"]
    layer = bench_module.layer_description(shape, tokens, [], None, None, None, torch.device("cpu"))
    assert layer.top_k == shape["top_k"] and set(tokens) <= set(layer.capture_rows)
    dims = (shape["intermediate"], shape["hidden"])
    split = decode_split(shape["hidden"], *dims, layer.top_k, H200_PROGRAMS)
    reserved = workspace_floats(layer.top_k, layer.capture_rows, split, *dims)
    for n in tokens:
        for purpose, view in workspace_shapes(n, shape["top_k"], split, *dims).items():
            assert int(np.prod(view)) <= reserved[purpose], (model, n, purpose)
    # the figures: the defaults (top_k 1, nothing captured) reserve too little for the 8- or 64-token row
    short = workspace_floats(1, (), decode_split(shape["hidden"], *dims, 1, H200_PROGRAMS), *dims)
    needs = {n: workspace_shapes(n, shape["top_k"], split, *dims) for n in (8, 64)}
    if model == "qwen3_30b_a3b":
        assert (int(np.prod(needs[8]["moe_partial"])), short["moe_partial"]) == (1_572_864, 393_216)
    else:
        assert int(np.prod(needs[64]["moe_out"])) == 1_966_080 > short["moe_out"]


_READ_PROBE_LOADS = """
import collections, importlib.util, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
spec = importlib.util.spec_from_file_location("probe", sys.argv[1])
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)
signature = {"table_ptr": "*i64", "out_ptr": "*i32", "chunk_words": "i32", "parts": "i32", "BLOCK": "constexpr",
             "STEPS": "constexpr"}
source = ASTSource(fn=probe._read_chunks, signature=signature, constexprs={"BLOCK": 1024, "STEPS": 4},
                   attrs={(i,): [["tt.divisibility", 16]] for i in range(3)})
ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
print(json.dumps(collections.Counter(re.findall(r"ld[.]global(?:[.]\\w+)*", ptx))))
"""


def test_the_read_probe_compiles_to_16_byte_loads() -> None:
    """The probe's chunk pointers come from a table, so Triton knows nothing of their alignment unless told: without
    `tl.multiple_of` every read compiled to `ld.global.b32`, and the rooflines by read size measured 4-byte loads.
    Compiled for sm_90 (no GPU) in a child without the interpreter, as the launch specialises it (table, output and
    word count 16-divisible)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    child = subprocess.run([sys.executable, "-c", _READ_PROBE_LOADS, str(REPO / "benchmarks" / "gpu_bandwidth_probe.py")],
                           capture_output=True, text=True, env=env, timeout=300, check=False)
    assert child.returncode == 0, child.stderr[-2000:]
    loads = json.loads(child.stdout.strip().splitlines()[-1])
    # the chunk's address from the table, then 1024 words x 4 steps over 128 lanes in 16-byte vectors
    assert loads == {"ld.global.b64": 1, "ld.global.v4.b32": 8}, loads


def test_a_misaligned_chunk_table_is_refused() -> None:
    with pytest.raises(ValueError, match="16-byte aligned"):
        probe_module._chunk_table(lambda offset: 0x1004 + offset, 1 << 16, 4096, 4, 0, torch.device("cpu"))


def test_the_probes_docstring_gives_the_read_sizes_it_measures() -> None:
    """The module docstring is the legend of the probe's rows: its range of chunk sizes must be what FULL measures."""
    stated = re.search(r"(\d+) KiB to (\d+) MiB per chunk", probe_module.__doc__)
    assert stated is not None
    sizes = probe_module.FULL["read_sizes"]
    assert (int(stated[1]) * 2**10, int(stated[2]) * 2**20) == (min(sizes), max(sizes))
