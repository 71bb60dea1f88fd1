"""A copy of a valid checkpoint with one thing changed: the starting point of every refusal test."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def edited_checkpoint(
    valid: Path, out: Path, tensors: Callable[[dict[str, torch.Tensor]], None] | None = None,
    quant: Callable[[dict], None] | None = None, config: Callable[[dict], None] | None = None,
) -> Path:
    """`valid` copied to `out`, then its tensors, its quantization_config and its config.json edited in place."""
    shutil.copytree(valid, out)
    if tensors is not None:
        loaded = load_file(out / "model.safetensors")
        tensors(loaded)
        save_file(loaded, out / "model.safetensors")
    hf = json.loads((out / "config.json").read_text())
    if quant is not None:
        quant(hf["quantization_config"])
    if config is not None:
        config(hf)
    (out / "config.json").write_text(json.dumps(hf))
    return out
