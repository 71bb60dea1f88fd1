"""Whole-checkpoint validation from safetensors headers, before any weight is loaded.

A 300 GB checkpoint with one bad expert must be refused in seconds with that expert named, not
after an hour of loading or, worse, served with garbage in one expert.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from .checkpoint import Exl3Checkpoint
from .contract import MixedContract
from .codebook import Codebook
from .contract_check import check_contract, dense_exl3_shards, not_served_reason
from .engram import EngramTable
from .errors import Exl3FormatError
from .naming import PROJECTIONS, MoeLayout, moe_layout
from .tensors import MARKER_SUFFIXES, Exl3Linear, parse_linear

_DTYPES = {"I16": torch.int16, "I32": torch.int32, "F16": torch.float16, "F32": torch.float32, "BF16": torch.bfloat16}


@dataclass
class CheckpointSummary:
    """What validation learned: every quantized module (header-level) and the MoE layout."""

    linears: dict[str, Exl3Linear]  # prefix -> tensor set with meta trellis/suh/svh
    suffixes: dict[str, frozenset[str]]  # prefix -> the suffixes stored for it (what a loader must receive)
    layout: MoeLayout | None
    expert_bytes: dict[int, list[int]] = field(default_factory=dict)  # moe layer -> bytes per expert
    contract: MixedContract | None = None  # a mixed pack's declaration (draft start resolved); None: native
    non_routed: dict[str, str] = field(default_factory=dict)  # mixed pack: linear -> the method serving it
    engram: dict[int, EngramTable] = field(default_factory=dict)  # DeepSeek-V4.1: layer -> engram table as stored

    @property
    def quantized_prefixes(self) -> frozenset[str]:
        return frozenset(self.linears)


def _meta(shape: tuple[int, ...], dtype: str, name: str) -> torch.Tensor:
    if dtype not in _DTYPES:
        raise Exl3FormatError(f"{name}: dtype {dtype} is not used by EXL3 tensors")
    return torch.empty(shape, dtype=_DTYPES[dtype], device="meta")


def _marker(ckpt: Exl3Checkpoint, name: str, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    """A codebook marker's value (validation checks it), read from its 4 bytes."""
    data = ckpt.small_tensor_bytes(name)
    if dtype not in _DTYPES or len(data) != _DTYPES[dtype].itemsize * math.prod(shape):
        return _meta(shape, dtype, name)  # parse_linear refuses its dtype/shape by name
    return torch.frombuffer(bytearray(data), dtype=_DTYPES[dtype]).reshape(shape)


def _header_linears(ckpt: Exl3Checkpoint) -> dict[str, Exl3Linear]:
    shapes = ckpt.header_shapes()
    groups = ckpt.linear_tensor_names()
    markers: dict[str, torch.Tensor] = {}
    for names in groups.values():
        for suffix, name in names.items():
            if suffix in MARKER_SUFFIXES:
                markers[name] = _marker(ckpt, name, *shapes[name])
    linears = {}
    for prefix, names in groups.items():
        tensors = {
            suffix: markers[name] if name in markers else _meta(*shapes[name], name) for suffix, name in names.items()
        }
        linears[prefix] = parse_linear(tensors, prefix)
    return linears


def _check_codebook(declared: Codebook | None, linears: dict[str, Exl3Linear], contract: MixedContract | None) -> None:
    """A declared `quantization_config.codebook` is what every tensor set's marker says (no marker: 3INST); the
    modules of a mixed pack's non_routed_exl3 answer to that key's own codebook (contract_check.py). Kernels
    decode by the marker, so a declaration that disagrees means a pack built or edited wrong, and every reader
    of the declaration (inspect, plan, a backend's choice) would be misled by it."""
    if declared is None:
        return
    own = set(dense_exl3_shards(contract)) if contract is not None else set()
    for prefix, lin in linears.items():
        if prefix not in own and lin.codebook is not declared:
            raise Exl3FormatError(f"{prefix}: its tensors say codebook {lin.codebook.value!r}, but "
                                  f"quantization_config.codebook declares {declared.value!r}")


def _check_uniform(layout: MoeLayout, linears: dict[str, Exl3Linear], layer: int, projection: str) -> None:
    first = linears[layout.expert_prefix(layer, 0, projection)]
    for expert in range(1, layout.num_experts):
        lin = linears[layout.expert_prefix(layer, expert, projection)]
        if (lin.k, lin.codebook) != (first.k, first.codebook):
            raise Exl3FormatError(
                f"{lin.name}.trellis: K={lin.k:g} {lin.codebook.value}, but expert 0 of layer {layer} has "
                f"K={first.k:g} {first.codebook.value}; the selected MoE kernel needs one K and codebook per "
                f"projection and layer (exllamav3 writes checkpoints that way)"
            )


def _check_expert_names(layout: MoeLayout, names: list[str], contract: MixedContract | None) -> None:
    """Tensors of experts or layers the model does not have, refused before any set is parsed; a mixed pack's
    source-format draft layers (past the main stack) are the draft model's, not the main model's."""
    root = re.escape(layout.expert_root).replace(r"\{layer\}", r"(\d+)")
    pattern = re.compile(rf"^{root}\.(\d+)\.")
    for name in names:
        match = pattern.match(name)
        if match and contract is not None and contract.source_experts(int(match.group(1))):
            continue
        if match and (int(match.group(1)) not in layout.moe_layers or int(match.group(2)) >= layout.num_experts):
            raise Exl3FormatError(
                f"{name}: unexpected tensor (layer {match.group(1)} has experts 0..{layout.num_experts - 1}"
                f"{'' if int(match.group(1)) in layout.moe_layers else ' and is not an MoE layer'})"
            )


def _check_experts(layout: MoeLayout, linears: dict[str, Exl3Linear], uniform_k: bool) -> dict[int, list[int]]:
    expert_bytes: dict[int, list[int]] = {}
    for layer in layout.moe_layers:
        per_expert = []
        for expert in range(layout.num_experts):
            total = 0
            for projection in PROJECTIONS:
                prefix = layout.expert_prefix(layer, expert, projection)
                if prefix not in linears:
                    raise Exl3FormatError(f"{prefix}.trellis: missing (routed expert {expert} of layer {layer})")
                in_f, out_f = layout.expert_shape(projection)
                lin = parse_linear(linears[prefix].tensors(), prefix, in_f, out_f)
                total += lin.nbytes()
            per_expert.append(total)
        expert_bytes[layer] = per_expert
        if uniform_k:
            for projection in PROJECTIONS:
                _check_uniform(layout, linears, layer, projection)
    return expert_bytes


def validate_checkpoint(ckpt: Exl3Checkpoint, *, uniform_expert_k: bool = False) -> CheckpointSummary:
    """Check every EXL3 tensor set from headers (markers are read, they are 4 bytes) and every routed expert.

    `uniform_expert_k`: the MoE kernel that will run needs one K and codebook per projection and layer
    (exllamav3's fused kernels do); the CPU table kernel decodes each expert on its own and mixes freely."""
    contract = ckpt.quant_config.contract
    reason = not_served_reason(ckpt.hf_config, contract)
    if reason is not None:
        raise Exl3FormatError(reason)
    layout = moe_layout(ckpt.hf_config)
    if contract is not None and layout is not None:
        contract = contract.with_draft_start(layout.num_layers)
    if layout is not None:
        _check_expert_names(layout, list(ckpt.tensor_files), contract)
    linears = _header_linears(ckpt)
    _check_codebook(ckpt.quant_config.codebook, linears, contract)
    checked = None if contract is None else check_contract(contract, layout, ckpt.header_shapes(), linears,
                                                           ckpt.hf_config)
    expert_bytes = _check_experts(layout, linears, uniform_expert_k) if layout else {}
    suffixes = {prefix: frozenset(names) for prefix, names in ckpt.linear_tensor_names().items()}
    return CheckpointSummary(linears=linears, suffixes=suffixes, layout=layout, expert_bytes=expert_bytes,
                             contract=contract, non_routed={} if checked is None else checked.roles,
                             engram={} if checked is None else checked.engram)
