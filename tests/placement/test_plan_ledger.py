"""`plan` counts dense EXL3 linears as serving holds them: quantized (the GPU kernels read the trellis in place),
or decoded to fp16 only when `--dequantize-linears` says serving will decode them."""

from __future__ import annotations

import math

import pytest

from vllm_expert_offload.cli import main
from vllm_expert_offload.exl3.checkpoint import Exl3Checkpoint
from vllm_expert_offload.testing.tiny_models import build_tiny_model

ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "I16": 2, "I32": 4}


def _non_expert_row(tmp_path, capsys, *flags: str) -> tuple[int, str]:
    model = build_tiny_model(None, "qwen3_moe")
    assert main(["plan", "--model", str(model), "--host-fraction", "0.5", "--out", str(tmp_path / "p.json"),
                 *flags]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("device  non-expert weights", "device  expert scales"))]
    return sum(int(row.split()[-2].replace(",", "")) for row in rows), out


def test_dense_exl3_linears_counted_quantized_unless_decoded(tmp_path, capsys: pytest.CaptureFixture) -> None:
    shapes = Exl3Checkpoint.open(build_tiny_model(None, "qwen3_moe")).header_shapes()
    size = {name: math.prod(shape) * ITEMSIZE[dtype] for name, (shape, dtype) in shapes.items()}
    expert_scales = sum(v for n, v in size.items() if ".mlp.experts." in n and n.endswith((".suh", ".svh")))
    non_expert = {n: v for n, v in size.items() if ".mlp.experts." not in n}
    dense_sets = {n.rsplit(".", 1)[0] for n in non_expert if n.endswith(".trellis")}
    stored_sets = sum(v for n, v in non_expert.items() if n.rsplit(".", 1)[0] in dense_sets)
    decoded_sets = sum(shapes[f"{p}.trellis"][0][0] * 16 * shapes[f"{p}.trellis"][0][1] * 16 * 2 for p in dense_sets)
    others = sum(non_expert.values()) - stored_sets

    quantized, out = _non_expert_row(tmp_path, capsys)
    assert quantized == others + stored_sets + expert_scales
    assert "other EXL3 linears counted at their quantized size" in out
    decoded, out = _non_expert_row(tmp_path, capsys, "--dequantize-linears")
    assert decoded == others + decoded_sets + expert_scales and decoded > quantized
    assert "counted decoded to fp16 (dequantize_linears)" in out


def test_plan_ep_reports_each_rank_and_splits_the_model_between_them(tmp_path, capsys) -> None:
    """`plan --tp 2 --ep`: whole experts, vLLM's linear split, each rank's own GPU and host tier; the ranks' tiers
    add up to the whole model's experts, each exactly once, and the file records ep_size."""
    import json

    from vllm_expert_offload.offload.rank_plan import RankExperts
    from vllm_expert_offload.placement import read_plan
    from vllm_expert_offload.tools.plan_cmd import expert_sizes

    model = build_tiny_model(None, "qwen3_moe")
    out, summary = tmp_path / "p.json", tmp_path / "s.json"
    assert main(["plan", "--model", str(model), "--host-fraction", "0.5", "--tp", "2", "--ep", "--out", str(out),
                 "--summary-json", str(summary)]) == 0
    text = capsys.readouterr().out
    assert "(TP 2, EP 2:" in text and "the last 2 local experts of each layer" in text
    _, whole, _ = expert_sizes(Exl3Checkpoint.open(model), 1)  # whole experts, as EP ranks hold them
    plan, identity = read_plan(out)
    assert (identity.tp_size, identity.ep_size) == (1, 2)
    ranks = json.loads(summary.read_text())["ep_ranks"]
    assert [r["experts"] for r in ranks] == [list(RankExperts.linear(8, i, 2).local) for i in range(2)]
    for r in ranks:
        cols = r["experts"]
        assert r["gpu_expert_bytes"] == whole[:, cols][plan[:, cols]].sum()
        assert r["host_expert_bytes"] == whole[:, cols][~plan[:, cols]].sum()
        assert f"ep rank {ranks.index(r)} of 2, experts {cols[0]}-{cols[-1]}: GPU tier 4 experts" in text
    assert sum(r["gpu_expert_bytes"] + r["host_expert_bytes"] for r in ranks) == whole.sum()
    assert plan.sum(axis=1).tolist() == [4, 4]  # half of each layer on GPU: 2 of each rank's 4


def test_plan_ep_over_more_ranks_than_experts_is_refused(tmp_path, capsys) -> None:
    model = build_tiny_model(None, "qwen3_moe")
    assert main(["plan", "--model", str(model), "--host-fraction", "0.5", "--tp", "4", "--dp", "4", "--ep",
                 "--out", str(tmp_path / "p.json")]) == 2
    assert "--ep over 16 ranks: the model has only 8 routed experts per layer" in capsys.readouterr().err
