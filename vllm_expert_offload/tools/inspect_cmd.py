"""`inspect MODEL_DIR`: what an EXL3 checkpoint holds and what it costs in memory, from headers only.

Routed experts are summarized per layer rather than listed: a large MoE has tens of thousands of them, and
their per-expert size is what placement decisions (GPU vs host memory) are made of.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..exl3.checkpoint import DTYPE_BYTES, Exl3Checkpoint, split_name
from ..exl3.errors import Exl3FormatError
from ..exl3.naming import PROJECTIONS
from ..exl3.validate import CheckpointSummary, validate_checkpoint
from ..units import MIB


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("inspect", help="summarize an EXL3 checkpoint's quantized modules and experts")
    parser.add_argument("model_dir", type=Path, metavar="MODEL_DIR")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    print(inspect_checkpoint(args.model_dir))
    return 0


def nbytes(shapes: Mapping[str, tuple[tuple[int, ...], str]], name: str) -> int:
    shape, dtype = shapes[name]
    if dtype not in DTYPE_BYTES:
        raise Exl3FormatError(f"{name}: unknown safetensors dtype {dtype}")
    count = 1
    for dim in shape:
        count *= dim
    return count * DTYPE_BYTES[dtype]


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """Numbers right-aligned, text left-aligned, widths from the content."""
    cells = [list(map(str, headers))] + [list(map(str, row)) for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    numeric = [all(row[i][:1].isdigit() for row in cells[1:]) for i in range(len(headers))]
    return [
        "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric)).rstrip()
        for row in cells
    ]


def _size(nbytes: int) -> str:
    return f"{nbytes:,} B ({nbytes / MIB:.2f} MiB)"


def _joined(values: set) -> str:
    return ",".join(str(v) for v in sorted(values))


def _expert_rows(summary: CheckpointSummary, module_bytes: Mapping[str, int]) -> tuple[list[list[object]], set[str]]:
    """One row per MoE layer, and the expert module prefixes that the row stands for."""
    layout = summary.layout
    rows: list[list[object]] = []
    prefixes: set[str] = set()
    if layout is None:
        return rows, prefixes
    for layer in layout.moe_layers:
        per_expert, ks, codebooks = [], set(), set()
        for expert in range(layout.num_experts):
            names = [layout.expert_prefix(layer, expert, p) for p in PROJECTIONS]
            prefixes.update(names)
            per_expert.append(sum(module_bytes[n] for n in names))
            ks.update(summary.linears[n].k for n in names)
            codebooks.update(summary.linears[n].codebook.value for n in names)
        low, high = min(per_expert), max(per_expert)
        rows.append([layer, layout.num_experts, _joined(ks), _joined(codebooks),
                     f"{low:,}" if low == high else f"{low:,}-{high:,}", f"{sum(per_expert):,}"])
    return rows, prefixes


def _layout_lines(summary: CheckpointSummary, shapes, module_bytes: Mapping[str, int]) -> list[str]:
    """Which layers are EXL3 and which are served another way: the split a mixed pack declares."""
    contract = summary.contract
    if contract is None:
        return ["", "pack layout: exllamav3-native (every linear stored as EXL3 is served by the EXL3 methods)"]
    delegate = "none" if contract.non_routed_quantization is None else dict(contract.non_routed_quantization)
    lines = [
        "",
        "pack layout: mixed (routed experts EXL3, other weights in their source format)",
        f"  scope={contract.scope} non_routed_dtype_policy={contract.dtype_policy} non_routed_quantization={delegate}",
        f"  routed experts: EXL3 at K={contract.bits:g}"
        + "".join(f", layer {layer} K={k:g}" for layer, k in sorted(contract.layer_bits.items())),
        f"  non-routed linears: {contract.dense_method()}"
        + ("" if not contract.exl3_layers else f", except {len(contract.exl3_layers)} non_routed_exl3 modules"),
    ]
    if contract.mtp_experts == "source":
        lines.append(f"  draft experts from layer {contract.mtp_start_layer}: source format, delegated to vLLM "
                     f"{contract.delegate_method!r}")
    by_module: dict[str, list[str]] = {}
    for name in shapes:
        by_module.setdefault(split_name(name)[0], []).append(name)
    rows = []
    for prefix, method in sorted(summary.non_routed.items()):
        names = by_module.get(prefix, [])
        stored = ",".join(sorted({shapes[n][1] for n in names}))
        size = module_bytes.get(prefix) or sum(nbytes(shapes, n) for n in names)
        rows.append([prefix, method, stored, f"{size:,}"])
    return lines + ["", "non-routed linears (mixed pack: the method serving each)"] + _table(
        ["module", "served as", "stored", "bytes"], rows)


def inspect_checkpoint(model_dir: str | Path) -> str:
    """The report `inspect` prints; every size comes from the stored tensors (padding and scales included)."""
    ckpt = Exl3Checkpoint.open(model_dir)
    summary = validate_checkpoint(ckpt)
    shapes = ckpt.header_shapes()
    groups = ckpt.linear_tensor_names()
    module_bytes = {prefix: sum(nbytes(shapes, n) for n in names.values()) for prefix, names in groups.items()}
    quant = {k: v for k, v in ckpt.hf_config["quantization_config"].items() if k != "tensor_storage"}
    lines = [
        f"model: {ckpt.path}",
        f"architecture: {', '.join(ckpt.hf_config.get('architectures') or ['?'])}",
        "quantization_config: " + " ".join(f"{k}={v}" for k, v in quant.items()),
    ]
    expert_rows, expert_prefixes = _expert_rows(summary, module_bytes)
    module_rows = [
        [prefix, lin.k, lin.codebook.value, f"{lin.in_features}x{lin.out_features}", f"{module_bytes[prefix]:,}"]
        for prefix, lin in summary.linears.items() if prefix not in expert_prefixes
    ]
    lines += ["", "quantized modules (routed experts summarized below; in x out padded to 128)"]
    lines += _table(["module", "K", "codebook", "in x out", "bytes"], module_rows)
    if expert_rows:
        lines += ["", "routed experts (gate, up and down projections per expert)"]
        lines += _table(["layer", "experts", "K", "codebooks", "bytes/expert", "total bytes"], expert_rows)
    lines += _layout_lines(summary, shapes, module_bytes)
    quantized = sum(module_bytes.values())
    grouped = {name for names in groups.values() for name in names.values()}
    unquantized = sum(nbytes(shapes, name) for name in shapes if name not in grouped)
    lines += [
        "",
        f"quantized:   {_size(quantized)} in {len(groups)} modules",
        f"unquantized: {_size(unquantized)} in {len(shapes) - len(grouped)} tensors",
    ]
    return "\n".join(lines)
