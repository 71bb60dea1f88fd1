"""The `quantization_config` block exllamav3 writes into config.json (exl3-format.md §1.1)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..validation import finite_number, refuse_unknown
from .bitrate import HALF_K, INTEGER_K
from .codebook import Codebook
from .contract import CONTRACT_KEYS, MixedContract, is_mixed, parse_contract
from .errors import Exl3FormatError

QUANT_METHOD = "exl3"
UNQUANTIZED_HEAD_BITS = 16
# Keys exllamav3 1.6.x writes; all are informational except where parse_quant_config checks them.
EXLLAMAV3_KEYS = frozenset(
    {
        "quant_method", "version", "bits", "head_bits", "calibration", "out_scales", "codebook",
        "vision_bits", "mtp_bits", "original_quantization_config", "tensor_storage",
    }
)
KNOWN_KEYS = EXLLAMAV3_KEYS | CONTRACT_KEYS
OUT_SCALES = ("always", "never", "auto")


@dataclass(frozen=True)
class Exl3QuantConfig:
    bits: float
    head_bits: float | None  # None: not recorded; the checkpoint's lm_head tensors decide
    codebook: Codebook | None  # None: not recorded; every tensor set carries its own marker
    version: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)  # informational keys kept for `inspect`
    contract: MixedContract | None = None  # a mixed pack (contract.py); None: exllamav3-native, all linears EXL3

    @property
    def lm_head_quantized(self) -> bool | None:
        return None if self.head_bits is None else self.head_bits != UNQUANTIZED_HEAD_BITS


def _number(config: Mapping[str, Any], key: str) -> float | None:
    if key not in config or config[key] is None:
        return None
    return finite_number(config[key], f"quantization_config.{key}", Exl3FormatError)


def parse_quant_config(config: Mapping[str, Any]) -> Exl3QuantConfig:
    """Validate the block; unknown keys and impossible values are refused rather than ignored."""
    method = str(config.get("quant_method", "")).lower()
    if method != QUANT_METHOD:
        raise Exl3FormatError(f"quantization_config.quant_method: {config.get('quant_method')!r}, expected 'exl3'")
    refuse_unknown(config, KNOWN_KEYS, "quantization_config", Exl3FormatError,
                   "unsupported key; this plugin reads exllamav3's keys and the mixed-pack contract's")
    bits = _number(config, "bits")
    if bits is None:
        raise Exl3FormatError("quantization_config.bits: missing")
    if not 1 <= bits <= 8:
        raise Exl3FormatError(f"quantization_config.bits: {bits:g} is outside 1..8 bits per weight")
    codebook = None
    if config.get("codebook") is not None:
        try:
            codebook = Codebook(str(config["codebook"]).lower())
        except ValueError:
            raise Exl3FormatError(
                f"quantization_config.codebook: {config['codebook']!r}, expected one of "
                f"{[c.value for c in Codebook]}"
            ) from None
    head_bits = _number(config, "head_bits")
    if head_bits is not None:
        allowed = (*INTEGER_K, *HALF_K, UNQUANTIZED_HEAD_BITS)
        if head_bits not in allowed:
            raise Exl3FormatError(f"quantization_config.head_bits: {head_bits:g}, expected one of {list(allowed)}")
        if head_bits in HALF_K and codebook not in (None, Codebook.MUL1):
            raise Exl3FormatError(
                f"quantization_config.head_bits: half-integer {head_bits:g} needs codebook 'mul1', "
                f"not {codebook.value!r}"
            )
    out_scales = config.get("out_scales")
    if out_scales is not None and out_scales not in OUT_SCALES:
        raise Exl3FormatError(f"quantization_config.out_scales: {out_scales!r}, expected one of {list(OUT_SCALES)}")
    parsed = ("quant_method", "bits", "head_bits", "codebook", "version", *CONTRACT_KEYS)
    extra = {k: v for k, v in config.items() if k not in parsed}
    return Exl3QuantConfig(
        bits=bits, head_bits=head_bits, codebook=codebook,
        version=None if config.get("version") is None else str(config["version"]), extra=extra,
        contract=parse_contract(config, bits) if is_mixed(config) else None,
    )


def quant_config_dict(bits: float, head_bits: float, codebook: Codebook, version: str) -> dict[str, Any]:
    """The block our encoder writes, in exllamav3's key order."""
    return {
        "quant_method": QUANT_METHOD,
        "version": version,
        "bits": round(float(bits), 2),
        "head_bits": head_bits,
        "calibration": {"rows": 0, "cols": 0},
        "out_scales": "never",
        "codebook": codebook.value,
    }
