"""A mixed pack's declaration checked against its safetensors headers, before any layer is built.

vLLM does not notice a pack that declares block FP8 for layers stored as BF16: the layer boots with an
uninitialized scale and the model emits empty text. Every mismatch is refused here with the tensor named:
an EXL3 tensor set the contract does not declare, a routed expert at another K than declared, a delegated
layer without the tensors its delegate loads, or a layer stored in a format its method cannot read.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .checkpoint import split_name
from .contract import KEY, MixedContract
from .deepseek_v4 import ARCHITECTURE as V4_ARCHITECTURE
from .deepseek_v4 import BUILT_UNQUANTIZED, V41_ARCHITECTURE, V41_WHY, v41_part
from .delegate_rules import E8M0, FP8_E4M3, MXFP4_BLOCK, PACKED_FP4, DelegateRules, delegate_rules
from .engram import EngramFormat, EngramTable, engram_tables
from .errors import Exl3FormatError
from .naming import HEADS, LINEAR_LEAVES, MoeLayout
from .tensors import Exl3Linear

FLOAT_DTYPES = ("BF16", "F16", "F32")
QUANTIZED_DTYPES = ("F8_E4M3", "F8_E5M2", "F8_E8M0", "I8", "U8")  # storage dtypes only a quant method reads
# Linear leaves checked besides LINEAR_LEAVES: DeepSeek-V4.1's indexer key projection, DSpark's main_proj and
# the vision tower's attention (all `.weight` tensors vLLM declares on a linear).
CHECKED_LEAVES = LINEAR_LEAVES | {"wk", "main_proj", "wqkv", "wo"}
ENGRAM_SERVED_BY = {
    EngramFormat.FP8: "engram table fp8: vLLM's ParallelEngramEmbedding (pinned host memory by default)",
    EngramFormat.MXINT4: "engram table mxint4: the plugin's lookup over the stored rows (pinned host memory)",
}
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale", "input_scale")
# DeepSeek-V4/V4.1 checkpoints name a block-FP8 linear's scale `<linear>.scale`; vLLM's mappers rename it to the
# delegate's parameter (deepseek_v4/nvidia/model.py and deepseek_v41/nvidia/model.py, rule `\.scale$`).
NATIVE_SCALE = "scale"
NATIVE_SCALE_ARCHITECTURES = (V4_ARCHITECTURE, V41_ARCHITECTURE)
# vLLM module -> the checkpoint modules it fuses (packed_modules_mapping of vLLM 0.32's Qwen3-MoE, Mixtral and
# DeepSeek-V2/V3 models): non_routed_exl3 names vLLM modules, the checkpoint stores each shard.
VLLM_FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
}
# Architectures whose packs are parsed and checked for the contract but not served, with the reason.
NOT_SERVED = {
    "DeepseekV4ForConditionalGeneration": (
        "the DeepSeek-V4 vision-language wrapper is not served (its `language_model.` tensors and vision tower have "
        "no EXL3 layout in exllamav3 1.6.5); serve the text model as DeepseekV4ForCausalLM"
    ),
}


def not_served_reason(hf_config: Mapping[str, object], contract: MixedContract | None) -> str | None:
    """Why a pack of this architecture is not served at all; DeepSeek-V4.1 only as a mixed pack (see V41_WHY)."""
    for arch in hf_config.get("architectures") or []:
        if arch in NOT_SERVED:
            return f"config.json: architectures {arch}: {NOT_SERVED[arch]}"
        if arch == V41_ARCHITECTURE and contract is None:
            return (f"config.json: architectures {arch}: {KEY} declares no mixed-pack contract (an exllamav3-native, "
                    f"all-EXL3 checkpoint); {V41_WHY}")
    return None


def refuse_v41_dense_exl3(contract: MixedContract, layout: MoeLayout, linears: Mapping[str, Exl3Linear]) -> None:
    """A DeepSeek-V4.1 pack is EXL3 in its routed experts only: a declared or stored EXL3 set anywhere else (engram,
    vision tower, attention, draft layers) has no exllamav3 layout to be checked against, so it is refused by name."""
    if contract.exl3_layers:
        module = next(iter(contract.exl3_layers))
        raise Exl3FormatError(f"{KEY}.non_routed_exl3.layers.{module}: {V41_WHY}")
    for prefix in linears:
        if layout.expert_layer(prefix) is None:
            raise Exl3FormatError(f"{prefix}.trellis: an EXL3 tensor set in {v41_part(prefix)}; {V41_WHY}")


def dense_exl3_shards(contract: MixedContract) -> dict[str, tuple[str, float]]:
    """Checkpoint module -> (the vLLM module declaring it, K) for every non_routed_exl3 layer."""
    out = {}
    for module, k in contract.exl3_layers.items():
        base, _, leaf = module.rpartition(".")
        for shard in VLLM_FUSED.get(leaf, (leaf,)):
            out[f"{base}.{shard}" if base else shard] = (module, k)
    return out


class _Checker:
    """One pack's checks; the delegate's header rules are resolved only if some layer is delegated, so a delegate
    declared only for draft layers this pack does not store is not refused. Every tensor a check accounts for is
    recorded in `claimed`, so the quantized-storage tensors no method reads can be refused at the end."""

    def __init__(self, contract: MixedContract, layout: MoeLayout, shapes: Mapping[str, tuple[tuple, str]],
                 hf_config: Mapping[str, Any]) -> None:
        self.contract = contract
        self.layout = layout
        self.shapes = shapes
        self.hf_config = hf_config
        self._delegate: DelegateRules | None = None
        self.native_scale = layout.architecture in NATIVE_SCALE_ARCHITECTURES
        self.scale_suffixes = SCALE_SUFFIXES + ((NATIVE_SCALE,) if self.native_scale else ())
        self.claimed: set[str] = set()
        self.engram: dict[int, EngramTable] = {}

    @property
    def delegate(self) -> DelegateRules:
        if self._delegate is None:
            text = {**self.hf_config, **(self.hf_config.get("text_config") or {})}
            quant = self.hf_config.get(KEY) or {}
            self._delegate = delegate_rules(self.contract.non_routed_quantization, text.get("model_type"),
                                            quant.get("expert_dtype", text.get("expert_dtype")))
        return self._delegate

    def check_exl3(self, linears: Mapping[str, Exl3Linear]) -> None:
        declared = dense_exl3_shards(self.contract)
        for prefix, lin in linears.items():
            layer = self.layout.expert_layer(prefix)
            if layer is not None and not self.contract.source_experts(layer):
                want = self.contract.routed_bits(layer)
                if lin.k != want:
                    source = f"layer_bits.{layer}" if layer in self.contract.layer_bits else "bits"
                    raise Exl3FormatError(f"{prefix}.trellis: K={lin.k:g}, but {KEY}.{source} declares {want:g} "
                                          f"for the routed experts of layer {layer}")
            elif prefix in declared:
                module, want = declared[prefix]
                codebook = self.contract.exl3_codebook
                if lin.k != want or (codebook is not None and lin.codebook is not codebook):
                    raise Exl3FormatError(
                        f"{prefix}.trellis: K={lin.k:g} {lin.codebook.value}, but {KEY}.non_routed_exl3 declares "
                        f"{module} at K={want:g}{'' if codebook is None else ' ' + codebook.value}"
                    )
            else:
                raise Exl3FormatError(
                    f"{prefix}.trellis: an EXL3 tensor set that {KEY} does not declare; a mixed pack is EXL3 only in "
                    f"its routed experts and in the modules listed in non_routed_exl3.layers"
                )
        for prefix, (module, _) in declared.items():
            if prefix not in linears:
                raise Exl3FormatError(f"{prefix}.trellis: missing, but {KEY}.non_routed_exl3.layers declares {module}")

    def _expect_float(self, prefix: str, why: str) -> str:
        shape, dtype = self.shapes[f"{prefix}.weight"]
        if dtype not in FLOAT_DTYPES:
            raise Exl3FormatError(f"{prefix}.weight: stored as {dtype}, but {why} serves it unquantized")
        for suffix in self.scale_suffixes:
            if f"{prefix}.{suffix}" in self.shapes:
                raise Exl3FormatError(f"{prefix}.{suffix}: a scale of a layer that {why} serves unquantized")
        return "unquantized, as stored"

    def _scale_name(self, prefix: str) -> str:
        if self.native_scale:
            return f"{prefix}.{NATIVE_SCALE}"
        return f"{prefix}.{'weight_scale_inv' if self.delegate.block else 'weight_scale'}"

    def _expect_scale(self, prefix: str, dtype: str, shape: tuple[int, ...], what: str) -> None:
        name = self._scale_name(prefix)
        if name not in self.shapes:
            raise Exl3FormatError(f"{name}: missing; the {self.delegate.method} delegate ({what}) loads it for {prefix}")
        stored_shape, stored_dtype = self.shapes[name]
        if stored_dtype != dtype or tuple(stored_shape) not in (shape, (1,) if shape == () else shape):
            raise Exl3FormatError(f"{name}: {stored_dtype} {list(stored_shape)}, but the {self.delegate.method} "
                                  f"delegate ({what}) loads {dtype} {list(shape)}")
        self.claimed |= {f"{prefix}.weight", name}

    def _expect_delegate(self, prefix: str) -> str:
        rules = self.delegate
        if prefix in rules.ignored:
            return self._expect_float(prefix, f"{KEY}.non_routed_quantization.ignored_layers")
        shape, dtype = self.shapes[f"{prefix}.weight"]
        if dtype != FP8_E4M3:
            raise Exl3FormatError(
                f"{prefix}.weight: stored as {dtype}, but {KEY}.non_routed_quantization declares {rules.method} "
                f"({rules.detail}, weights {FP8_E4M3}); vLLM would boot this layer with an uninitialized scale. "
                f"Declare non_routed_dtype_policy 'bf16_as_stored' if the pack keeps it as stored"
            )
        self._expect_scale(prefix, rules.scale_dtype, rules.linear_scale_shape(*shape), rules.detail)
        return f"delegated to vLLM {rules.method!r} ({rules.detail})"

    def _expect_draft_expert(self, prefix: str, projection: str) -> None:
        """A source-format draft (MTP/DSpark) expert: MXFP4 for deepseek_v4_fp8 with fp4 experts (vLLM's
        Mxfp4MoEMethod), else block FP8 like a delegated linear."""
        rules = self.delegate
        if not rules.mxfp4_experts:
            self._expect_delegate(prefix)
            return
        in_f, out_f = self.layout.expert_shape(projection)
        shape, dtype = self.shapes[f"{prefix}.weight"]
        if dtype != PACKED_FP4 or tuple(shape) != (out_f, in_f // 2):
            raise Exl3FormatError(f"{prefix}.weight: {dtype} {list(shape)}, but a source-format draft expert of the "
                                  f"{rules.method} delegate (expert_dtype fp4) is MXFP4: {PACKED_FP4} "
                                  f"{[out_f, in_f // 2]}")
        self._expect_scale(prefix, E8M0, (out_f, in_f // MXFP4_BLOCK), "MXFP4 experts, UE8M0 scales per 32")

    def check_source(self, prefixes: Iterable[str]) -> dict[str, str]:
        """Every linear stored as a plain `.weight`: its method, after checking that it can read what is stored."""
        roles = {}
        unquantized = BUILT_UNQUANTIZED.get(self.layout.architecture)
        projections = {name: p for p, name in self.layout.projection_names.items()}
        for prefix in prefixes:
            layer = self.layout.expert_layer(prefix)
            if layer is not None:
                if not self.contract.source_experts(layer):
                    _, dtype = self.shapes[f"{prefix}.weight"]
                    raise Exl3FormatError(f"{prefix}.weight: a routed expert stored as {dtype}; the contract keeps "
                                          f"routed experts in EXL3 (only mtp_experts 'source' layers are not)")
                self._expect_draft_expert(prefix, projections[prefix.rpartition(".")[2]])
            elif prefix in HEADS:
                roles[prefix] = self._expect_float(prefix, "vLLM's lm_head (no delegate quantizes it)")
            elif unquantized is not None and unquantized.search(prefix):
                roles[prefix] = self._expect_float(prefix, "vLLM (it builds this linear without a quant config)")
            elif self.contract.delegates_dense:
                roles[prefix] = self._expect_delegate(prefix)
            else:
                policy = self.contract.dtype_policy
                why = f"{KEY}.non_routed_dtype_policy {policy!r}" if policy else f"{KEY} (no non_routed_quantization)"
                roles[prefix] = self._expect_float(prefix, why)
        return roles

    def check_engram(self) -> dict[str, str]:
        """DeepSeek-V4.1's engram tables: each in a form something serves (exl3/engram.py)."""
        if self.layout.architecture != V41_ARCHITECTURE:
            return {}
        roles = {}
        for root, table in engram_tables(self.shapes, self.hf_config).items():
            self.claimed |= {f"{root}.weight", f"{root}.scale"}
            self.engram[table.layer] = table
            roles[root] = ENGRAM_SERVED_BY[table.format]
        return roles

    def refuse_unclaimed(self, linears: Mapping[str, Exl3Linear]) -> None:
        """A tensor in a quantized storage dtype that no check above accounted for would reach vLLM's loader
        with no method that reads it: refused by name."""
        for name, (_, dtype) in self.shapes.items():
            if dtype in QUANTIZED_DTYPES and name not in self.claimed and split_name(name)[0] not in linears:
                raise Exl3FormatError(f"{name}: stored as {dtype}, but nothing this pack declares reads it (not a "
                                      f"delegated linear's weight or scale, a draft expert, or an engram table)")


@dataclass(frozen=True)
class ContractCheck:
    roles: dict[str, str]  # checkpoint module -> the method serving it (non-routed linears, engram tables)
    engram: dict[int, EngramTable]  # DeepSeek-V4.1: layer -> its engram table as stored


def check_contract(
    contract: MixedContract, layout: MoeLayout | None, shapes: Mapping[str, tuple[tuple, str]],
    linears: Mapping[str, Exl3Linear], hf_config: Mapping[str, Any],
) -> ContractCheck:
    """Refuse a mixed pack whose tensors do not match its declaration; returns the method serving every
    non-routed linear and engram table (`inspect` and `plan` show the split), and the engram tables.
    `contract` has its draft start resolved (MixedContract.with_draft_start)."""
    if layout is None:
        raise Exl3FormatError(f"{KEY}: a mixed pack (routed experts EXL3), but config.json's architectures have no "
                              f"routed-expert layout this plugin knows")
    start = contract.mtp_start_layer
    if start is not None and start < layout.num_layers:
        raise Exl3FormatError(
            f"{KEY}.mtp_experts_start_layer: {start} is inside the main model ({layout.num_layers} layers); "
            f"source-format routed experts are served only in draft layers past the main stack"
        )
    if start is not None and layout.draft_expert_root is not None and start != layout.num_layers:
        raise Exl3FormatError(
            f"{KEY}.mtp_experts_start_layer: {start}, but {layout.architecture}'s draft layers start right after its "
            f"{layout.num_layers} layers (vLLM builds mtp.i as layer {layout.num_layers} + i)"
        )
    if layout.architecture == V41_ARCHITECTURE:
        refuse_v41_dense_exl3(contract, layout, linears)
    checker = _Checker(contract, layout, shapes, hf_config)
    checker.check_exl3(linears)
    plain = [
        prefix for prefix, suffix in map(split_name, shapes)
        if suffix == "weight" and prefix not in linears
        and (prefix in HEADS or prefix.rpartition(".")[2] in CHECKED_LEAVES)
    ]
    roles = checker.check_source(plain)
    roles |= checker.check_engram()
    checker.refuse_unclaimed(linears)
    declared = dense_exl3_shards(contract)
    roles |= {prefix: f"EXL3 K={k:g} (non_routed_exl3 {module})" for prefix, (module, k) in declared.items()}
    return ContractCheck(roles, checker.engram)
