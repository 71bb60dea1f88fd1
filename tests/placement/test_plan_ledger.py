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
