"""Tensor-parallel shares that cut through a 128-block: ExpertGeometry.rank_slice keeps the whole block,
ExpertCrop says where the rank's channels sit in it, and TableMoE computes with exactly those channels; the dense
linears' method (Exl3LinearMethod) crops the same way.

Every standard e2e fixture splits on 128-blocks at TP 2, where the crop offset is always 0; here intermediate
sizes 320 and 192 give offsets 16 to 112 (TP 2 and a simulated TP 4), against slices of the dense weight.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear

from vllm_expert_offload.exl3 import dequantize
from vllm_expert_offload.exl3.naming import PROJECTIONS
from vllm_expert_offload.exl3.tensors import padded
from vllm_expert_offload.integration.methods.linear_method import Exl3LinearMethod
from vllm_expert_offload.kernels.contract import ExpertCrop
from vllm_expert_offload.kernels.oracle import choose_kernels
from vllm_expert_offload.kernels.pointer_tables import build_pointer_tables, kernel_address
from vllm_expert_offload.kernels.table_moe import TableMoE
from vllm_expert_offload.memory import HostArena
from vllm_expert_offload.offload.rank_plan import ExpertGeometry
from vllm_expert_offload.offload.tiers import host_record_bytes, place_expert

from support import exl3_reference as ref

HIDDEN = 128
EXPERTS = 4
# (intermediate, tp size) -> crop offset of each rank: the rank's start modulo 128.
OFFSETS = {(320, 2): [0, 32], (320, 4): [0, 80, 32, 112], (192, 2): [0, 96], (192, 4): [0, 48, 96, 16]}


def _scales(rng: np.random.Generator, n: int) -> torch.Tensor:
    return torch.from_numpy((rng.choice([-1.0, 1.0], n) * rng.uniform(0.5, 1.5, n)).astype(np.float16))


def _projection(rng: np.random.Generator, in_features: int, out_features: int) -> dict[str, torch.Tensor]:
    """A random EXL3 tensor set at the padded shape; random trellises decode to non-zero padding too, so a crop
    that reaches into the padding is visible."""
    fin, fout = padded(in_features), padded(out_features)
    return {
        "trellis": torch.from_numpy(ref.random_trellis(rng, fin // 16, fout // 16, 3)),
        "suh": _scales(rng, fin),
        "svh": _scales(rng, fout),
        "mul1": torch.tensor(ref.MUL1_MARKER_INT32, dtype=torch.int32),
    }


def _expert(seed: int, intermediate: int) -> dict[str, dict[str, torch.Tensor]]:
    rng = np.random.default_rng(seed)
    shapes = {"gate": (HIDDEN, intermediate), "up": (HIDDEN, intermediate), "down": (intermediate, HIDDEN)}
    return {p: _projection(rng, *shapes[p]) for p in PROJECTIONS}


def _dense(expert: dict[str, dict[str, torch.Tensor]], intermediate: int) -> dict[str, torch.Tensor]:
    """The whole expert's (out, in) weights at their true, unpadded shapes."""
    dense = {p: dequantize(tensors) for p, tensors in expert.items()}
    return {"gate": dense["gate"][:intermediate, :HIDDEN], "up": dense["up"][:intermediate, :HIDDEN],
            "down": dense["down"][:HIDDEN, :intermediate]}


def _geometry(intermediate: int, tp_size: int, rank: int) -> ExpertGeometry:
    return ExpertGeometry(HIDDEN, intermediate, intermediate // tp_size, rank, tp_size)


def _ranks(intermediate: int, tp_size: int) -> list[tuple[int, int]]:
    return [(intermediate, tp_size, rank) for rank in range(tp_size)]


@pytest.mark.parametrize(("intermediate", "tp_size", "rank"), [r for key in OFFSETS for r in _ranks(*key)])
def test_rank_slice_cropped_equals_the_dense_weights_slice(intermediate: int, tp_size: int, rank: int) -> None:
    geometry = _geometry(intermediate, tp_size, rank)
    assert geometry.crop_offset == OFFSETS[(intermediate, tp_size)][rank]
    expert = _expert(rank, intermediate)
    dense = _dense(expert, intermediate)
    start, end, o = geometry.rank_start, geometry.rank_start + geometry.intermediate_per_rank, geometry.crop_offset
    share = slice(o, o + geometry.intermediate_per_rank)
    for projection in ("gate", "up"):
        part = dequantize(geometry.rank_slice(expert[projection], projection, projection))
        assert torch.equal(part[share, :HIDDEN], dense[projection][start:end]), projection
    part = dequantize(geometry.rank_slice(expert["down"], "down", "down"))
    assert torch.equal(part[:HIDDEN, share], dense["down"][:, start:end])


def _table_moe(experts: list[dict], geometry: ExpertGeometry) -> TableMoE:
    """This rank's kernel over its slices of `experts`, odd experts in the host tier (decoded through the
    arena on every use) and even ones in the GPU tier (decoded once, kept resident on a CPU)."""
    sliced = [{p: geometry.rank_slice(e[p], f"expert{i}.{p}", p) for p in PROJECTIONS} for i, e in enumerate(experts)]
    arena = HostArena(sum(host_record_bytes(s) for s in sliced[1::2]))
    placed = [place_expert(s, i % 2 == 0, arena, "cpu") for i, s in enumerate(sliced)]
    tables = build_pointer_tables(placed, kernel_address(arena, "cpu"))
    crop = ExpertCrop(geometry.hidden, geometry.intermediate_per_rank, geometry.crop_offset)
    return TableMoE(placed, tables, arena, crop, torch.float32, torch.device("cpu"))


def _dense_moe(dense: list[dict[str, torch.Tensor]], x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
    """The unsharded MoE in float64: sum over each token's experts of weight * down(silu(gate x) * up x)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            d = {p: v.double() for p, v in dense[e].items()}
            h = F.silu(d["gate"] @ x[t].double()) * (d["up"] @ x[t].double())
            out[t] += w * (d["down"] @ h)
    return out


@pytest.mark.parametrize(("intermediate", "tp_size"), list(OFFSETS))
def test_table_moe_ranks_sum_to_the_dense_moe(intermediate: int, tp_size: int) -> None:
    """What TP all-reduce computes: the ranks' partial outputs add up to the unsharded MoE; a crop at the wrong
    offset, of the wrong width or into the padding changes the sum."""
    experts = [_expert(100 + e, intermediate) for e in range(EXPERTS)]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:2] for _ in range(6)])
    weights = torch.softmax(torch.randn(6, 2, generator=gen), dim=-1)
    got = sum(
        _table_moe(experts, _geometry(intermediate, tp_size, rank)).forward(x, weights, ids, False)
        for rank in range(tp_size)
    )
    want = _dense_moe([_dense(e, intermediate) for e in experts], x, weights, ids)
    err = (got.double() - want).abs().max() / want.abs().max()
    assert err < 1e-5, err


def _linear_layer(tp_rank: int, tp_size: int, row_parallel: bool, output_size: int) -> torch.nn.Module:
    """The attributes Exl3LinearMethod reads from vLLM's linear layers, without vLLM's process groups."""
    cls = RowParallelLinear if row_parallel else ColumnParallelLinear
    layer = cls.__new__(cls)
    torch.nn.Module.__init__(layer)
    layer.tp_rank, layer.tp_size, layer.output_size = tp_rank, tp_size, output_size
    return layer


@pytest.fixture(scope="module")
def vllm_config():
    """vLLM builds layers under a current config (the method registers its op target in its forward context)."""
    from vllm.config import VllmConfig, set_current_vllm_config

    config = VllmConfig()
    with set_current_vllm_config(config):
        yield config


@pytest.mark.parametrize("kernel", ["torch", "cpu"])
@pytest.mark.parametrize("row_parallel", [False, True], ids=["column", "row"])
@pytest.mark.parametrize(("intermediate", "tp_size", "rank"), [r for key in OFFSETS for r in _ranks(*key)])
def test_linear_method_rank_weight_equals_the_dense_weights_slice(
    vllm_config, row_parallel: bool, intermediate: int, tp_size: int, rank: int, kernel: str
) -> None:
    """A dense MLP's up (column-parallel, output split) and down (row-parallel, input split) at the same widths:
    the reference backend's decoded weight is exactly the dense slice; the CPU kernel computes with it."""
    per_rank, start = intermediate // tp_size, rank * (intermediate // tp_size)
    fin, fout = (intermediate, HIDDEN) if row_parallel else (HIDDEN, intermediate)
    tensors = _projection(np.random.default_rng(rank), fin, fout)
    name = "model.layers.0.mlp.down_proj" if row_parallel else "model.layers.0.mlp.up_proj"
    quant_config = SimpleNamespace(shard_prefixes=lambda prefix: [prefix],
                                   kernel_choice=lambda device: choose_kernels(kernel, device))
    method = Exl3LinearMethod(quant_config, name)
    quant_config.capture_sizes = lambda: ()
    vllm_config.compilation_config.static_forward_context.pop(f"{name}.exl3", None)  # one layer per case
    layer = _linear_layer(rank, tp_size, row_parallel, fout)
    method.create_weights(layer, per_rank if row_parallel else fin, [fout if row_parallel else per_rank], fin, fout,
                          torch.float32)
    for suffix, tensor in tensors.items():
        method._load(getattr(layer, suffix), tensor)
    method.process_weights_after_loading(layer)
    dense = dequantize(tensors)[:fout, :fin]
    want = dense[:, start : start + per_rank] if row_parallel else dense[start : start + per_rank]
    if kernel == "torch":
        assert torch.equal(method.kernel.weight, want)
    else:
        x = torch.randn(3, want.shape[1], generator=torch.Generator().manual_seed(rank))
        torch.testing.assert_close(method.apply(layer, x), x @ want.T, rtol=1e-4, atol=1e-4)
