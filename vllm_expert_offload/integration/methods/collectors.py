"""Collector parameters: empty placeholders that receive EXL3 checkpoint tensors by name.

vLLM's loaders find a destination with `getattr(layer, name)` / `params_dict[name]` and call its
`weight_loader`; EXL3 tensors (trellis, suh, svh, markers) have shapes that depend on each tensor's
own bit rate, so no stacked parameter can be sized in advance. Each placeholder holds no data
(vLLM exempts 0-element parameters from its "every parameter loaded" check) and hands what it
receives to a dict on the layer; process_weights_after_loading validates and assembles it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch
from vllm.model_executor.utils import set_weight_attrs

from ...exl3.errors import Exl3FormatError

TENSOR_SUFFIXES = ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1")
LOADED_ATTR = "_exl3_loaded"


def register_collectors(layer: torch.nn.Module, names: dict[str, str], loader: Callable[..., Any]) -> None:
    """Register one 0-element parameter per name; `names` maps parameter name -> EXL3 suffix."""
    setattr(layer, LOADED_ATTR, {})
    for param_name, suffix in names.items():
        param = torch.nn.Parameter(torch.empty(0, device="cpu"), requires_grad=False)
        set_weight_attrs(param, {"exl3_suffix": suffix, "weight_loader": loader})  # what vLLM's loaders call
        layer.register_parameter(param_name, param)


def collected(layer: torch.nn.Module) -> dict[Hashable, dict[str, torch.Tensor]]:
    """What has arrived so far, by key; callers may pop entries they have consumed."""
    return getattr(layer, LOADED_ATTR)


def collect(layer: torch.nn.Module, key: Hashable, suffix: str, tensor: torch.Tensor, where: str) -> None:
    """Record one tensor; a second copy of the same tensor means the checkpoint is ambiguous."""
    entry = collected(layer).setdefault(key, {})
    if suffix in entry:
        raise Exl3FormatError(f"{where}.{suffix}: loaded twice (duplicate tensor in the checkpoint)")
    entry[suffix] = tensor


def take_loaded(layer: torch.nn.Module, collector_names: list[str]) -> dict[Hashable, dict[str, torch.Tensor]]:
    """Hand over what was collected and drop the placeholders, so the layer keeps no loader state."""
    store = getattr(layer, LOADED_ATTR)
    delattr(layer, LOADED_ATTR)
    for name in collector_names:
        delattr(layer, name)
    return store
