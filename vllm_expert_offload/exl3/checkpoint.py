"""Reading an exllamav3 checkpoint directory: config, tensor names grouped into linear layers, lazy tensor access."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .config import Exl3QuantConfig, parse_quant_config
from .errors import Exl3FormatError
from .tensors import Exl3Linear, parse_linear


def split_name(name: str) -> tuple[str, str]:
    prefix, _, suffix = name.rpartition(".")
    return prefix, suffix


@dataclass
class Exl3Checkpoint:
    """A checkpoint directory; tensors are read on demand so inspecting a 300 GB model costs only its headers."""

    path: Path
    hf_config: dict[str, Any]
    quant_config: Exl3QuantConfig
    tensor_files: dict[str, Path]  # tensor name -> file

    @classmethod
    def open(cls, path: str | Path) -> "Exl3Checkpoint":
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise Exl3FormatError(f"{config_file}: not found")
        try:
            hf_config = json.loads(config_file.read_text())
        except json.JSONDecodeError as exc:
            raise Exl3FormatError(f"{config_file}: not valid JSON ({exc})") from exc
        if "quantization_config" not in hf_config:
            raise Exl3FormatError(f"{config_file}: no quantization_config; not an EXL3 checkpoint")
        quant = parse_quant_config(hf_config["quantization_config"])
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise Exl3FormatError(f"{path}: no .safetensors files")
        tensor_files: dict[str, Path] = {}
        for file in files:
            try:
                with safe_open(file, framework="pt") as f:
                    for name in f.keys():
                        tensor_files[name] = file
            except Exception as exc:  # safetensors raises its own error types for truncated/corrupt headers
                raise Exl3FormatError(f"{file.name}: cannot read safetensors header ({exc})") from exc
        return cls(path, hf_config, quant, tensor_files)

    def tensor(self, name: str) -> torch.Tensor:
        try:
            with safe_open(self.tensor_files[name], framework="pt") as f:
                return f.get_tensor(name)
        except KeyError:
            raise Exl3FormatError(f"{name}: missing from the checkpoint") from None
        except Exception as exc:
            raise Exl3FormatError(f"{name}: cannot be read from {self.tensor_files[name].name} ({exc})") from exc

    def quantized_prefixes(self) -> list[str]:
        """Module names that carry a trellis, in file order."""
        return [prefix for prefix, suffix in map(split_name, self.tensor_files) if suffix == "trellis"]

    def linear_tensor_names(self) -> dict[str, dict[str, str]]:
        """prefix -> {suffix: full name} for every module with a trellis, unknown suffixes included so that
        parse_linear can refuse them by name."""
        groups: dict[str, dict[str, str]] = defaultdict(dict)
        quantized = set(self.quantized_prefixes())
        for name in self.tensor_files:
            prefix, suffix = split_name(name)
            if prefix in quantized:
                groups[prefix][suffix] = name
        return dict(groups)

    def linear(self, prefix: str, in_features: int | None = None, out_features: int | None = None) -> Exl3Linear:
        names = self.linear_tensor_names().get(prefix)
        if names is None:
            raise Exl3FormatError(f"{prefix}.trellis: missing from the checkpoint")
        return parse_linear({s: self.tensor(n) for s, n in names.items()}, prefix, in_features, out_features)

    def iter_linears(self) -> Iterator[Exl3Linear]:
        for prefix in self.linear_tensor_names():
            yield self.linear(prefix)

    def header_shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """name -> (shape, dtype) from headers only."""
        out = {}
        by_file: dict[Path, list[str]] = defaultdict(list)
        for name, file in self.tensor_files.items():
            by_file[file].append(name)
        for file, names in by_file.items():
            with safe_open(file, framework="pt") as f:
                for name in names:
                    sl = f.get_slice(name)
                    out[name] = (tuple(sl.get_shape()), sl.get_dtype())
        return out
