"""The EXL3 weight format: parse, validate, decode, encode. Imports neither vLLM nor CUDA."""

from .codebook import MCG_MARKER, MUL1_MARKER, Codebook, codebook_table, codebook_values
from .config import Exl3QuantConfig, parse_quant_config
from .decode import dequantize, dequantize_kn, linear, rotated_weight
from .errors import Exl3FormatError
from .naming import MoeLayout, moe_layout
from .ring import pack_states, unpack_states
from .tensors import Exl3Linear, padded, parse_linear

__all__ = [
    "MCG_MARKER", "MUL1_MARKER", "Codebook", "codebook_table", "codebook_values", "Exl3QuantConfig",
    "parse_quant_config", "dequantize", "dequantize_kn", "linear", "rotated_weight", "Exl3FormatError",
    "MoeLayout", "moe_layout", "pack_states", "unpack_states", "Exl3Linear", "padded", "parse_linear",
]
