"""A mixed pack's declaration checked against its safetensors headers, before any layer is built.

vLLM does not notice a pack that declares block FP8 for layers stored as BF16: the layer boots with an
uninitialized scale and the model emits empty text. Every mismatch is refused here with the tensor named:
an EXL3 tensor set the contract does not declare, a routed expert at another K than declared, a delegated
layer without the tensors its delegate loads, or a layer stored in a format its method cannot read.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .checkpoint import split_name
from .contract import KEY, MixedContract
from .deepseek_v4 import ARCHITECTURE as V4_ARCHITECTURE
from .deepseek_v4 import BUILT_UNQUANTIZED, V41_ARCHITECTURE, V41_WHY, v41_part
from .errors import Exl3FormatError
from .naming import HEADS, LINEAR_LEAVES, MoeLayout
from .tensors import Exl3Linear

FLOAT_DTYPES = ("BF16", "F16", "F32")
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


@dataclass(frozen=True)
class DelegateTensors:
    """What a delegate's linear method loads: the weight's stored dtypes and its scale tensor."""

    method: str
    weight_dtypes: tuple[str, ...]
    scale: str
    detail: str
    ignored: frozenset[str]  # checkpoint prefixes the delegate leaves unquantized


def delegate_tensors(params: Mapping[str, object]) -> DelegateTensors:
    """The header rules of a delegate; only methods whose tensors are known here can be checked, and an
    unchecked delegate is the silent-garbage case this module exists for, so others are refused."""
    method = str(params["quant_method"]).lower()
    if method != "fp8":
        raise Exl3FormatError(
            f"{KEY}.non_routed_quantization.quant_method: {method!r}; this plugin checks the stored tensors of 'fp8' "
            f"delegates only (block or per-tensor), so it cannot tell whether this pack's layers match"
        )
    block = params.get("weight_block_size")
    if block is not None and (
        not isinstance(block, (list, tuple)) or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise Exl3FormatError(f"{KEY}.non_routed_quantization.weight_block_size: {block!r}, expected [rows, cols]")
    ignored = params.get("ignored_layers") or params.get("modules_to_not_convert") or ()
    return DelegateTensors(
        method, ("F8_E4M3",), "weight_scale_inv" if block else "weight_scale",
        f"block {block[0]}x{block[1]}" if block else "per-tensor", frozenset(ignored),
    )


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
    declared only for draft layers this pack does not store is not refused."""

    def __init__(self, contract: MixedContract, layout: MoeLayout, shapes: Mapping[str, tuple[tuple, str]]) -> None:
        self.contract = contract
        self.layout = layout
        self.shapes = shapes
        self._delegate: DelegateTensors | None = None
        self.native_scale = layout.architecture in NATIVE_SCALE_ARCHITECTURES
        self.scale_suffixes = SCALE_SUFFIXES + ((NATIVE_SCALE,) if self.native_scale else ())

    @property
    def delegate(self) -> DelegateTensors:
        if self._delegate is None:
            self._delegate = delegate_tensors(self.contract.non_routed_quantization)
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

    def _expect_delegate(self, prefix: str) -> str:
        rules = self.delegate
        if prefix in rules.ignored:
            return self._expect_float(prefix, f"{KEY}.non_routed_quantization.ignored_layers")
        _, dtype = self.shapes[f"{prefix}.weight"]
        if dtype not in rules.weight_dtypes:
            raise Exl3FormatError(
                f"{prefix}.weight: stored as {dtype}, but {KEY}.non_routed_quantization declares {rules.method} "
                f"({rules.detail}, weights {'/'.join(rules.weight_dtypes)}); vLLM would boot this layer with an "
                f"uninitialized scale. Declare non_routed_dtype_policy 'bf16_as_stored' if the pack keeps it as stored"
            )
        scale = NATIVE_SCALE if self.native_scale else rules.scale
        if f"{prefix}.{scale}" not in self.shapes:
            raise Exl3FormatError(f"{prefix}.{scale}: missing; the {rules.method} delegate ({rules.detail}) "
                                  f"loads it for {prefix}")
        return f"delegated to vLLM {rules.method!r} ({rules.detail})"

    def check_source(self, prefixes: Iterable[str]) -> dict[str, str]:
        """Every linear stored as a plain `.weight`: its method, after checking that it can read what is stored."""
        roles = {}
        unquantized = BUILT_UNQUANTIZED.get(self.layout.architecture)
        for prefix in prefixes:
            layer = self.layout.expert_layer(prefix)
            if layer is not None:
                if not self.contract.source_experts(layer):
                    _, dtype = self.shapes[f"{prefix}.weight"]
                    raise Exl3FormatError(f"{prefix}.weight: a routed expert stored as {dtype}; the contract keeps "
                                          f"routed experts in EXL3 (only mtp_experts 'source' layers are not)")
                self._expect_delegate(prefix)
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


def check_contract(
    contract: MixedContract, layout: MoeLayout | None, shapes: Mapping[str, tuple[tuple, str]],
    linears: Mapping[str, Exl3Linear],
) -> dict[str, str]:
    """Refuse a mixed pack whose tensors do not match its declaration; returns checkpoint module -> the method
    that serves it, for every non-routed linear (`inspect` and `plan` show the split)."""
    if layout is None:
        raise Exl3FormatError(f"{KEY}: a mixed pack (routed experts EXL3), but config.json's architectures have no "
                              f"routed-expert layout this plugin knows")
    start = contract.mtp_start_layer
    if start is not None and start < layout.num_layers:
        raise Exl3FormatError(
            f"{KEY}.mtp_experts_start_layer: {start} is inside the main model ({layout.num_layers} layers); "
            f"source-format routed experts are served only in draft layers past the main stack"
        )
    if layout.architecture == V41_ARCHITECTURE:
        refuse_v41_dense_exl3(contract, layout, linears)
    checker = _Checker(contract, layout, shapes)
    checker.check_exl3(linears)
    plain = [
        prefix for prefix, suffix in map(split_name, shapes)
        if suffix == "weight" and prefix not in linears
        and (prefix in HEADS or prefix.rpartition(".")[2] in LINEAR_LEAVES)
    ]
    roles = checker.check_source(plain)
    declared = dense_exl3_shards(contract)
    roles |= {prefix: f"EXL3 K={k:g} (non_routed_exl3 {module})" for prefix, (module, k) in declared.items()}
    return roles

