"""The kernel truth table (kv/kernel_pages.py): what it says per backend and GPU, and how pages are judged by it.

The expected pages are the upstream statements the table cites, written out here by hand: FlashInfer's SM120
DeepSeek-V4 kernels take compressed pages of 64 states and 64-token sliding-window pages, DeepGEMM's SM120 paged
MQA 64 states; everything off SM120 is what vLLM 0.32/0.33 declare.
"""

from __future__ import annotations

import pytest

from vllm_expert_offload.kv.kernel_pages import (
    CAPABILITIES,
    TABLE,
    check_page,
    kernel_pages,
    no_kernel,
    tabled,
)

# (backend, GPU family) -> {compression ratio: kernel block sizes in tokens (exact, multiples of)}.
EXPECTED = {
    ("FLASHINFER_MLA_SPARSE_DSV41", 120): {1: ((64,), ()), 2: ((128,), ())},
    ("DEEPSEEK_V41_INDEXER", 120): {1: ((64,), ()), 2: ((128,), ())},
    ("DEEPSEEK_SPARSE_SWA", 120): {1: ((64,), ())},
    ("FLASHINFER_MLA_SPARSE_DSV41", 100): {1: ((128,), ()), 2: ((128,), ())},
    ("FLASHMLA_MEGA_ATTN_DSV41", 100): {1: ((128,), ()), 2: ((128,), ())},
    ("FLASHMLA_SPARSE_DSV41", 100): {1: ((128,), ()), 2: ((128,), ())},
    ("DEEPSEEK_V41_INDEXER", 100): {1: ((128,), ()), 2: ((128,), ())},
    ("FLASHMLA_SPARSE_DSV41", 90): {1: ((64,), ()), 2: ((64,), ())},
    ("DEEPSEEK_V41_INDEXER", 90): {1: ((64,), ()), 2: ((64,), ())},
    ("DEEPSEEK_SPARSE_SWA", 100): {1: ((), (32,))},
    ("DEEPSEEK_SPARSE_SWA", 90): {1: ((), (32,))},
    ("FLASHINFER_MLA_SPARSE_DSV4", 120): {4: ((256,), ()), 128: ((256,), ())},
    ("DEEPSEEK_V4_INDEXER", 120): {4: ((256,), ())},
    ("FLASHMLA_SPARSE_DSV4", 90): {4: ((256,), ()), 128: ((256,), ())},
}


@pytest.mark.parametrize(("key", "sizes"), list(EXPECTED.items()), ids=[f"{b}-SM{c}" for b, c in EXPECTED])
def test_table_gives_each_kernel_its_pages(key: tuple[str, int], sizes: dict) -> None:
    row = kernel_pages(*key)
    assert row is not None and row.source
    assert {ratio: row.token_sizes(ratio) for ratio in sizes} == sizes


def test_one_row_per_backend_and_gpu_each_with_a_source() -> None:
    keys = [(row.backend, row.capability) for row in TABLE]
    assert len(keys) == len(set(keys)) and all(row.source for row in TABLE)
    assert CAPABILITIES == (90, 100, 120)
    # Backends vLLM cannot select on a GPU have no row there (supports_compute_capability, vLLM 0.32/0.33).
    for missing in [("FLASHMLA_SPARSE_DSV41", 120), ("FLASHMLA_MEGA_ATTN_DSV41", 120), ("FLASHMLA_MEGA_ATTN_DSV41", 90),
                    ("FLASHINFER_MLA_SPARSE_DSV41", 90), ("FLASHMLA_SPARSE_DSV4", 120)]:
        assert kernel_pages(*missing) is None and tabled(missing[0])
    assert not tabled("CPU_ATTN") and not tabled("CompressorBackend")


@pytest.mark.parametrize(("backend", "capability", "kernel", "ratio", "exists"), [
    ("FLASHINFER_MLA_SPARSE_DSV41", 120, 64, 1, True),
    ("FLASHINFER_MLA_SPARSE_DSV41", 120, 128, 2, True),
    ("FLASHINFER_MLA_SPARSE_DSV41", 120, 128, 1, False),  # vLLM 0.32/0.33's SM120 plan: 128 states
    ("DEEPSEEK_V41_INDEXER", 120, 128, 1, False),
    ("FLASHINFER_MLA_SPARSE_DSV41", 120, 64, 2, False),  # the 64-token draft: 32 states
    ("DEEPSEEK_SPARSE_SWA", 120, 32, 1, False),  # the model's 32-token window (flashinfer#5323)
    ("DEEPSEEK_SPARSE_SWA", 120, 64, 1, True),
    ("DEEPSEEK_SPARSE_SWA", 90, 32, 1, True),
    ("DEEPSEEK_SPARSE_SWA", 100, 96, 1, True),
    ("FLASHMLA_SPARSE_DSV41", 90, 128, 1, False),
    ("FLASHMLA_SPARSE_DSV41", 120, 64, 1, False),  # no kernels on SM120 at all
])
def test_pages_judged_by_the_table(backend: str, capability: int, kernel: int, ratio: int, exists: bool) -> None:
    assert check_page(backend, capability, kernel, ratio).exists is exists


def test_page_reports_say_what_the_kernels_take() -> None:
    assert check_page("FLASHINFER_MLA_SPARSE_DSV41", 120, 128, 1).describe() == (
        "FLASHINFER_MLA_SPARSE_DSV41 128 states per page (128 tokens at ratio 1): NO KERNEL (SM120: 64 states per page)"
    )
    assert check_page("DEEPSEEK_SPARSE_SWA", 120, 64, 1).describe() == (
        "DEEPSEEK_SPARSE_SWA 64-token pages: kernel exists (SM120: 64-token pages)"
    )
    assert check_page("CompressorBackend", 120, 8, 1).exists is None
    assert check_page("DEEPSEEK_SPARSE_SWA", None, 32, 1).describe().endswith("not checked (no GPU named)")
    assert check_page("FLASHMLA_SPARSE_DSV41", 120, 64, 1).truth == "no kernels on SM120"


def test_no_kernel_names_backend_gpu_and_the_pages_it_has_elsewhere() -> None:
    assert no_kernel("FLASHMLA_SPARSE_DSV41", 120) == (
        "FLASHMLA_SPARSE_DSV41 has no kernels on SM120: the kernel truth table "
        "(vllm_expert_offload/kv/kernel_pages.py) has it on SM90: 64-token pages; SM100: 128-token pages. "
        "Choose an attention backend that runs on SM120"
    )
