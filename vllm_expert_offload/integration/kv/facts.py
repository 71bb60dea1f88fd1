"""Translate vLLM's KV-cache objects into the facts kv_block_rules decides on.

Kept apart from the rules so that those stay importable and testable without vLLM, and apart from the hooks
so that the `check-kv` tool describes groups exactly as the startup fix sees them.
"""

from __future__ import annotations

from vllm.v1.attention.backend import AttentionBackend, MultipleOf
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    EncoderOnlyAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.worker.utils import AttentionGroup

from .rules import BackendSizes, GroupFacts, Member


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
    return Member(backend_sizes(backend, spec), spec.tokens_per_state)


def layer_group(backend: type[AttentionBackend], spec: AttentionSpec) -> GroupFacts:
    """The would-be group of every layer with this backend and spec, decided before vLLM forms groups.

    Whether its blocks will be packed is known only once the layout is resolved; a backend that accepts
    block-outermost layouts only (DeepSeek-V4's indexer) is certain to be packed.
    """
    layouts = backend.supported_kv_cache_layouts()
    packed = layouts is not None and all(layout.is_block_outermost for layout in layouts)
    name = f"{type(spec).__name__} layers on {backend.get_name()}"
    if spec.tokens_per_state > 1:
        name += f" (compression ratio {spec.tokens_per_state})"
    return GroupFacts(name, (member(backend, spec),), spec.block_size, packed)


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
        facts[gid] = GroupFacts(name, members, group.kv_cache_spec.block_size, packed)
    return facts
