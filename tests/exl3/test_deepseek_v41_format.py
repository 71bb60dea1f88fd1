"""DeepSeek-V4.1 mixed packs in the published contract (the seeds' format and diffbot's 2-bit pack), without an
engine: every key of the contract accepted, the headers checked against what each method loads, `inspect` and
`plan`, and everything that cannot be served refused by name before loading.

The tiny pack (testing/tiny_dsv41.py) has the released key set, dtypes and names with shrunk shapes: routed experts
EXL3 (mcg), FP8 E4M3 linears with E8M0 scales per 32x32 block under DeepSeek's `<linear>.scale`, MXFP4 DSpark
draft experts, an MXINT-4 (or FP8) engram table, BF16 compressors/indexer keys/vision tower.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from vllm_expert_offload.exl3.checkpoint import Exl3Checkpoint
from vllm_expert_offload.exl3.config import parse_quant_config
from vllm_expert_offload.exl3.convert import convert_checkpoint
from vllm_expert_offload.exl3.engram import EngramFormat
from vllm_expert_offload.exl3.errors import Exl3FormatError
from vllm_expert_offload.exl3.validate import validate_checkpoint
from vllm_expert_offload.testing.dsv41_pack import published_contract
from vllm_expert_offload.testing.tiny_dsv41 import TEXT, build_tiny_dsv41
from vllm_expert_offload.tools.inspect_cmd import inspect_checkpoint

from support.edited_checkpoint import edited_checkpoint

LAYER_BITS = {1: 2}  # routed experts of layers 0 and 2 at K=3, layer 1 at K=2
ENGRAM = "layers.1.engram.embed"
DELEGATED = "delegated to vLLM 'deepseek_v4_fp8' (block 32x32, UE8M0 scales)"


@pytest.fixture(scope="module")
def v41() -> Path:
    return build_tiny_dsv41(EngramFormat.MXINT4, 3, LAYER_BITS)


def _edited(pack: Path, tmp_path: Path, tensors=None, quant=None, config=None) -> Path:
    return edited_checkpoint(pack, tmp_path / "edited", tensors, quant, config)


def test_published_contract_parses_key_by_key() -> None:
    """diffbot's 2-bit contract and the seeds' 3-bit one, with and without mtp_experts_start_layer."""
    for bits in (2, 3):
        for start in (40, None):
            contract = parse_quant_config(published_contract(bits, start_layer=start)).contract
            assert contract.delegate_method == "deepseek_v4_fp8" and contract.delegates_dense
            assert contract.mtp_experts == "source" and contract.mtp_start_layer == start
            assert contract.with_draft_start(40).mtp_start_layer == 40
            assert contract.with_draft_start(40).source_experts(40) and not contract.with_draft_start(40).source_experts(39)


MIRROR_REFUSALS = {
    "block differs": ({"weight_block_size": [128, 128]}, "quantization_config.weight_block_size: [128, 128], but "
                                                         "non_routed_quantization.weight_block_size is [32, 32]"),
    "expert dtype differs": ({"expert_dtype": "fp8"}, "quantization_config.expert_dtype: 'fp8', but "
                                                      "non_routed_quantization.expert_dtype is 'fp4'"),
    "mirror without delegate": ({"non_routed_quantization": None, "mtp_experts": "exl3",
                                 "mtp_experts_start_layer": None},
                                "quantization_config.weight_block_size: [32, 32] restates"),
    "start not an index": ({"mtp_experts_start_layer": "40"}, "quantization_config.mtp_experts_start_layer: '40'"),
}


@pytest.mark.parametrize("case", list(MIRROR_REFUSALS))
def test_contract_refusals(case: str) -> None:
    edit, named = MIRROR_REFUSALS[case]
    config = {k: v for k, v in (published_contract(2) | edit).items() if v is not None}
    with pytest.raises(Exl3FormatError) as err:
        parse_quant_config(config)
    assert named in str(err.value)


def test_pack_validates_with_every_part_served(v41: Path) -> None:
    """Routed experts at their declared K per layer; FP8 linears delegated (scale dtype and block shape checked);
    compressors, indexer keys, vision tower and head stored as floats; DSpark experts MXFP4; the engram table as
    stored; the draft start inferred from config.json when omitted."""
    summary = validate_checkpoint(Exl3Checkpoint.open(v41))
    layout = summary.layout
    assert (layout.num_layers, layout.num_experts, layout.draft_experts) == (3, 16, 8)
    for layer in range(3):
        assert {lin.k for p, lin in summary.linears.items() if layout.expert_layer(p) == layer} == \
            {LAYER_BITS.get(layer, 3)}
    assert len(summary.linears) == 3 * 16 * 3
    for prefix in ("layers.1.attn.wq_a", "layers.2.attn.indexer.wq_b", "layers.1.engram.wkv",
                   "layers.0.ffn.shared_experts.w2", "mtp.0.attn.wo_b", "mtp.0.main_proj"):
        assert summary.non_routed[prefix] == DELEGATED, prefix
    for prefix in ("head", "layers.1.attn.compressor.wkv", "layers.1.attn.compressor.wgate",
                   "layers.2.attn.indexer.wk", "layers.1.attn.indexer.weights_proj", "aligner.w1",
                   "vision.blocks.0.attn.wqkv", "vision.blocks.0.mlp.w1"):
        assert summary.non_routed[prefix] == "unquantized, as stored", prefix
    assert summary.non_routed[ENGRAM].startswith("engram table mxint4: the plugin's lookup")


def test_draft_start_inferred_when_omitted(v41: Path, tmp_path: Path) -> None:
    pack = _edited(v41, tmp_path, quant=lambda q: q.pop("mtp_experts_start_layer"))
    assert validate_checkpoint(Exl3Checkpoint.open(pack)).contract.mtp_start_layer == TEXT["num_hidden_layers"]


def test_fp8_engram_table_as_released(tmp_path: Path) -> None:
    pack = build_tiny_dsv41(EngramFormat.FP8, 3)
    summary = validate_checkpoint(Exl3Checkpoint.open(pack))
    assert summary.non_routed[ENGRAM].startswith("engram table fp8: vLLM's ParallelEngramEmbedding")


def test_inspect_and_plan(v41: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from vllm_expert_offload.cli import main

    report = inspect_checkpoint(v41)
    assert "architecture: DeepseekV41ForCausalLM" in report
    assert re.search(r"^ +1 +16 +2 ", report, re.MULTILINE) and re.search(r"^ +2 +16 +3 ", report, re.MULTILINE)
    assert re.search(rf"^{re.escape(ENGRAM)} +engram table mxint4", report, re.MULTILINE)
    summary_file = tmp_path / "summary.json"
    assert main(["plan", "--model", str(v41), "--host-fraction", "0.5", "--out", str(tmp_path / "plan.json"),
                 "--summary-json", str(summary_file)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^host +host-tier experts +24 ", out, re.MULTILINE)  # 3 layers x 8 of 16 experts
    assert re.search(r"^host +engram tables \(pinned\) ", out, re.MULTILINE)
    assert "not loaded: draft layers (speculative decoding)" in out
    summary = json.loads(summary_file.read_text())
    assert (summary["host_experts"], summary["total_experts"]) == (24, 48)


def _set(name: str, value: torch.Tensor) -> Callable[[dict], None]:
    return lambda t: t.__setitem__(name, value)


def _pop(*names: str) -> Callable[[dict], None]:
    return lambda t: [t.pop(n) for n in names]


def _as_float(prefix: str) -> Callable[[dict], None]:
    def edit(t: dict) -> None:
        t[f"{prefix}.weight"] = t[f"{prefix}.weight"].float().to(torch.bfloat16)
        t.pop(f"{prefix}.scale")

    return edit


def _scale_as(prefix: str, dtype: torch.dtype) -> Callable[[dict], None]:
    return lambda t: t.__setitem__(f"{prefix}.scale", t[f"{prefix}.scale"].float().to(dtype))


REFUSALS = {
    "delegated linear stored BF16": ({"tensors": _as_float("layers.1.attn.wq_b")},
                                     "layers.1.attn.wq_b.weight: stored as BF16, but quantization_config."
                                     "non_routed_quantization declares deepseek_v4_fp8"),
    "float32 scales for fp4 experts": ({"tensors": _scale_as("layers.1.attn.wo_b", torch.float32)},
                                       "layers.1.attn.wo_b.scale: F32 [8, 8], but the deepseek_v4_fp8 delegate "
                                       "(block 32x32, UE8M0 scales) loads F8_E8M0 [8, 8]"),
    "scale block shape": ({"tensors": lambda t: t.__setitem__("layers.0.attn.wkv.scale",
                                                             t["layers.0.attn.wkv.scale"][:, :4].contiguous())},
                          "layers.0.attn.wkv.scale: F8_E8M0 [16, 4], but the deepseek_v4_fp8 delegate"),
    "missing scale": ({"tensors": _pop("layers.2.attn.wq_a.scale")},
                      "layers.2.attn.wq_a.scale: missing; the deepseek_v4_fp8 delegate"),
    "indexer wk stored FP8": ({"tensors": _set("layers.2.attn.indexer.wk.weight",
                                               torch.zeros(128, 512).to(torch.float8_e4m3fn))},
                              "layers.2.attn.indexer.wk.weight: stored as F8_E4M3, but vLLM (it builds this linear "
                              "without a quant config)"),
    "draft expert not MXFP4": ({"tensors": _set("mtp.0.ffn.experts.3.w2.weight",
                                                torch.zeros(256, 256).to(torch.float8_e4m3fn))},
                               "mtp.0.ffn.experts.3.w2.weight: F8_E4M3 [256, 256], but a source-format draft expert "
                               "of the deepseek_v4_fp8 delegate (expert_dtype fp4) is MXFP4: I8 [256, 128]"),
    "draft expert scale": ({"tensors": _pop("mtp.0.ffn.experts.0.w1.scale")},
                           "mtp.0.ffn.experts.0.w1.scale: missing"),
    "engram rows": ({"tensors": lambda t: [t.__setitem__(f"{ENGRAM}.{s}", t[f"{ENGRAM}.{s}"][:100].contiguous())
                                           for s in ("weight", "scale")]},
                    f"{ENGRAM}.weight: shape [100, 32], expected [184, 32] for an mxint4 table of 184 rows x 64"),
    "engram stored BF16": ({"tensors": _set(f"{ENGRAM}.weight", torch.zeros(184, 64, dtype=torch.bfloat16))},
                           f"{ENGRAM}.weight: stored as BF16 [184, 64]; the engram tables served are fp8"),
    "engram scale dtype": ({"tensors": _scale_as(ENGRAM, torch.float8_e8m0fnu)},
                           f"{ENGRAM}.scale: F8_E8M0 [184, 2], but an mxint4 table's scales are F8_E4M3"),
    "engram table not declared": ({"config": lambda c: c["text_config"].update(engram_layer_ids=[],
                                                                               engram_num_embeddings=[])},
                                  f"{ENGRAM}.weight: an engram table at a layer config.json's engram_layer_ids"),
    "engram table missing": ({"tensors": _pop(f"{ENGRAM}.weight", f"{ENGRAM}.scale")},
                             f"{ENGRAM}.weight: missing; config.json declares an engram table at layer 1"),
    "unread quantized tensor": ({"tensors": _set("layers.0.attn.stray", torch.zeros(4, dtype=torch.uint8))},
                                "layers.0.attn.stray: stored as U8, but nothing this pack declares reads it"),
    "draft start past the stack": ({"quant": lambda q: q.update(mtp_experts_start_layer=4)},
                                   "mtp_experts_start_layer: 4, but DeepseekV41ForCausalLM's draft layers start "
                                   "right after its 3 layers"),
    "expert dtype vs config": ({"config": lambda c: (c["quantization_config"]["non_routed_quantization"].update(
                                    expert_dtype="fp8"), c.update(expert_dtype="fp4"))},
                               "non_routed_quantization.expert_dtype: 'fp8', but config.json's expert_dtype is 'fp4'"),
    "EXL3 engram wkv": ({"tensors": lambda t: [t.pop("layers.1.engram.wkv.weight"), t.pop("layers.1.engram.wkv.scale"),
                                               *[t.__setitem__(f"layers.1.engram.wkv.{s}",
                                                               t[f"layers.1.ffn.experts.0.w2.{s}"].clone())
                                                 for s in ("trellis", "suh", "svh", "mcg")]]},
                        "layers.1.engram.wkv.trellis: an EXL3 tensor set in an engram (n-gram table) layer"),
    "expert at another K": ({"tensors": lambda t: [t.__setitem__(f"layers.1.ffn.experts.3.w2.{s}",
                                                                 t[f"layers.0.ffn.experts.3.w2.{s}"].clone())
                                                   for s in ("trellis", "suh", "svh", "mcg")]},
                            "layers.1.ffn.experts.3.w2.trellis: K=3, but quantization_config.layer_bits.1 declares 2"),
    "missing expert": ({"tensors": lambda t: [t.pop(n) for n in list(t) if n.startswith("layers.2.ffn.experts.7.w1.")]},
                       "layers.2.ffn.experts.7.w1.trellis: missing (routed expert 7 of layer 2)"),
    "vision tower stored FP8": ({"tensors": lambda t: t.__setitem__("aligner.w2.weight",
                                                                    t["aligner.w2.weight"].to(torch.float8_e4m3fn))},
                                "aligner.w2.weight: stored as F8_E4M3, but vLLM (it builds this linear without a "
                                "quant config)"),
    "unknown delegate method": ({"quant": lambda q: q["non_routed_quantization"].update(quant_method="mxfp8")},
                                "non_routed_quantization.quant_method: 'mxfp8'; this plugin checks the stored "
                                "tensors of 'fp8' and 'deepseek_v4_fp8' delegates only"),
    "exllamav3-native (no contract)": (
        {"quant": lambda q: [q.pop(k) for k in list(q) if k not in ("quant_method", "bits", "codebook")]},
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


def test_residency_lines_follow_vllms_sharding(v41: Path) -> None:
    """Per GPU: the split lines halve from TP 1 to TP 2, the replicated ones do not; the vision tower follows
    --mm-encoder-tp-mode; the engram tables sit in the host line whole (the ranks' shares together); the draft
    layers count only with speculative decoding."""
    from vllm_expert_offload.exl3 import residency as r

    ckpt = Exl3Checkpoint.open(v41)
    summary = validate_checkpoint(ckpt)
    shapes = ckpt.header_shapes()

    def lines(**options):
        return r.residency(summary, shapes, ckpt.hf_config, r.ResidencyOptions(**options))

    one, two = lines(tp=1), lines(tp=2)
    assert two.device[r.REPLICATED_LINE] == one.device[r.REPLICATED_LINE] > 0
    assert 0.5 * one.device[r.SPLIT] - 64 <= two.device[r.SPLIT] <= 0.5 * one.device[r.SPLIT] + 64
    replicated = sum(r.nbytes(*shapes[n]) for n in shapes
                     if not r.DRAFT.match(n) and not r.VISION.match(n) and r.REPLICATED.search(n))
    assert one.device[r.REPLICATED_LINE] == replicated
    assert lines(tp=2, vision_replicated=True).device[r.VISION_LINES[True]] == one.device[r.VISION_LINES[False]]
    assert two.device[r.VISION_LINES[False]] < one.device[r.VISION_LINES[False]]
    assert two.host[r.ENGRAM_LINE] == one.host[r.ENGRAM_LINE] == summary.engram[1].nbytes
    draft = sum(r.nbytes(*shapes[n]) for n in shapes if n.startswith("mtp."))
    assert r.DRAFT_LINE not in one.device and one.not_loaded[r.DRAFT_LINE] == draft
    assert lines(tp=1, speculative=True).device[r.DRAFT_LINE] == draft
    assert lines(tp=1, embedding_on_host=True).host[r.EMBEDDING_LINE] == r.nbytes(*shapes["embed.weight"])


def test_quant_config_resolves_the_draft_start(v41: Path, tmp_path: Path) -> None:
    """With mtp_experts_start_layer omitted, the quant config uses the start inferred from config.json: main-layer
    routed experts get the EXL3 method, draft layers (vLLM's layers.{3+i}) the delegate's method."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    from vllm_expert_offload.integration.methods.moe_method import Exl3MoEMethod
    from vllm_expert_offload.integration.methods.quant_config import Exl3Config

    pack = _edited(v41, tmp_path, quant=lambda q: q.pop("mtp_experts_start_layer"))
    hf = json.loads((pack / "config.json").read_text())
    config = Exl3Config.from_config(hf["quantization_config"])
    from types import SimpleNamespace

    config.maybe_update_config(str(pack), SimpleNamespace(model_type="deepseek_v41", expert_dtype="fp4"))
    experts = object.__new__(RoutedExperts)
    torch.nn.Module.__init__(experts)
    experts.moe_config = SimpleNamespace(moe_parallel_config=None)
    assert isinstance(config.get_quant_method(experts, "language_model.model.layers.2.ffn.experts"), Exl3MoEMethod)
    config.delegate.get_quant_method = lambda layer, prefix: ("delegate", prefix)
    assert config.get_quant_method(experts, "model.layers.3.ffn.experts") == ("delegate", "model.layers.3.ffn.experts")
