"""Translate vLLM's KV-cache objects into the facts kv/rules.py decides on.

Kept apart from the rules so that those stay importable and testable without vLLM, and apart from the hooks
so that the `check-kv` tool describes groups exactly as the startup fix sees them.
"""

from __future__ import annotations

from dataclasses import replace

from vllm.utils.math_utils import round_up
from vllm.v1.attention.backend import AttentionBackend, MultipleOf
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    EncoderOnlyAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.worker.utils import AttentionGroup

from ...kv.rules import BackendSizes, GroupFacts, KVBlockLayoutError, Member
from .declarations import gpu_label

# The `model_version` DeepSeek-V4 and V4.1 put on their attention specs (main MLA and sliding-window caches),
# checked on vLLM 0.32 and 0.33 (`models/deepseek_v4/attention.py`, `models/deepseek_v41/attention.py`,
# `v1/attention/backends/mla/sparse_swa.py`).
DEEPSEEK_V4_FAMILY = "deepseek_v4"


def backend_sizes(backend: type[AttentionBackend], spec: KVCacheSpec) -> BackendSizes:
    """The backend's declared kernel block sizes for this spec (declarations may depend on the spec)."""
    exact: list[int] = []
    bases: list[int] = []
    for size in backend.get_supported_kernel_block_sizes(spec):
        if isinstance(size, MultipleOf):
            bases.append(size.base)
        elif isinstance(size, int):
            exact.append(size)
        else:
            raise TypeError(f"{backend.get_name()} declares an unknown kernel block size {size!r}")
    return BackendSizes(backend.get_name(), tuple(exact), tuple(bases))


def member(backend: type[AttentionBackend], spec: AttentionSpec) -> Member:
    """The backend with what the rules need of the cache: compression, and (MLA and sliding-window MLA specs,
    whose pages vLLM pads to `alignment`) whether smaller pages would need padding."""
    state_bytes = spec.num_heads * spec.state_content_size_bytes
    alignment = getattr(spec, "alignment", None) or 1
    return Member(backend_sizes(backend, spec), spec.tokens_per_state, state_bytes, alignment)


def certainly_packed(backend: type[AttentionBackend], spec: AttentionSpec) -> bool:
    """Whether this layer's blocks will lie between other layers' pages (a block-outermost layout), known
    before the engine resolves one layout for the whole model.

    True for a backend that accepts block-outermost layouts only (the DeepSeek-V4 and V4.1 indexers), and
    for every cache of a DeepSeek-V4-family model: its indexer's constraint makes the model's one layout
    block-outermost, so its main MLA caches are packed too although their own backends accept any layout.
    That matters for V4.1's ratio-1 caches, which vLLM cannot split into smaller kernel blocks when packed
    (`AttentionGroup.map_kv_cache_to_kernel_blocks`, 0.32 and 0.33).
    """
    layouts = backend.supported_kv_cache_layouts()
    if layouts is not None and all(layout.is_block_outermost for layout in layouts):
        return True
    return getattr(spec, "model_version", None) == DEEPSEEK_V4_FAMILY


def layer_group(backend: type[AttentionBackend], spec: AttentionSpec) -> GroupFacts:
    """The would-be group of every layer with this backend and spec, decided before vLLM forms groups."""
    packed = certainly_packed(backend, spec)
    name = f"{type(spec).__name__} layers on {backend.get_name()}"
    if spec.tokens_per_state > 1:
        name += f" (compression ratio {spec.tokens_per_state})"
    return GroupFacts(name, (member(backend, spec),), spec.block_size, packed, gpu_label())


def resized(spec: AttentionSpec, block_size: int) -> AttentionSpec:
    """`spec` with `block_size`-token blocks and its page size recomputed for them.

    vLLM's `copy_with_new_block_size` (0.32, 0.33) keeps `page_size_padded`. MLA and sliding-window MLA specs
    derive it from their `alignment` in `__post_init__`, which overwrites it only when the new page needs
    padding: a size padded for the old block then survives, too small for a larger block (the
    `page_size_padded >= unpadded_page_size_bytes` AssertionError of DeepSeek-V4.1's indexer moved from 64 to
    128 tokens) or too large for a smaller one. Such derived padding is recomputed; padding set for another
    reason (a page shared with other layers) is kept, and refused if it no longer holds the page.
    """
    padded = spec.page_size_padded
    alignment = getattr(spec, "alignment", None)
    if padded is None:
        return spec.copy_with_new_block_size(block_size)
    if alignment is not None and padded == round_up(spec.unpadded_page_size_bytes, alignment):
        return replace(spec, block_size=block_size, page_size_padded=None)
    new = spec.copy_with_new_block_size(block_size)
    if new.page_size_padded is not None and new.page_size_padded < new.unpadded_page_size_bytes:
        raise KVBlockLayoutError(
            f"{type(spec).__name__} with a page padded to {padded} B for {spec.block_size}-token blocks cannot "
            f"move to {block_size}-token blocks: the padding was not set by its alignment, so the fix cannot "
            f"recompute it, and {new.unpadded_page_size_bytes} B no longer fit"
        )
    return new


def layer_spec(group_spec: KVCacheSpec, layer_name: str) -> KVCacheSpec:
    """A layer's own spec inside a group (mixed-spec groups hold one per layer)."""
    if isinstance(group_spec, UniformTypeKVCacheSpecs):
        return group_spec.kv_cache_specs[layer_name]
    return group_spec


def is_packed(kv_cache_config: KVCacheConfig, layer_names: list[str]) -> bool:
    """vLLM's own test in `prepare_kernel_block_sizes`: another layer's page sits between two blocks."""
    return any(
        tensor.block_stride > tensor.layer_stride
        for tensor in kv_cache_config.kv_cache_tensors
        if not set(tensor.layers).isdisjoint(layer_names)
    )


def planned_groups(kv_cache_config: KVCacheConfig, attn_groups: list[list[AttentionGroup]]) -> dict[int, GroupFacts]:
    """Facts for each planned KV-cache group whose kernel block size vLLM chooses (attention caches with
    per-layer views), keyed by group id."""
    facts: dict[int, GroupFacts] = {}
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        first = layer_spec(group.kv_cache_spec, group.layer_names[0]) if group.layer_names else None
        if (
            not isinstance(first, AttentionSpec)
            or isinstance(first, EncoderOnlyAttentionSpec)
            or not first.has_layer_views
            or gid >= len(attn_groups)
            or not attn_groups[gid]
        ):
            continue
        members = tuple(member(ag.backend, ag.kv_cache_spec) for ag in attn_groups[gid])
        name = f"g{gid} ({len(group.layer_names)} layers from {group.layer_names[0]})"
        packed = is_packed(kv_cache_config, group.layer_names)
        facts[gid] = GroupFacts(name, members, group.kv_cache_spec.block_size, packed, gpu_label())
    return facts
