"""vLLM quantization config `exl3`: picks the EXL3 method for each layer the checkpoint quantized."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

from ...exl3.checkpoint import Exl3Checkpoint
from ...exl3.config import Exl3QuantConfig, parse_quant_config
from ...exl3.errors import CheckpointRefused, Exl3FormatError
from ...exl3.validate import CheckpointSummary, validate_checkpoint
from ...kernels.oracle import KernelChoice, choose_kernels, log_choice
from ...offload.options import OffloadOptions, parse_offload_options
from ...offload.process import ProcessPlacement
from ..versions import VLLMVersionError
from ..vllm_hooks import install_engram
from .delegate import build_delegate

QUANT_NAME = "exl3"


def resolve_model_dir(model: str, revision: str | None = None) -> Path:
    """A local directory, or a Hugging Face repo id already in the local cache (no download here)."""
    if os.path.isdir(model):
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception as exc:  # huggingface_hub raises several unrelated types for "not cached"
        raise Exl3FormatError(
            f"--model {model}: not a local directory and not in the Hugging Face cache ({exc}); "
            f"download it first so its EXL3 tensors can be validated before serving"
        ) from exc


@lru_cache(maxsize=4)
def scan_checkpoint(model_dir: str) -> CheckpointSummary:
    """Validated once per process and directory: config parsing runs several times during startup."""
    return validate_checkpoint(Exl3Checkpoint.open(model_dir))


def refuse_unservable(vllm_config, summary: CheckpointSummary) -> None:
    """Configurations that route around the EXL3 methods: vLLM's MegaMoE backends build their own expert
    modules (no quant method is asked), EPLB moves experts between ranks behind the per-expert plan, and a
    speculative drafter would build the draft layers' EXL3 sets, which no plan places."""
    from vllm.config.kernel import MEGA_MOE_BACKENDS

    draft = _draft_exl3_set(summary)
    if vllm_config.speculative_config is not None and draft is not None:
        raise CheckpointRefused(
            f"EXL3 checkpoint refused: --speculative-config would load the draft layers, but {draft}.trellis is an "
            "EXL3 set in a draft layer: the placement plan covers the main model's routed experts only. Serve "
            "without speculative decoding, or a pack whose draft layers stay in their source format "
            "(quantization_config.mtp_experts 'source')"
        )

    backend = vllm_config.kernel_config.moe_backend
    if backend in MEGA_MOE_BACKENDS:
        raise CheckpointRefused(
            f"EXL3 checkpoint refused: --moe-backend {backend} (a MegaMoE kernel) bypasses quantization methods, "
            "so EXL3 experts would never be loaded; use the default MoE backend"
        )
    if vllm_config.parallel_config.enable_eplb:
        raise CheckpointRefused(
            "EXL3 checkpoint refused: --enable-eplb moves experts between ranks, which the per-expert placement "
            "plan does not follow; serve without EPLB"
        )


def _draft_exl3_set(summary: CheckpointSummary) -> str | None:
    """An EXL3 set stored in a draft (MTP/DSpark) layer, if the pack has one."""
    layout = summary.layout
    if layout is None or layout.draft_expert_root is None:
        return None
    draft_root = layout.draft_expert_root.partition(".")[0] + "."
    return next((prefix for prefix in summary.quantized_prefixes if prefix.startswith(draft_root)), None)


class ProcessState:
    """What one vLLM process decides once, at the first EXL3 layer built (where vLLM's config is current): the
    `expert_offload` options parsed once and handed down, the backends, and the placement (plan + arena + routing
    counts, made by the first MoE layer: moe_method.py). Kept apart from the quant config, which is vLLM's per-model
    description and travels to the workers pickled; this is the process's own and changes while it loads."""

    def __init__(self) -> None:
        self.options: OffloadOptions | None = None
        self.kernels: KernelChoice | None = None
        self.placement: ProcessPlacement | None = None

    def kernel_choice(self, summary: CheckpointSummary, device: torch.device) -> KernelChoice:
        """The process's EXL3 backends, decided (and logged) once; a backend asked for that cannot run, or a
        configuration that bypasses the EXL3 methods, is refused here, before any weight is loaded."""
        if self.kernels is None:
            vllm_config = get_current_vllm_config()
            refuse_unservable(vllm_config, summary)
            self.options = parse_offload_options(vllm_config.additional_config)
            self.kernels = choose_kernels(self.options.kernel, device, self.options.dequantize_linears)
            log_choice(self.kernels)
        return self.kernels

    def abandon_placement(self, why: str) -> None:
        """The load the placement was made for failed (`why`): release its arena now and forget it."""
        placement, self.placement = self.placement, None
        if placement is not None:
            placement.release(why)


def _mirrored(name: str) -> property:
    """The delegate's `name`, read through the quant config: vLLM's models read it from the model's quant config
    before any layer asks for its method (exl3/contract.py's DELEGATE_MIRRORS says which and why)."""

    def read(config: Exl3Config) -> Any:
        if config.delegate is None:
            raise AttributeError(f"Exl3Config.{name}: this pack declares no non_routed_quantization to read it from")
        return getattr(config.delegate, name)

    return property(read, doc=read.__doc__)


@register_quantization_config(QUANT_NAME)
class Exl3Config(QuantizationConfig):
    """Built from config.json's quantization_config in every vLLM process; the checkpoint itself is
    validated in `maybe_update_config`, before any layer is constructed."""

    def __init__(self, quant: Exl3QuantConfig) -> None:
        # Built in maybe_update_config, where vLLM hands over the HF config its resolution needs (delegate.py);
        # set before super().__init__, which assigns packed_modules_mapping.
        self.delegate: QuantizationConfig | None = None
        super().__init__()
        self.quant = quant
        self.summary: CheckpointSummary | None = None
        self.process = ProcessState()
        self.vllm_mapper = None  # the model's checkpoint -> vLLM name mapper (DeepSeek-V4: `layers.` -> `model.layers.`)
        self._checkpoint_names: dict[str, str] | None = None

    # The delegate's attributes that models read from the quant config: DELEGATE_MIRRORS, and nothing else.
    weight_block_size = _mirrored("weight_block_size")
    expert_dtype = _mirrored("expert_dtype")

    @property
    def packed_modules_mapping(self) -> dict[str, list[str]]:
        return self.__dict__["_packed_modules_mapping"]

    @packed_modules_mapping.setter
    def packed_modules_mapping(self, mapping: dict[str, list[str]]) -> None:
        """vLLM assigns (model_loader.utils.configure_quant_config) or updates in place (SupportsQuant.__new__) the
        model's fused-module map after building the config (checked against vLLM 0.32.0 and 0.33.0); the delegate
        shares the same dict, as it would if vLLM had built it as the model's config."""
        self.__dict__["_packed_modules_mapping"] = mapping
        if self.__dict__.get("delegate") is not None:
            self.delegate.packed_modules_mapping = mapping

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        """vLLM hands over the model's rename mapper (model_loader/utils.configure_quant_config, vLLM 0.32/0.33);
        layers are built under vLLM's names, the checkpoint keeps its own (DeepSeek-V4 has no `model.` prefix)."""
        super().apply_vllm_mapper(hf_to_vllm_mapper)
        self.vllm_mapper = hf_to_vllm_mapper
        self._checkpoint_names = None
        if self.delegate is not None:
            self.delegate.apply_vllm_mapper(hf_to_vllm_mapper)

    def checkpoint_prefix(self, vllm_prefix: str) -> str:
        """The checkpoint's name of the module vLLM calls `vllm_prefix` (identical where the model maps no names)."""
        if self._checkpoint_names is None:
            prefixes = {p: p for p in self._summary().quantized_prefixes}
            mapped = self.vllm_mapper.apply_dict(prefixes) if self.vllm_mapper is not None else prefixes
            self._checkpoint_names = {vllm: ckpt for vllm, ckpt in mapped.items() if vllm != ckpt}
        return self._checkpoint_names.get(vllm_prefix, vllm_prefix)

    def __repr__(self) -> str:
        return f"Exl3Config(bits={self.quant.bits}, head_bits={self.quant.head_bits}, codebook={self.quant.codebook})"

    def get_name(self) -> str:
        return QUANT_NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 80

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Exl3Config":
        try:
            return cls(parse_quant_config(config))
        except Exl3FormatError as exc:
            raise CheckpointRefused(f"EXL3 checkpoint refused: {exc}") from exc

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None) -> str | None:
        method = str((hf_quant_cfg or {}).get("quant_method", "")).lower()
        if method == QUANT_NAME and user_quant in (None, QUANT_NAME):
            return QUANT_NAME
        return None

    def maybe_update_config(self, model_name: str, hf_config=None, revision: str | None = None) -> None:
        """Called by vLLM right after from_config, before any layer is built (config/vllm.py): the checkpoint is
        validated and the delegate built as vLLM's ModelConfig would build it for this model."""
        try:
            self.summary = scan_checkpoint(str(resolve_model_dir(model_name, revision)))
        except Exl3FormatError as exc:
            raise CheckpointRefused(f"EXL3 checkpoint refused: {exc}") from exc
        install_engram(self.summary.engram)
        self.delegate = build_delegate(self.summary.contract, hf_config)
        if self.delegate is not None:
            self.delegate.packed_modules_mapping = self.packed_modules_mapping
            if self.vllm_mapper is not None:
                self.delegate.apply_vllm_mapper(self.vllm_mapper)
            self.delegate.maybe_update_config(model_name, hf_config, revision)

    def kernel_choice(self, device: torch.device) -> KernelChoice:
        """The process's EXL3 backends (ProcessState.kernel_choice), for this checkpoint."""
        return self.process.kernel_choice(self._summary(), device)

    @staticmethod
    def capture_sizes() -> tuple[int, ...]:
        """The batch sizes vLLM will capture CUDA graphs for (kernels that tune per shape warm up on them)."""
        sizes = get_current_vllm_config().compilation_config.cudagraph_capture_sizes
        return tuple(sorted(set(sizes or ())))

    def shard_prefixes(self, prefix: str) -> list[str]:
        """Checkpoint names of a vLLM module's shards: qkv_proj -> q_proj, k_proj, v_proj (EXL3 stores each
        shard as its own tensor set), from the model's packed_modules_mapping."""
        base, _, name = prefix.rpartition(".")
        shards = self.packed_modules_mapping.get(name) or [name]
        return [self.checkpoint_prefix(f"{base}.{shard}" if base else shard) for shard in shards]

    def _summary(self) -> CheckpointSummary:
        if self.summary is None:
            raise VLLMVersionError(
                "Exl3Config.maybe_update_config was not called before layers were built; "
                "this vLLM version loads quantization configs differently from the verified ones"
            )
        return self.summary

    def is_quantized(self, prefix: str) -> bool:
        quantized = self._summary().quantized_prefixes
        shards = self.shard_prefixes(prefix)
        present = [s in quantized for s in shards]
        if any(present) and not all(present):
            missing = [s for s, p in zip(shards, present) if not p]
            raise CheckpointRefused(
                f"EXL3 checkpoint refused: {missing[0]}.trellis: missing, but the other shards of fused module "
                f"{prefix} are EXL3; a fused module must be quantized in every shard"
            )
        return all(present)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """EXL3 for routed experts and for every linear stored in EXL3 (validation made those agree with a mixed
        pack's declaration); a mixed pack's other layers get what its contract says."""
        from .linear_method import Exl3LinearMethod
        from .moe_method import LAYER_INDEX, Exl3MoEMethod

        contract = self._summary().contract  # draft start resolved against config.json
        if isinstance(layer, RoutedExperts):
            match = LAYER_INDEX.search(prefix)
            if contract is not None and match and contract.source_experts(int(match.group(1))):
                return self.delegate.get_quant_method(layer, prefix)
            return Exl3MoEMethod(layer.moe_config, self)
        is_linear = isinstance(layer, (LinearBase, ParallelLMHead))
        if is_linear and self.is_quantized(prefix):
            return Exl3LinearMethod(self, prefix)
        if contract is not None and contract.delegates_dense:
            return self.delegate.get_quant_method(layer, prefix)
        return UnquantizedLinearMethod() if is_linear else None
