"""MXINT-4 engram tables served as stored: vLLM's Engram builds the plugin's table for them (its FP8 one for FP8
tables), each TP rank loads exactly its heads' stored rows into host memory, the lookup returns the reference
decode of those rows, `plan` counts the same bytes in its host line, and the configurations that read the FP8
layout are refused by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from vllm.config.engram import EngramConfig
from vllm.models.deepseek_v41.common import engram as vllm_engram

from vllm_expert_offload.exl3.checkpoint import Exl3Checkpoint
from vllm_expert_offload.exl3.engram import EngramFormat, dequantize_rows
from vllm_expert_offload.exl3.residency import ENGRAM_LINE, ResidencyOptions, residency
from vllm_expert_offload.exl3.validate import validate_checkpoint
from vllm_expert_offload.integration import vllm_hooks
from vllm_expert_offload.integration.methods import engram_int4
from vllm_expert_offload.testing.tiny_dsv41 import TEXT, build_tiny_dsv41

TABLE = "layers.1.engram.embed"


@pytest.fixture(scope="module")
def pack():
    path = build_tiny_dsv41(EngramFormat.MXINT4)
    return path, validate_checkpoint(Exl3Checkpoint.open(path)), load_file(path / "model.safetensors")


def _layout():
    return vllm_engram.EngramLayout(SimpleNamespace(**TEXT))


def _build(layout, tp: int, rank: int) -> engram_int4.Mxint4EngramEmbedding:
    heads = tuple(size for order in layout.primes[0] for size in order)
    return engram_int4.Mxint4EngramEmbedding(layout.num_embeddings[0], layout.head_dim, heads, tp_size=tp,
                                             tp_rank=rank, cpu_offload=True)


def test_vllm_layout_matches_the_pack(pack) -> None:
    _, summary, _ = pack
    layout = _layout()
    table = summary.engram[1]
    assert (table.rows, table.dim, table.format) == (layout.num_embeddings[0], layout.head_dim, EngramFormat.MXINT4)


@pytest.mark.parametrize("tp", [1, 2])
def test_each_rank_loads_its_rows_and_looks_them_up_as_stored(pack, tp: int) -> None:
    _, summary, tensors = pack
    layout = _layout()
    codes, scales = tensors[f"{TABLE}.weight"], tensors[f"{TABLE}.scale"]
    gen = torch.Generator().manual_seed(tp)
    sizes = torch.tensor([s for order in layout.primes[0] for s in order])
    ids = layout.offsets[0] + (torch.rand(9, layout.n_hash_cols, generator=gen) * sizes).long()  # in each head's range
    parts, held = [], 0
    for rank in range(tp):
        table = _build(layout, tp, rank)
        table.weight.weight_loader(table.weight, codes)
        table.weight_scale_inv.weight_loader(table.weight_scale_inv, scales)
        lo, hi = table.vocab_start_idx, table.vocab_end_idx
        assert torch.equal(table.weight.data, codes[lo:hi]) and torch.equal(table.weight_scale_inv.data,
                                                                             scales[lo:hi].view(torch.uint8))
        assert table.weight.device.type == "cpu"  # host memory (pinned where a GPU is present)
        held += table.weight.nbytes + table.weight_scale_inv.nbytes
        out = torch.empty(9, table.part_n_hash_cols, layout.head_dim, dtype=torch.bfloat16)
        table.lookup(ids, out)
        parts.append(out)
    rows = torch.cat(parts, dim=1)[:, :layout.n_hash_cols]
    want = dequantize_rows(EngramFormat.MXINT4, codes[ids.reshape(-1)], scales[ids.reshape(-1)])
    assert torch.equal(rows.reshape(-1, layout.head_dim), want.to(torch.bfloat16))
    assert held == summary.engram[1].nbytes  # the ranks' shares add up to the table as stored


def test_plan_counts_the_tables_in_host_memory(pack) -> None:
    path, summary, _ = pack
    ckpt = Exl3Checkpoint.open(path)
    for tp in (1, 2):
        weights = residency(summary, ckpt.header_shapes(), ckpt.hf_config, ResidencyOptions(tp=tp))
        assert weights.host[ENGRAM_LINE] == summary.engram[1].nbytes
    on_gpu = residency(summary, ckpt.header_shapes(), ckpt.hf_config, ResidencyOptions(tp=2, engram_on_host=False))
    assert ENGRAM_LINE not in on_gpu.host


def _wrapped(monkeypatch, tables, engram_config: EngramConfig, dp: int = 1):
    import vllm.config
    import vllm.distributed

    monkeypatch.setattr(vllm.config, "get_current_vllm_config", lambda: SimpleNamespace(engram_config=engram_config))
    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_rank", lambda: 1)
    monkeypatch.setattr(vllm.distributed, "get_engram_dp_size", lambda: dp)
    original = []
    create = engram_int4.wrap_create_embedding(lambda self, layout, index: original.append(index) or "vllm", tables)
    return create, original


def test_engram_builds_the_plugins_table_for_mxint4_only(pack, monkeypatch) -> None:
    _, summary, _ = pack
    layout = _layout()
    create, original = _wrapped(monkeypatch, summary.engram, EngramConfig())
    table = create(None, layout, 0)
    assert isinstance(table, engram_int4.Mxint4EngramEmbedding) and (table.tp_size, table.head_start) == (2, 2)
    fp8 = validate_checkpoint(Exl3Checkpoint.open(build_tiny_dsv41(EngramFormat.FP8))).engram
    create, original = _wrapped(monkeypatch, fp8, EngramConfig())
    assert create(None, layout, 0) == "vllm" and original == [0]
    assert not vllm_hooks.install_engram(fp8)  # nothing to wrap for FP8 tables


@pytest.mark.parametrize("settings,named", [
    ({"dp_shared_memory": True}, "--engram-config dp_shared_memory"),
    ({"use_thp": True}, "--engram-config use_thp"),
])
def test_fp8_layout_configurations_refused(pack, monkeypatch, settings: dict, named: str) -> None:
    _, summary, _ = pack
    config = SimpleNamespace(**{"dp_shared_memory": False, "use_thp": False, "cpu_offload": True} | settings)
    create, _ = _wrapped(monkeypatch, summary.engram, config)
    with pytest.raises(ValueError, match=named):
        create(None, _layout(), 0)
    create, _ = _wrapped(monkeypatch, summary.engram, EngramConfig(), dp=2)
    with pytest.raises(ValueError, match="engram DP group larger than 1"):
        create(None, _layout(), 0)
