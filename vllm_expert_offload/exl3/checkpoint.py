"""Reading an exllamav3 checkpoint directory: config, tensor names grouped into linear layers, lazy tensor access."""

from __future__ import annotations

import json
import struct
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .config import Exl3QuantConfig, parse_quant_config
from .errors import Exl3FormatError
from .tensors import Exl3Linear, parse_linear

MAX_HEADER_BYTES = 100 * 10**6  # safetensors' own limit on the header's size
# safetensors header dtype -> bytes per element
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}


def split_name(name: str) -> tuple[str, str]:
    prefix, _, suffix = name.rpartition(".")
    return prefix, suffix


def read_header(file: Path) -> tuple[int, dict[str, dict[str, Any]]]:
    """(offset of the data region, name -> {dtype, shape, data_offsets}) of a safetensors file, read with two
    plain reads: a 300 GB pack is validated from its headers without mapping its shards (a memory map of a 50 GB
    engram shard is refused outright on a host with less memory than that, and costs page tables elsewhere)."""
    with open(file, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise Exl3FormatError(f"{file.name}: not a safetensors file (shorter than its 8-byte header length)")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES:
            raise Exl3FormatError(f"{file.name}: header length {length:,} bytes exceeds {MAX_HEADER_BYTES:,}")
        blob = f.read(length)
    try:
        header = json.loads(blob)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise Exl3FormatError(f"{file.name}: safetensors header is not valid JSON ({exc})") from exc
    if len(blob) != length or not isinstance(header, dict):
        raise Exl3FormatError(f"{file.name}: truncated or malformed safetensors header")
    header.pop("__metadata__", None)
    check_data_layout(file, header, file.stat().st_size - 8 - length)
    return 8 + length, header


def _entry_span(file: Path, name: str, entry: Any) -> tuple[int, int]:
    """(begin, end) of one tensor's bytes, checked against its dtype and shape as safetensors checks them."""
    try:
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
    except (KeyError, TypeError, ValueError) as exc:
        raise Exl3FormatError(f"{file.name}: {name}: malformed safetensors header entry ({exc!r})") from exc
    if dtype not in DTYPE_BYTES:
        raise Exl3FormatError(f"{file.name}: {name}: unknown safetensors dtype {dtype!r}")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise Exl3FormatError(f"{file.name}: {name}: shape {shape!r} is not a list of non-negative integers")
    if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
        raise Exl3FormatError(f"{file.name}: {name}: data_offsets {[begin, end]} are not 0 <= begin <= end")
    count = DTYPE_BYTES[dtype]
    for dim in shape:
        count *= dim
    if end - begin != count:
        raise Exl3FormatError(f"{file.name}: {name}: data_offsets {[begin, end]} span {end - begin:,} bytes, its "
                              f"{dtype} shape {shape} needs {count:,}")
    return begin, end


def check_data_layout(file: Path, header: dict[str, Any], data_bytes: int) -> None:
    """The tensors must tile the data region exactly, as safetensors requires when vLLM opens the shard: checked
    here so a truncated or padded shard is refused with its file (and the tensor it cuts) named, before vLLM's
    loader fails inside safetensors with a message naming neither."""
    covered = 0
    for begin, end, name in sorted((*_entry_span(file, name, entry), name) for name, entry in header.items()):
        if begin != covered:
            raise Exl3FormatError(f"{file.name}: {name} starts at data offset {begin:,}, expected {covered:,} "
                                  f"(tensors must tile the data region without gaps or overlaps)")
        if end > data_bytes:
            raise Exl3FormatError(f"{file.name}: truncated: {name} ends at data offset {end:,} but the file holds "
                                  f"only {data_bytes:,} bytes of data")
        covered = end
    if covered != data_bytes:
        raise Exl3FormatError(f"{file.name}: {data_bytes - covered:,} bytes after the last tensor's data "
                              f"(the header covers {covered:,} of {data_bytes:,})")


@dataclass
class Exl3Checkpoint:
    """A checkpoint directory; tensors are read on demand so inspecting a 300 GB model costs only its headers."""

    path: Path
    hf_config: dict[str, Any]
    quant_config: Exl3QuantConfig
    tensor_files: dict[str, Path]  # tensor name -> file
    headers: dict[Path, tuple[int, dict[str, dict[str, Any]]]] = field(default_factory=dict, repr=False)

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
        headers = {}
        for file in files:
            headers[file] = read_header(file)
            for name in headers[file][1]:
                tensor_files[name] = file
        return cls(path, hf_config, quant, tensor_files, headers)

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
        for name, file in self.tensor_files.items():  # entries were checked by read_header
            entry = self.headers[file][1][name]
            out[name] = (tuple(entry["shape"]), entry["dtype"])
        return out

    def small_tensor_bytes(self, name: str, limit: int = 64) -> bytes:
        """The raw bytes of a tiny tensor (a codebook marker), read at its offset without mapping the file."""
        file = self.tensor_files[name]
        data_start, header = self.headers[file]
        begin, end = header[name]["data_offsets"]
        if not 0 <= end - begin <= limit:
            raise Exl3FormatError(f"{name}: {end - begin} bytes, expected a small tensor (at most {limit})")
        with open(file, "rb") as f:
            f.seek(data_start + begin)
            data = f.read(end - begin)
        if len(data) != end - begin:
            raise Exl3FormatError(f"{name}: {file.name} ends inside its data")
        return data
