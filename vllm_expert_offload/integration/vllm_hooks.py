"""The plugin's whole contact surface with vLLM: every vLLM function it wraps and every method it adds, declared here
and nowhere else (tests/integration/test_vllm_hooks.py enforces it), each through `patching.Hook` (or `ClassHook`,
`InstancePatch`, `Addition`) with the parameters it was read against on vLLM `versions.VERIFIED_VLLM`. The wrappers
themselves live beside the code they serve; `surface()` lists the lot (`docs/architecture.md` prints it as a table).

When each is installed:
- in every vLLM process, by `register()` (integration/plugin.py): `install_in_every_process`;
- at the first EXL3 MoE layer built (a worker): `install_profile_flag`, `install_crash_line` (CUDA),
  `install_replay_padding` (CUDA, DeepSeek-V4.1);
- while `vllm serve` serves with record_stats: `SERVING_SHUTDOWN.applied` on the serving client (stats_saver.py);
- while `check-kv --gpu-arch` plans: `EMULATED_CAPABILITY.applied` on the platform class (tools/gpu_arch.py);
- while the checkpoint is validated, for a pack with MXINT-4 engram tables: `install_engram`;
- while a KV spec meets its attention backend, where vLLM declares other kernel pages than the truth table:
  `align_kernel_pages` (kv/declarations.py).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import NamedTuple

from ..exl3.engram import EngramFormat, EngramTable
from .kv import declarations
from .kv import fix as kv_fix
from .methods import decoded_at_load, engram_int4, replay_padding
from .patching import Addition, ClassHook, Hook, HookError, InstancePatch, require_checked_version
from .startup import crash_line, engine_hooks, failed_load, profiling, stats_saver, worker_rpc
from .versions import VERIFIED_VLLM

logger = logging.getLogger("vllm.expert_offload")

# --- in every process, at register() ------------------------------------------------------------------------------

# DeepSeek-V4's EXL3 sets that vLLM reads as plain weights, decoded as the checkpoint streams in.
DECODED_AT_LOAD = Hook(decoded_at_load.LOADER, "DefaultModelLoader.get_all_weights", ("self", "model_config", "model"),
                       decoded_at_load.wrap_get_all_weights)
# A model load that fails midway releases the host arena before the error propagates.
FAILED_LOAD = Hook(failed_load.LOADER, "BaseModelLoader.load_model", ("self", "vllm_config", "model_config", "prefix"),
                   failed_load.wrap_load_model)
# The engine factories, where the API (or LLM) process has them loaded before plugins load; engine-core and worker
# processes have neither, so both act only where their module is loaded.
ENGINE_FACTORIES = (
    Hook("vllm.v1.engine.llm_engine", "LLMEngine.from_engine_args",
         ("cls", "engine_args", "usage_context", "stat_loggers", "enable_multiprocessing"),
         engine_hooks.wrap_engine_factory, loaded_only=True),
    Hook("vllm.entrypoints.launchers.api_server.entry", "build_async_engine_client_from_engine_args",
         ("engine_args", "usage_context", "client_config"), engine_hooks.wrap_async_builder, loaded_only=True),
)
# KV block sizes: each function where it is defined (later importers bind the wrapper from there) and where the
# runners already bound it by name, if loaded (kv/fix.py).
KV_FIX = tuple(
    Hook(module, name, params, wrap, loaded_only=module != kv_fix.UTILS)
    for name, params, wrap in (
        ("customize_attention_spec", ("backend", "spec"), kv_fix.wrap_customize_attention_spec),
        ("prepare_kernel_block_sizes", ("kv_cache_config", "attn_groups"), kv_fix.wrap_prepare_kernel_block_sizes),
    )
    for module in (kv_fix.UTILS, kv_fix.RUNNER_V1, kv_fix.RUNNER_V2)
)
# Worker methods reachable by name through collective_rpc (startup/worker_rpc.py).
WORKER_METHODS = tuple(
    Addition("vllm.v1.worker.worker_base", "WorkerBase", name, method)
    for name, method in worker_rpc.METHODS.items()
)

# While `vllm serve` serves with record_stats: the serving client's shutdown saves the statistics first
# (startup/stats_saver.py; vLLM's launcher calls it on SIGTERM from a thread pool).
SERVING_SHUTDOWN = InstancePatch("vllm.v1.engine.async_llm", "AsyncLLM.shutdown", ("self", "timeout"),
                                 stats_saver.save_before_shutdown)

# `check-kv --gpu-arch`: the running platform class answers the named GPU's capability while the tool plans
# (tools/gpu_arch.py); vLLM 0.32 and 0.33 derive has_device_capability and is_device_capability_family from it.
EMULATED_CAPABILITY = InstancePatch("vllm.platforms.interface", "Platform.get_device_capability",
                                    ("cls", "device_id"), declarations.answer_capability)

# --- at the first EXL3 MoE layer ----------------------------------------------------------------------------------

# vLLM's memory-profiling pass, on both model runners (V1, which the CPU runner subclasses, and V2) where loaded.
PROFILE_RUN = tuple(
    Hook(module, "GPUModelRunner.profile_run", ("self", "randomize_inputs"), profiling.flagged, loaded_only=True)
    for module in ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner")
)
# Right after the GPU worker allocates its KV cache (CUDA only).
CRASH_LINE = Hook("vllm.v1.worker.gpu_worker", "Worker.initialize_from_config", ("self", "kv_cache_config"),
                  crash_line.wrap_initialize_from_config, loaded_only=True)

# DeepSeek-V4.1's replay batch gets a padding mask (methods/replay_padding.py), on CUDA where vLLM replays it.
REPLAY_PADDING = Hook("vllm.models.deepseek_v41.nvidia.model_state", "DeepseekV41ModelState._prepare_replay_batch",
                      ("self", "input_batch", "cudagraph_mode", "block_tables", "slot_mappings", "attn_groups",
                       "kv_cache_config", "replay_start", "capture_desc"), replay_padding.wrap_prepare_replay_batch)

# --- for the checkpoint or the attention backends met at run time -------------------------------------------------

ENGRAM = Hook(engram_int4.ENGRAM, "Engram._create_embedding", ("self", "layout", "layer_hash_index"),
              engram_int4.wrap_create_embedding)
KERNEL_PAGES = ClassHook(declarations.DECLARATION, ("kv_cache_spec",), declarations.wrap_declaration,
                         "an attention backend the kernel truth table lists, on a GPU where vLLM declares other pages")


class Contact(NamedTuple):
    """One row of the contact surface."""

    target: str
    kind: str  # wrap, wrap per class, wrap on one instance, add, register (vLLM's own registry)
    versions: tuple[str, ...]  # the vLLM series its parameters were read against
    when: str


def surface() -> list[Contact]:
    """Every point where the plugin touches vLLM other than through vLLM's plugin API calling it."""
    declared = [
        (DECODED_AT_LOAD, "every process"), (FAILED_LOAD, "every process"),
        *((hook, "every process (API / LLM process)") for hook in ENGINE_FACTORIES),
        *((hook, f"every process, unless {kv_fix.ENV_SWITCH}=0") for hook in KV_FIX),
        *((addition, "every process") for addition in WORKER_METHODS),
        (SERVING_SHUTDOWN, "while vllm serve serves with record_stats (the serving client only)"),
        (EMULATED_CAPABILITY, "while check-kv --gpu-arch plans (the running platform class only)"),
        *((hook, "first EXL3 MoE layer") for hook in PROFILE_RUN),
        (CRASH_LINE, "first EXL3 MoE layer, CUDA"),
        (REPLAY_PADDING, "first EXL3 MoE layer of a DeepSeek-V4.1 model, CUDA"),
        (ENGRAM, "a pack with MXINT-4 engram tables"), (KERNEL_PAGES, "a KV spec meets such a backend"),
    ]
    rows = [Contact(item.target, item.kind, VERIFIED_VLLM, when) for item, when in declared]
    rows.append(Contact("vllm.model_executor.layers.quantization.QUANTIZATION_METHODS['exl3']", "register",
                        VERIFIED_VLLM, "import of integration/methods/quant_config.py (register_quantization_config)"))
    return rows


def install_kv_fix(vllm_version: str | None = None) -> list[str]:
    """The KV block-size fix (kv/fix.py); returns the targets wrapped by this call (none when already installed or
    switched off). Every hook's version is checked before any is applied."""
    if not kv_fix.fix_enabled():
        logger.info("KV block-size fix off (%s=0): vLLM chooses block sizes on its own", kv_fix.ENV_SWITCH)
        return []
    if vllm_version is None:
        import vllm

        vllm_version = vllm.__version__
    try:
        for hook in KV_FIX:
            hook.check_version(vllm_version)
    except HookError as exc:
        raise HookError(
            f"vllm-expert-offload KV block-size fix: {exc}. Set {kv_fix.ENV_SWITCH}=0 to start without it "
            "(DeepSeek-V4 then needs --block-size 256; DeepSeek-V4.1 128 on SM100, 64 on SM90, and on SM120 "
            "upstream vLLM 0.32/0.33 plans no pages FlashInfer's SM120 kernels have)."
        ) from exc
    return [hook.target for hook in KV_FIX if hook.install()]


def install_engine_hooks() -> int:
    """Wrap the engine factories already imported in this process; returns how many were wrapped now."""
    require_checked_version("the engine construction hooks")
    return sum(hook.install() for hook in ENGINE_FACTORIES)


def install_in_every_process() -> None:
    """What `register()` installs in each vLLM process (integration/plugin.py)."""
    DECODED_AT_LOAD.install()
    install_kv_fix()
    install_engine_hooks()
    FAILED_LOAD.install()
    for addition in WORKER_METHODS:
        addition.install()


def install_profile_flag() -> int:
    """The profiling flag around `profile_run` of each runner class already imported in this process (a worker
    has its runner loaded before the model is built). Returns how many classes were wrapped now."""
    require_checked_version("the profile_run hook")
    return sum(hook.install() for hook in PROFILE_RUN)


def install_crash_line(min_free_fraction: float, gpu_expert_sizes: list[int]) -> bool:
    """The crash line after the KV cache is allocated (startup/crash_line.py). False when this process has no GPU
    worker loaded or the hook is in already."""
    require_checked_version("the crash-line hook")
    return CRASH_LINE.install(min_free_fraction, gpu_expert_sizes)


def install_replay_padding() -> bool:
    """The replay batch's padding mask, where this process builds a DeepSeek-V4.1 model (its package is loaded by
    the time its first MoE layer is built); False otherwise or when installed already."""
    if "vllm.models.deepseek_v41" not in sys.modules:
        return False
    require_checked_version("the DeepSeek-V4.1 replay padding hook")
    return REPLAY_PADDING.install()


def install_engram(tables: Mapping[int, EngramTable]) -> bool:
    """Serve the MXINT-4 tables among `tables` (layer -> table, from the pack's validated headers)."""
    if not any(t.format is EngramFormat.MXINT4 for t in tables.values()):
        return False
    return ENGRAM.install(dict(tables))


def align_kernel_pages(backend: type) -> bool:
    """Make `backend` declare the kernel truth table's pages (kv/declarations.py decides that it must)."""
    return KERNEL_PAGES.for_class(backend).install(backend.get_name())
