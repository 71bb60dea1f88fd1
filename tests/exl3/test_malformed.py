"""Malformed tensor sets, checkpoints and quantization_config blocks are refused with the offending name.

Every refusal case starts from a valid tensor set (accepted by the positive controls below) and breaks one thing.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from vllm_expert_offload.exl3 import Codebook, Exl3FormatError, dequantize, parse_linear, parse_quant_config
from vllm_expert_offload.exl3.checkpoint import Exl3Checkpoint

from support import exl3_reference as ref

NAME = "model.layers.0.mlp.experts.3.down_proj"
IN, OUT, K = 256, 128, 2
MUL1 = ref.MUL1_MARKER_INT32
MCG = ref.MCG_MARKER_INT32


def valid_set(k: float = K, fin: int = IN, fout: int = OUT, seed: int = 0) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    return {
        "trellis": torch.from_numpy(ref.random_trellis(rng, fin // 16, fout // 16, k)),
        "suh": torch.from_numpy(rng.choice([-1.0, 1.0], fin).astype(np.float16)),
        "svh": torch.from_numpy(rng.choice([-1.0, 1.0], fout).astype(np.float16)),
        "mul1": torch.tensor(MUL1, dtype=torch.int32),
        "bias": torch.zeros(fout, dtype=torch.float16),
    }


def without(t: dict, *keys: str) -> dict:
    return {k: v for k, v in t.items() if k not in keys}


def with_(t: dict, **changes) -> dict:
    return {**t, **changes}


def trellis_of(fin: int, fout: int, width: int, dtype=torch.int16) -> torch.Tensor:
    return torch.zeros(fin // 16, fout // 16, width, dtype=dtype)


# ------------------------------------------------------------------ positive controls


def test_valid_set_is_accepted():
    layer = parse_linear(valid_set(), NAME, in_features=IN, out_features=OUT)
    assert layer.name == NAME and layer.k == 2 and layer.codebook is Codebook.MUL1
    assert (layer.in_features, layer.out_features) == (IN, OUT)


@pytest.mark.parametrize("marker, codebook", [(None, Codebook.INST3), ("mcg", Codebook.MCG), ("mul1", Codebook.MUL1)])
def test_each_codebook_marker_accepted(marker, codebook):
    t = without(valid_set(), "mul1")
    if marker:
        t[marker] = torch.tensor({"mcg": MCG, "mul1": MUL1}[marker], dtype=torch.int32)
    assert parse_linear(t, NAME).codebook is codebook


def test_declared_unpadded_features_accepted_and_bias_padded():
    t = with_(valid_set(), bias=torch.arange(120, dtype=torch.float32))
    layer = parse_linear(t, NAME, in_features=200, out_features=120)  # pad to 256 and 128
    assert layer.bias.dtype == torch.float16 and layer.bias.shape == (OUT,)
    assert layer.bias[:120].tolist() == list(range(120)) and not layer.bias[120:].any()


@pytest.mark.parametrize("k", [1, 8, 1.5, 3.5])
def test_other_rates_accepted(k):
    assert parse_linear(valid_set(k=k), NAME).k == k


# ------------------------------------------------------------------ tensor-set refusals

BASE = valid_set()

TENSOR_CASES = {
    "trellis width 50": (with_(BASE, trellis=trellis_of(IN, OUT, 50)), {}, f"{NAME}.trellis"),
    "trellis width 16*9": (with_(BASE, trellis=trellis_of(IN, OUT, 16 * 9)), {}, f"{NAME}.trellis"),
    "trellis width 16*0.5": (with_(BASE, trellis=trellis_of(IN, OUT, 8)), {}, f"{NAME}.trellis"),
    "missing suh": (without(BASE, "suh"), {}, f"{NAME}.suh"),
    "missing svh": (without(BASE, "svh"), {}, f"{NAME}.svh"),
    "missing trellis": (without(BASE, "trellis"), {}, f"{NAME}.trellis"),
    "mul1 holding mcg value": (with_(BASE, mul1=torch.tensor(MCG, dtype=torch.int32)), {}, f"{NAME}.mul1"),
    "mcg holding mul1 value": (
        with_(without(BASE, "mul1"), mcg=torch.tensor(MUL1, dtype=torch.int32)), {}, f"{NAME}.mcg"),
    "marker int64": (with_(BASE, mul1=torch.tensor(MUL1, dtype=torch.int64)), {}, f"{NAME}.mul1"),
    "marker float32": (with_(BASE, mul1=torch.tensor(float(MUL1), dtype=torch.float32)), {}, f"{NAME}.mul1"),
    "marker two values": (with_(BASE, mul1=torch.tensor([MUL1, MUL1], dtype=torch.int32)), {}, f"{NAME}.mul1"),
    "both markers": (with_(BASE, mcg=torch.tensor(MCG, dtype=torch.int32)), {}, NAME),
    "in_features 144": (
        with_(BASE, trellis=trellis_of(144, OUT, 32), suh=torch.ones(144, dtype=torch.float16)), {}, f"{NAME}.trellis"),
    "out_features 144": (
        with_(BASE, trellis=trellis_of(IN, 144, 32), svh=torch.ones(144, dtype=torch.float16),
              bias=torch.zeros(144, dtype=torch.float16)), {}, f"{NAME}.trellis"),
    "trellis int32": (with_(BASE, trellis=trellis_of(IN, OUT, 32, torch.int32)), {}, f"{NAME}.trellis"),
    "trellis uint8": (with_(BASE, trellis=trellis_of(IN, OUT, 64, torch.uint8)), {}, f"{NAME}.trellis"),
    "trellis 2-D": (with_(BASE, trellis=torch.zeros(IN // 16, 32, dtype=torch.int16)), {}, f"{NAME}.trellis"),
    "suh float32": (with_(BASE, suh=BASE["suh"].float()), {}, f"{NAME}.suh"),
    "suh length 255": (with_(BASE, suh=BASE["suh"][:255]), {}, f"{NAME}.suh"),
    "suh length of svh": (with_(BASE, suh=BASE["svh"]), {}, f"{NAME}.suh"),
    "svh bfloat16": (with_(BASE, svh=BASE["svh"].bfloat16()), {}, f"{NAME}.svh"),
    "svh 2-D": (with_(BASE, svh=BASE["svh"].reshape(1, OUT)), {}, f"{NAME}.svh"),
    "legacy su int32": (with_(without(BASE, "suh"), su=torch.zeros(IN // 16, dtype=torch.int32)), {}, f"{NAME}.su"),
    "legacy sv wrong length": (
        with_(without(BASE, "svh"), sv=torch.zeros(OUT // 16 + 1, dtype=torch.int16)), {}, f"{NAME}.sv"),
    "half K 3inst": (with_(without(BASE, "mul1"), trellis=trellis_of(IN, OUT, 40)), {}, f"{NAME}.trellis"),
    "half K mcg": (
        with_(without(BASE, "mul1"), trellis=trellis_of(IN, OUT, 24), mcg=torch.tensor(MCG, dtype=torch.int32)),
        {}, f"{NAME}.trellis"),
    "unexpected qweight": (with_(BASE, qweight=torch.zeros(4, dtype=torch.int32)), {}, f"{NAME}.qweight"),
    "obsolete scale": (with_(BASE, scale=torch.ones(1, dtype=torch.float16)), {}, f"{NAME}.scale"),
    "declared in 300 vs 256": (BASE, {"in_features": 300}, f"{NAME}.trellis"),
    "declared in 128 vs 256": (BASE, {"in_features": 128}, f"{NAME}.trellis"),
    "declared out 200 vs 128": (BASE, {"out_features": 200}, f"{NAME}.trellis"),
    "bias length 100": (with_(BASE, bias=torch.zeros(100, dtype=torch.float16)), {}, f"{NAME}.bias"),
    "bias length 129": (with_(BASE, bias=torch.zeros(129, dtype=torch.float16)), {}, f"{NAME}.bias"),
    "bias 120 vs declared out 128": (
        with_(BASE, bias=torch.zeros(120, dtype=torch.float16)), {"out_features": 128}, f"{NAME}.bias"),
    "bias int32": (with_(BASE, bias=torch.zeros(OUT, dtype=torch.int32)), {}, f"{NAME}.bias"),
}


@pytest.mark.parametrize("tensors, kwargs, expected", list(TENSOR_CASES.values()), ids=list(TENSOR_CASES))
def test_tensor_set_refused_with_name(tensors, kwargs, expected):
    with pytest.raises(Exl3FormatError) as info:
        parse_linear(tensors, NAME, **kwargs)
    assert expected in str(info.value), str(info.value)
    assert isinstance(info.value, ValueError)


def test_decode_entry_points_validate_too():
    """dequantize on a raw map runs the same checks (it must not decode a set it would refuse)."""
    with pytest.raises(Exl3FormatError):
        dequantize(with_(BASE, mul1=torch.tensor(MCG, dtype=torch.int32)))


# ------------------------------------------------------------------ checkpoints

VALID_QCONFIG = {
    "quant_method": "exl3",
    "version": "1.6.5",
    "bits": 3.02,
    "head_bits": 6,
    "calibration": {"rows": 250, "cols": 2048},
    "out_scales": "auto",
    "codebook": "mul1",
}
VALID_EXTRA = {"calibration": {"rows": 250, "cols": 2048}, "out_scales": "auto"}  # VALID_QCONFIG's informational keys
SHARD = "model-00001-of-00001.safetensors"


def write_checkpoint(path, qconfig=VALID_QCONFIG, tensors=None):
    config = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 128}
    if qconfig is not None:
        config["quantization_config"] = qconfig
    (path / "config.json").write_text(json.dumps(config))
    tensors = BASE if tensors is None else tensors
    flat = {f"{NAME}.{suffix}": t.contiguous() for suffix, t in tensors.items()}
    flat["model.layers.0.mlp.gate.weight"] = torch.ones(8, 128, dtype=torch.float16)
    save_file(flat, str(path / SHARD))
    return path / SHARD


def test_checkpoint_valid_roundtrip(tmp_path):
    write_checkpoint(tmp_path)
    ckpt = Exl3Checkpoint.open(tmp_path)
    assert ckpt.quant_config.codebook is Codebook.MUL1
    assert ckpt.quantized_prefixes() == [NAME]
    layer = ckpt.linear(NAME, in_features=IN, out_features=OUT)
    assert torch.equal(layer.trellis, BASE["trellis"])
    assert torch.equal(dequantize(layer), dequantize(BASE))


@pytest.mark.parametrize("keep", ["all but 200 bytes", "all but 1 byte", "30 bytes", "7 bytes"])
def test_truncated_safetensors_refused(tmp_path, keep):
    shard = write_checkpoint(tmp_path)
    data = shard.read_bytes()
    cut = {"all but 200 bytes": len(data) - 200, "all but 1 byte": len(data) - 1, "30 bytes": 30, "7 bytes": 7}[keep]
    shard.write_bytes(data[:cut])
    with pytest.raises(Exl3FormatError) as info:
        Exl3Checkpoint.open(tmp_path)  # refused from the header and the file size, before any tensor is read
    assert SHARD in str(info.value), str(info.value)


def rewrite_header(shard, change, tail: bytes = b"") -> None:
    """Re-serialize the shard's header after `change(header)` (same data region, plus `tail`)."""
    data = shard.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    change(header)
    blob = json.dumps(header).encode()
    shard.write_bytes(len(blob).to_bytes(8, "little") + blob + data[8 + length:] + tail)


def _offsets(name: str, delta_begin: int, delta_end: int):
    def change(header):
        begin, end = header[name]["data_offsets"]
        header[name]["data_offsets"] = [begin + delta_begin, end + delta_end]
    return change


def _last(header) -> str:
    return max((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][1])


@pytest.mark.parametrize("case, expect", [
    ("trailing bytes", "bytes after the last tensor"),
    ("span shorter than the shape", "needs"),
    ("gap before a tensor", "expected"),
    ("unknown dtype", "unknown safetensors dtype"),
    ("offsets reversed", "begin <= end"),
    ("negative dimension", "non-negative"),
    ("entry without data_offsets", "malformed"),
])
def test_bad_safetensors_layout_refused_by_file_and_tensor(tmp_path, case, expect):
    shard = write_checkpoint(tmp_path)
    trellis = f"{NAME}.trellis"
    changes = {
        "trailing bytes": (lambda h: None, b"\0" * 16),
        "span shorter than the shape": (_offsets(trellis, 0, -2), b""),
        "gap before a tensor": (lambda h: _offsets(_last(h), 2, 2)(h), b""),
        "unknown dtype": (lambda h: h[trellis].update(dtype="Q4"), b""),
        "offsets reversed": (lambda h: h[trellis].update(data_offsets=h[trellis]["data_offsets"][::-1]), b""),
        "negative dimension": (lambda h: h[trellis].update(shape=[-1] + h[trellis]["shape"][1:]), b""),
        "entry without data_offsets": (lambda h: h[trellis].pop("data_offsets"), b""),
    }
    change, tail = changes[case]
    rewrite_header(shard, change, tail)
    with pytest.raises(Exl3FormatError) as info:
        Exl3Checkpoint.open(tmp_path)
    message = str(info.value)
    assert SHARD in message and expect in message, message
    if case not in ("trailing bytes", "gap before a tensor"):
        assert trellis in message, message


def test_rewritten_header_without_change_is_accepted(tmp_path):
    """Positive control for the layout cases: re-serializing the header alone keeps the shard valid."""
    rewrite_header(write_checkpoint(tmp_path), lambda h: None)
    assert Exl3Checkpoint.open(tmp_path).quantized_prefixes() == [NAME]


def test_checkpoint_without_quantization_config(tmp_path):
    write_checkpoint(tmp_path, qconfig=None)
    with pytest.raises(Exl3FormatError) as info:
        Exl3Checkpoint.open(tmp_path)
    assert "config.json" in str(info.value) and "quantization_config" in str(info.value)


def test_checkpoint_with_bad_quantization_config(tmp_path):
    write_checkpoint(tmp_path, qconfig={**VALID_QCONFIG, "codebook": "e8p"})
    with pytest.raises(Exl3FormatError, match="codebook"):
        Exl3Checkpoint.open(tmp_path)


def test_checkpoint_missing_tensor_and_broken_set(tmp_path):
    write_checkpoint(tmp_path, tensors=without(BASE, "svh"))
    ckpt = Exl3Checkpoint.open(tmp_path)
    with pytest.raises(Exl3FormatError) as info:
        ckpt.linear(NAME)
    assert f"{NAME}.svh" in str(info.value)
    with pytest.raises(Exl3FormatError) as info:
        ckpt.tensor(f"{NAME}.svh")
    assert f"{NAME}.svh" in str(info.value)


# ------------------------------------------------------------------ quantization_config


def test_valid_exllamav3_config_accepted():
    cfg = parse_quant_config(VALID_QCONFIG)
    assert cfg.bits == 3.02 and cfg.head_bits == 6 and cfg.codebook is Codebook.MUL1
    assert cfg.version == "1.6.5" and cfg.lm_head_quantized is True
    assert cfg.extra["calibration"] == {"rows": 250, "cols": 2048}


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"head_bits": 16}, {"head_bits": 16, "lm_head_quantized": False}),
        ({"head_bits": 2.5}, {"head_bits": 2.5, "lm_head_quantized": True}),
        ({"codebook": "mcg", "head_bits": 8}, {"codebook": Codebook.MCG, "head_bits": 8}),
        ({"codebook": "3inst"}, {"codebook": Codebook.INST3}),
        ({"codebook": "MUL1"}, {"codebook": Codebook.MUL1}),
        ({"out_scales": "never"}, {"extra": {**VALID_EXTRA, "out_scales": "never"}}),
        (
            {"vision_bits": 4, "mtp_bits": 6, "original_quantization_config": {"quant_method": "fp8"}},
            {"extra": {**VALID_EXTRA, "vision_bits": 4, "mtp_bits": 6,
                       "original_quantization_config": {"quant_method": "fp8"}}},
        ),
        ({"bits": 1}, {"bits": 1.0}),
        ({"bits": 8}, {"bits": 8.0}),
    ],
)
def test_valid_config_variants_accepted(changes, expected):
    """Each variant is read as written, and every key the variant does not touch keeps its valid value."""
    cfg = parse_quant_config({**VALID_QCONFIG, **changes})
    unchanged = {"bits": 3.02, "head_bits": 6, "codebook": Codebook.MUL1, "version": "1.6.5", "extra": VALID_EXTRA}
    for attr, value in {**unchanged, **expected}.items():
        assert getattr(cfg, attr) == value, attr


def test_minimal_config_accepted():
    cfg = parse_quant_config({"quant_method": "exl3", "bits": 4})
    assert cfg.bits == 4 and cfg.head_bits is None and cfg.codebook is None


QCONFIG_CASES = {
    "quant_method gptq": ({"quant_method": "gptq"}, "quant_method"),
    "quant_method missing": ({"quant_method": None}, "quant_method"),
    "unknown key": ({"group_size": 128}, "group_size"),
    "bits 9": ({"bits": 9}, "bits"),
    "bits 0.5": ({"bits": 0.5}, "bits"),
    "bits negative": ({"bits": -3}, "bits"),
    "bits nan": ({"bits": float("nan")}, "bits"),
    "bits string": ({"bits": "3.0"}, "bits"),
    "bits bool": ({"bits": True}, "bits"),
    "bits missing": ({"bits": None}, "bits"),
    "codebook e8p": ({"codebook": "e8p"}, "codebook"),
    "head_bits 9": ({"head_bits": 9}, "head_bits"),
    "head_bits 2.25": ({"head_bits": 2.25}, "head_bits"),
    "head_bits string": ({"head_bits": "6"}, "head_bits"),
    "half head_bits with mcg": ({"head_bits": 2.5, "codebook": "mcg"}, "head_bits"),
    "half head_bits with 3inst": ({"head_bits": 1.5, "codebook": "3inst"}, "head_bits"),
    "out_scales sometimes": ({"out_scales": "sometimes"}, "out_scales"),
    "out_scales bool": ({"out_scales": True}, "out_scales"),
}


@pytest.mark.parametrize("changes, key", list(QCONFIG_CASES.values()), ids=list(QCONFIG_CASES))
def test_quant_config_refused_with_key(changes, key):
    config = {**VALID_QCONFIG, **changes}
    config = {k: v for k, v in config.items() if v is not None}
    with pytest.raises(Exl3FormatError) as info:
        parse_quant_config(config)
    assert key in str(info.value), str(info.value)
