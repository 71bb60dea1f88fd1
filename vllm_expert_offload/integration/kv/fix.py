"""Startup fix: every KV-cache group gets a block size its attention backend can use, on pages its kernels have.

Upstream vLLM (0.32, 0.33) builds DeepSeek-V4's indexer and compressed-attention specs with the user's
`--block-size` although their kernels take 256-token blocks only: at 64 the ratio-128 pages hold 0 bytes
(ZeroDivisionError in the engine's KV planning), at 64 and 128 the worker refuses ("No common block size").
DeepSeek-V4.1 has the same shape of problem with GPU-dependent sizes: its main MLA and indexer kernels take
128-token blocks on SM100 (64 fails: "No common block size for 64 (FLASHMLA_MEGA_ATTN_DSV41: [128])") and 64 on
SM90, where larger packed blocks cannot be split for its ratio-1 caches. On SM120 vLLM declares SM100's sizes,
but FlashInfer's SM120 kernels exist only for compressed pages of 64 states and 64-token sliding-window pages
(kv/kernel_pages.py): those declarations are set from the kernel truth table first (declarations.py).
Two hooks, installed by `register()` in every vLLM process, fix that at the narrowest points where a spec
meets its backend:

- `customize_attention_spec(backend, spec)` (worker, spec construction, both model runners): aligns the
  backend's declaration with the kernel truth table (or refuses a GPU the table gives it no kernels on), then
  keeps the spec's block size when its backend can use it, else raises it to the smallest workable size
  (kv/rules.py: resolve_block_sizes), before the engine plans anything. On SM120 this puts V4.1's ratio-1 and
  ratio-2 caches in separate groups (64 and 128 tokens: 64 states each) and its sliding windows at 64;
- `prepare_kernel_block_sizes(kv_cache_config, attn_groups)` (worker, KV-cache init, both model runners):
  refuses a planned group no kernel block fits, naming the group, GPU, backends and workable sizes, where
  upstream either raises an opaque error or (packed layouts) skips the check; logs the per-group sizes and
  pages, and what was declared from the table, in one line.

The names are wrapped in vllm.v1.worker.utils, where they are defined, and rebound in the runner modules
that import them (V1 `gpu_model_runner`, which the CPU runner subclasses, and V2 `gpu.attn_utils`).
`VLLM_EXPERT_OFFLOAD_KV_FIX=0` leaves vLLM untouched.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import TYPE_CHECKING

from ...errors import InvalidValueError
from ...kv.rules import GroupFacts, check_block_sizes, kernel_block_sizes, resolve_block_sizes
from . import declarations

if TYPE_CHECKING:
    from vllm.v1.attention.backend import AttentionBackend
    from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheConfig
    from vllm.v1.worker.utils import AttentionGroup

ENV_SWITCH = "VLLM_EXPERT_OFFLOAD_KV_FIX"
UTILS = "vllm.v1.worker.utils"
RUNNER_V1 = "vllm.v1.worker.gpu_model_runner"
RUNNER_V2 = "vllm.v1.worker.gpu.attn_utils"

# A child of vLLM's configured "vllm" logger, so the line reaches vLLM's handlers and honours its level.
logger = logging.getLogger("vllm.expert_offload.kv")

# (backend name, compression ratio, chosen size) -> the size vLLM had asked for; annotates the summary line.
_raised: dict[tuple[str, int | Fraction, int], int] = {}
_logged: set[str] = set()


def fix_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """The switch is "1" (default) or "0"; anything else is refused rather than guessed."""
    value = environ.get(ENV_SWITCH, "1")
    if value not in ("0", "1"):
        raise InvalidValueError(f"{ENV_SWITCH}={value!r}: use 1 (default, fix on) or 0 (vLLM's own behaviour)")
    return value == "1"


def wrap_customize_attention_spec(original: Callable) -> Callable:
    """Checked on vLLM 0.32 and 0.33 (`vllm/v1/worker/utils.py`, identical in both)."""
    from .facts import layer_group, resized

    @functools.wraps(original)
    def customize_attention_spec(backend: type[AttentionBackend], spec: AttentionSpec) -> AttentionSpec:
        # First: vLLM's customization reads the declaration (a stride alignment of its largest size).
        declarations.align(backend, spec)
        customized = original(backend, spec)
        if not customized.has_layer_views:  # raw storage: vLLM picks no kernel block for it
            return customized
        group = layer_group(backend, customized)
        size = resolve_block_sizes([group])[group.name]
        if size == customized.block_size:
            return customized
        _raised[(backend.get_name(), customized.tokens_per_state, size)] = customized.block_size
        # The backend customizes again for the new size: its declarations may depend on the spec.
        return original(backend, resized(spec, size))

    return customize_attention_spec


def _pages(group: GroupFacts) -> str:
    """Stored states per kernel page of the group's compressed caches, and of caches whose kernels the truth table
    counts in states (V4.1's ratio-1 caches on SM120); "" for token caches."""
    kernels = kernel_block_sizes(group, group.requested) or ()
    states = sorted({
        int(k // m.tokens_per_state) for k, m in zip(kernels, group.members)
        if m.compressed or declarations.counts_states(m.backend.name)
    })
    return f" {'/'.join(map(str, states))} states/page" if states else ""


def _summary(groups: Mapping[int, GroupFacts], kernel_sizes: list[int]) -> str:
    parts = []
    for gid, group in groups.items():
        part = f"g{gid}={group.requested}"
        if gid < len(kernel_sizes) and kernel_sizes[gid] != group.requested:
            part += f" (kernel {kernel_sizes[gid]})"
        asked = {_raised.get((m.backend.name, m.tokens_per_state, group.requested)) for m in group.members}
        asked.discard(None)
        if asked:
            part += f" (asked {', '.join(map(str, sorted(asked)))})"
        part += " [" + ", ".join(dict.fromkeys(m.backend.name for m in group.members)) + "]" + _pages(group)
        parts.append(part)
    gpu = declarations.gpu_label()
    line = f"vllm-expert-offload KV block sizes per group{' on ' + gpu if gpu else ''}: " + "; ".join(parts)
    declared = declarations.summary()
    return f"{line}; {declared}" if declared else line


def wrap_prepare_kernel_block_sizes(original: Callable) -> Callable:
    """Checked on vLLM 0.32 and 0.33 (`vllm/v1/worker/utils.py`, identical in both)."""
    from .facts import planned_groups

    @functools.wraps(original)
    def prepare_kernel_block_sizes(
        kv_cache_config: KVCacheConfig, attn_groups: list[list[AttentionGroup]]
    ) -> list[int]:
        groups = planned_groups(kv_cache_config, attn_groups)
        check_block_sizes(list(groups.values()))
        kernel_sizes = original(kv_cache_config, attn_groups)
        line = _summary(groups, kernel_sizes)
        if line not in _logged:  # the profiling KV cache and the real one repeat the same layout
            _logged.add(line)
            logger.info(line)
        return kernel_sizes

    return prepare_kernel_block_sizes
