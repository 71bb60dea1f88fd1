"""Mixed EXL3 packs (vllm-exl3's config contract): routed experts in EXL3, everything else in its source format.

The contract is parsed with every key checked, compared with the safetensors headers before any layer is built
(each mismatch refused with the tensor or key named), and every non-EXL3 layer gets exactly the method vLLM
would build for the declared `non_routed_quantization`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vllm_expert_offload.exl3.checkpoint import Exl3Checkpoint
from vllm_expert_offload.exl3.config import parse_quant_config
from vllm_expert_offload.exl3.errors import Exl3FormatError
from vllm_expert_offload.exl3.validate import validate_checkpoint
from vllm_expert_offload.testing.tiny_models import (
    FP8_DELEGATE,
    build_dense_twin,
    build_fp8_mixed_model,
    build_tiny_model,
    quantize_block_fp8,
)
from vllm_expert_offload.tools.inspect_cmd import inspect_checkpoint

from support.edited_checkpoint import edited_checkpoint

LAYER_BITS = {1: 2}  # layer 0's routed experts at the default K=3, layer 1's at K=2 (MixedK)
# The published contract (vllm-exl3 README), with the `activation_scheme` vLLM's Fp8Config requires.
PUBLISHED = {
    "quant_method": "exl3", "bits": 2, "codebook": "mcg", "layer_bits": {"3": 3, "13": 3},
    "non_routed_quantization": {**FP8_DELEGATE},
    "non_routed_dtype_policy": "bf16_as_stored", "mtp_experts": "source", "mtp_experts_start_layer": 40,
    "scope": "deepseek_v41_routed_experts",
    "non_routed_exl3": {"codebook": "mul1", "layers": {"model.layers.0.self_attn.o_proj": {"bits": 4}}},
}


@pytest.fixture(scope="module")
def mixed() -> Path:
    return build_tiny_model(None, "qwen3_moe", layer_bits=LAYER_BITS)


@pytest.fixture(scope="module")
def fp8_mixed() -> Path:
    return build_fp8_mixed_model("qwen3_moe", layer_bits=LAYER_BITS)


def test_published_contract_parses() -> None:
    contract = parse_quant_config(PUBLISHED).contract
    assert contract.layer_bits == {3: 3, 13: 3} and contract.routed_bits(3) == 3 and contract.routed_bits(4) == 2
    assert contract.delegate_method == "fp8" and not contract.delegates_dense  # bf16_as_stored
    assert contract.source_experts(40) and not contract.source_experts(39)
    assert contract.exl3_layers == {"model.layers.0.self_attn.o_proj": 4}
    assert parse_quant_config({"quant_method": "exl3", "bits": 3.27}).contract is None  # exllamav3-native


CONTRACT_REFUSALS = {
    "unknown key": ({"serving_reader_qualified": False}, "quantization_config.serving_reader_qualified"),
    "layer_bits key": ({"layer_bits": {"x": 3}}, "quantization_config.layer_bits: key 'x'"),
    "layer_bits value": ({"layer_bits": {"3": 9}}, "quantization_config.layer_bits.3"),
    "fractional bits": ({"bits": 2.7}, "quantization_config.bits"),
    "policy": ({"non_routed_dtype_policy": "official_source_native"}, "quantization_config.non_routed_dtype_policy"),
    "start not an index": ({"mtp_experts_start_layer": -1}, "quantization_config.mtp_experts_start_layer"),
    "source without delegate": ({"non_routed_quantization": None}, "quantization_config.mtp_experts: 'source'"),
    "start without source": ({"mtp_experts": "exl3"}, "quantization_config.mtp_experts_start_layer"),
    "mtp mode": ({"mtp_experts": "fp8"}, "quantization_config.mtp_experts"),
    "delegate not a config": ({"non_routed_quantization": {"bits": 8}}, "quantization_config.non_routed_quantization"),
    "delegate exl3": ({"non_routed_quantization": {"quant_method": "EXL3"}},
                      "quantization_config.non_routed_quantization.quant_method"),
    "short form": ({"non_routed_exl3": {"modules": ["o_proj"], "bits": 4}}, "quantization_config.non_routed_exl3.bits"),
    "bf16 shards": ({"non_routed_exl3": {"layers": {"m.qkv_proj": {"bits": 4, "bf16_shards": [2]}}}},
                    "non_routed_exl3.layers.m.qkv_proj.bf16_shards"),
    "dense bits": ({"non_routed_exl3": {"layers": {"m.o_proj": {"bits": 0}}}}, "non_routed_exl3.layers.m.o_proj.bits"),
    "dense codebook": ({"non_routed_exl3": {"codebook": "nf4"}}, "quantization_config.non_routed_exl3.codebook"),
}


@pytest.mark.parametrize("case", list(CONTRACT_REFUSALS))
def test_contract_refused_with_key_named(case: str) -> None:
    changes, named = CONTRACT_REFUSALS[case]
    with pytest.raises(Exl3FormatError) as err:
        parse_quant_config({**PUBLISHED, **changes})
    assert named in str(err.value)


def _edited(valid: Path, tmp_path: Path, tensors=None, quant=None, config=None) -> Path:
    return edited_checkpoint(valid, tmp_path / "edited", tensors, quant, config)


def _refused(path: Path) -> str:
    with pytest.raises(Exl3FormatError) as err:
        validate_checkpoint(Exl3Checkpoint.open(path))
    return str(err.value)


def test_mixed_pack_validates_with_each_layer_method(mixed: Path, fp8_mixed: Path) -> None:
    bf16 = validate_checkpoint(Exl3Checkpoint.open(mixed))
    assert {lin.k for p, lin in bf16.linears.items() if ".layers.1." in p} == {2}
    assert {lin.k for p, lin in bf16.linears.items() if ".layers.0." in p} == {3}
    assert all(".mlp.experts." in p for p in bf16.linears)  # nothing but routed experts is EXL3
    assert bf16.non_routed["model.layers.0.self_attn.q_proj"] == "unquantized, as stored"
    fp8 = validate_checkpoint(Exl3Checkpoint.open(fp8_mixed))
    assert fp8.non_routed["model.layers.1.self_attn.o_proj"] == "delegated to vLLM 'fp8' (block 128x128, float32 scales)"
    assert fp8.non_routed["lm_head"] == "unquantized, as stored"


Q = "model.layers.0.self_attn.q_proj"


def _set_fp8(name: str) -> Callable[[dict], None]:
    def edit(t: dict) -> None:
        t[f"{name}.weight"], t[f"{name}.weight_scale_inv"] = quantize_block_fp8(t[f"{name}.weight"])

    return edit


def _declare_fp8(q: dict) -> None:
    q.pop("non_routed_dtype_policy")
    q["non_routed_quantization"] = FP8_DELEGATE


HEADER_REFUSALS = {
    "declared fp8, stored BF16": (
        {"quant": _declare_fp8}, ".weight: stored as BF16, but quantization_config.non_routed_quantization declares fp8"),
    "fp8 scale missing": (
        {"fp8": True, "tensors": lambda t: t.pop(f"{Q}.weight_scale_inv")}, f"{Q}.weight_scale_inv: missing"),
    "fp8 weight stored BF16": (
        {"fp8": True, "tensors": lambda t: t.__setitem__(f"{Q}.weight", torch.zeros(256, 128, dtype=torch.bfloat16))},
        f"{Q}.weight: stored as BF16, but quantization_config.non_routed_quantization declares fp8"),
    "bf16_as_stored layer stored fp8": (
        {"tensors": _set_fp8(Q)}, f"{Q}.weight: stored as F8_E4M3, but quantization_config.non_routed_dtype_policy"),
    "routed K differs from layer_bits": (
        {"quant": lambda q: q["layer_bits"].update({"1": 4})},
        "K=2, but quantization_config.layer_bits.1 declares 4 for the routed experts of layer 1"),
    "routed K differs from bits": (
        {"quant": lambda q: q.update(bits=4)}, "K=3, but quantization_config.bits declares 4"),
    "non_routed_exl3 layer not stored": (
        {"quant": lambda q: q.update(non_routed_exl3={"layers": {"model.layers.0.self_attn.qkv_proj": {"bits": 4}}})},
        f"{Q}.trellis: missing, but quantization_config.non_routed_exl3.layers declares "
        "model.layers.0.self_attn.qkv_proj"),
    "draft layers inside the main model": (
        {"quant": lambda q: q.update(non_routed_quantization=FP8_DELEGATE, mtp_experts="source",
                                     mtp_experts_start_layer=1)},
        "quantization_config.mtp_experts_start_layer: 1 is inside the main model"),
    "unchecked delegate": (
        {"quant": lambda q: (q.pop("non_routed_dtype_policy"), q.update(non_routed_quantization={"quant_method": "awq"}))},
        "quantization_config.non_routed_quantization.quant_method: 'awq'"),
    "DeepSeek-V4 vision-language wrapper": (
        {"config": lambda c: c.update(architectures=["DeepseekV4ForConditionalGeneration"])},
        "DeepseekV4ForConditionalGeneration: the DeepSeek-V4 vision-language wrapper is not served"),
}


@pytest.mark.parametrize("case", list(HEADER_REFUSALS))
def test_inconsistent_pack_refused_with_name(mixed: Path, fp8_mixed: Path, tmp_path: Path, case: str) -> None:
    edits, named = HEADER_REFUSALS[case]
    base = fp8_mixed if edits.get("fp8") else mixed
    path = _edited(base, tmp_path, edits.get("tensors"), edits.get("quant"), edits.get("config"))
    assert named in _refused(path)


def test_undeclared_exl3_layer_refused_and_declared_one_accepted(tmp_path: Path) -> None:
    """An exllamav3-native pack (attention and lm_head in EXL3 too) under the contract: its attention is refused
    by tensor name until non_routed_exl3 declares it, with vLLM's fused qkv_proj standing for q/k/v."""
    native = build_tiny_model(None, "qwen3_moe", k=3)

    def contract(q: dict, declared: dict) -> None:
        q.update(non_routed_dtype_policy="bf16_as_stored", bits=3, non_routed_exl3={"codebook": "mul1", "layers": declared})

    message = _refused(_edited(native, tmp_path / "a", quant=lambda q: contract(q, {"lm_head": {"bits": 6}})))
    assert "model.layers.0.self_attn.k_proj.trellis: an EXL3 tensor set that quantization_config does not declare" \
        in message
    layers = {f"model.layers.{i}.self_attn.{m}": {"bits": 3} for i in (0, 1) for m in ("qkv_proj", "o_proj")}
    message = _refused(_edited(native, tmp_path / "b", quant=lambda q: contract(q, layers)))
    assert "lm_head.trellis: an EXL3 tensor set that quantization_config does not declare" in message
    layers["lm_head"] = {"bits": 6}
    summary = validate_checkpoint(Exl3Checkpoint.open(_edited(native, tmp_path / "c", quant=lambda q: contract(q, layers))))
    assert summary.non_routed["model.layers.1.self_attn.v_proj"] == \
        "EXL3 K=3 (non_routed_exl3 model.layers.1.self_attn.qkv_proj)"
    layers["lm_head"] = {"bits": 4}
    message = _refused(_edited(native, tmp_path / "d", quant=lambda q: contract(q, layers)))
    assert "lm_head.trellis: K=6 mul1, but quantization_config.non_routed_exl3 declares lm_head at K=4" in message


def test_dense_twin_dequantizes_block_fp8(fp8_mixed: Path, mixed: Path) -> None:
    twin = load_file(build_dense_twin(fp8_mixed) / "model.safetensors")
    source = load_file(mixed / "model.safetensors")[f"{Q}.weight"].float()
    assert f"{Q}.weight_scale_inv" not in twin
    error = (twin[f"{Q}.weight"] - source).abs().max() / source.abs().max()
    assert 0 < error < 0.07  # e4m3 keeps 3 mantissa bits: within 2^-4 of each block's largest weight


def test_inspect_shows_the_split(fp8_mixed: Path) -> None:
    report = inspect_checkpoint(fp8_mixed)
    assert "pack layout: mixed (routed experts EXL3" in report
    assert "routed experts: EXL3 at K=3, layer 1 K=2" in report
    assert "non-routed linears: delegated to vLLM 'fp8'" in report
    line = next(line for line in report.splitlines() if line.startswith("model.layers.0.self_attn.k_proj "))
    assert "delegated to vLLM 'fp8' (block 128x128, float32 scales)" in line and "F32,F8_E4M3" in line
    assert "pack layout: exllamav3-native" in inspect_checkpoint(build_tiny_model(None, "qwen3_moe"))


def _module(cls: type) -> torch.nn.Module:
    """An instance for get_quant_method, which only looks at the class and the prefix; building a real parallel
    layer needs a distributed group this test does not need."""
    layer = object.__new__(cls)
    torch.nn.Module.__init__(layer)
    return layer


def test_delegated_layers_get_exactly_vllms_method(fp8_mixed: Path, mixed: Path) -> None:
    """Every non-EXL3 layer of a delegated pack gets the method vLLM's own config class builds from the same
    parameters; the delegate's attributes the contract mirrors read through ours, no other; bf16_as_stored never
    delegates."""
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear, UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization import get_quantization_config
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    from vllm_expert_offload.integration.methods.quant_config import Exl3Config

    quant = json.loads((fp8_mixed / "config.json").read_text())["quantization_config"]
    config = Exl3Config.from_config(quant)
    config.maybe_update_config(str(fp8_mixed))
    vllm_own = get_quantization_config("fp8").from_config(FP8_DELEGATE)
    assert type(config.delegate) is type(vllm_own)
    assert config.weight_block_size == [128, 128] and config.weight_block_size is config.delegate.weight_block_size
    assert config.delegate.activation_scheme == "dynamic" and not hasattr(config, "activation_scheme")  # no mirror
    fused = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    config.packed_modules_mapping = fused  # what vLLM does once it knows the model class
    vllm_own.packed_modules_mapping = fused
    assert config.delegate.packed_modules_mapping is fused

    model_config = ModelConfig(model=str(fp8_mixed))  # our quant config, picked up from config.json
    assert model_config.quantization == "exl3"
    with set_current_vllm_config(VllmConfig(model_config=model_config)):
        for cls, prefix in ((QKVParallelLinear, "model.layers.0.self_attn.qkv_proj"),
                            (RowParallelLinear, "model.layers.1.self_attn.o_proj")):
            ours, theirs = config.get_quant_method(_module(cls), prefix), vllm_own.get_quant_method(_module(cls), prefix)
            assert type(ours) is type(theirs) and ours.quant_config is config.delegate
            assert {k: v for k, v in vars(ours).items() if k != "quant_config"} == \
                {k: v for k, v in vars(theirs).items() if k != "quant_config"}
        assert config.get_quant_method(_module(ParallelLMHead), "lm_head") is None  # as fp8: unquantized embedding

        bf16 = Exl3Config.from_config(json.loads((mixed / "config.json").read_text())["quantization_config"])
        bf16.maybe_update_config(str(mixed))
        assert bf16.delegate is None
        assert isinstance(bf16.get_quant_method(_module(RowParallelLinear), "model.layers.0.self_attn.o_proj"),
                          UnquantizedLinearMethod)
        assert bf16.get_quant_method(torch.nn.Module(), "model.layers.0.self_attn.attn") is None
        with pytest.raises(AttributeError):
            bf16.weight_block_size  # noqa: B018 - nothing to forward to


def test_the_quant_config_mirrors_exactly_the_contracts_delegate_keys() -> None:
    """Exl3Config reads through to its delegate the keys exl3/contract.py's DELEGATE_MIRRORS names, each an
    explicit property, and has no catch-all lookup."""
    from vllm_expert_offload.exl3.contract import DELEGATE_MIRRORS
    from vllm_expert_offload.integration.methods.quant_config import Exl3Config

    mirrored = {name for name, value in vars(Exl3Config).items()
                if isinstance(value, property) and value.fget.__qualname__.startswith("_mirrored.")}
    assert mirrored == set(DELEGATE_MIRRORS)
    assert not any("__getattr__" in vars(cls) for cls in Exl3Config.__mro__ if cls is not object)


def test_draft_layer_experts_go_to_the_delegate_and_config_pickles(mixed: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """mtp_experts 'source': routed experts from the start layer on get whatever the delegate builds, the main
    model's get EXL3; the config (delegate included) survives the pickling that carries it to vLLM's workers."""
    import pickle

    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    from vllm_expert_offload.integration.methods.moe_method import Exl3MoEMethod
    from vllm_expert_offload.integration.methods.quant_config import Exl3Config

    def with_drafts(q: dict) -> None:
        q.update(non_routed_quantization=FP8_DELEGATE, mtp_experts="source", mtp_experts_start_layer=2)

    pack = _edited(mixed, tmp_path, quant=with_drafts)
    config = Exl3Config.from_config(json.loads((pack / "config.json").read_text())["quantization_config"])
    config.maybe_update_config(str(pack))
    config = pickle.loads(pickle.dumps(config))
    assert config.weight_block_size == [128, 128]
    monkeypatch.setattr(config.delegate, "get_quant_method", lambda layer, prefix: ("delegate's", prefix))
    experts = _module(RoutedExperts)
    experts.moe_config = None
    assert config.get_quant_method(experts, "model.layers.2.mlp.experts") == ("delegate's", "model.layers.2.mlp.experts")
    assert isinstance(config.get_quant_method(experts, "model.layers.1.mlp.experts"), Exl3MoEMethod)


def test_delegate_refused_by_vllm_names_the_key() -> None:
    """The README's example omits activation_scheme, which vLLM's Fp8Config requires: refused with the key when
    the delegate is built (maybe_update_config, before any layer)."""
    from types import SimpleNamespace

    from vllm_expert_offload.integration.methods.delegate import build_delegate

    published = {**PUBLISHED, "non_routed_quantization": {"quant_method": "fp8", "fmt": "e4m3",
                                                          "weight_block_size": [128, 128]}}
    contract = parse_quant_config(published).contract
    with pytest.raises(ValueError, match="quantization_config.non_routed_quantization: vLLM refuses .*activation_sch"):
        build_delegate(contract, SimpleNamespace(model_type="qwen3_moe"))


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_mixed_fixture_is_exl3_exactly_in_its_routed_experts(arch: str) -> None:
    """Every architecture's tiny mixed pack: routed experts EXL3 at their layer's K, every other linear (DeepSeek's
    MLA, shared experts and dense first layer included) stored BF16; its block-FP8 variant delegates exactly those."""
    from support.tiny_names import expected_names

    linears, _ = expected_names(arch)
    routed = {p for p in linears if ".experts." in p and ".shared_experts." not in p}
    pack = build_tiny_model(None, arch, layer_bits=LAYER_BITS)
    summary = validate_checkpoint(Exl3Checkpoint.open(pack))
    assert set(summary.linears) == routed
    assert {lin.k for p, lin in summary.linears.items() if ".layers.1." in p} == {2}
    assert set(summary.non_routed) == linears - routed
    shapes = Exl3Checkpoint.open(pack).header_shapes()
    assert {shapes[f"{p}.weight"][1] for p in linears - routed} == {"BF16"}
    fp8 = validate_checkpoint(Exl3Checkpoint.open(build_fp8_mixed_model(arch, layer_bits=LAYER_BITS)))
    delegated = {p for p, method in fp8.non_routed.items() if method.startswith("delegated to vLLM 'fp8'")}
    assert delegated == linears - routed - {"lm_head"}


def test_quantize_cli_writes_a_mixed_pack(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from vllm_expert_offload.cli import main
    from vllm_expert_offload.testing.tiny_models import build_hf_model

    (tmp_path / "src").mkdir()
    build_hf_model(tmp_path / "src", "qwen3_moe")
    argv = ["quantize", str(tmp_path / "src"), str(tmp_path / "dst"), "--bits", "3", "--encoder", "random",
            "--routed-only", "--layer-bits", "1=2"]
    assert main(argv) == 0
    quant = json.loads((tmp_path / "dst" / "config.json").read_text())["quantization_config"]
    assert (quant["bits"], quant["layer_bits"], quant["non_routed_dtype_policy"], quant["head_bits"]) == \
        (3, {"1": 2}, "bf16_as_stored", 16)
    shapes = Exl3Checkpoint.open(tmp_path / "dst").header_shapes()
    assert shapes["model.layers.1.mlp.experts.7.down_proj.trellis"][0][-1] == 32  # K=2
    assert shapes["model.layers.0.mlp.experts.7.down_proj.trellis"][0][-1] == 48  # K=3
    assert shapes[f"{Q}.weight"][1] == "BF16" and "lm_head.trellis" not in shapes
    capsys.readouterr()
    assert main([*argv[:2], str(tmp_path / "dst2"), *argv[3:7], "--layer-bits", "1=2"]) == 2
    assert "--layer-bits" in capsys.readouterr().err  # per-layer K without --routed-only


def test_plan_counts_delegated_weights_at_their_stored_size(fp8_mixed: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture) -> None:
    """Only EXL3 routed experts are placed; every other stored tensor is a non-expert weight at its stored size
    (one byte per FP8 weight, not the two of the BF16 it came from), plus the experts' suh/svh kept on the GPU."""
    from vllm_expert_offload.cli import main

    itemsize = {"F8_E4M3": 1, "BF16": 2, "F16": 2, "F32": 4, "I16": 2, "I32": 4}
    shapes = Exl3Checkpoint.open(fp8_mixed).header_shapes()
    expected = sum(
        math.prod(shape) * itemsize[dtype] for name, (shape, dtype) in shapes.items()
        if ".mlp.experts." not in name or name.endswith((".suh", ".svh"))
    )
    assert main(["plan", "--model", str(fp8_mixed), "--host-fraction", "1", "--out", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "pack: mixed; EXL3 routed experts placed per expert" in out
    rows = [line for line in out.splitlines() if line.startswith(("device  non-expert weights", "device  expert scales"))]
    assert sum(int(row.split()[-2].replace(",", "")) for row in rows) == expected
    assert re.search(r"^host +host-tier experts +16 ", out, re.MULTILINE)
