"""`simulate` against step times computed by hand for 2 MoE layers x 4 experts of 100 bytes, top-2.

Bandwidths are 100 B/s over the link and 1000 B/s from GPU memory, so every step time below is a few
additions. Plan: layer 0 keeps experts 0 and 1 on the GPU, layer 1 keeps expert 0."""

from __future__ import annotations

import json

import numpy as np
import pytest

from vllm_expert_offload.cli import main
from vllm_expert_offload.placement import ModelIdentity, RoutingCounts, save_plan

SIZES = np.full((2, 4), 100)
IDENTITY = ModelIdentity.from_expert_bytes("TestMoe", 2, [0, 1], 1, SIZES)
LINK = ["--pcie-gbs", "1e-7", "--hbm-gbs", "1e-6"]  # 100 and 1000 bytes/s


@pytest.fixture
def plan(tmp_path):
    path = tmp_path / "plan.json"
    save_plan(path, np.array([[True, True, False, False], [True, False, False, False]]), IDENTITY)
    return path


def simulate(tmp_path, plan, *extra: str, sizes: tuple[str, str] = ("--expert-bytes", "100")) -> list[dict]:
    out = tmp_path / "sim.json"
    assert main(["simulate", "--plan", str(plan), *sizes, "--top-k", "2", *LINK, "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())["concurrency"]


def test_uniform_routing_reads_shared_experts_once(tmp_path, plan):
    # p = 2/4 per expert. c=1: layer 0 reads 100 B from GPU, 100 B from host -> max(0.1, 1.0) s;
    # layer 1: 50 B GPU, 150 B host -> 1.5 s; step 2.5 s.
    # c=2: each expert read with 1 - 0.5^2 = 0.75 -> host 150 B (1.5 s) and 225 B (2.25 s); step 3.75 s.
    one, two = simulate(tmp_path, plan, "--concurrency", "1,2")
    assert one["step_s"] == pytest.approx(2.5)
    assert one["per_stream_tok_s"] == pytest.approx(0.4)
    assert one["distinct_experts_per_layer"] == pytest.approx(2.0)
    assert (one["gpu_bytes"], one["host_bytes"]) == (pytest.approx(150), pytest.approx(250))
    assert two["step_s"] == pytest.approx(3.75)
    assert two["distinct_experts_per_layer"] == pytest.approx(3.0)
    assert two["per_stream_tok_s"] == pytest.approx(1 / 3.75)
    assert two["aggregate_tok_s"] == pytest.approx(2 / 3.75)


def test_serial_reads_add_up(tmp_path, plan):
    # c=1 without overlap: (0.1 + 1.0) + (0.05 + 1.5) = 2.65 s.
    (one,) = simulate(tmp_path, plan, "--concurrency", "1", "--serial")
    assert one["step_s"] == pytest.approx(2.65)


def test_statistics_set_the_selection_probabilities(tmp_path, plan):
    # Layer 0 always picks experts 0 and 1 (both on GPU): 200 B at 1000 B/s = 0.2 s at any concurrency.
    # Layer 1 is uniform: at c=3 each expert is read with 1 - 0.5^3 = 0.875 -> host 3 x 87.5 B = 2.625 s.
    stats = tmp_path / "counts.json"
    RoutingCounts(np.array([[4, 4, 0, 0], [2, 2, 2, 2]]), (0, 1), IDENTITY).save(stats)
    (three,) = simulate(tmp_path, plan, "--concurrency", "3", "--stats", str(stats))
    assert three["step_s"] == pytest.approx(0.2 + 2.625)
    assert three["host_bytes"] == pytest.approx(262.5)


def test_gpu_check_supplies_the_largest_read_bandwidths(tmp_path, plan, capsys):
    limits = tmp_path / "limits.json"
    limits.write_text(json.dumps({"h2d_copy_gbs": 50, "uva_kernel_read_gbs": {"16KiB": 1, "4096KiB": 2e-7},
                                  "hbm_kernel_read_gbs": {"64KiB": 1, "1024KiB": 2e-6}}))
    out = tmp_path / "sim.json"
    assert main(["simulate", "--plan", str(plan), "--expert-bytes", "100", "--top-k", "2", "--gpu-check",
                 str(limits), "--concurrency", "1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["concurrency"][0]["step_s"] == pytest.approx(1.25)  # twice as fast
    assert "tok/s per stream" in capsys.readouterr().out


def test_sizes_other_than_the_plans_are_refused(tmp_path, plan, capsys):
    assert main(["simulate", "--plan", str(plan), "--expert-bytes", "99", "--top-k", "2"]) == 2
    assert "expert_bytes_sha256" in capsys.readouterr().err


def test_model_gives_the_sizes_a_checkpoints_plan_was_made_for(tmp_path, capsys):
    """A plan from `plan --model` checks against the checkpoint's own sizes: every expert of the tiny Qwen3-MoE is
    3 projections x 128 x 256 weights x 3 bits / 8 = 36,864 trellis bytes, so both ways give the same bound."""
    from vllm_expert_offload.testing.tiny_models import build_tiny_model

    model, plan = build_tiny_model(None, "qwen3_moe"), tmp_path / "plan.json"
    assert main(["plan", "--model", str(model), "--host-fraction", "0.5", "--out", str(plan)]) == 0
    by_model = simulate(tmp_path, plan, "--concurrency", "1,4", sizes=("--model", str(model)))
    assert simulate(tmp_path, plan, "--concurrency", "1,4", sizes=("--expert-bytes", "36864")) == by_model
    assert by_model[0]["host_bytes"] == pytest.approx(by_model[0]["gpu_bytes"])  # half of each layer on host


def test_expert_parallel_plan_is_refused_by_name(tmp_path, capsys):
    """One step's bytes summed over every expert is not what EP ranks, each reading its own experts, take."""
    path = tmp_path / "plan-ep.json"
    save_plan(path, np.ones((2, 4), dtype=bool), ModelIdentity.from_expert_bytes("TestMoe", 2, [0, 1], 1, SIZES, 2))
    assert main(["simulate", "--plan", str(path), "--expert-bytes", "100", "--top-k", "2"]) == 2
    assert "is an expert-parallel plan (ep_size 2)" in capsys.readouterr().err
