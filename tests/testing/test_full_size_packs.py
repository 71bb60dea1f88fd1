"""The seeds' pack at full size, headers only: DeepSeek-V4.1-Flash (40 layers x 384 routed experts, hidden 5120,
expert intermediate 2304) with routed experts EXL3 K=3 and MXINT-4 engram tables, 188,245 tensors in sparse
safetensors shards. Validation (the startup check), `inspect` and `plan` run on it; `plan` reproduces the seeds'
per-GPU weights at TP 2: 102.1 GiB with every routed expert on the GPUs (engram tables in host memory, as vLLM
keeps them), 72.4 GiB with 4,608 experts and the embedding in host memory (each within 3 %)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest

from vllm_expert_offload.exl3.checkpoint import Exl3Checkpoint
from vllm_expert_offload.exl3.residency import ENGRAM_LINE, ResidencyOptions
from vllm_expert_offload.exl3.validate import validate_checkpoint
from vllm_expert_offload.testing.full_size_packs import write_pack
from vllm_expert_offload.tools.inspect_cmd import inspect_checkpoint
from vllm_expert_offload.tools.plan_cmd import expert_sizes, plan_ledger
from vllm_expert_offload.units import GIB

SEEDS_PACK_GIB = 309.3
SEEDS_ALL_GPU_GIB, SEEDS_OFFLOADED_GIB, SEEDS_HOST_EXPERTS = 102.1, 72.4, 4608


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("full") / "dsv41-flash"
    stats = write_pack("dsv41-flash", out)
    ckpt = Exl3Checkpoint.open(out)
    return out, stats, ckpt, validate_checkpoint(ckpt)


def test_pack_is_full_size_and_costs_no_disk(seeds) -> None:
    out, stats, ckpt, _ = seeds
    assert stats["tensors"] == len(ckpt.tensor_files) == 96_085 - 92_160 + 184_320  # release, experts as EXL3 sets
    assert abs(stats["bytes"] / GIB - SEEDS_PACK_GIB) / SEEDS_PACK_GIB < 0.02
    allocated = sum(os.stat(f).st_blocks * 512 for f in out.iterdir())
    assert allocated < 100 * 2**20  # headers and markers only


def test_startup_validation_and_inspect_pass(seeds) -> None:
    out, _, _, summary = seeds
    assert (summary.layout.num_layers, summary.layout.num_experts, summary.layout.draft_experts) == (40, 384, 128)
    assert len(summary.linears) == 40 * 384 * 3 and {lin.k for lin in summary.linears.values()} == {3}
    assert summary.contract.mtp_start_layer == 40
    assert {t.format.value for t in summary.engram.values()} == {"mxint4"}
    report = inspect_checkpoint(out)
    assert "architecture: DeepseekV41ForCausalLM" in report and "draft experts from layer 40" in report


def test_plan_reproduces_the_seeds_per_gpu_weights(seeds) -> None:
    _, _, ckpt, summary = seeds
    summary, sizes, _ = expert_sizes(ckpt, 2, summary)
    everything = np.ones(sizes.shape, dtype=bool)
    ledger, weights = plan_ledger(ckpt, summary, everything, sizes, ResidencyOptions(tp=2))
    assert abs(ledger.gpu_weight_bytes / GIB - SEEDS_ALL_GPU_GIB) / SEEDS_ALL_GPU_GIB < 0.03
    assert weights.host[ENGRAM_LINE] == sum(t.nbytes for t in summary.engram.values())
    # 4,608 of the 15,360 experts to the host (all experts are the same size, so which ones does not matter).
    plan = everything.copy()
    plan.reshape(-1)[: SEEDS_HOST_EXPERTS] = False
    ledger, weights = plan_ledger(ckpt, summary, plan, sizes, ResidencyOptions(tp=2, embedding_on_host=True))
    assert (ledger.host_experts, ledger.host_experts + ledger.gpu_experts) == (SEEDS_HOST_EXPERTS, 15_360)
    assert abs(ledger.gpu_weight_bytes / GIB - SEEDS_OFFLOADED_GIB) / SEEDS_OFFLOADED_GIB < 0.03
    assert math.isclose(ledger.host_expert_bytes * 2, int(sizes[~plan].sum()) * 2)
    assert "embedding (host arena, UVA row gather)" in weights.host


def test_published_two_bit_pack_validates(tmp_path: Path) -> None:
    """diffbot's 2-bit pack: the same contract at K=2 with the engram tables as released (FP8)."""
    out = tmp_path / "dsv41-flash-2bpw"
    write_pack("dsv41-flash-2bpw", out)
    summary = validate_checkpoint(Exl3Checkpoint.open(out))
    assert {lin.k for lin in summary.linears.values()} == {2}
    assert {t.format.value for t in summary.engram.values()} == {"fp8"}
