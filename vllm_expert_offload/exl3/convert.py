"""Hugging Face MoE checkpoint -> EXL3 checkpoint laid out as exllamav3 writes one, and EXL3 -> dense "twin".

The forward direction makes test fixtures and small real conversions without exllamav3 or a GPU. The backward
direction decodes every EXL3 linear into a plain HF checkpoint: HF transformers and stock vLLM run that twin,
so it is the reference for the plugin's output and the baseline for its benchmarks. It is decoded with this
package's own `dequantize`, so on its own it is not independent of the decoder the plugin serves with: the test
suite checks every twin linear against the exact-arithmetic decoder in tests/support/exl3_reference.py
(tests/support/reference_twin.py) before using it as a reference.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from . import deepseek_v4 as dsv4
from .bitrate import HALF_K, INTEGER_K, check_k_codebook
from .checkpoint import Exl3Checkpoint, split_name
from .codebook import Codebook, codebook_table
from .config import UNQUANTIZED_HEAD_BITS, quant_config_dict
from .contract import BF16_AS_STORED
from .decode import dequantize
from .errors import Exl3FormatError
from .naming import HEAD, HEADS, LINEAR_LEAVES, SUPPORTED_ARCHITECTURES, moe_layout
from .tensors import Exl3Linear, padded

# Our tensors follow exllamav3 1.6.5's layout bit for bit, so that is the format version we record.
EXL3_FORMAT_VERSION = "1.6.5"
DEFAULT_HEAD_BITS = 6  # exllamav3's default
WEIGHTS_FILE = "model.safetensors"
EMBEDDING = "model.embed_tokens"
# Unquantized tensors are stored as fp16, except these: DeepSeek's routing bias must keep its resolution
# (exllamav3 loads it in checkpoint precision; fp16 steps would swamp the gaps between expert scores).
# DeepSeek-V4's routing bias (`gate.bias`), attention sinks, compressor position biases (`ape`) and the
# hyper-connection mixers (`hc_*`, fp32 in its release) likewise.
FULL_PRECISION_SUFFIXES = ("e_score_correction_bias", "gate.bias", "attn_sink", ".ape")
FULL_PRECISION_NAMES = re.compile(r"(^|\.)hc_")
# Files a model directory needs besides weights and config.json.
SIDE_FILES = (
    "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt", "*.tiktoken",
    "chat_template*", "generation_config.json",
)
ENCODERS = ("viterbi", "random")
MIXED_SCOPE = "routed_experts"  # `scope` a mixed pack written here records (informational)


def _head_bits(hf_config: Mapping[str, Any], head_bits: float | None) -> float:
    if head_bits is not None:
        return head_bits
    recorded = (hf_config.get("quantization_config") or {}).get("head_bits")
    return DEFAULT_HEAD_BITS if recorded is None else recorded


def is_quantized_linear(name: str, hf_config: Mapping[str, Any], head_bits: float | None = None) -> bool:
    """Whether checkpoint tensor `name` is the weight of a linear that EXL3 stores as a trellis set.

    Routers, embeddings, norms and biases are not. lm_head is unless head_bits is 16; head_bits defaults to
    the config's quantization_config (an EXL3 checkpoint), else exllamav3's default 6 (a source checkpoint).
    """
    prefix, suffix = split_name(name)
    if suffix != "weight":
        return False
    if prefix in HEADS:
        return _head_bits(hf_config, head_bits) != UNQUANTIZED_HEAD_BITS
    if dsv4.is_deepseek_v4(hf_config):
        return dsv4.is_exl3_linear(prefix)
    return prefix.rpartition(".")[2] in LINEAR_LEAVES


def _mlp_width(prefix: str, hf_config: Mapping[str, Any]) -> int:
    if ".shared_experts." not in prefix and ".experts." not in prefix:
        return int(hf_config["intermediate_size"])
    layout = moe_layout(hf_config)
    if layout is None:
        raise Exl3FormatError(f"{prefix}: an expert, but config.json's architectures have no known MoE layout")
    return layout.shared_intermediate_size if ".shared_experts." in prefix else layout.intermediate_size


def _attention_shapes(hf_config: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    c = hf_config
    hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
    if c.get("kv_lora_rank"):  # MLA; its config's head_dim, if any, is the rope dim and not used here
        nope, rope, v = int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"]), int(c["v_head_dim"])
        kv_rank, q_rank = int(c["kv_lora_rank"]), c.get("q_lora_rank")
        shapes = {
            "q_proj": (heads * (nope + rope), hidden),
            "kv_a_proj_with_mqa": (kv_rank + rope, hidden),
            "kv_b_proj": (heads * (nope + v), kv_rank),
            "o_proj": (hidden, heads * v),
        }
        if q_rank:
            shapes |= {"q_a_proj": (int(q_rank), hidden), "q_b_proj": (heads * (nope + rope), int(q_rank))}
        return shapes
    head_dim = int(c.get("head_dim") or hidden // heads)
    kv_heads = int(c.get("num_key_value_heads") or heads)
    return {
        "q_proj": (heads * head_dim, hidden),
        "k_proj": (kv_heads * head_dim, hidden),
        "v_proj": (kv_heads * head_dim, hidden),
        "o_proj": (hidden, heads * head_dim),
    }


def linear_shape(prefix: str, hf_config: Mapping[str, Any]) -> tuple[int, int]:
    """(out_features, in_features) of linear `prefix` as the model declares it (unpadded), from config.json.

    The EXL3 tensors only record the padded shape; this is what crops them back.
    """
    if dsv4.is_deepseek_v4(hf_config):
        return dsv4.linear_shape(prefix, hf_config)
    hidden = int(hf_config["hidden_size"])
    if prefix == HEAD:
        return int(hf_config["vocab_size"]), hidden
    leaf = prefix.rpartition(".")[2]
    if leaf in ("gate_proj", "up_proj", "w1", "w3"):
        return _mlp_width(prefix, hf_config), hidden
    if leaf in ("down_proj", "w2"):
        return hidden, _mlp_width(prefix, hf_config)
    shapes = _attention_shapes(hf_config)
    if leaf not in shapes:
        raise Exl3FormatError(f"{prefix}: no known shape for a '{leaf}' linear in this model's config.json")
    return shapes[leaf]


def tensor_seed(name: str, seed: int) -> int:
    """A per-tensor seed, stable across processes and Python versions (unlike hash())."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2**63 - 1)


def encode_random(
    weight: torch.Tensor, k: float, codebook: Codebook = Codebook.MUL1, *, name: str = "linear",
    bias: torch.Tensor | None = None, seed: int = 0,
) -> Exl3Linear:
    """A random trellis (any bit pattern is a valid tile) with random-sign scales sized so the dequantized weight
    has the source weight's RMS: valid tensors at no encoding cost, for plumbing tests and fixtures."""
    out_features, in_features = weight.shape
    k_pad, n_pad = padded(in_features), padded(out_features)
    gen = torch.Generator().manual_seed(tensor_seed(name, seed))
    shape = (k_pad // 16, n_pad // 16, round(16 * k))
    trellis = torch.randint(-(2**15), 2**15, shape, generator=gen, dtype=torch.int16)
    # The Hadamards are orthonormal, so RMS(W) = |suh| * |svh| * RMS(codebook); split the factor evenly.
    side = (weight.float().pow(2).mean().sqrt() / codebook_table(codebook).float().pow(2).mean().sqrt()).sqrt()
    suh, svh = ((torch.randint(0, 2, (size,), generator=gen) * 2 - 1) * side for size in (k_pad, n_pad))
    if bias is not None:
        bias = torch.nn.functional.pad(bias.reshape(-1).half(), (0, n_pad - bias.numel()))
    return Exl3Linear(name=name, trellis=trellis, suh=suh.half(), svh=svh.half(), codebook=codebook, k=k, bias=bias)


def _encode_viterbi(
    weight: torch.Tensor, k: float, codebook: Codebook, *, name: str, bias: torch.Tensor | None, seed: int,
    show_progress: bool,
) -> Exl3Linear:
    from .encode import encode_linear

    out_features, in_features = weight.shape
    tiles = padded(in_features) * padded(out_features) // 256
    with tqdm(total=tiles, desc=f"  {name}", unit="tile", leave=False, disable=None if show_progress else True) as bar:
        return encode_linear(
            weight, k, codebook, name=name, bias=bias, seed=tensor_seed(name, seed),
            progress=lambda done: bar.update(done - bar.n),
        )


def _checked_bits(bits: float, codebook: Codebook, flag: str) -> float:
    if bits not in INTEGER_K and bits not in HALF_K:
        raise Exl3FormatError(f"{flag}: {bits:g} bits per weight; EXL3 encodes 1..8 or 1.5/2.5/3.5")
    check_k_codebook(bits, codebook, flag)
    return int(bits) if bits in INTEGER_K else bits


def _read_config(model_dir: Path) -> dict[str, Any]:
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise Exl3FormatError(f"{config_file}: not found")
    return json.loads(config_file.read_text())


class _SourceTensors:
    """Name -> tensor over every *.safetensors file of a directory, read one tensor at a time; `rows` views
    (output name -> (source name, first row, end row)) read part of a source tensor under another name."""

    def __init__(self, model_dir: Path) -> None:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise Exl3FormatError(f"{model_dir}: no .safetensors files")
        self.files: dict[str, Path] = {}
        for file in files:
            try:
                with safe_open(file, framework="pt") as f:
                    self.files.update(dict.fromkeys(f.keys(), file))
            except Exception as exc:  # safetensors raises its own error types for truncated/corrupt headers
                raise Exl3FormatError(f"{file}: cannot read safetensors header ({exc})") from exc

        self.rows: dict[str, tuple[str, int, int]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files or name in self.rows

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.rows:
            source, start, end = self.rows[name]
            return self[source][start:end]
        try:
            with safe_open(self.files[name], framework="pt") as f:
                return f.get_tensor(name)
        except Exception as exc:
            raise Exl3FormatError(f"{name}: cannot be read from {self.files[name].name} ({exc})") from exc


def _unquantized(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if not tensor.is_floating_point():
        return tensor.contiguous()
    full = name.endswith(FULL_PRECISION_SUFFIXES) or FULL_PRECISION_NAMES.search(name) is not None
    return tensor.to(torch.float32 if full else dtype).contiguous()


def _dsv4_output_names(source: _SourceTensors, hf_config: Mapping[str, Any], split_wo_a: bool) -> dict[str, str]:
    """exllamav3's DeepSeek-V4 names for a native or transformers-saved checkpoint; with `split_wo_a` (it is
    quantized) each `wo_a` becomes its o_groups row slices `wo_a.slice.{g}` (views registered on `source`)."""
    names = {dsv4.source_name(name): name for name in source.files}
    if not split_wo_a:
        return names
    groups, rows = dsv4.wo_a_slices(hf_config)
    for name in [n for n in names if n.endswith(".attn.wo_a.weight")]:
        original = names.pop(name)
        attn = name.removesuffix(".wo_a.weight")
        for g in range(groups):
            view = f"{attn}.wo_a.slice.{g}.weight"
            source.rows[view] = (original, g * rows, (g + 1) * rows)
            names[view] = view
    return names


def _output_names(source: _SourceTensors, hf_config: Mapping[str, Any], routed_only: bool) -> dict[str, str]:
    """Output tensor name -> source tensor name; exllamav3 always writes an lm_head, a tied one from the embedding."""
    if dsv4.is_deepseek_v4(hf_config):
        names = _dsv4_output_names(source, hf_config, split_wo_a=not routed_only)
        head, embedding = f"{dsv4.HEAD}.weight", f"{dsv4.EMBEDDING}.weight"
    else:
        names = {name: name for name in source.files}
        head, embedding = f"{HEAD}.weight", f"{EMBEDDING}.weight"
    if head not in names and embedding in names:
        names[head] = names[embedding]
    return names


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _storage_entry(tensors: Mapping[str, torch.Tensor], layer: Exl3Linear | None) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "stored_tensors": {n: {"dtype": _dtype_name(t.dtype), "shape": list(t.shape)} for n, t in tensors.items()}
    }
    if layer is not None:
        entry |= {"quant_format": "exl3", "bits_per_weight": layer.k}
        if layer.codebook.marker_value is not None:
            entry[f"{layer.codebook.value}_multiplier"] = layer.codebook.marker_value & 0xFFFFFFFF
    return entry


def _tensor_storage(out: Mapping[str, torch.Tensor], layers: Mapping[str, Exl3Linear]) -> dict[str, Any]:
    """quantization_config.json's tensor_storage: module -> its stored tensors (informational, as exllamav3)."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in out.items():
        modules.setdefault(split_name(name)[0], {})[name] = tensor
    return {prefix: _storage_entry(tensors, layers.get(prefix)) for prefix, tensors in modules.items()}


def _copy_side_files(src: Path, dst: Path) -> None:
    for pattern in SIDE_FILES:
        for file in src.glob(pattern):
            if file.is_file():
                shutil.copy2(file, dst / file.name)


def _check_output(dst: Path, src: Path) -> None:
    """Refuse before any work; the directory itself is created only once there is something to write."""
    if dst.resolve() == src.resolve():
        raise Exl3FormatError(f"{dst}: output directory is the source directory")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise Exl3FormatError(f"{dst}: output directory is not empty")


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def convert_checkpoint(
    src: str | Path,
    dst: str | Path,
    *,
    bits: float,
    head_bits: float = DEFAULT_HEAD_BITS,
    codebook: Codebook = Codebook.MUL1,
    encoder: str = "viterbi",
    seed: int = 0,
    progress: bool = True,
    routed_only: bool = False,
    layer_bits: Mapping[int, float] | None = None,
) -> Path:
    """Write an EXL3 checkpoint of the HF checkpoint in `src` to `dst` (a single model.safetensors).

    Every tensor present in `src` is converted or copied, so a partial checkpoint gives a partial result;
    completeness is the loader's check. The recorded `bits` is the trellis bits per stored (padded) weight over
    the non-head linears.

    `routed_only` writes a mixed pack (exl3/contract.py) instead: only routed experts in EXL3, at `bits` or
    their layer's `layer_bits`, every other tensor exactly as stored, declared `bf16_as_stored`.
    """
    src, dst = Path(src), Path(dst)
    if encoder not in ENCODERS:
        raise Exl3FormatError(f"--encoder: {encoder!r}, expected one of {list(ENCODERS)}")
    bits = _checked_bits(bits, codebook, "--bits")
    if layer_bits and not routed_only:
        raise Exl3FormatError("--layer-bits: per-layer routed K is part of the mixed-pack contract (routed_only)")
    layer_bits = {
        int(layer): _checked_bits(k, codebook, f"--layer-bits {layer}") for layer, k in (layer_bits or {}).items()
    }
    if routed_only:
        head_bits = UNQUANTIZED_HEAD_BITS
    if head_bits != UNQUANTIZED_HEAD_BITS:
        head_bits = _checked_bits(head_bits, codebook, "--head-bits")
    hf_config = _read_config(src)
    layout = moe_layout(hf_config)
    if layout is None:  # other architectures may name their linears differently: refuse them
        raise Exl3FormatError(
            f"{src / 'config.json'}: architectures {hf_config.get('architectures')} are not supported; "
            f"expected one of {list(SUPPORTED_ARCHITECTURES)}"
        )
    if layout.architecture == dsv4.V41_ARCHITECTURE:  # validated and served, but not written here
        raise Exl3FormatError(f"{src / 'config.json'}: architectures {layout.architecture}: quantize writes "
                              f"exllamav3 layouts only; {dsv4.V41_WHY}")
    source = _SourceTensors(src)
    _check_output(dst, src)

    encode = partial(_encode_viterbi, show_progress=progress) if encoder == "viterbi" else encode_random
    names = _output_names(source, hf_config, routed_only)
    targets = [name for name in names if is_quantized_linear(name, hf_config, head_bits)]
    if routed_only:
        targets = [name for name in targets if layout.expert_layer(split_name(name)[0]) is not None]
    consumed = set(targets) | {f"{split_name(name)[0]}.bias" for name in targets}
    out: dict[str, torch.Tensor] = {}
    layers: dict[str, Exl3Linear] = {}
    for name in tqdm(targets, desc="quantize", unit="linear", disable=None if progress else True):
        prefix = split_name(name)[0]
        weight = source[names[name]]
        expected = linear_shape(prefix, hf_config)
        if tuple(weight.shape) != expected:
            raise Exl3FormatError(f"{names[name]}: shape {tuple(weight.shape)}, but config.json implies {expected}")
        bias_name = f"{prefix}.bias"
        expert_layer = layout.expert_layer(prefix)
        k = head_bits if prefix in HEADS else layer_bits.get(expert_layer, bits)
        layer = encode(
            weight, k, codebook, name=prefix,
            bias=source[bias_name] if bias_name in source else None, seed=seed,
        )
        layers[prefix] = layer
        out |= {f"{prefix}.{suffix}": t.contiguous() for suffix, t in layer.tensors().items()}
    for name, source_name in names.items():
        if name not in consumed:
            tensor = source[source_name]
            out[name] = tensor.contiguous() if routed_only else _unquantized(name, tensor, torch.float16)
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, dst / WEIGHTS_FILE, metadata={"format": "pt"})

    body = [layer for prefix, layer in layers.items() if prefix not in HEADS]
    stored = sum(layer.in_features * layer.out_features for layer in body)
    average = sum(layer.k * layer.in_features * layer.out_features for layer in body) / stored if stored else bits
    quant = quant_config_dict(bits if routed_only else average, head_bits, codebook, EXL3_FORMAT_VERSION)
    if routed_only:
        quant |= {"layer_bits": {str(layer): k for layer, k in sorted(layer_bits.items())},
                  "non_routed_dtype_policy": BF16_AS_STORED, "scope": MIXED_SCOPE}
    if "quantization_config" in hf_config:
        quant["original_quantization_config"] = hf_config["quantization_config"]
    _write_json(dst / "config.json", {**hf_config, "quantization_config": quant, "tie_word_embeddings": False})
    _write_json(dst / "quantization_config.json", {**quant, "tensor_storage": _tensor_storage(out, layers)})
    _copy_side_files(src, dst)
    return dst


BLOCK_FP8_SCALE = "weight_scale_inv"  # DeepSeek's name for the per-block dequantization multiplier


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """W = q * scale per [rows/scale_rows, cols/scale_cols] block (DeepSeek block FP8; edge blocks may be short)."""
    out_f, in_f = weight.shape
    block_r, block_c = -(-out_f // scale_inv.shape[0]), -(-in_f // scale_inv.shape[1])
    scale = scale_inv.float().repeat_interleave(block_r, 0)[:out_f].repeat_interleave(block_c, 1)[:, :in_f]
    return weight.float() * scale


def _join_plain_weights(out: dict[str, torch.Tensor], hf_config: Mapping[str, Any]) -> None:
    """Decoded sets back into the tensors the model declares (DeepSeek-V4's `wo_a.slice.{g}` -> `wo_a.weight`),
    joined as the loader joins them (deepseek_v4.plain_weights)."""
    for dense, parts in dsv4.plain_weights([split_name(n)[0] for n in out if n.endswith(".weight")], hf_config).items():
        if parts != [split_name(dense)[0]]:
            out[dense] = torch.cat([out.pop(f"{p}.weight") for p in parts]).contiguous()


def write_dense_twin(exl3_dir: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Dequantize every EXL3 linear (and a mixed pack's block-FP8 linears) of `exl3_dir` into a plain HF checkpoint
    in `out_dir`, cropped to the model's true shapes, in `dtype` (the routing bias stays fp32). float32 keeps the
    decoded weights exact."""
    exl3_dir, out_dir = Path(exl3_dir), Path(out_dir)
    ckpt = Exl3Checkpoint.open(exl3_dir)
    _check_output(out_dir, exl3_dir)
    groups = ckpt.linear_tensor_names()
    out: dict[str, torch.Tensor] = {}
    for prefix in tqdm(groups, desc="dequantize", unit="linear", disable=None):
        out_features, in_features = linear_shape(prefix, ckpt.hf_config)
        layer = ckpt.linear(prefix, in_features, out_features)
        out[f"{prefix}.weight"] = dequantize(layer)[:out_features, :in_features].to(dtype).contiguous()
        if layer.bias is not None:
            out[f"{prefix}.bias"] = layer.bias[:out_features].to(dtype).contiguous()
    _join_plain_weights(out, ckpt.hf_config)
    grouped = {name for names in groups.values() for name in names.values()}
    for name in ckpt.tensor_files:
        prefix, suffix = split_name(name)
        scale = f"{prefix}.{BLOCK_FP8_SCALE}"
        if suffix == "weight" and scale in ckpt.tensor_files:
            out[name] = dequantize_block_fp8(ckpt.tensor(name), ckpt.tensor(scale)).to(dtype).contiguous()
        elif name not in grouped and suffix != BLOCK_FP8_SCALE:
            out[name] = _unquantized(name, ckpt.tensor(name), dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(out, out_dir / WEIGHTS_FILE, metadata={"format": "pt"})
    config = {k: v for k, v in ckpt.hf_config.items() if k != "quantization_config"}
    config["dtype"] = _dtype_name(dtype)
    if "torch_dtype" in config:
        config["torch_dtype"] = _dtype_name(dtype)
    _write_json(out_dir / "config.json", config)
    _copy_side_files(exl3_dir, out_dir)
    return out_dir
