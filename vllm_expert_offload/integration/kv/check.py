"""Would vLLM plan and accept this model's KV cache, on pages its kernels have? What `check-kv` runs.

The steps of a vLLM start-up that touch KV caches, from config.json alone (no weights, no GPU): per-layer specs
(worker), layout and planning against a stand-in memory budget (engine core), the engine's block-size resolution,
the worker's kernel-block selection and its kernel-block views of the cache; all with the startup fix installed,
unless VLLM_EXPERT_OFFLOAD_KV_FIX=0 asks for vLLM's own behaviour. Then each group's kernel pages against the
kernel truth table (kv/kernel_pages.py): vLLM's checks passing does not mean a kernel exists for the page. The
point is to check a GPU deployment from any machine, so the adjustments the CPU build makes to a config are
undone: on CUDA, `--block-size` is taken as given, prefix caching stays on and the hybrid KV-cache manager is used.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...kv.kernel_pages import PageCheck, check_page
from ...kv.rules import KVBlockLayoutError
from ...units import GIB
from . import declarations
from .facts import layer_spec
from ..vllm_hooks import install_kv_fix
from .fix import ENV_SWITCH, fix_enabled
from .model_specs import layer_specs

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.worker.utils import AttentionGroup


@dataclass(frozen=True)
class KVCheckRequest:
    """A deployment to check: the model, the flags vLLM would get, the GPU (`--gpu-arch` name) and the KV memory
    per rank to plan with."""

    model_dir: Path
    block_size: int
    tp: int = 1
    attention_backend: str | None = None
    gpu_arch: str | None = None
    max_model_len: int = 8192
    kv_gib: float = 8.0


class StepFailed(Exception):
    """A start-up step raised: reported by step name with vLLM's (or the fix's) own error."""

    def __init__(self, step: str, error: BaseException) -> None:
        super().__init__(f"{step}: {type(error).__name__}: {error}")


def _step(name: str, fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as exc:  # the check's job is to name whatever vLLM raises at this step
        raise StepFailed(name, exc) from exc


def _vllm_config(request: KVCheckRequest) -> VllmConfig:
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, VllmConfig

    config = VllmConfig(
        model_config=ModelConfig(
            model=str(request.model_dir), skip_tokenizer_init=True, max_model_len=request.max_model_len
        ),
        cache_config=CacheConfig(block_size=request.block_size, enable_prefix_caching=True),
        parallel_config=ParallelConfig(tensor_parallel_size=request.tp),
        device_config=DeviceConfig(device="cpu"),  # planning only; keeps a GPU-less CUDA build usable
    )
    # Undo the CPU platform's adjustments (forced sizes and layout, prefix caching off for MLA, no hybrid manager).
    config.cache_config.block_size = request.block_size
    config.cache_config.kv_cache_layout = None
    config.cache_config.enable_prefix_caching = True
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    return config


def _plan(config: VllmConfig, specs: list[dict], budgets: list[int]) -> list[KVCacheConfig]:
    """EngineCore's planning call; vLLM 0.33 moved it to kv_cache_planning and computes the groups apart."""
    try:
        from vllm.v1.core import kv_cache_planning as planning
    except ImportError:  # vLLM 0.32
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

        return get_kv_cache_configs(config, specs, budgets)
    groups = planning.get_global_kv_cache_groups(config, specs)
    return planning.get_kv_cache_configs(config, specs, budgets, groups)


def _engine_block_sizes(config: VllmConfig, kv_cache_configs: list[KVCacheConfig]) -> tuple[int, int]:
    """EngineCore._initialize_kv_caches after planning: the global block size becomes the smallest
    prefix-cacheable group's, then vLLM validates it and derives the scheduler and hash block sizes."""
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config, resolve_kv_cache_block_sizes

    scheduler_config = generate_scheduler_kv_cache_config(kv_cache_configs)
    groups = scheduler_config.kv_cache_groups
    sizes = [g.kv_cache_spec.block_size for g in groups if g.kv_cache_spec.prefix_cacheable]
    config.cache_config.block_size = min(sizes or [g.kv_cache_spec.block_size for g in groups])
    config.validate_block_size()
    return resolve_kv_cache_block_sizes(scheduler_config, config)


def _attention_groups(kv_cache_config: KVCacheConfig, backends: dict) -> list[list[AttentionGroup]]:
    """The runner's attention groups: per KV-cache group, one per distinct (backend, layer spec)."""
    from vllm.v1.worker.utils import AttentionGroup

    per_group = []
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        found: dict[tuple, AttentionGroup] = {}
        for name in group.layer_names:
            spec = layer_spec(group.kv_cache_spec, name)
            key = (backends[name], spec)
            if key in found:
                found[key].layer_names.append(name)
            else:
                found[key] = AttentionGroup(backends[name], [name], spec, gid)
        per_group.append(list(found.values()))
    return per_group


def _kernel_block_sizes(kv_cache_config: KVCacheConfig, attn_groups: list[list[AttentionGroup]]) -> list[int]:
    """Worker KV-cache init: `prepare_kernel_block_sizes`, then the per-backend selection that
    `AttentionGroup.create_metadata_builders` starts with (looked up at call time: the fix wraps the first)."""
    from vllm.v1.worker import utils as worker_utils

    kernel_sizes = worker_utils.prepare_kernel_block_sizes(kv_cache_config, attn_groups)
    for gid, groups in enumerate(attn_groups):
        for group in groups:
            worker_utils.select_common_block_size(kernel_sizes[gid], [group.backend], [group.kv_cache_spec])
    return kernel_sizes


def _kernel_views(
    config: VllmConfig, kv_cache_config: KVCacheConfig, attn_groups: list[list[AttentionGroup]], kernel_sizes: list[int]
) -> None:
    """Worker KV-cache binding: vLLM's own per-layer views (`allocate_kv_cache`, on the meta device: shapes and
    strides, no memory), each backend's kernel block size as `AttentionGroup.create_metadata_builders` sets it,
    and the kernel-block views (`map_kv_caches_to_kernel_blocks`). This is where vLLM refuses to split a packed
    block for a cache that is not compressed, e.g. DeepSeek-V4.1's ratio-1 caches at 128 on SM90."""
    import torch
    from vllm.v1.kv_cache_interface import AttentionSpec
    from vllm.v1.worker import utils as worker_utils

    layout = config.cache_config.get_resolved_kv_cache_layout()
    kv_caches = worker_utils.allocate_kv_cache(kv_cache_config, torch.device("meta"), layout, kernel_sizes)
    for gid, groups in enumerate(attn_groups):
        for group in groups:  # the first lines of create_metadata_builders (0.32, 0.33)
            if not isinstance(group.kv_cache_spec, AttentionSpec):
                continue
            kernel = worker_utils.select_common_block_size(kernel_sizes[gid], [group.backend], [group.kv_cache_spec])
            if kernel != group.kv_cache_spec.block_size:
                group.kernel_block_size = kernel
    worker_utils.map_kv_caches_to_kernel_blocks(kv_caches, [g for groups in attn_groups for g in groups])


def page_checks(attn_groups: list[list[AttentionGroup]], kernel_sizes: list[int]) -> list[list[PageCheck]]:
    """Per KV-cache group, each attention cache's kernel page (the kernel block `create_metadata_builders` picks)
    checked against the kernel truth table for the running GPU."""
    from vllm.v1.kv_cache_interface import AttentionSpec
    from vllm.v1.worker import utils as worker_utils

    capability = declarations.running_capability()
    per_group = []
    for gid, groups in enumerate(attn_groups):
        checks: dict[tuple, PageCheck] = {}
        for group in groups:
            spec = group.kv_cache_spec
            if not isinstance(spec, AttentionSpec):
                continue
            kernel = worker_utils.select_common_block_size(kernel_sizes[gid], [group.backend], [spec])
            name, ratio = group.backend.get_name(), spec.tokens_per_state
            checks.setdefault((name, ratio), check_page(name, capability, kernel, ratio))
        per_group.append(list(checks.values()))
    return per_group


def _missing(pages: list[list[PageCheck]]) -> None:
    """Refuse the plan if the table says some page has no kernel (vLLM's own checks cannot see it)."""
    missing = [
        f"g{gid} {page.describe()}" for gid, checks in enumerate(pages) for page in checks if page.exists is False
    ]
    if missing:
        raise KVBlockLayoutError("; ".join(missing))


def _spec_lines(specs: dict) -> list[str]:
    """Distinct layer specs: where an empty page or an unexpected block size shows before planning."""
    seen: dict[tuple, int] = {}
    for spec, backend in specs.values():
        key = (type(spec).__name__, backend.get_name(), spec.block_size, spec.tokens_per_state, spec.page_size_bytes)
        seen[key] = seen.get(key, 0) + 1
    return [
        f"  spec {kind} on {backend}: {count} layers, block {block}, compression {ratio}, page {page} B"
        for (kind, backend, block, ratio, page), count in seen.items()
    ]


def _group_lines(
    kv_cache_config: KVCacheConfig, attn_groups: list[list[AttentionGroup]], kernel_sizes: list[int],
    pages: list[list[PageCheck]],
) -> list[str]:
    lines = []
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        backends = ", ".join(dict.fromkeys(ag.backend.get_name() for ag in attn_groups[gid]))
        sizes = sorted({ag.kv_cache_spec.page_size_bytes for ag in attn_groups[gid]})
        lines.append(
            f"  g{gid}: {len(group.layer_names)} layers, block {group.kv_cache_spec.block_size}, "
            f"kernel {kernel_sizes[gid]}, page {'/'.join(map(str, sizes))} B [{backends}]"
        )
        lines.extend(f"      kernel page: {page.describe()}" for page in pages[gid])
    return lines


def _layout(config: VllmConfig, backends: dict, specs: dict, tp: int):
    """EngineCore's layout resolution from every rank's supported layouts (all ranks run the same backends)."""
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

    register_all_kvcache_specs(config)
    supported = [layout.name for layout in get_supported_kv_cache_layouts(set(backends.values()))]
    return resolve_kv_cache_layout(config, [supported] * tp, specs.values())


def check_kv(
    request: KVCheckRequest, emit: Callable[[str], None],
    on_gpu: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> None:
    """Emits the report as the steps pass; raises StepFailed at the first one that fails. `on_gpu` makes vLLM's
    capability queries answer for `request.gpu_arch` while specs are built and planned (tools/gpu_arch.py)."""
    import vllm

    install_kv_fix()
    config = _step("config", _vllm_config, request)
    fix = "on" if fix_enabled() else f"off ({ENV_SWITCH}=0)"
    gpu = f", --gpu-arch {request.gpu_arch}" if request.gpu_arch else ""
    emit(
        f"{request.model_dir}: {config.model_config.hf_config.model_type}, --block-size {request.block_size}, "
        f"--tp {request.tp}{gpu}, vLLM {vllm.__version__}, KV block-size fix {fix}"
    )
    with on_gpu():
        for line in _steps(request, config):
            emit(line)


def _steps(request: KVCheckRequest, config: VllmConfig) -> Iterator[str]:
    layers = _step("spec construction", layer_specs, config, request.tp, request.attention_backend, request.gpu_arch)
    yield from _spec_lines(layers)
    specs = {name: spec for name, (spec, _) in layers.items()}
    backends = {name: backend for name, (_, backend) in layers.items()}
    layout = _step("layout", _layout, config, backends, specs, request.tp)
    budgets = [int(request.kv_gib * GIB)] * request.tp
    configs = _step("engine planning", _plan, config, [specs] * request.tp, budgets)
    scheduler_block, hash_block = _step("engine block sizes", _engine_block_sizes, config, configs)
    attn_groups = _attention_groups(configs[0], backends)
    kernel_sizes = _step("worker kernel blocks", _kernel_block_sizes, configs[0], attn_groups)
    _step("worker KV views", _kernel_views, config, configs[0], attn_groups, kernel_sizes)
    yield (
        f"  layout {layout.name}; {configs[0].num_blocks} blocks per rank in {request.kv_gib:g} GiB; "
        f"scheduler block {scheduler_block}, hash block {hash_block}"
    )
    pages = page_checks(attn_groups, kernel_sizes)
    yield from _group_lines(configs[0], attn_groups, kernel_sizes, pages)
    _step("kernel pages", _missing, pages)
