"""The mixed-pack contract (vllm-exl3's "config contract"): routed experts in EXL3, every other weight in the
format the source model shipped it in (block FP8 for DeepSeek, BF16 for most others), declared in
`quantization_config`.

The EXL3 MoE packs published for the large models are laid out this way, not as exllamav3 writes a whole model.
A pack declares the contract with any of `CONTRACT_KEYS`; without one it is an exllamav3-native pack, whose
stored tensors alone say which linears are EXL3. Parsing here is pure: which vLLM method serves a delegated
layer, and whether the safetensors headers match the declaration, are checked elsewhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import InvalidStateError
from ..validation import refuse_unknown
from .bitrate import HALF_K, INTEGER_K
from .codebook import Codebook
from .errors import Exl3FormatError

BF16_AS_STORED = "bf16_as_stored"
DTYPE_POLICIES = (BF16_AS_STORED,)
MTP_EXPERTS = ("exl3", "source")
# Top-level copies of the delegate's block size and expert dtype: the published DeepSeek-V4.1 packs carry them
# because vLLM's V4.1 model reads `quant_config.weight_block_size` before any layer asks for its method, and its
# config class copies a top-level `expert_dtype` onto the HF config (docs/models.md, the V4.1 contract).
DELEGATE_MIRRORS = ("weight_block_size", "expert_dtype")
CONTRACT_KEYS = frozenset(
    {
        "layer_bits", "non_routed_quantization", "non_routed_dtype_policy", "mtp_experts",
        "mtp_experts_start_layer", "scope", "non_routed_exl3", *DELEGATE_MIRRORS,
    }
)
NON_ROUTED_EXL3_KEYS = frozenset({"codebook", "layers"})
NON_ROUTED_EXL3_LAYER_KEYS = frozenset({"bits"})
KEY = "quantization_config"


@dataclass(frozen=True)
class MixedContract:
    """What a mixed pack declares; every field validated on its own and against the others."""

    bits: float  # routed experts' default K
    layer_bits: Mapping[int, float] = field(default_factory=dict)  # per-layer routed K (MixedK packs)
    non_routed_quantization: Mapping[str, Any] | None = None  # vLLM quantization config for the delegate
    dtype_policy: str | None = None
    mtp_experts: str = "exl3"
    mtp_start_layer: int | None = None  # None with mtp_experts 'source': the first layer past the main stack
    scope: str | None = None  # informational, shown by `inspect`
    exl3_codebook: Codebook | None = None  # non_routed_exl3.codebook
    exl3_layers: Mapping[str, float] = field(default_factory=dict)  # vLLM module prefix -> K

    @property
    def delegate_method(self) -> str | None:
        """The vLLM quantization method name of the delegate, lower-cased as vLLM normalizes it."""
        if self.non_routed_quantization is None:
            return None
        return str(self.non_routed_quantization["quant_method"]).lower()

    @property
    def delegates_dense(self) -> bool:
        """Whether non-routed linears go to the delegate (else they are served unquantized as stored)."""
        return self.non_routed_quantization is not None and self.dtype_policy != BF16_AS_STORED

    def routed_bits(self, layer: int) -> float:
        return self.layer_bits.get(layer, self.bits)

    def source_experts(self, layer: int) -> bool:
        """Routed experts of `layer` stay in the source format (draft/MTP layers) and go to the delegate."""
        if self.mtp_experts != "source":
            return False
        if self.mtp_start_layer is None:
            raise InvalidStateError("mtp_experts_start_layer was not resolved against config.json (with_draft_start)")
        return layer >= self.mtp_start_layer

    def with_draft_start(self, num_layers: int) -> MixedContract:
        """The contract with an omitted `mtp_experts_start_layer` inferred from config.json: draft layers follow
        the main stack (vLLM builds them as layers num_layers + i; vllm-exl3's V4.1 doc infers it the same way)."""
        if self.mtp_experts != "source" or self.mtp_start_layer is not None:
            return self
        return replace(self, mtp_start_layer=num_layers)

    def dense_method(self) -> str:
        """Which method serves a non-routed linear that is not EXL3, in words (for `inspect` and `plan`)."""
        return f"delegated to vLLM {self.delegate_method!r}" if self.delegates_dense else "unquantized, as stored"


def _k(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value not in (*INTEGER_K, *HALF_K):
        raise Exl3FormatError(f"{KEY}.{key}: {value!r}, expected bits per weight 1..8 or 1.5/2.5/3.5")
    return int(value) if value in INTEGER_K else float(value)


def _layer_bits(value: Any) -> dict[int, float]:
    if not isinstance(value, Mapping):
        raise Exl3FormatError(f"{KEY}.layer_bits: {value!r}, expected a map of layer index -> bits")
    out = {}
    for layer, bits in value.items():
        if not str(layer).isdigit():
            raise Exl3FormatError(f"{KEY}.layer_bits: key {layer!r} is not a layer index")
        out[int(layer)] = _k(bits, f"layer_bits.{layer}")
    return out


def _delegate(value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping) or not isinstance(value.get("quant_method"), str):
        raise Exl3FormatError(
            f"{KEY}.non_routed_quantization: {value!r}, expected a vLLM quantization config with a 'quant_method'"
        )
    if value["quant_method"].lower() == "exl3":
        raise Exl3FormatError(
            f"{KEY}.non_routed_quantization.quant_method: 'exl3'; EXL3 dense layers are declared in non_routed_exl3"
        )
    return dict(value)


def _non_routed_exl3(value: Any) -> tuple[Codebook | None, dict[str, float]]:
    where = f"{KEY}.non_routed_exl3"
    if not isinstance(value, Mapping):
        raise Exl3FormatError(f"{where}: {value!r}, expected {{'codebook': ..., 'layers': {{prefix: {{'bits': K}}}}}}")
    refuse_unknown(value, NON_ROUTED_EXL3_KEYS, where, Exl3FormatError, "not supported",
                   "; the short form 'modules' is not read, list each module under 'layers'")
    codebook = None
    if value.get("codebook") is not None:
        try:
            codebook = Codebook(str(value["codebook"]).lower())
        except ValueError:
            raise Exl3FormatError(f"{where}.codebook: {value['codebook']!r}, expected one of "
                                  f"{[c.value for c in Codebook]}") from None
    layers = value.get("layers", {})
    if not isinstance(layers, Mapping):
        raise Exl3FormatError(f"{where}.layers: {layers!r}, expected a map of vLLM module prefix -> {{'bits': K}}")
    out = {}
    for prefix, entry in layers.items():
        if not isinstance(entry, Mapping) or "bits" not in entry:
            raise Exl3FormatError(f"{where}.layers.{prefix}: {entry!r}, expected {{'bits': K}}")
        refuse_unknown(entry, NON_ROUTED_EXL3_LAYER_KEYS, f"{where}.layers.{prefix}", Exl3FormatError,
                       "not supported", "; a module is EXL3 in every shard")
        out[str(prefix)] = _k(entry["bits"], f"non_routed_exl3.layers.{prefix}.bits")
    return codebook, out


def _mtp(config: Mapping[str, Any], delegate: Mapping[str, Any] | None) -> tuple[str, int | None]:
    mode = config.get("mtp_experts", "exl3")
    if mode not in MTP_EXPERTS:
        raise Exl3FormatError(f"{KEY}.mtp_experts: {mode!r}, expected one of {list(MTP_EXPERTS)}")
    start = config.get("mtp_experts_start_layer")
    if mode == "exl3":
        if start is not None:
            raise Exl3FormatError(f"{KEY}.mtp_experts_start_layer: {start!r} given, but mtp_experts is not 'source'")
        return mode, None
    if start is not None and (isinstance(start, bool) or not isinstance(start, int) or start < 0):
        raise Exl3FormatError(f"{KEY}.mtp_experts_start_layer: {start!r}, expected the first draft layer's index "
                              f"(or omit it: the first layer past the main stack)")
    if delegate is None:
        raise Exl3FormatError(f"{KEY}.mtp_experts: 'source' needs non_routed_quantization, the method that serves "
                              f"the source-format draft experts")
    return mode, start


def _mirrors(config: Mapping[str, Any], delegate: Mapping[str, Any] | None) -> None:
    """A top-level `weight_block_size` / `expert_dtype` restates the delegate's; one that says something else, or
    has no delegate to restate, would make vLLM's model and the delegate disagree, so it is refused by name."""
    for key in DELEGATE_MIRRORS:
        if key not in config:
            continue
        if delegate is None:
            raise Exl3FormatError(f"{KEY}.{key}: {config[key]!r} restates non_routed_quantization.{key}, but the "
                                  f"pack declares no non_routed_quantization")
        if key in delegate and delegate[key] != config[key]:
            raise Exl3FormatError(f"{KEY}.{key}: {config[key]!r}, but non_routed_quantization.{key} is "
                                  f"{delegate[key]!r}; the top-level key restates the delegate's")


def is_mixed(config: Mapping[str, Any]) -> bool:
    return any(key in config for key in CONTRACT_KEYS)


def parse_contract(config: Mapping[str, Any], bits: float) -> MixedContract:
    """The contract keys of a `quantization_config` (that `is_mixed`); `bits` is its already-checked `bits`."""
    bits = _k(bits, "bits")
    delegate = None if config.get("non_routed_quantization") is None else _delegate(config["non_routed_quantization"])
    policy = config.get("non_routed_dtype_policy")
    if policy is not None and policy not in DTYPE_POLICIES:
        raise Exl3FormatError(f"{KEY}.non_routed_dtype_policy: {policy!r}, expected one of {list(DTYPE_POLICIES)}")
    mode, start = _mtp(config, delegate)
    _mirrors(config, delegate)
    scope = config.get("scope")
    if scope is not None and not isinstance(scope, str):
        raise Exl3FormatError(f"{KEY}.scope: {scope!r}, expected a string")
    codebook, exl3_layers = _non_routed_exl3(config.get("non_routed_exl3") or {})
    return MixedContract(
        bits=bits, layer_bits=_layer_bits(config.get("layer_bits") or {}), non_routed_quantization=delegate,
        dtype_policy=policy, mtp_experts=mode, mtp_start_layer=start, scope=scope, exl3_codebook=codebook,
        exl3_layers=exl3_layers,
    )
