"""Header-only copies of published packs at full size: every tensor name, dtype and shape of the real pack, data
regions sparse, so a 309 GiB pack costs its headers on disk and validation, `inspect` and `plan` run on the real
tensor list (~190k tensors) without downloading it.

    python -m vllm_expert_offload.testing.full_size_packs dsv41-flash OUT

Files are safetensors shards (a header, then a data region made by seeking: the file system allocates nothing for
it) with a `model.safetensors.index.json`, as published. The only bytes written are the headers and the EXL3
codebook markers (4 bytes each; validation reads them). Reading any other tensor returns zeros.

Packs: `dsv41-flash` is the seeds' deployment (DeepSeek-V4.1-Flash, routed experts EXL3 K=3, engram tables
MXINT-4; 309.3 GiB as served); `dsv41-flash-2bpw` the published 2-bit pack
(diffbot/DeepSeek-V4.1-Flash-EXL3-2.0bpw-2x-RTX-PRO-6000: K=2, engram tables as released in FP8).
"""

from __future__ import annotations

import argparse
import json
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..exl3.checkpoint import DTYPE_BYTES
from ..exl3.codebook import Codebook
from ..exl3.engram import EngramFormat
from ..units import GIB
from .dsv41_pack import V41_FLASH_TEXT, V41_FLASH_VISION, TensorSpec, pack_config, pack_tensors, published_contract

SHARD_BYTES = 5 * 10**9  # the published packs' shard size order; any size gives the same tensors
MARKERS = {"mcg": Codebook.MCG, "mul1": Codebook.MUL1}


def _dsv41(bits: int, engram: EngramFormat) -> Callable[[], tuple[dict[str, Any], list[TensorSpec]]]:
    def build() -> tuple[dict[str, Any], list[TensorSpec]]:
        config = pack_config(V41_FLASH_TEXT, V41_FLASH_VISION, published_contract(bits))
        return config, pack_tensors(config, engram)

    return build


PACKS = {
    "dsv41-flash": _dsv41(3, EngramFormat.MXINT4),
    "dsv41-flash-2bpw": _dsv41(2, EngramFormat.FP8),
}


def nbytes(spec: TensorSpec) -> int:
    count = 1
    for dim in spec.shape:
        count *= dim
    return count * DTYPE_BYTES[spec.dtype]


def _shards(specs: Sequence[TensorSpec], shard_bytes: int) -> list[list[TensorSpec]]:
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + nbytes(spec) > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes(spec)
    return shards


def _write_shard(path: Path, specs: Sequence[TensorSpec]) -> int:
    """One safetensors file: markers first in the data region (the only data written), then the rest sparse."""
    ordered = sorted(specs, key=lambda s: s.name.rpartition(".")[2] not in MARKERS)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in ordered:
        size = nbytes(spec)
        header[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for spec in ordered:
            suffix = spec.name.rpartition(".")[2]
            if suffix not in MARKERS:
                break
            f.write(struct.pack("<i", MARKERS[suffix].marker_value))
        f.truncate(8 + len(blob) + offset)
    return offset


def write_pack(name: str, out: Path, shard_bytes: int = SHARD_BYTES) -> dict[str, int]:
    """Write pack `name` (PACKS) under `out`; returns its tensor count, data bytes and shard count."""
    config, specs = PACKS[name]()
    out.mkdir(parents=True, exist_ok=True)
    shards = _shards(specs, shard_bytes)
    weight_map, total = {}, 0
    for index, shard in enumerate(shards, 1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        total += _write_shard(out / file, shard)
        weight_map |= {spec.name: file for spec in shard}
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return {"tensors": len(specs), "bytes": total, "shards": len(shards)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pack", choices=sorted(PACKS))
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    stats = write_pack(args.pack, args.out)
    print(f"wrote {args.out}: {stats['tensors']:,} tensors in {stats['shards']} shards, "
          f"{stats['bytes']:,} bytes ({stats['bytes'] / GIB:.1f} GiB, sparse)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
