"""Kernel launches as torch ops (kernels/launch_ops.py): the launcher runs where tensors have memory, with the
MatrixTable handed through field by field, and nothing runs on meta or under fake tensors."""

from __future__ import annotations

import uuid

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from vllm_expert_offload.kernels import cpu_exl3, triton_exl3  # noqa: F401  (register their launches)
from vllm_expert_offload.kernels.launch_ops import LAUNCH_OPS, register_table_launch
from vllm_expert_offload.kernels.matrix_table import MatrixTable, present_key


def _table(device: str) -> MatrixTable:
    return MatrixTable(torch.tensor([7, 9], device=device), torch.tensor([6, 5], dtype=torch.int32, device=device),
                       torch.tensor([2, 1], dtype=torch.int32, device=device), present_key((2, 1)), 128, 256,
                       present_key((6, 5)))


def _probe() -> tuple[list, object]:
    calls = []

    def launch(a, row_ids, block_matrix, table, out) -> None:
        calls.append(table)
        out.fill_(1.0)

    return calls, register_table_launch(f"probe_{uuid.uuid4().hex}", launch)


def test_launch_runs_on_cpu_with_the_table_intact() -> None:
    calls, op = _probe()
    table, out = _table("cpu"), torch.zeros(2, 4)
    op(torch.zeros(2, 128), torch.zeros(32, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), table, out)
    (seen,) = calls
    assert (seen.uniform_codebook, seen.in_features, seen.out_features, seen.uniform_twice_k) == (-6, 128, 256, -96)
    assert all(torch.equal(getattr(seen, f), getattr(table, f)) for f in ("trellis", "twice_k", "codebook"))
    assert (out == 1).all()


def test_launch_writes_nothing_on_meta_or_fake_tensors() -> None:
    calls, op = _probe()
    meta = dict(device="meta")
    op(torch.empty(2, 128, **meta), torch.empty(32, dtype=torch.int32, **meta),
       torch.empty(2, dtype=torch.int32, **meta), _table("meta"), torch.empty(2, 4, **meta))
    with FakeTensorMode():
        op(torch.empty(2, 128), torch.empty(32, dtype=torch.int32), torch.empty(2, dtype=torch.int32), _table("cpu"),
           torch.empty(2, 4))
    assert calls == []


def test_the_backends_launches_are_registered() -> None:
    names = {"exl3_matmul_triton", "exl3_matmul_cpu", "moe_gate_up_triton", "moe_down_triton", "moe_sum_triton",
             "linear_triton", "linear_finish_triton"}
    assert {f"vllm_expert_offload::{name}" for name in names} <= set(LAUNCH_OPS)
