"""The KV-cache block-size startup fix (issues "Startup: KV block sizes 64 and 128 initialize and serve",
"DeepSeek-V4.1 KV block sizes: the seeds' block-64 startup crash" and "DeepSeek-V4.1 on SM120: KV pages the
kernels actually have").

Four layers of evidence: the pure resolver and the kernel truth table (tests/kv, no vLLM); the hooks on vLLM's own
worker functions and backend declarations, in process (the CPU build's V1 runner path, and the V2 runner's
bindings); `check-kv` on the DeepSeek-V4 and V4.1 configs the project carries (tests/fixtures, runs on a bare
clone), for every V4.1 backend and GPU at --block-size 64, 128 and 256, each planned kernel page checked against the
kernel truth table; and the shared kv-plan-repro scripts, which run vLLM's spec construction, planning and
kernel-block checks for DeepSeek-V4 layer patterns and for DeepSeek-V4.1 on each emulated GPU and backend, as
subprocesses with and without the general plugins (10-30 s each; they run three at a time). Every repro case has a
twin through the project's own `check-kv` on the configs under tests/fixtures (DeepSeek-V4-Flash, V4.1-Flash,
Qwen3-30B-A3B: public config.json values), so a bare clone, without ../shared, checks the same layouts with the
fix on and reproduces the same upstream errors with it off.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from vllm_expert_offload.integration.vllm_hooks import install_kv_fix
from vllm_expert_offload.kv.rules import KVBlockLayoutError

from support.paths import FIXTURES, SHARED

# ../shared beside the checkout (present in CI); KV_PLAN_REPRO overrides.
_SHARED_REPRO = SHARED / "tools" / "kv-plan-repro" / "kv_plan_repro.py"
REPRO = Path(os.environ.get("KV_PLAN_REPRO", str(_SHARED_REPRO)))
REPRO41 = REPRO.parent / "kv41_plan_repro.py"
# Public config.json values carried by the project: DeepSeek-V4.1-Flash (40 layers, compress ratios 0/1/2),
# DeepSeek-V4-Flash (43 layers, ratios 0/4/128, the repro's dsv4_flash) and Qwen3-30B-A3B (its qwen3moe).
DSV41_FIXTURE = FIXTURES / "deepseek_v41_flash"
DSV4_FIXTURE = FIXTURES / "deepseek_v4_flash"
QWEN_FIXTURE = FIXTURES / "qwen3_30b_a3b"
# Another V4.1 layer pattern: ratio-2 kv sources first and in runs of four, then ratio 1 (24 layers, +1 MTP entry).
V41_RATIO2_FIRST = [0, 2, 2, 2, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 2, 2, 2, 1, 1, 2, 2, 0, 0, 0, 0]
V41_RATIO2_FIRST_SOURCES = [1, 3, 5, 7, 9, 11, 13, 15, 17, 19]


def _dsv41_config(directory: Path, ratios: list[int], sources: list[int]) -> Path:
    """The DeepSeek-V4.1-Flash config.json with another layer pattern (kv and index sources alike)."""
    config = json.loads((DSV41_FIXTURE / "config.json").read_text())
    text = config.get("text_config", config)
    text.update(num_hidden_layers=len(ratios) - 1, compress_ratios=ratios, kv_source_layer_ids=sources,
                index_source_layer_ids=sources)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


@pytest.fixture(scope="module")
def v41_patterns(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The public V4.1-Flash config and the second layer pattern, by name."""
    other = _dsv41_config(tmp_path_factory.mktemp("v41") / "ratio2_first", V41_RATIO2_FIRST, V41_RATIO2_FIRST_SOURCES)
    return {"v41_flash": DSV41_FIXTURE, "ratio2_first": other}


# ---------------------------------------------------------------- hooks in vLLM's worker functions


@pytest.fixture(scope="module")
def kv_fix():
    """The fix, installed in this process (as `register()` does in every vLLM process)."""
    import vllm.v1.worker.gpu.attn_utils  # noqa: F401  (Model Runner V2: its bindings must be rebound)
    import vllm.v1.worker.gpu_model_runner  # noqa: F401  (Model Runner V1)

    from vllm_expert_offload.integration.kv import fix as kv_fix

    install_kv_fix()
    return kv_fix


def _bound(kv_fix) -> dict[str, object]:
    from vllm_expert_offload.integration.vllm_hooks import KV_FIX

    return {hook.target: getattr(sys.modules[hook.module], hook.name) for hook in KV_FIX}


def test_install_covers_both_runners_and_is_idempotent(kv_fix) -> None:
    from vllm_expert_offload.integration.patching import SENTINEL

    before = _bound(kv_fix)
    assert len(before) == 6 and all(getattr(fn, SENTINEL, False) for fn in before.values())
    assert install_kv_fix() == []
    assert _bound(kv_fix) == before


def test_switch(kv_fix, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kv_fix.ENV_SWITCH, "0")
    assert install_kv_fix() == []
    monkeypatch.setenv(kv_fix.ENV_SWITCH, "off")
    with pytest.raises(ValueError, match="use 1 .* or 0"):
        install_kv_fix()


def test_spec_hook_raises_dsv4_indexer_and_keeps_workable_sizes(kv_fix) -> None:
    import torch
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.mla.indexer import DeepseekV4IndexerBackend
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
    from vllm.v1.worker import utils

    indexer = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=132, dtype=torch.uint8, tokens_per_state=4)
    assert utils.customize_attention_spec(DeepseekV4IndexerBackend, indexer).block_size == 256
    for size, expected in ((16, 32), (32, 32), (64, 64), (256, 256)):
        spec = FullAttentionSpec(block_size=size, num_kv_heads=4, head_size=128, dtype=torch.bfloat16)
        assert utils.customize_attention_spec(CPUAttentionBackend, spec).block_size == expected


def _v41_indexer_spec(block_size: int, ratio: int = 1):
    """DeepSeek-V4.1's indexer key cache as `DeepseekV4IndexerCache.get_kv_cache_spec` builds it on SM100
    (132 B rows, pages padded to 512 B: at ratio 1 8,448 B padded to 8,704 B at 64 tokens, 16,896 B at 128)."""
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=132, dtype=torch.uint8, alignment=512,
                            tokens_per_state=ratio, model_version="deepseek_v4")


def test_resized_recomputes_padding_for_the_new_block() -> None:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_expert_offload.integration.kv.facts import resized

    at_64 = _v41_indexer_spec(64)
    assert at_64.page_size_bytes == 8704
    with pytest.raises(AssertionError):  # upstream's copy keeps the padding set for 64 tokens
        _ = at_64.copy_with_new_block_size(128).page_size_bytes
    assert resized(at_64, 128) == _v41_indexer_spec(128) and resized(at_64, 128).page_size_bytes == 16896
    shared = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16, page_size_padded=8192)
    assert resized(shared, 32).page_size_bytes == 8192  # padding set for another reason is kept while it fits
    with pytest.raises(KVBlockLayoutError, match="padded to 8192 B for 16-token blocks cannot move to 64-token blocks"):
        resized(shared, 64)


@pytest.mark.parametrize(("arch", "ratio", "expected"),
                         [("sm100", 1, 128), ("sm100", 2, 128), ("sm120", 1, 64), ("sm120", 2, 128), ("sm90", 1, 64)])
def test_spec_hook_gives_the_v41_indexer_its_gpus_block(kv_fix, arch: str, ratio: int, expected: int) -> None:
    """SM100 and SM90 keep vLLM's declared 128 and 64; on SM120 the page holds 64 states whatever the ratio."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.mla.indexer import DeepseekV41IndexerBackend
    from vllm.v1.worker import utils

    from vllm_expert_offload.tools.gpu_arch import emulated

    with emulated(arch):
        spec = utils.customize_attention_spec(DeepseekV41IndexerBackend, _v41_indexer_spec(64, ratio))
    assert spec.block_size == expected and spec.num_states == expected // ratio
    assert spec.page_size_bytes == _v41_indexer_spec(expected, ratio).page_size_bytes
    assert current_platform.get_device_capability() is None  # the CPU platform again


def _swa_spec(block_size: int):
    """DeepSeek-V4.1's sliding-window cache on SM120 (`DeepseekV4SWACache`, fp8_ds_mla: 584 B records, 576 B
    aligned pages: 19,008 B at the model's 32 tokens, 37,440 B at 64)."""
    import torch
    from vllm.v1.kv_cache_interface import SlidingWindowMLASpec

    return SlidingWindowMLASpec(block_size=block_size, num_kv_heads=1, head_size=512, dtype=torch.uint8,
                                sliding_window=128, cache_dtype_str="fp8_ds_mla", state_content_bytes=584,
                                alignment=576, model_version="deepseek_v4")


def test_spec_hook_declares_the_sm120_pages_from_the_truth_table(kv_fix) -> None:
    """On SM120 the FlashInfer backend, the indexer and FlashInfer's sliding window declare what the kernel truth
    table says (vLLM 0.32/0.33 declare [128], [128], [MultipleOf(32)]); on SM100 the same classes keep vLLM's."""
    from vllm.models.deepseek_v41.nvidia.flashinfer_sparse import (
        DeepseekSparseSWAFlashInferBackend,
        DeepseekV4FlashInferMLASparseBackend,
    )
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.mla.indexer import DeepseekV41IndexerBackend
    from vllm.v1.worker import utils

    from vllm_expert_offload.integration.patching import SENTINEL
    from vllm_expert_offload.tools.gpu_arch import emulated

    with emulated("sm120"):
        swa = utils.customize_attention_spec(DeepseekSparseSWAFlashInferBackend, _swa_spec(32))
        mla = utils.customize_attention_spec(DeepseekV4FlashInferMLASparseBackend, _v41_indexer_spec(128, 1))
        utils.customize_attention_spec(DeepseekV41IndexerBackend, _v41_indexer_spec(128, 1))
        declared = [backend.get_supported_kernel_block_sizes(spec)
                    for backend in (DeepseekV4FlashInferMLASparseBackend, DeepseekV41IndexerBackend)
                    for spec in (_v41_indexer_spec(64, 1), _v41_indexer_spec(64, 2))]
        declared_swa = DeepseekSparseSWAFlashInferBackend.get_supported_kernel_block_sizes(_swa_spec(32))
    assert (swa.block_size, swa.page_size_bytes, mla.block_size) == (64, 37440, 64)
    assert declared == [[64], [128], [64], [128]] and declared_swa == [64]
    assert getattr(DeepseekSparseSWAFlashInferBackend.get_supported_kernel_block_sizes, SENTINEL, False)
    with emulated("sm100"):
        assert DeepseekV4FlashInferMLASparseBackend.get_supported_kernel_block_sizes(_v41_indexer_spec(64, 1)) == [128]
        (multiple,) = DeepseekSparseSWAFlashInferBackend.get_supported_kernel_block_sizes(_swa_spec(32))
    assert isinstance(multiple, MultipleOf) and multiple.base == 32
    assert DeepseekV4FlashInferMLASparseBackend.get_supported_kernel_block_sizes() == [128]  # no spec, no GPU: vLLM's


def test_sm120_specs_are_customized_for_the_declarations_they_end_with(kv_fix, monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    """vLLM's customization aligns block strides to the largest declared size; it runs after the declaration is set,
    also for the first cache of each backend in a process (here with vLLM's own declarations back in place)."""
    from vllm.models.deepseek_v41.nvidia.flashinfer_sparse import (
        DeepseekSparseSWAFlashInferBackend,
        DeepseekV4FlashInferMLASparseBackend,
    )
    from vllm.v1.attention.backends.mla.indexer import DeepseekV41IndexerBackend

    from vllm_expert_offload.integration.kv.check import KVCheckRequest, _vllm_config
    from vllm_expert_offload.integration.kv.model_specs import layer_specs
    from vllm_expert_offload.tools.gpu_arch import emulated

    for backend in (DeepseekV4FlashInferMLASparseBackend, DeepseekV41IndexerBackend,
                    DeepseekSparseSWAFlashInferBackend):
        declared = backend.get_supported_kernel_block_sizes
        monkeypatch.setattr(backend, "get_supported_kernel_block_sizes",
                            staticmethod(getattr(declared, "__wrapped__", declared)))
    config = _vllm_config(KVCheckRequest(DSV41_FIXTURE, 64, gpu_arch="sm120"))
    with emulated("sm120"):
        layers = layer_specs(config, 1, None, "sm120")
    aligned = {(spec.block_size, spec.block_stride_alignment.base) for spec, backend in layers.values()
               if backend.get_name() != "CompressorBackend"}
    assert aligned == {(64, 64), (128, 128)}


def test_spec_hook_refuses_a_backend_the_table_gives_no_kernels_on_the_gpu(kv_fix) -> None:
    """FlashMLA's V4.1 backend has kernels on SM90 and SM100 only: on SM120 startup stops at the first spec."""
    from vllm.models.deepseek_v41.sparse_mla import DeepseekV4FlashMLABackend
    from vllm.v1.worker import utils

    from vllm_expert_offload.tools.gpu_arch import emulated

    with emulated("sm120"), pytest.raises(KVBlockLayoutError, match=(
            r"^FLASHMLA_SPARSE_DSV41 has no kernels on SM120: the kernel truth table .* has it on SM90: 64-token "
            r"pages; SM100: 128-token pages\. Choose an attention backend that runs on SM120$")):
        utils.customize_attention_spec(DeepseekV4FlashMLABackend, _v41_indexer_spec(64, 1))


def _planned(block_size: int):
    """One planned full-attention group on the CPU backend, with the runner's attention group for it."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.worker.utils import AttentionGroup

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=4, head_size=128, dtype=torch.bfloat16)
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], spec)])
    return config, [[AttentionGroup(CPUAttentionBackend, ["l0", "l1"], spec, 0)]]


class _Lines(logging.Handler):
    """Collects one logger's messages, whether or not vLLM's logging config stops propagation."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_kernel_hook_refuses_and_logs_one_line(kv_fix) -> None:
    from vllm.v1.worker import gpu_model_runner, utils
    from vllm.v1.worker.gpu import attn_utils

    refusal = r"g0 \(2 layers from l0\): block size 16 is not usable \(CPU_ATTN takes \[MultipleOf\(32\)\]\); sizes"
    with pytest.raises(KVBlockLayoutError, match=refusal + " that would work: 32,"):
        attn_utils.prepare_kernel_block_sizes(*_planned(16))  # Model Runner V2's binding
    lines, level = _Lines(), kv_fix.logger.level
    kv_fix.logger.addHandler(lines)
    kv_fix.logger.setLevel(logging.INFO)
    try:
        for _ in range(2):  # the profiling KV cache and the real one: logged once
            assert gpu_model_runner.prepare_kernel_block_sizes(*_planned(96)) == [96]  # V1's binding
        assert utils.prepare_kernel_block_sizes(*_planned(96)) == [96]
    finally:
        kv_fix.logger.removeHandler(lines)
        kv_fix.logger.setLevel(level)
    assert lines.lines == ["vllm-expert-offload KV block sizes per group: g0=96 [CPU_ATTN]"]


def test_kernel_hook_names_the_gpu_in_a_refusal(kv_fix) -> None:
    from vllm.v1.worker import utils

    from vllm_expert_offload.tools.gpu_arch import emulated

    with emulated("sm120"), pytest.raises(KVBlockLayoutError, match=r"KV-cache group g0 \(2 layers from l0\) on "
                                                                     r"SM120: block size 16 is not usable"):
        utils.prepare_kernel_block_sizes(*_planned(16))


def test_check_kv_subcommand_is_wired() -> None:
    from vllm_expert_offload.cli import build_parser
    from vllm_expert_offload.tools import check_kv_cmd

    args = build_parser().parse_args(["check-kv", "m", "--block-size", "64", "--tp", "2"])
    assert (args.handler, args.block_size, args.tp) == (check_kv_cmd.run, 64, 2)


def _check_kv_args(model: Path, block_size: int, gpu_arch: str | None = None, backend: str | None = None,
                   tp: int = 1, kv_gib: float = 8.0) -> argparse.Namespace:
    return argparse.Namespace(model_dir=model, block_size=block_size, tp=tp, attention_backend=backend,
                              gpu_arch=gpu_arch, max_model_len=8192, kv_gib=kv_gib)


# V4.1 on each GPU and backend (--gpu-arch, --attention-backend; None: vLLM's pick) -> {--block-size: the planned
# block of each KV-cache group}: sliding-window groups at the window's page, the compressed caches (main MLA +
# indexer; on SM120 one group per compression ratio, at SM100 256 the ratio-2 caches apart), the compressor states.
_SM100_FLASH = {64: [32, 32, 32, 32, 128, 8], 128: [32, 32, 32, 32, 128, 8], 256: [32, 32, 32, 32, 128, 256, 8]}
_SM100_OTHER = {64: [32, 128, 8], 128: [32, 128, 8], 256: [32, 256, 128, 8]}
V41_GROUPS = {
    "v41_flash": {
        ("sm120", None): dict.fromkeys((64, 128, 256), [64, 64, 64, 64, 64, 128, 8]),
        ("sm100", None): _SM100_FLASH,
        ("sm100", "FLASHINFER_MLA_SPARSE_DSV41"): _SM100_FLASH,
        ("sm100", "FLASHMLA_SPARSE_DSV41"): _SM100_FLASH,
        ("sm90", None): dict.fromkeys((64, 128, 256), [32, 32, 32, 32, 64, 8]),
    },
    "ratio2_first": {
        ("sm120", None): dict.fromkeys((64, 128, 256), [64, 64, 64, 64, 128, 8, 64]),
        ("sm100", None): {64: [32, 32, 128, 8], 128: [32, 32, 128, 8], 256: [32, 32, 256, 128, 8]},
        ("sm100", "FLASHINFER_MLA_SPARSE_DSV41"): _SM100_OTHER,
        ("sm100", "FLASHMLA_SPARSE_DSV41"): _SM100_OTHER,
        ("sm90", None): dict.fromkeys((64, 128, 256), [32, 32, 64, 8]),
    },
}
# The kernel page, in tokens, each V4.1 cache must get on each GPU (by compression ratio; 0: sliding window), as
# the kernel truth table's sources say: SM120 64 states per compressed page and 64-token windows (FlashInfer,
# DeepGEMM), SM100 128-token and SM90 64-token compressed pages, windows of any multiple of 32 (vLLM's own sizes).
V41_PAGES = {"sm120": {1: 64, 2: 128, 0: 64}, "sm100": {1: 128, 2: 128, 0: 32}, "sm90": {1: 64, 2: 64, 0: 32}}
_PAGE_LINE = re.compile(r"^      kernel page: (\S+) (?:(\d+)-token pages|\d+ states per page \((\d+) tokens at ratio "
                        r"(\d+)\)): (kernel exists|NO KERNEL|not checked)", flags=re.MULTILINE)


def _kernel_pages(out: str) -> set[tuple[str, int, int, str]]:
    """(backend, kernel page in tokens, compression ratio, verdict) of every `kernel page:` line of a report."""
    return {(name, int(tokens or ratio_tokens), int(ratio or 1), verdict)
            for name, tokens, ratio_tokens, ratio, verdict in _PAGE_LINE.findall(out)}


def _v41_expected_pages(arch: str, backend: str) -> set[tuple[str, int, int, str]]:
    pages = V41_PAGES[arch]
    indexer = "DEEPSEEK_V41_INDEXER"
    return {("DEEPSEEK_SPARSE_SWA", pages[0], 1, "kernel exists"), ("CompressorBackend", 8, 1, "not checked")} | {
        (name, pages[ratio], ratio, "kernel exists") for name in (backend, indexer) for ratio in (1, 2)
    }


_DEFAULT_V41 = {
    "sm120": "FLASHINFER_MLA_SPARSE_DSV41", "sm100": "FLASHMLA_MEGA_ATTN_DSV41", "sm90": "FLASHMLA_SPARSE_DSV41",
}


@pytest.mark.parametrize("pattern", ["v41_flash", "ratio2_first"])
@pytest.mark.parametrize("block_size", [64, 128, 256])
@pytest.mark.parametrize(("arch", "backend"), list(V41_GROUPS["v41_flash"]))
def test_check_kv_plans_dsv41_on_the_pages_its_kernels_have(kv_fix, capsys: pytest.CaptureFixture, v41_patterns,
                                                            arch: str, backend: str | None, block_size: int,
                                                            pattern: str) -> None:
    """Every V4.1 backend on every GPU at --block-size 64, 128 and 256, through spec construction, planning, the
    engine's block sizes, the worker's kernel blocks and its kernel-block views, with the fix: each cache's kernel
    page is the one the kernel truth table's sources give (SM120: 64 compressed states, 64-token windows; SM90 and
    SM100 unchanged), for the public layer pattern and another."""
    from vllm_expert_offload.tools import check_kv_cmd

    assert check_kv_cmd.run(_check_kv_args(v41_patterns[pattern], block_size, arch, backend, kv_gib=32.0)) == 0
    out = capsys.readouterr().out
    assert f"deepseek_v41, --block-size {block_size}, --tp 1, --gpu-arch {arch}" in out and out.rstrip().endswith("OK")
    assert _group_blocks(out) == V41_GROUPS[pattern][arch, backend][block_size], out
    assert _kernel_pages(out) == _v41_expected_pages(arch, backend or _DEFAULT_V41[arch]), out


def _sm120_summary(kv_fix, monkeypatch: pytest.MonkeyPatch, block_size: int) -> list[str]:
    """check-kv on the carried V4.1 config on SM120, returning the fix's log lines (the summary line is the last)."""
    from vllm_expert_offload.tools import check_kv_cmd

    monkeypatch.setattr(kv_fix, "_logged", set())  # earlier tests logged this layout already
    monkeypatch.setattr(kv_fix, "_raised", {})  # and asked other sizes of the same caches
    lines, level = _Lines(), kv_fix.logger.level
    kv_fix.logger.addHandler(lines)
    kv_fix.logger.setLevel(logging.INFO)
    try:
        assert check_kv_cmd.run(_check_kv_args(DSV41_FIXTURE, block_size, "sm120", kv_gib=32.0)) == 0
    finally:
        kv_fix.logger.removeHandler(lines)
        kv_fix.logger.setLevel(level)
    return lines.lines


def test_dsv41_block_sizes_logged_in_one_line(kv_fix, capsys: pytest.CaptureFixture,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The one line per start: each group's block (and what vLLM asked), backends and states per compressed page,
    and which declarations the kernel truth table set (vLLM's own, also where earlier tests wrapped them already)."""
    from vllm_expert_offload.integration.kv import declarations

    monkeypatch.setattr(declarations, "corrected", {})
    monkeypatch.setattr(declarations, "confirmed", set())
    lines = _sm120_summary(kv_fix, monkeypatch, 64)
    capsys.readouterr()
    swa = "=64 (asked 32) [DEEPSEEK_SPARSE_SWA]"
    compressed = "[FLASHINFER_MLA_SPARSE_DSV41, DEEPSEEK_V41_INDEXER] 64 states/page"
    assert lines[-1] == (
        f"vllm-expert-offload KV block sizes per group on SM120: g0{swa}; g1{swa}; g2{swa}; g3{swa}; "
        f"g4=64 {compressed}; g5=128 (asked 64) {compressed}; g6=8 [CompressorBackend]; "
        "kernel pages declared from the kernel truth table: "
        "DEEPSEEK_SPARSE_SWA at ratio 1 [MultipleOf(32)] -> [64], DEEPSEEK_V41_INDEXER at ratio 1 [128] -> [64], "
        "FLASHINFER_MLA_SPARSE_DSV41 at ratio 1 [128] -> [64]"
    ), lines


def test_vllm_declaring_the_sm120_pages_itself_is_left_alone(kv_fix, capsys: pytest.CaptureFixture,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A vLLM that declares what the kernels have (its later revision's `64 * tokens_per_state` and 64-token window
    on SM120) plans the same groups, with nothing wrapped, and the line says so."""
    from vllm.models.deepseek_v41.nvidia.flashinfer_sparse import (
        DeepseekSparseSWAFlashInferBackend,
        DeepseekV4FlashInferMLASparseBackend,
    )
    from vllm.v1.attention.backends.mla.indexer import DeepseekV41IndexerBackend

    from vllm_expert_offload.integration.kv import declarations
    from vllm_expert_offload.integration.patching import SENTINEL

    def states_of_64(kv_cache_spec=None):
        return [64 * kv_cache_spec.tokens_per_state] if kv_cache_spec is not None else [128, 64]

    fixed = {DeepseekV4FlashInferMLASparseBackend: states_of_64, DeepseekV41IndexerBackend: states_of_64,
             DeepseekSparseSWAFlashInferBackend: lambda kv_cache_spec=None: [64]}
    for backend, declaration in fixed.items():  # what upstream's later revision declares on SM120
        monkeypatch.setattr(backend, "get_supported_kernel_block_sizes", staticmethod(declaration))
    monkeypatch.setattr(declarations, "corrected", {})
    monkeypatch.setattr(declarations, "confirmed", set())
    lines = _sm120_summary(kv_fix, monkeypatch, 128)
    out = capsys.readouterr().out
    assert _group_blocks(out) == [64, 64, 64, 64, 64, 128, 8] and "NO KERNEL" not in out
    assert declarations.corrected == {}
    assert all(backend.__dict__["get_supported_kernel_block_sizes"].__func__ is declaration
               and not getattr(declaration, SENTINEL, False) for backend, declaration in fixed.items())
    assert lines[-1].endswith(
        "; vLLM's own kernel-page declarations match the kernel truth table; the plugin changed none"
    ), lines


def test_check_kv_refuses_dsv41_without_a_gpu(kv_fix, capsys: pytest.CaptureFixture) -> None:
    from vllm_expert_offload.tools import check_kv_cmd

    assert check_kv_cmd.run(_check_kv_args(DSV41_FIXTURE, 64)) == 1
    assert "FAILED at spec construction: InvalidValueError: DeepSeek-V4.1's kernel block sizes depend on the GPU: name it " \
           "with --gpu-arch sm90|sm100|sm120" in capsys.readouterr().out


def test_check_kv_reports_vllms_own_dsv41_errors_with_the_fix_off() -> None:
    """Upstream, on the same config: SM120 and SM100 refuse 64 in the worker; SM90 plans 128 but cannot view its
    ratio-1 caches' packed 128-token blocks as the 64-token kernel blocks FlashMLA takes; SM120 at 128 passes every
    vLLM check on pages FlashInfer's SM120 kernels do not have (the seeds' "128 starts, the first request crashes")."""
    script = (
        "import sys; from pathlib import Path; from vllm_expert_offload.cli import main\n"
        "for arch, size in (('sm120', 64), ('sm100', 64), ('sm90', 128), ('sm120', 128)):\n"
        "    main(['check-kv', sys.argv[1], '--block-size', str(size), '--gpu-arch', arch, '--kv-gib', '32'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"} | {"VLLM_EXPERT_OFFLOAD_KV_FIX": "0"}
    run = _run([sys.executable, "-c", script, str(DSV41_FIXTURE)], env)
    out = run.stdout
    assert out.count("KV block-size fix off (VLLM_EXPERT_OFFLOAD_KV_FIX=0)") == 4, _output(run)[-4000:]
    sm120_128 = out[out.rindex("--block-size 128, --tp 1, --gpu-arch sm120"):]
    assert _group_blocks(sm120_128) == [32, 32, 32, 32, 128, 8]
    assert ("FAILED at kernel pages: KVBlockLayoutError: g0 DEEPSEEK_SPARSE_SWA 32-token pages: NO KERNEL (SM120: "
            "64-token pages);") in sm120_128
    assert ("g4 FLASHINFER_MLA_SPARSE_DSV41 128 states per page (128 tokens at ratio 1): NO KERNEL (SM120: 64 states "
            "per page); g4 DEEPSEEK_V41_INDEXER 128 states per page") in sm120_128
    assert "FLASHINFER_MLA_SPARSE_DSV41 64 states per page (128 tokens at ratio 2): kernel exists" in sm120_128
    assert "FAILED at worker kernel blocks: ValueError: No common block size for 64 (FLASHINFER_MLA_SPARSE_DSV41: " \
           "[128])." in out
    assert "FAILED at worker kernel blocks: ValueError: No common block size for 64 (FLASHMLA_MEGA_ATTN_DSV41: " \
           "[128])." in out
    assert "FAILED at worker KV views: ValueError: FLASHMLA_SPARSE_DSV41 needs 64-token kernel blocks, which packed " \
           "128-token KV cache blocks cannot be split into." in out


# ---------------------------------------------------------------- vLLM's planning, via the shared repro

# compress_ratios per layer, the last entry for the MTP layer (0: sliding window only).
PATTERNS = {
    "c128_first": [128, 4, 128, 4, 0, 128, 128, 4, 128, 4, 128, 4, 0],
    "more_layers": [0] + [4, 4, 128] * 20 + [0],
}
# kv41_plan_repro's --attn and --cap: RTX PRO 6000 (SM120), B200 with FlashInfer, mega attention and FlashMLA, H200;
# the (--gpu-arch, --attention-backend) of the same case in V41_GROUPS.
DSV41_BACKENDS = {
    ("flashinfer_sm120", 120): ("sm120", None), ("flashinfer", 100): ("sm100", "FLASHINFER_MLA_SPARSE_DSV41"),
    ("mega", 100): ("sm100", None), ("flashmla", 100): ("sm100", "FLASHMLA_SPARSE_DSV41"),
    ("flashmla", 90): ("sm90", None),
}


def _dsv4_config(directory: Path, ratios: list[int]) -> Path:
    """A DeepSeek-V4-Flash config.json with another layer pattern."""
    config = json.loads((DSV4_FIXTURE / "config.json").read_text())
    config.update(num_hidden_layers=len(ratios) - 1, compress_ratios=ratios)
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


def _run(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=900, check=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess]:
    """Every subprocess this module needs, three at a time; keyed by case, "+plugin" with the plugins loaded."""
    if not REPRO.exists():
        pytest.skip(f"kv-plan-repro not found at {REPRO} (set KV_PLAN_REPRO); its check-kv twins below run without it")
    data = tmp_path_factory.mktemp("data")
    repro = [sys.executable, str(REPRO)]
    cases = {
        "flash+plugin": [*repro, "--plugins", "--block-sizes", "32,64,128,256", "--expect-ok", "32,64,128,256"],
        "flash": [*repro, "--block-sizes", "64,128", "--expect-ok", "64,128"],
    }
    repro41 = [sys.executable, str(REPRO41), "--avail-gib", "32"]
    for attn, cap in DSV41_BACKENDS:
        cases[f"v41 {attn} {cap}+plugin"] = [*repro41, "--plugins", "--attn", attn, "--cap", str(cap),
                                             "--block-sizes", "64,128,256", "--expect-ok", "64,128,256"]
    ratio2_first = _dsv41_config(data / "ratio2_first", V41_RATIO2_FIRST, V41_RATIO2_FIRST_SOURCES)
    cases["v41 ratio2_first+plugin"] = [*repro41, "--dsv4-config", str(ratio2_first), "--plugins", "--attn",
                                        "flashinfer_sm120", "--cap", "120", "--block-sizes", "64,128,256",
                                        "--expect-ok", "64,128,256"]
    cases["v41 flashinfer_sm120"] = [*repro41, "--attn", "flashinfer_sm120", "--cap", "120",
                                     "--block-sizes", "64", "--expect-ok", "64"]
    for name, ratios in PATTERNS.items():
        pattern = [*repro, "--dsv4-config", str(_dsv4_config(data / name, ratios))]
        cases[f"{name}+plugin"] = [*pattern, "--plugins", "--block-sizes", "64,128", "--expect-ok", "64,128"]
        cases[name] = [*pattern, "--block-sizes", "64", "--expect-ok", "64"]
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "VLLM_EXPERT_OFFLOAD_KV_FIX")}
    envs = {name: env for name in cases}
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {name: pool.submit(_run, command, envs[name]) for name, command in cases.items()}
        return {name: future.result() for name, future in futures.items()}


def _output(run: subprocess.CompletedProcess) -> str:
    return run.stdout + run.stderr


@pytest.mark.parametrize("case", ["flash+plugin", "c128_first+plugin", "more_layers+plugin"])
def test_repro_passes_with_the_plugin(runs, case: str) -> None:
    run = runs[case]
    assert run.returncode == 0 and "all OK" in run.stdout, _output(run)[-4000:]


def test_flash_keeps_sliding_window_and_qwen_plans_at_every_size(runs) -> None:
    out = runs["flash+plugin"].stdout
    for size in (64, 128):
        assert f"bs={size:<4} layout=BLHNC group_bs=[64, 64, 256, 4, 8]" in out, out[-4000:]
    qwen = out[out.index("=== SUMMARY Qwen3-MoE"):].splitlines()
    for size in (32, 64, 128, 256):
        line = next(line for line in qwen if line.startswith(f"bs={size:<4} layout=LBHNC kernel_bs=[{size}]"))
        assert line.endswith("-> OK"), line


@pytest.mark.parametrize("case", ["flash", "c128_first", "more_layers"])
def test_repro_fails_without_the_plugin(runs, case: str) -> None:
    run = runs[case]
    out = _output(run)
    assert run.returncode == 1 and "expected OK at" in out and "FAILED DSv4 bs=64" in out, out[-4000:]
    assert "ZeroDivisionError" in out
    assert re.search(r"No common block size for 64 \((DEEPSEEK_V4_INDEXER|FLASHMLA_SPARSE_DSV4): \[256\]\)", out)


def test_flash_128_fails_in_the_worker_without_the_plugin(runs) -> None:
    out = runs["flash"].stdout
    assert "FAILED DSv4 bs=64, DSv4 bs=128" in out
    assert "ValueError: No common block size for 128 (DEEPSEEK_V4_INDEXER: [256])" in out


@pytest.mark.parametrize(("attn", "cap"), list(DSV41_BACKENDS))
def test_dsv41_repro_passes_with_the_plugin(runs, attn: str, cap: int) -> None:
    """vLLM's own planning and worker checks, with the plugin loaded as vLLM loads it: the groups check-kv plans
    (V41_GROUPS), at 64, 128 and 256. On SM120 these are pages FlashInfer's SM120 kernels have; elsewhere unchanged."""
    run = runs[f"v41 {attn} {cap}+plugin"]
    assert run.returncode == 0 and "expect-ok [64, 128, 256]: all OK" in run.stdout, _output(run)[-4000:]
    for size, groups in V41_GROUPS["v41_flash"][DSV41_BACKENDS[attn, cap]].items():
        assert f"bs={size:<4} layout=BLHNC group_bs={groups}" in run.stdout, run.stdout[-4000:]


def test_dsv41_repro_plans_another_layer_pattern_on_sm120(runs) -> None:
    run = runs["v41 ratio2_first+plugin"]
    assert run.returncode == 0 and "expect-ok [64, 128, 256]: all OK" in run.stdout, _output(run)[-4000:]
    for size, groups in V41_GROUPS["ratio2_first"]["sm120", None].items():
        assert f"bs={size:<4} layout=BLHNC group_bs={groups}" in run.stdout, run.stdout[-4000:]
    assert "swa_cache:page=37440" in run.stdout and "swa_cache:page=19008" not in run.stdout  # 64-token windows


def test_dsv41_repro_fails_at_64_on_sm120_without_the_plugin(runs) -> None:
    """The seeds' crash: DeepSeek-V4.1-Flash on RTX PRO 6000 at --block-size 64, upstream."""
    run = runs["v41 flashinfer_sm120"]
    assert run.returncode == 1 and "FAILED at [64]" in run.stdout, _output(run)[-4000:]
    assert "ValueError: No common block size for 64 (FLASHINFER_MLA_SPARSE_DSV41: [128])." in run.stdout




def test_check_kv_in_process_for_a_pattern(kv_fix, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from vllm_expert_offload.tools import check_kv_cmd

    model = _dsv4_config(tmp_path / "c128_first", PATTERNS["c128_first"])
    assert check_kv_cmd.run(_check_kv_args(model, 128, tp=2)) == 0
    out = capsys.readouterr().out
    assert "KV block-size fix on" in out and out.rstrip().endswith("OK")
    assert "block 256, kernel 256, page 1728/8640/37440 B [FLASHMLA_SPARSE_DSV4, DEEPSEEK_V4_INDEXER]" in out


# ---------------------------------------------------------------- the repro's cases through check-kv (a bare clone)


def _group_blocks(out: str) -> list[int]:
    """The planned block size of each KV-cache group, in group order, from check-kv's report."""
    return [int(size) for size in re.findall(r"^  g\d+: \d+ layers, block (\d+)", out, flags=re.MULTILINE)]


@pytest.mark.parametrize("block_size", [32, 64, 128, 256])
def test_check_kv_plans_dsv4_flash_at_every_size(kv_fix, capsys: pytest.CaptureFixture, block_size: int) -> None:
    """Twin of the repro's flash+plugin case: with the fix, the compressed group gets its 256-token pages while
    the sliding-window groups keep 64 and the compressor states 4 and 8, whatever --block-size asks."""
    from vllm_expert_offload.tools import check_kv_cmd

    assert check_kv_cmd.run(_check_kv_args(DSV4_FIXTURE, block_size)) == 0
    out = capsys.readouterr().out
    assert f"deepseek_v4, --block-size {block_size}, --tp 1" in out and out.rstrip().endswith("OK"), out
    assert _group_blocks(out) == [64, 64, 256, 4, 8], out
    assert ("g2: 62 layers, block 256, kernel 256, page 1728/8640/37440 B [DEEPSEEK_V4_INDEXER, FLASHMLA_SPARSE_DSV4]"
            in out)


@pytest.mark.parametrize("block_size", [64, 128, 256])
def test_check_kv_plans_dsv4_on_sm120_on_pages_its_kernels_have(kv_fix, capsys: pytest.CaptureFixture,
                                                               block_size: int) -> None:
    """DeepSeek-V4 on SM120 runs FlashInfer's SM120 kernels (`_select_dsv4_attn_cls`): its model-fixed 64-token
    window and 256-token compressed blocks (64 states at ratio 4, 2 at ratio 128) are pages they have."""
    from vllm_expert_offload.tools import check_kv_cmd

    assert check_kv_cmd.run(_check_kv_args(DSV4_FIXTURE, block_size, "sm120", kv_gib=32.0)) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("OK") and _group_blocks(out) == [64, 64, 256, 4, 8], out
    assert _kernel_pages(out) == {
        ("DEEPSEEK_SPARSE_SWA", 64, 1, "kernel exists"), ("DEEPSEEK_V4_INDEXER", 256, 4, "kernel exists"),
        ("FLASHINFER_MLA_SPARSE_DSV4", 256, 4, "kernel exists"),
        ("FLASHINFER_MLA_SPARSE_DSV4", 256, 128, "kernel exists"),
        ("CompressorBackend", 4, 1, "not checked"), ("CompressorBackend", 8, 1, "not checked"),
    }, out


@pytest.mark.parametrize("block_size", [64, 128])
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_check_kv_plans_dsv4_layer_patterns(kv_fix, tmp_path: Path, capsys: pytest.CaptureFixture, pattern: str,
                                           block_size: int) -> None:
    """Twin of the repro's c128_first+plugin and more_layers+plugin cases: other layer orders plan too."""
    from vllm_expert_offload.tools import check_kv_cmd

    model = _dsv4_config(tmp_path / pattern, PATTERNS[pattern])
    assert check_kv_cmd.run(_check_kv_args(model, block_size)) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("OK") and 256 in _group_blocks(out), out
    assert "compression 128, page 0 B" not in out  # the upstream planning's empty ratio-128 page


def _dsv4_033_config(directory: Path, compress_rates: dict[str, int] | None) -> Path:
    """The DeepSeek-V4-Flash config.json as vLLM 0.33 spells it: `layer_types` (and `compress_rates`) in place of
    `compress_ratios`."""
    config = json.loads((DSV4_FIXTURE / "config.json").read_text())
    names = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
    config["layer_types"] = [names[r] for r in config.pop("compress_ratios")[: config["num_hidden_layers"]]]
    if compress_rates is not None:
        config["compress_rates"] = compress_rates
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


@pytest.mark.parametrize(("compress_rates", "layers_at_ratio"), [
    (None, {4: 21, 128: 20}),  # transformers' default rates: the fixture's own compress_ratios
    ({"compressed_sparse_attention": 128, "heavily_compressed_attention": 4}, {4: 20, 128: 21}),
])
def test_check_kv_reads_dsv4_rates_as_the_format_check_does(kv_fix, tmp_path: Path, capsys: pytest.CaptureFixture,
                                                            compress_rates: dict[str, int] | None,
                                                            layers_at_ratio: dict[int, int]) -> None:
    """check-kv takes each layer's rate from exl3's compress_ratios, the one rule the checkpoint's compressor shapes
    are checked by: 0.33's spelling (no `compress_ratios`) plans, and the rates `compress_rates` names move the
    layers between the ratio-4 and ratio-128 caches."""
    from vllm_expert_offload.tools import check_kv_cmd

    model = _dsv4_033_config(tmp_path / "v033", compress_rates)
    assert check_kv_cmd.run(_check_kv_args(model, 128)) == 0
    out = capsys.readouterr().out
    planned = {int(ratio): int(layers) for layers, ratio in re.findall(
        r"spec MLAAttentionSpec on FLASHMLA_SPARSE_DSV4: (\d+) layers, block \d+, compression (\d+)", out)}
    assert planned == layers_at_ratio and out.rstrip().endswith("OK"), out


@pytest.mark.parametrize(("requested", "planned"), [(16, 32), (32, 32), (64, 64), (128, 128), (256, 256)])
def test_check_kv_plans_qwen_on_the_cpu_backend(kv_fix, capsys: pytest.CaptureFixture, requested: int,
                                                planned: int) -> None:
    """Twin of the repro's Qwen3-MoE summary: CPU_ATTN takes multiples of 32, so 16 is raised to 32 (upstream
    refuses it, see the fix-off test below) and every multiple of 32 is kept."""
    from vllm_expert_offload.tools import check_kv_cmd

    assert check_kv_cmd.run(_check_kv_args(QWEN_FIXTURE, requested, backend="CPU_ATTN")) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("OK") and _group_blocks(out) == [planned], out
    assert f"g0: 48 layers, block {planned}, kernel {planned}," in out


# (model, --block-size, extra check-kv arguments) -> what upstream vLLM says; checked in one subprocess.
UPSTREAM_CASES = {
    "flash 64": ("deepseek_v4_flash", 64, [], "FAILED at engine planning: ZeroDivisionError"),
    "flash 128": ("deepseek_v4_flash", 128, [],
                  "FAILED at worker kernel blocks: ValueError: No common block size for 128 "
                  "(DEEPSEEK_V4_INDEXER: [256])."),
    "c128_first 64": ("c128_first", 64, [], "FAILED at engine planning: ZeroDivisionError"),
    "more_layers 64": ("more_layers", 64, [], "FAILED at engine planning: ZeroDivisionError"),
    "qwen 16": ("qwen3_30b_a3b", 16, ["--attention-backend", "CPU_ATTN"],
                "FAILED at worker kernel blocks: ValueError: No common block size for 16 "
                "(CPU_ATTN: [MultipleOf(32)])."),
}


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """check-kv's report per UPSTREAM_CASES entry with VLLM_EXPERT_OFFLOAD_KV_FIX=0 (a subprocess: the fix is
    installed in this one)."""
    data = tmp_path_factory.mktemp("patterns")
    models = {"deepseek_v4_flash": DSV4_FIXTURE, "qwen3_30b_a3b": QWEN_FIXTURE}
    models |= {name: _dsv4_config(data / name, ratios) for name, ratios in PATTERNS.items()}
    cases = [[name, str(models[model]), size, extra] for name, (model, size, extra, _) in UPSTREAM_CASES.items()]
    script = (
        "import json, sys; from vllm_expert_offload.cli import main\n"
        "for name, model, size, extra in json.loads(sys.argv[1]):\n"
        "    print(f'=== {name}', flush=True)\n"
        "    print('exit', main(['check-kv', model, '--block-size', str(size), *extra]), flush=True)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"} | {"VLLM_EXPERT_OFFLOAD_KV_FIX": "0"}
    run = _run([sys.executable, "-c", script, json.dumps(cases)], env)
    assert run.returncode == 0, _output(run)[-4000:]
    parts = run.stdout.split("=== ")[1:]
    return {part.split("\n", 1)[0]: part for part in parts}


@pytest.mark.parametrize("case", list(UPSTREAM_CASES))
def test_check_kv_reproduces_upstream_errors_with_the_fix_off(upstream: dict[str, str], case: str) -> None:
    """Twins of the repro's runs without the plugin and of its V4 worker failure at 128: vLLM's own errors."""
    out = upstream[case]
    assert "KV block-size fix off (VLLM_EXPERT_OFFLOAD_KV_FIX=0)" in out and "exit 1" in out, out
    assert UPSTREAM_CASES[case][3] in out, out
    if case == "flash 64":
        assert "compression 128, page 0 B" in out  # why planning divides by zero
