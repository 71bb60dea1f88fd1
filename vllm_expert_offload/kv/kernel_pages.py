"""Kernel truth: the KV-cache pages DeepSeek-V4 and V4.1's attention kernels exist for, per backend and GPU.

vLLM's `get_supported_kernel_block_sizes` is a declaration; on SM120, vLLM 0.32 and 0.33 declare for DeepSeek-V4.1
what SM100's kernels take (128-token compressed pages, any multiple of 32 for the sliding window), while
FlashInfer's SM120 kernels exist only for other pages. Planning then passes and the first attention call has no
kernel. This table says what the kernels take, row by row with the upstream source that says so; the startup fix
(integration/kv/declarations.py) makes vLLM's declarations follow it, and `check-kv` reports each planned page
against it. It imports nothing, so the rules and the tests read it without vLLM.

A page is described in the unit the kernel is instantiated for: stored states per page (a compressed cache of
ratio r then needs blocks of states x r tokens), tokens per page, or any multiple of a token count (kernels that
take the page size at run time). Capabilities are CUDA families, as vLLM's `is_device_capability_family` asks them
(major x 10: SM103 counts as 100, SM121 as 120).

Confirmed from the sources cited per row (read 2026-12-01):
- SM120, FlashInfer (FLASHINFER_MLA_SPARSE_DSV41, DeepSeek-V4.1): compressed pages of 64 states. vLLM's later
  revision says so (vllm-project/vllm@4c2c5afb, vllm/models/deepseek_v41/nvidia/flashinfer_sparse.py:
  `_SM120_PAGE_BLOCK_SIZE = 64`, `get_supported_kernel_block_sizes(spec)` returning `64 * tokens_per_state` on
  the SM120 family); FlashInfer's SM120 dual-cache prefill is instantiated for extra (compressed) pages of 64 and
  2 states only (flashinfer-ai/flashinfer@4fbd9464, csrc/sparse_mla_sm120_prefill.cu, `dispatch_dsv4_dual`:
  `extra_page_block_size == 64 || extra_page_block_size == 2`); flashinfer#5244 (open) would add 128.
- SM120, sliding window (DEEPSEEK_SPARSE_SWA): 64-token pages. FlashInfer's SM120 decode dispatches only
  `page_block_size == _DECODE_DSV4_PAGE_BLOCK_SIZE` (= 64; flashinfer-ai/flashinfer@6efa57b9,
  flashinfer/mla/_sparse_mla_sm120.py, `_decode_dsv4_dispatchable`), its dual prefill instantiates a main page of
  64 (`launch_prefill_mg_dual*<..., 64, PBSX, ...>`, same .cu); vLLM@4c2c5afb adds
  `DeepseekSparseSWAFlashInferSM120Backend` taking only `[64]`. flashinfer#5323: V4.1-Flash on SM120 fails with
  "no dispatch entry for page_block_size=32" (vLLM 0.32/0.33 build the V4.1 sliding window at 32).
- SM120, indexer (DEEPSEEK_V41_INDEXER, DeepGEMM paged MQA logits): pages of 64 states. vLLM 0.32 and 0.33
  `vllm/utils/deep_gemm.py: get_paged_mqa_page_sizes` returns `(64,)` on the SM120 family; DeepGEMM's SM120
  path (deepseek-ai/DeepGEMM@1e94dc25, csrc/jit_kernels/impls/smxx_fp8_fp4_paged_mqa_logits.hpp,
  `sm120_fp8_paged_mqa_logits`) asserts `block_kv == 32 or block_kv == 64` for its reference kernel and takes the
  tiled kernel only at 64; vllm-project/vllm#57292 (draft) reports the pinned DeepGEMM SM120 FP8 path rejecting
  32-state pages, #56509 (draft) states `num_states == 64`. The indexer is fed `kernel_block_size // ratio`
  states (`DeepseekV32IndexerMetadataBuilder.build`, `get_paged_mqa_logits_metadata(..., num_states, ...)`).
- DeepSeek-V4 on SM120 (FLASHINFER_MLA_SPARSE_DSV4, DEEPSEEK_V4_INDEXER at `[256]`): 256-token blocks hold 64
  states at ratio 4 and 2 at ratio 128, the two extra-page sizes of `dispatch_dsv4_dual`; indexer pages of 64.

Not confirmed beyond vLLM's own declarations (their kernels' template lists were not read): SM90 FlashMLA
(FLASHMLA_SPARSE_DSV41 64-token pages, FLASHMLA_SPARSE_DSV4 256), SM100 FlashMLA, FlashMLA mega attention and
FlashInfer TRT-LLM-gen (128-token pages for V4.1; `FlashMLAMegaAttnBackend.supports_compute_capability` is
major 10 only), and the V4.1 indexer on SM90/SM100 (64/128-token pages; DeepGEMM@1c9fa43e csrc/apis/attention.hpp
computes in blocks of 64 on SM90 and 128 on SM100 and accepts pages dividing them, at most 4 per block). Their rows
equal vLLM 0.32/0.33's declarations (vllm/models/deepseek_v41/sparse_mla.py, nvidia/flashinfer_sparse.py,
vllm/v1/attention/backends/mla/indexer.py, vllm/models/deepseek_v4/sparse_mla.py), unchanged at vLLM@4c2c5afb
outside SM120, so the startup fix leaves them alone. The sliding window off SM120 takes any multiple of 32 ("the
sparse decode kernels take the page size at runtime", vllm/v1/attention/backends/mla/sparse_swa.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

COMPRESSED = "compressed MLA"
SWA = "sliding window"
INDEXER = "indexer keys"

_VLLM = "vLLM 0.32/0.33"
_LATER = "vllm-project/vllm@4c2c5afb vllm/models/deepseek_v41/nvidia/flashinfer_sparse.py"
_FI_PREFILL = "flashinfer-ai/flashinfer@4fbd9464 csrc/sparse_mla_sm120_prefill.cu dispatch_dsv4_dual"
_FI_DECODE = "flashinfer-ai/flashinfer@6efa57b9 flashinfer/mla/_sparse_mla_sm120.py _DECODE_DSV4_PAGE_BLOCK_SIZE"
_DG_SM120 = (
    f"{_VLLM} vllm/utils/deep_gemm.py get_paged_mqa_page_sizes; deepseek-ai/DeepGEMM@1e94dc25 "
    "csrc/jit_kernels/impls/smxx_fp8_fp4_paged_mqa_logits.hpp sm120_fp8_paged_mqa_logits"
)


@dataclass(frozen=True)
class KernelPages:
    """The pages one backend's kernels take on one GPU family: exactly `states` stored states per page, exactly
    `tokens` tokens, or any multiple of `multiple_of` tokens (whichever is given)."""

    backend: str
    capability: int
    cache: str
    source: str
    states: tuple[int, ...] = ()
    tokens: tuple[int, ...] = ()
    multiple_of: int | None = None

    def token_sizes(self, tokens_per_state: int | Fraction) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(exact sizes, bases of multiples) in tokens per kernel block for a cache of this compression."""
        exact = set(self.tokens)
        if self.states and tokens_per_state >= 1 and tokens_per_state == int(tokens_per_state):
            exact.update(s * int(tokens_per_state) for s in self.states)
        return tuple(sorted(exact)), (self.multiple_of,) if self.multiple_of else ()

    def has_kernel(self, kernel_tokens: int, tokens_per_state: int | Fraction) -> bool:
        exact, bases = self.token_sizes(tokens_per_state)
        return kernel_tokens in exact or any(kernel_tokens % base == 0 for base in bases)

    def describe(self) -> str:
        if self.states:
            return f"{'/'.join(map(str, self.states))} states per page"
        if self.tokens:
            return f"{'/'.join(map(str, self.tokens))}-token pages"
        return f"pages of any multiple of {self.multiple_of} tokens"


def _rows(backend: str, cache: str, source: str, capabilities: tuple[int, ...], **page: object) -> list[KernelPages]:
    return [KernelPages(backend, capability, cache, source, **page) for capability in capabilities]


TABLE: tuple[KernelPages, ...] = (
    # DeepSeek-V4.1
    KernelPages("FLASHMLA_SPARSE_DSV41", 90, COMPRESSED, f"{_VLLM} models/deepseek_v41/sparse_mla.py", tokens=(64,)),
    KernelPages("FLASHMLA_SPARSE_DSV41", 100, COMPRESSED, f"{_VLLM} models/deepseek_v41/sparse_mla.py",
                tokens=(128,)),
    KernelPages("FLASHMLA_MEGA_ATTN_DSV41", 100, COMPRESSED, f"{_VLLM} models/deepseek_v41/sparse_mla.py",
                tokens=(128,)),
    KernelPages("FLASHINFER_MLA_SPARSE_DSV41", 100, COMPRESSED, f"{_VLLM} and {_LATER}", tokens=(128,)),
    KernelPages("FLASHINFER_MLA_SPARSE_DSV41", 120, COMPRESSED, f"{_LATER} _SM120_PAGE_BLOCK_SIZE; {_FI_PREFILL}",
                states=(64,)),
    KernelPages("DEEPSEEK_V41_INDEXER", 90, INDEXER, f"{_VLLM} v1/attention/backends/mla/indexer.py", tokens=(64,)),
    KernelPages("DEEPSEEK_V41_INDEXER", 100, INDEXER, f"{_VLLM} v1/attention/backends/mla/indexer.py",
                tokens=(128,)),
    KernelPages("DEEPSEEK_V41_INDEXER", 120, INDEXER, _DG_SM120, states=(64,)),
    # DeepSeek-V4
    *_rows("FLASHMLA_SPARSE_DSV4", COMPRESSED, f"{_VLLM} models/deepseek_v4/sparse_mla.py", (90, 100),
           tokens=(256,)),
    *_rows("FLASHINFER_MLA_SPARSE_DSV4", COMPRESSED,
           f"{_VLLM} models/deepseek_v4/nvidia/flashinfer_sparse.py; SM120: {_FI_PREFILL}", (100, 120),
           tokens=(256,)),
    *_rows("DEEPSEEK_V4_INDEXER", INDEXER, f"{_VLLM} v1/attention/backends/mla/indexer.py", (90, 100, 120),
           tokens=(256,)),
    # The sliding-window caches of both (one backend name for every attention class's window)
    *_rows("DEEPSEEK_SPARSE_SWA", SWA, f"{_VLLM} v1/attention/backends/mla/sparse_swa.py", (90, 100),
           multiple_of=32),
    KernelPages("DEEPSEEK_SPARSE_SWA", 120, SWA, f"{_FI_DECODE}; {_FI_PREFILL}; {_LATER}", tokens=(64,)),
)


# The GPU families the table has rows for.
CAPABILITIES: tuple[int, ...] = tuple(sorted({row.capability for row in TABLE}))


def kernel_pages(backend: str, capability: int) -> KernelPages | None:
    """The row for this backend on this GPU family, or None."""
    return next((row for row in TABLE if row.backend == backend and row.capability == capability), None)


def tabled(backend: str) -> bool:
    """Whether the table knows this backend at all (on some GPU)."""
    return any(row.backend == backend for row in TABLE)


def no_kernel(backend: str, capability: int) -> str:
    """Why a tabled backend cannot run on this GPU family: where its kernels do exist, and their pages."""
    elsewhere = "; ".join(f"SM{row.capability}: {row.describe()}" for row in TABLE if row.backend == backend)
    return (
        f"{backend} has no kernels on SM{capability}: the kernel truth table (vllm_expert_offload/kv/kernel_pages.py) "
        f"has it on {elsewhere}. Choose an attention backend that runs on SM{capability}"
    )


@dataclass(frozen=True)
class PageCheck:
    """One cache's kernel page against the table: `exists` is None where the table cannot say (no GPU named, or
    a backend it does not list); `in_states` when the table counts that backend's pages in stored states."""

    backend: str
    kernel_tokens: int
    tokens_per_state: int | Fraction
    exists: bool | None
    truth: str
    in_states: bool = False

    def describe(self) -> str:
        page = f"{self.kernel_tokens}-token pages"
        if self.in_states or self.tokens_per_state != 1:
            states = int(self.kernel_tokens // self.tokens_per_state)
            page = f"{states} states per page ({self.kernel_tokens} tokens at ratio {self.tokens_per_state})"
        verdict = {True: "kernel exists", False: "NO KERNEL", None: "not checked"}[self.exists]
        return f"{self.backend} {page}: {verdict} ({self.truth})"


def check_page(backend: str, capability: int | None, kernel_tokens: int, tokens_per_state: int | Fraction) -> PageCheck:
    """Whether `backend`'s kernels on this GPU family exist for kernel blocks of `kernel_tokens` tokens."""
    if capability is None:
        return PageCheck(backend, kernel_tokens, tokens_per_state, None, "no GPU named")
    if not tabled(backend):
        return PageCheck(backend, kernel_tokens, tokens_per_state, None, "not in the kernel truth table")
    row = kernel_pages(backend, capability)
    if row is None:
        return PageCheck(backend, kernel_tokens, tokens_per_state, False, f"no kernels on SM{capability}")
    exists = row.has_kernel(kernel_tokens, tokens_per_state)
    truth = f"SM{capability}: {row.describe()}"
    return PageCheck(backend, kernel_tokens, tokens_per_state, exists, truth, bool(row.states))
