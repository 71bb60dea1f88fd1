"""DeepSeek-V4 in exllamav3's layout, without an engine: quantize from either naming, validation and refusals by
name, the sets decoded at load equal to the dense twin, and vLLM's module names mapped to the checkpoint's."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from vllm_expert_offload.exl3 import deepseek_v4 as dsv4
from vllm_expert_offload.exl3.checkpoint import Exl3Checkpoint
from vllm_expert_offload.exl3.convert import convert_checkpoint
from vllm_expert_offload.exl3.decode import dequantize
from vllm_expert_offload.exl3.errors import Exl3FormatError
from vllm_expert_offload.exl3.naming import moe_layout
from vllm_expert_offload.exl3.validate import validate_checkpoint
from vllm_expert_offload.integration.methods.decoded_at_load import DecodedAtLoad
from vllm_expert_offload.testing.tiny_dsv4 import (
    EXL3_OVERRIDES,
    build_tiny_dsv4,
    build_tiny_dsv4_exl3,
    save_pretrained_names,
)

from support.edited_checkpoint import edited_checkpoint
from support.reference_twin import checked_dense_twin

TRELLIS_SUFFIXES = ("trellis", "suh", "svh", "mul1", "mcg")


@pytest.fixture(scope="module")
def exl3() -> Path:
    return build_tiny_dsv4_exl3()


@pytest.fixture(scope="module")
def twin(exl3: Path) -> Path:
    return checked_dense_twin(exl3)  # decoded by the package, checked against the independent reference


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


def test_layout_matches_exllamav3(exl3: Path) -> None:
    """exllamav3's names: every layer MoE with w1/w3/w2 experts and a shared expert, wo_a in o_groups slices, the
    indexer's weights_proj unquantized, head in EXL3; nothing under `model.`."""
    ckpt = Exl3Checkpoint.open(exl3)
    summary = validate_checkpoint(ckpt)
    layout = summary.layout
    assert layout.moe_layers == tuple(range(ckpt.hf_config["num_hidden_layers"]))
    assert layout.expert_prefix(2, 63, "up") == "layers.2.ffn.experts.63.w3"
    assert layout.shared_prefix(0, "down") == "layers.0.ffn.shared_experts.w2"
    names = set(ckpt.tensor_files)
    assert not any(n.startswith("model.") for n in names)
    groups = EXL3_OVERRIDES["o_groups"]
    for layer in range(3):
        assert {f"layers.{layer}.attn.wo_a.slice.{g}" for g in range(groups)} <= summary.quantized_prefixes
        assert f"layers.{layer}.attn.wo_a.weight" not in names
    assert "layers.1.attn.indexer.weights_proj.weight" in names  # CSA layer: dense, as exllamav3 keeps it
    assert {"head", "layers.1.attn.indexer.wq_b", "layers.2.attn.compressor.wgate"} <= summary.quantized_prefixes
    for name in ("layers.0.ffn.gate.tid2eid", "layers.1.ffn.gate.bias", "hc_head_fn", "layers.1.attn.attn_sink"):
        assert name in names
    with safe_open(exl3 / "model.safetensors", "pt") as f:
        assert f.get_slice("layers.1.ffn.gate.bias").get_dtype() == "F32"  # routing bias keeps its resolution
        assert f.get_slice("layers.0.hc_attn_fn").get_dtype() == "F32"


def test_twin_is_the_release_layout(exl3: Path, twin: Path) -> None:
    """The twin has exactly the source's names and shapes (wo_a slices joined back in group order)."""
    source = _tensors(build_tiny_dsv4(config_overrides=EXL3_OVERRIDES))
    dense = _tensors(twin)
    assert set(dense) == set(source)
    assert {n: tuple(t.shape) for n, t in dense.items()} == {n: tuple(t.shape) for n, t in source.items()}
    ckpt = Exl3Checkpoint.open(exl3)
    rows, in_f = dsv4.linear_shape("layers.1.attn.wo_a.slice.1", ckpt.hf_config)
    second = dequantize(ckpt.linear("layers.1.attn.wo_a.slice.1", in_f, rows))[:rows, :in_f]
    assert torch.equal(dense["layers.1.attn.wo_a.weight"][rows:], second)


def test_save_pretrained_naming_quantizes_identically(exl3: Path, tmp_path: Path) -> None:
    """transformers' save_pretrained names (`model.` prefix, `embed_tokens`, `hc_head.hc_*`, `attn.norm`) give the
    same exllamav3 checkpoint, tensor for tensor, as DeepSeek's release names."""
    release = build_tiny_dsv4(config_overrides=EXL3_OVERRIDES)
    hf_dir = tmp_path / "hf"
    shutil.copytree(release, hf_dir)
    save_file(save_pretrained_names(_tensors(release)), hf_dir / "model.safetensors")
    assert any(n.startswith("model.") for n in _tensors(hf_dir))
    out = convert_checkpoint(hf_dir, tmp_path / "out", bits=3, encoder="random", progress=False)
    want, got = _tensors(exl3), _tensors(out)
    assert set(got) == set(want)
    assert all(torch.equal(got[n], want[n]) for n in want)


def _broken(exl3: Path, tmp_path: Path, edit) -> Path:
    return edited_checkpoint(exl3, tmp_path / "broken", edit)


@pytest.mark.parametrize("case,edit,named", [
    ("missing routed expert", lambda t: [t.pop(k) for k in list(t) if k.startswith("layers.1.ffn.experts.7.w2.")],
     "layers.1.ffn.experts.7.w2.trellis: missing"),
    ("expert past n_routed_experts", lambda t: t.__setitem__("layers.0.ffn.experts.64.w1.trellis",
                                                              torch.zeros(16, 8, 48, dtype=torch.int16)),
     "layers.0.ffn.experts.64.w1.trellis: unexpected tensor"),
    ("missing scale of a shared expert", lambda t: t.pop("layers.2.ffn.shared_experts.w1.suh"),
     "layers.2.ffn.shared_experts.w1"),
])
def test_bad_checkpoint_refused_by_name(exl3: Path, tmp_path: Path, case: str, edit, named: str) -> None:
    with pytest.raises(Exl3FormatError, match=named.replace(".", r"\.")):
        summary = validate_checkpoint(Exl3Checkpoint.open(_broken(exl3, tmp_path, edit)))
        ckpt = Exl3Checkpoint.open(tmp_path / "broken")
        for prefix in summary.quantized_prefixes:  # a set with a missing part fails when it is parsed
            ckpt.linear(prefix, *reversed(dsv4.linear_shape(prefix, ckpt.hf_config)))


def _stream(path: Path):
    with safe_open(path / "model.safetensors", "pt") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


def test_decoded_at_load_equals_the_twin(exl3: Path, twin: Path) -> None:
    """What vLLM reads as plain weights arrives decoded, equal to the twin's tensor (wo_a joined from its slices);
    every other tensor passes through untouched and nothing decoded is left over."""
    ckpt = Exl3Checkpoint.open(exl3)
    decoder = DecodedAtLoad(validate_checkpoint(ckpt), ckpt.hf_config, torch.float32)
    out = dict(decoder.transform(_stream(exl3)))
    dense = _tensors(twin)
    expected = {"head.weight", *(f"layers.{i}.attn.wo_a.weight" for i in range(3)),
                *(f"layers.{i}.attn.compressor.{w}.weight" for i in (1, 2) for w in ("wkv", "wgate")),
                *(f"layers.1.attn.indexer.compressor.{w}.weight" for w in ("wkv", "wgate"))}
    assert set(decoder.members) == expected
    for name in expected:
        assert torch.equal(out[name], dense[name]), name
    passed = {n for n in out if n not in expected}
    assert passed == {n for n in ckpt.tensor_files if dsv4.dense_name(n.rpartition(".")[0]) not in expected}
    assert "layers.0.attn.wq_a.trellis" in passed and "layers.1.attn.indexer.weights_proj.weight" in passed


def test_decoded_at_load_refuses_a_missing_slice(exl3: Path) -> None:
    ckpt = Exl3Checkpoint.open(exl3)
    decoder = DecodedAtLoad(validate_checkpoint(ckpt), ckpt.hf_config, torch.float32)
    stream = ((n, t) for n, t in _stream(exl3) if not n.startswith("layers.2.attn.wo_a.slice.1."))
    with pytest.raises(Exl3FormatError, match=r"layers\.2\.attn\.wo_a\.slice\.1\.trellis: not delivered"):
        list(decoder.transform(stream))


def test_vllm_names_map_to_checkpoint_names(exl3: Path) -> None:
    """vLLM builds `model.layers.L.attn.fused_wqa_wkv` from `layers.L.attn.{wq_a,wkv}` (its rename mapper adds
    `model.`); the quant config finds the checkpoint's sets through that mapper, and wo_a (read as a plain weight)
    is not an EXL3 layer."""
    from vllm.models.deepseek_v4.cpu.model import DeepseekV4ForCausalLM

    from vllm_expert_offload.exl3.config import parse_quant_config
    from vllm_expert_offload.integration.methods.quant_config import Exl3Config

    ckpt = Exl3Checkpoint.open(exl3)
    config = Exl3Config(parse_quant_config(ckpt.hf_config["quantization_config"]))
    config.summary = validate_checkpoint(ckpt)
    config.packed_modules_mapping = dict(DeepseekV4ForCausalLM.packed_modules_mapping)
    config.apply_vllm_mapper(DeepseekV4ForCausalLM.hf_to_vllm_mapper.get_rename_mapper())
    assert config.shard_prefixes("model.layers.1.attn.fused_wqa_wkv") == ["layers.1.attn.wq_a", "layers.1.attn.wkv"]
    assert config.shard_prefixes("model.layers.0.ffn.shared_experts.down_proj") == ["layers.0.ffn.shared_experts.w2"]
    assert config.is_quantized("model.layers.1.attn.indexer.wq_b")
    assert config.is_quantized("model.layers.2.ffn.shared_experts.gate_up_proj")
    assert not config.is_quantized("model.layers.1.attn.wo_a")
    assert not config.is_quantized("model.layers.1.attn.compressor.fused_wkv_wgate")


@pytest.mark.parametrize("settings,named", [
    ({"moe_backend": "deep_gemm_mega_moe", "enable_eplb": False}, "--moe-backend deep_gemm_mega_moe"),
    ({"moe_backend": "auto", "enable_eplb": True}, "--enable-eplb"),
])
def test_configurations_that_bypass_the_methods_are_refused(settings: dict, named: str) -> None:
    from vllm_expert_offload.integration.methods.quant_config import refuse_unservable

    no_draft = SimpleNamespace(layout=None, quantized_prefixes=frozenset())
    vllm_config = SimpleNamespace(kernel_config=SimpleNamespace(moe_backend=settings["moe_backend"]),
                                  parallel_config=SimpleNamespace(enable_eplb=settings["enable_eplb"]),
                                  speculative_config=None)
    with pytest.raises(ValueError, match=named):
        refuse_unservable(vllm_config, no_draft)
    refuse_unservable(SimpleNamespace(kernel_config=SimpleNamespace(moe_backend="auto"),
                                      parallel_config=SimpleNamespace(enable_eplb=False), speculative_config=None),
                      no_draft)


def test_incomplete_v4_config_refused_by_field() -> None:
    with pytest.raises(Exl3FormatError, match="DeepseekV4ForCausalLM config is incomplete"):
        moe_layout({"architectures": ["DeepseekV4ForCausalLM"], "num_hidden_layers": 2})
    with pytest.raises(Exl3FormatError, match="compress_ratios"):
        dsv4.linear_shape("layers.0.attn.wq_a", {"hidden_size": 8, "num_attention_heads": 1, "q_lora_rank": 4,
                                                 "num_hidden_layers": 1})


def test_draft_layers_are_accepted_and_left_to_vllm(exl3: Path, tmp_path: Path) -> None:
    """`mtp.*` sets (exllamav3 writes them when the source has draft layers) validate, and pass the load-time
    decoder untouched: vLLM's loader drops them unless a draft model is requested."""
    def add_draft(t: dict) -> None:
        for name in [n for n in t if n.startswith("layers.2.")]:
            t["mtp.0." + name.removeprefix("layers.2.")] = t[name].clone()

    path = _broken(exl3, tmp_path, add_draft)
    ckpt = Exl3Checkpoint.open(path)
    summary = validate_checkpoint(ckpt)
    assert "mtp.0.ffn.experts.5.w1" in summary.quantized_prefixes
    decoder = DecodedAtLoad(summary, ckpt.hf_config, torch.float32)
    assert not any(p.startswith("mtp.") for parts in decoder.members.values() for p in parts)
    passed = dict(decoder.transform(_stream(path)))
    assert "mtp.0.attn.compressor.wkv.trellis" in passed and "mtp.0.ffn.experts.5.w1.trellis" in passed


def test_draft_layer_ids_mapped_both_ways_and_speculative_decoding_refused(exl3: Path, tmp_path: Path) -> None:
    """vLLM's MTP/DSpark drafters build `mtp.i` as layer num_hidden_layers + i; the MoE method's layer index maps
    back to the checkpoint's `mtp.i` names. EXL3 draft sets have no place in the plan, so a speculative config is
    refused when the first EXL3 layer is built (before any weight is read), naming the set; without one the draft
    layers are vLLM's to drop."""
    from vllm_expert_offload.integration.methods.quant_config import refuse_unservable

    def add_draft(t: dict) -> None:
        for name in [n for n in t if n.startswith("layers.2.")]:
            t["mtp.0." + name.removeprefix("layers.2.")] = t[name].clone()

    summary = validate_checkpoint(Exl3Checkpoint.open(_broken(exl3, tmp_path, add_draft)))
    layout = summary.layout
    assert layout.expert_prefix(3, 5, "gate") == "mtp.0.ffn.experts.5.w1"
    assert layout.expert_layer("mtp.0.ffn.experts.5.w1") == 3 and layout.expert_layer("layers.2.ffn.experts.5.w1") == 2
    assert layout.expert_prefix(2, 5, "down") == "layers.2.ffn.experts.5.w2"
    settings = dict(kernel_config=SimpleNamespace(moe_backend="auto"), parallel_config=SimpleNamespace(enable_eplb=False))
    with pytest.raises(ValueError, match=r"--speculative-config would load the draft layers, but mtp\.0\.\S+\.trellis"):
        refuse_unservable(SimpleNamespace(**settings, speculative_config=object()), summary)
    refuse_unservable(SimpleNamespace(**settings, speculative_config=None), summary)


def test_a_wo_a_without_all_its_slices_is_refused_before_loading(exl3: Path) -> None:
    """A checkpoint that lacks a whole `wo_a` slice would join into a short `wo_a.weight`; it is refused by name
    when the sets to decode are grouped, before any tensor streams in."""
    ckpt = Exl3Checkpoint.open(exl3)
    prefixes = validate_checkpoint(ckpt).quantized_prefixes - {"layers.0.attn.wo_a.slice.1"}
    with pytest.raises(Exl3FormatError, match=r"layers\.0\.attn\.wo_a\.slice\.1\.trellis: missing"):
        dsv4.plain_weights(prefixes, ckpt.hf_config)
    extra = validate_checkpoint(ckpt).quantized_prefixes | {"layers.0.attn.wo_a.slice.2"}
    with pytest.raises(Exl3FormatError, match=r"layers\.0\.attn\.wo_a\.slice\.2\.trellis: unexpected"):
        dsv4.plain_weights(extra, ckpt.hf_config)
