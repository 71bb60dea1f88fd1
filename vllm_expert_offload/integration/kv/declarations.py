"""Backends declare the kernel pages their kernels have (kv/kernel_pages.py), where vLLM's declaration differs.

vLLM's planning and its worker checks (`select_common_block_size`, `prepare_kernel_block_sizes`) read
`get_supported_kernel_block_sizes(spec)`; on SM120 vLLM 0.32 and 0.33 declare DeepSeek-V4.1's pages as on SM100,
so everything passes and the first attention call has no kernel. The spec hook (fix.py) calls `align` for every
backend it meets, before it resolves a block size: a backend the truth table lists, on a GPU where its declaration
for that cache differs from the table, gets its `get_supported_kernel_block_sizes` wrapped (a `patching.Hook` on
the backend's own class, signature-checked, declared in vllm_hooks.py) to return the table's sizes. Where vLLM
already declares what the table says (its later revisions do), nothing is wrapped, and the summary line says so. A
tabled backend on a GPU the table gives it no kernels for is refused at once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from ...kv.kernel_pages import CAPABILITIES, KernelPages, kernel_pages, no_kernel, tabled
from ...kv.rules import KVBlockLayoutError
from ..patching import SENTINEL

if TYPE_CHECKING:
    from vllm.v1.attention.backend import AttentionBackend, MultipleOf
    from vllm.v1.kv_cache_interface import KVCacheSpec

DECLARATION = "get_supported_kernel_block_sizes"

# (backend, GPU family, compression ratio) -> (vLLM's declaration, the table's), for the summary line.
corrected: dict[tuple[str, int, object], tuple[str, str]] = {}
# (backend, GPU family, compression ratio) of caches whose declaration already was the table's.
confirmed: set[tuple[str, int, object]] = set()


def running_capability() -> int | None:
    """The CUDA family the kernels run on (90, 100, 120), asked as vLLM's backends ask it
    (`is_device_capability_family`), or None: no GPU, or ROCm, whose gfx capabilities (9.4 for MI300) would read as
    CUDA families the table does not describe (other platforms report none). `check-kv --gpu-arch` and the
    kv-plan-repro's `--cap` make a CPU answer for a CUDA GPU."""
    from vllm.platforms import current_platform

    if current_platform.is_rocm():
        return None
    return next((family for family in CAPABILITIES if current_platform.is_device_capability_family(family)), None)


def gpu_label() -> str:
    capability = running_capability()
    return "" if capability is None else f"SM{capability}"


def counts_states(backend: str) -> bool:
    """Whether the table gives this backend's pages on the running GPU in stored states."""
    capability = running_capability()
    row = None if capability is None else kernel_pages(backend, capability)
    return row is not None and bool(row.states)


def _describe(sizes: list[int | MultipleOf]) -> str:
    return "[" + ", ".join(str(s) if isinstance(s, int) else f"MultipleOf({s.base})" for s in sizes) + "]"


def _normalized(sizes: list[int | MultipleOf]) -> tuple[frozenset[int], frozenset[int]]:
    return frozenset(s for s in sizes if isinstance(s, int)), frozenset(s.base for s in sizes if not isinstance(s, int))


def table_sizes(row: KernelPages, spec: KVCacheSpec) -> list[int | MultipleOf]:
    """The row's pages as a vLLM declaration for this cache (its compression sets tokens per state)."""
    from vllm.v1.attention.backend import MultipleOf

    exact, bases = row.token_sizes(getattr(spec, "tokens_per_state", 1))
    return [*exact, *(MultipleOf(base) for base in bases)]


def wrap_declaration(original: Callable, name: str) -> Callable:
    """Backend `name`'s declaration, answered from the truth table where it has a row for the running GPU."""

    @functools.wraps(original)
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        capability = running_capability()
        row = None if capability is None or kv_cache_spec is None else kernel_pages(name, capability)
        # Without a spec (vLLM's default block-size choice, before specs exist) the compression is unknown.
        return original(kv_cache_spec) if row is None else table_sizes(row, kv_cache_spec)

    return get_supported_kernel_block_sizes


def answer_capability(original: Callable, capability: object) -> classmethod:
    """The platform's `get_device_capability`, answering `capability` for every device: `check-kv --gpu-arch`
    plans for a GPU this machine lacks (vllm_hooks.EMULATED_CAPABILITY; tools/gpu_arch.py)."""
    return classmethod(lambda cls, device_id=0: capability)


def align(backend: type[AttentionBackend], spec: KVCacheSpec) -> None:
    """Make `backend` declare the table's pages for `spec` on this GPU; refuse a GPU it has no kernels for."""
    capability = running_capability()
    name = backend.get_name()
    if capability is None or not tabled(name):
        return
    row = kernel_pages(name, capability)
    if row is None:
        raise KVBlockLayoutError(no_kernel(name, capability))
    declaration = backend.get_supported_kernel_block_sizes
    own = declaration.__wrapped__ if getattr(declaration, SENTINEL, False) else declaration
    declared, truth = own(spec), table_sizes(row, spec)
    key = (name, capability, getattr(spec, "tokens_per_state", 1))
    if _normalized(declared) == _normalized(truth):
        confirmed.add(key)
        return
    corrected[key] = (_describe(declared), _describe(truth))
    from ..vllm_hooks import align_kernel_pages  # vllm_hooks declares this module's wrapper: imported at use

    align_kernel_pages(backend)


def summary() -> str:
    """What this process did to the declarations on the running GPU, for the per-group log line."""
    capability = running_capability()
    changes = [
        f"{name} at ratio {ratio} {vllm} -> {table}"
        for (name, family, ratio), (vllm, table) in sorted(corrected.items(), key=str)
        if family == capability
    ]
    if changes:
        return "kernel pages declared from the kernel truth table: " + ", ".join(changes)
    if any(family == capability for _, family, _ in confirmed):
        return "vLLM's own kernel-page declarations match the kernel truth table; the plugin changed none"
    return ""
