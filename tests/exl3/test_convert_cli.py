"""HF -> EXL3 conversion, the dense twin, the tiny fixtures and the `quantize` / `inspect` commands.

Expected tensor names and sizes are written out here from the architectures' published layouts (exl3-format.md
§1.3-1.5), not taken from the converter, so a naming or classification slip in convert.py fails a test.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from vllm_expert_offload.cli import main
from vllm_expert_offload.exl3 import Codebook, parse_linear, parse_quant_config
from vllm_expert_offload.exl3.checkpoint import Exl3Checkpoint
from vllm_expert_offload.exl3.convert import convert_checkpoint, encode_random
from vllm_expert_offload.exl3.validate import validate_checkpoint
from vllm_expert_offload.testing import ARCHITECTURES, ENCODE_CODE, build_dense_twin, build_tiny_model, cached_fixture

from support.reference_twin import check_twin, reference_weight
from support.tiny_names import EXL3_SUFFIXES, EXPERTS, HEAD_BITS, ITEMSIZE, LAYERS, MLP, K, expected_names


def headers(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    with safe_open(path / "model.safetensors", framework="pt") as f:
        return {n: (tuple(f.get_slice(n).get_shape()), f.get_slice(n).get_dtype()) for n in f.keys()}


def stored_bytes(shapes: dict, prefix: str) -> int:
    return sum(math.prod(shapes[f"{prefix}.{s}"][0]) * ITEMSIZE[shapes[f"{prefix}.{s}"][1]] for s in EXL3_SUFFIXES)


@pytest.fixture(scope="module", params=ARCHITECTURES)
def tiny(request) -> tuple[str, Path]:
    return request.param, build_tiny_model(None, request.param, k=K, head_bits=HEAD_BITS)


def test_tiny_checkpoint_has_exactly_the_exllamav3_tensor_set(tiny):
    arch, path = tiny
    linears, plain = expected_names(arch)
    shapes = headers(path)
    assert set(shapes) == {f"{p}.{s}" for p in linears for s in EXL3_SUFFIXES} | plain
    for prefix in linears:
        width = 16 * (HEAD_BITS if prefix == "lm_head" else K)
        assert shapes[f"{prefix}.trellis"][1] == "I16" and shapes[f"{prefix}.trellis"][0][-1] == width, prefix
        assert shapes[f"{prefix}.mul1"] == ((), "I32")
    for name in plain:
        assert shapes[name][1] == ("F32" if name.endswith("e_score_correction_bias") else "F16"), name
    routers = [n for n in plain if n.endswith("gate.weight")]
    assert routers and all(shapes[n][0] == (EXPERTS, json.loads((path / "config.json").read_text())["hidden_size"])
                           for n in routers)


def test_tiny_checkpoint_config_and_validation(tiny):
    arch, path = tiny
    config = json.loads((path / "config.json").read_text())
    quant = parse_quant_config(config["quantization_config"])
    assert (quant.bits, quant.head_bits, quant.codebook) == (K, HEAD_BITS, Codebook.MUL1)
    assert config["quantization_config"]["quant_method"] == "exl3" and config["tie_word_embeddings"] is False
    storage = json.loads((path / "quantization_config.json").read_text())["tensor_storage"]
    assert storage["lm_head"]["bits_per_weight"] == HEAD_BITS and storage["lm_head"]["quant_format"] == "exl3"
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (path / name).is_file(), name
    summary = validate_checkpoint(Exl3Checkpoint.open(path))
    assert summary.layout is not None and summary.layout.num_experts == EXPERTS
    assert summary.quantized_prefixes == expected_names(arch)[0]


def test_dense_twin_is_the_cropped_dequantized_checkpoint_and_runs_in_transformers(tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    arch, path = tiny
    twin = build_dense_twin(path)
    assert "quantization_config" not in json.loads((twin / "config.json").read_text())
    # Linears against the independent exact-arithmetic decoder, not the package's `dequantize` that wrote them;
    # everything else is the stored tensor, widened.
    check_twin(path, twin)

    # transformers checks every name and shape against the architecture (experts included).
    model, info = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32, output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) < json.loads((path / "config.json").read_text())["vocab_size"]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "def add(a, b):"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    assert tokenizer.decode(ids[0]).endswith("<|im_start|>assistant\n")
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 1024) and torch.isfinite(logits).all()


def test_random_encoder_matches_rms_and_is_deterministic_per_name():
    weight = torch.randn(200, 72, generator=torch.Generator().manual_seed(0)) * 0.02
    layer = encode_random(weight, 3, name="a", seed=1)
    parse_linear(layer.tensors(), "a", in_features=72, out_features=200)
    dense = torch.from_numpy(reference_weight(layer.tensors())[:200, :72])
    assert 0.85 < dense.pow(2).mean().sqrt() / weight.pow(2).mean().sqrt() < 1.15
    assert torch.equal(encode_random(weight, 3, name="a", seed=1).trellis, layer.trellis)
    assert not torch.equal(encode_random(weight, 3, name="b", seed=1).trellis, layer.trellis)
    assert not torch.equal(encode_random(weight, 3, name="a", seed=2).trellis, layer.trellis)


# A hand-made one-linear Qwen3-MoE checkpoint: q_proj is 128x128 (64 tiles, the smallest EXL3 linear), so the
# Viterbi case stays small; the tied embedding exercises the explicit lm_head.
SMALL_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 128, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64, "num_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 256, "intermediate_size": 256, "vocab_size": 1024, "tie_word_embeddings": True,
}
Q_PROJ = "model.layers.0.self_attn.q_proj"


def small_source(path: Path, q_shape: tuple[int, int] = (128, 128)) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    tensors = {
        f"{Q_PROJ}.weight": (torch.randn(*q_shape, generator=gen) * 0.02).bfloat16(),
        "model.embed_tokens.weight": (torch.randn(1024, 128, generator=gen) * 0.02).bfloat16(),
        "model.norm.weight": torch.ones(128, dtype=torch.bfloat16),
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(SMALL_CONFIG))
    save_file(tensors, path / "model.safetensors")
    return tensors


def test_viterbi_conversion_reproduces_the_weight_within_the_rate_distortion_bound(tmp_path):
    bits = 2
    source = small_source(tmp_path / "src")
    weight = source[f"{Q_PROJ}.weight"].float()
    spec = {"config": SMALL_CONFIG, "bits": bits, "weight": hashlib.sha256(weight.numpy().tobytes()).hexdigest()}

    def build(work: Path) -> None:
        convert_checkpoint(tmp_path / "src", work, bits=bits, head_bits=16, encoder="viterbi", progress=False)

    # Cached: 64 tiles of Viterbi take seconds on idle cores but minutes on loaded ones.
    out = cached_fixture("viterbi-q_proj", spec, build, code=ENCODE_CODE)
    ckpt = Exl3Checkpoint.open(out)
    decoded = torch.from_numpy(reference_weight(ckpt.linear(Q_PROJ).tensors())).float()
    rel_mse = (decoded - weight).pow(2).mean() / weight.pow(2).mean()
    # Gaussian rate-distortion bound 2^-2K; exllamav3's no-Hessian path lands within ~10 % of it (exl3-format §3.3).
    assert rel_mse < 1.25 * 2.0 ** (-2 * bits)
    assert ckpt.quant_config.head_bits == 16 and ckpt.quant_config.bits == bits
    assert torch.equal(ckpt.tensor("lm_head.weight"), source["model.embed_tokens.weight"].half())


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_inspect_reports_experts_k_and_bytes_from_tensor_shapes(capsys):
    path = build_tiny_model(None, "qwen3_moe", k=K, head_bits=HEAD_BITS)
    shapes = headers(path)
    rc, out, _ = run_cli(capsys, "inspect", path)
    assert rc == 0
    for layer in range(LAYERS):
        experts = [f"model.layers.{layer}.mlp.experts.{e}" for e in range(EXPERTS)]
        per_expert = {sum(stored_bytes(shapes, f"{expert}.{p}") for p in MLP) for expert in experts}
        assert len(per_expert) == 1
        (size,) = per_expert
        row = rf"^\s*{layer}\s+{EXPERTS}\s+{K}\s+mul1\s+{size:,}\s+{EXPERTS * size:,}$"
        assert re.search(row, out, re.M), out
    q_proj = "model.layers.0.self_attn.q_proj"
    row = rf"^{re.escape(q_proj)}\s+{K}\s+mul1\s+128x256\s+{stored_bytes(shapes, q_proj):,}$"
    assert re.search(row, out, re.M), out
    assert re.search(rf"^lm_head\s+{HEAD_BITS}\s+mul1\s+128x1024\s", out, re.M), out
    assert "model.layers.0.mlp.experts.0" not in out  # summarized, not listed
    quantized = sum(stored_bytes(shapes, n.rpartition(".")[0]) for n in shapes if n.endswith(".trellis"))
    assert f"quantized:   {quantized:,} B" in out and "bits=3" in out and "head_bits=6" in out


def test_quantize_cli_writes_the_requested_rates(tmp_path, capsys):
    small_source(tmp_path / "src")
    argv = ["quantize", tmp_path / "src", tmp_path / "dst", "--bits", "4", "--encoder", "random", "--codebook", "mcg"]
    rc, out, _ = run_cli(capsys, *argv)
    assert rc == 0 and f"wrote {tmp_path / 'dst'}" in out
    shapes = headers(tmp_path / "dst")
    assert shapes[f"{Q_PROJ}.trellis"] == ((8, 8, 64), "I16") and shapes["lm_head.trellis"] == ((8, 64, 96), "I16")
    assert f"{Q_PROJ}.mcg" in shapes and "lm_head.mcg" in shapes and "model.embed_tokens.weight" in shapes
    config = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert config["quantization_config"]["codebook"] == "mcg" and config["tie_word_embeddings"] is False


def corrupt_trellis(src: Path, dst: Path, name: str) -> None:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    tensors[name] = torch.zeros(*tensors[name].shape[:2], 50, dtype=torch.int16)  # K = 50/16 is no EXL3 rate
    save_file(tensors, dst / "model.safetensors")


def bad_inputs(tmp_path: Path) -> list[tuple[list[str], str]]:
    """(argv, text the one-line error must contain)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    bad_trellis = "model.layers.1.mlp.experts.5.up_proj.trellis"
    corrupt_trellis(build_tiny_model(None, "qwen3_moe", k=K, head_bits=HEAD_BITS), tmp_path / "corrupt", bad_trellis)
    small_source(tmp_path / "wrong_shape", q_shape=(256, 128))
    (tmp_path / "no_weights").mkdir()
    (tmp_path / "no_weights" / "config.json").write_text(json.dumps(SMALL_CONFIG))
    small_source(tmp_path / "src")
    shutil.copytree(tmp_path / "src", tmp_path / "llama")
    (tmp_path / "llama" / "config.json").write_text(json.dumps({**SMALL_CONFIG, "architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    quantize = ["quantize", str(tmp_path / "src")]
    return [
        (["inspect", str(empty)], f"{empty / 'config.json'}: not found"),
        (["inspect", str(tmp_path / "corrupt")], bad_trellis),
        (["quantize", str(empty), str(tmp_path / "o1"), "--bits", "3"], f"{empty / 'config.json'}"),
        (["quantize", str(tmp_path / "no_weights"), str(tmp_path / "o2"), "--bits", "3"], "no .safetensors files"),
        (["quantize", str(tmp_path / "wrong_shape"), str(tmp_path / "o3"), "--bits", "3"],
         f"{Q_PROJ}.weight: shape (256, 128)"),
        ([*quantize, str(tmp_path / "o4"), "--bits", "9"], "--bits: 9"),
        ([*quantize, str(tmp_path / "o5"), "--bits", "2.5", "--codebook", "mcg"], "--bits"),
        ([*quantize, str(tmp_path / "o6"), "--bits", "3", "--head-bits", "12"], "--head-bits"),
        ([*quantize, str(tmp_path / "full"), "--bits", "3"], "not empty"),
        (["quantize", str(tmp_path / "llama"), str(tmp_path / "o7"), "--bits", "3"],
         "['LlamaForCausalLM'] are not supported"),
    ]


def test_bad_inputs_exit_2_with_one_line_naming_the_culprit(tmp_path, capsys):
    for argv, culprit in bad_inputs(tmp_path):
        rc, _, err = run_cli(capsys, *argv)
        assert rc == 2, argv
        assert err.startswith("error: ") and err.count("\n") == 1 and culprit in err, (argv, err)
