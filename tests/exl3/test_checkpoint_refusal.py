"""Bad EXL3 checkpoints are refused before serving, with the tensor at fault named.

Each case starts from a valid tiny checkpoint and breaks exactly one thing in its safetensors file.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from vllm_expert_offload.exl3.checkpoint import Exl3Checkpoint
from vllm_expert_offload.exl3.codebook import MCG_MARKER
from vllm_expert_offload.exl3.errors import Exl3FormatError
from vllm_expert_offload.exl3.validate import validate_checkpoint
from vllm_expert_offload.testing.tiny_models import build_tiny_model

from support.edited_checkpoint import edited_checkpoint

EXPERT = "model.layers.1.mlp.experts.5"


@pytest.fixture(scope="module")
def valid_model() -> Path:
    return build_tiny_model(None, "qwen3_moe")


def _broken(valid: Path, tmp_path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    return edited_checkpoint(valid, tmp_path / "broken", edit)


def _retrellis(name: str, shape: tuple[int, ...]) -> Callable[[dict], None]:
    def edit(t: dict) -> None:
        t[name] = torch.zeros(shape, dtype=torch.int16)

    return edit


CASES = {
    "missing expert tensor": (lambda t: t.pop(f"{EXPERT}.down_proj.suh"), f"{EXPERT}.down_proj.suh"),
    "missing expert": (
        lambda t: [t.pop(k) for k in list(t) if k.startswith(f"{EXPERT}.up_proj.")], f"{EXPERT}.up_proj.trellis"
    ),
    "unexpected expert index": (
        lambda t: t.__setitem__("model.layers.1.mlp.experts.8.gate_proj.trellis", torch.zeros(8, 16, 48, dtype=torch.int16)),
        "model.layers.1.mlp.experts.8.gate_proj.trellis",
    ),
    "unexpected suffix": (
        lambda t: t.__setitem__(f"{EXPERT}.gate_proj.qweight", torch.zeros(4, dtype=torch.int32)),
        f"{EXPERT}.gate_proj.qweight",
    ),
    "trellis width not a bit rate": (_retrellis(f"{EXPERT}.gate_proj.trellis", (8, 16, 50)), f"{EXPERT}.gate_proj.trellis"),
    "trellis does not fit the layer": (
        _retrellis(f"{EXPERT}.gate_proj.trellis", (8, 8, 48)), f"{EXPERT}.gate_proj.svh"
    ),
    "unknown marker value": (
        lambda t: t.__setitem__(f"{EXPERT}.down_proj.mul1", torch.tensor(MCG_MARKER, dtype=torch.int32)),
        f"{EXPERT}.down_proj.mul1",
    ),
    "unpadded dims": (_retrellis(f"{EXPERT}.down_proj.trellis", (9, 8, 48)), f"{EXPERT}.down_proj.trellis"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_refused_with_tensor_named(valid_model: Path, tmp_path: Path, case: str) -> None:
    edit, named = CASES[case]
    broken = _broken(valid_model, tmp_path, edit)
    with pytest.raises(Exl3FormatError) as err:
        validate_checkpoint(Exl3Checkpoint.open(broken))
    assert named in str(err.value)


def test_valid_checkpoint_passes(valid_model: Path) -> None:
    summary = validate_checkpoint(Exl3Checkpoint.open(valid_model), uniform_expert_k=True)
    assert summary.layout.num_experts == 8 and len(summary.expert_bytes[1]) == 8


def test_mixed_expert_k_refused_only_for_kernels_that_cannot_mix(valid_model: Path, tmp_path: Path) -> None:
    # Expert 5's gate at K=2 while the layer's other gates are K=3: fine for the CPU table kernel,
    # refused for a fused kernel that takes one K per projection and layer.
    broken = _broken(valid_model, tmp_path, _retrellis(f"{EXPERT}.gate_proj.trellis", (8, 16, 32)))
    validate_checkpoint(Exl3Checkpoint.open(broken), uniform_expert_k=False)
    with pytest.raises(Exl3FormatError, match=f"{EXPERT}.gate_proj.trellis: K=2 mul1"):
        validate_checkpoint(Exl3Checkpoint.open(broken), uniform_expert_k=True)


def test_experts_stored_in_a_dense_layer_refused(valid_model: Path, tmp_path: Path) -> None:
    """The config makes layer 0 dense (Qwen3's mlp_only_layers); its routed experts are still in the file."""
    broken = edited_checkpoint(valid_model, tmp_path / "broken", config=lambda hf: hf.update(mlp_only_layers=[0]))
    with pytest.raises(Exl3FormatError, match=r"model\.layers\.0\.mlp\.experts\.\d+\..*unexpected tensor "
                                              r"\(layer 0 has experts 0\.\.7 and is not an MoE layer\)"):
        validate_checkpoint(Exl3Checkpoint.open(broken))


def _to_mcg(t: dict) -> None:
    """Expert 5's down projection re-marked MCG: the same K (its trellis is untouched), another codebook."""
    t.pop(f"{EXPERT}.down_proj.mul1")
    t[f"{EXPERT}.down_proj.mcg"] = torch.tensor(MCG_MARKER, dtype=torch.int32)


def test_the_wrong_codebook_at_the_declared_k_is_refused_by_tensor(valid_model: Path, tmp_path: Path) -> None:
    """The pack declares mul1 (quantization_config.codebook); one set's marker says mcg at the same K=3."""
    broken = _broken(valid_model, tmp_path, _to_mcg)
    with pytest.raises(Exl3FormatError, match=rf"{EXPERT}\.down_proj: its tensors say codebook 'mcg', but "
                                              r"quantization_config\.codebook declares 'mul1'"):
        validate_checkpoint(Exl3Checkpoint.open(broken))


def test_a_declared_codebook_no_tensor_has_is_refused(valid_model: Path, tmp_path: Path) -> None:
    broken = edited_checkpoint(valid_model, tmp_path / "broken", quant=lambda q: q.update(codebook="3inst"))
    with pytest.raises(Exl3FormatError, match=r"its tensors say codebook 'mul1', but quantization_config\.codebook "
                                              r"declares '3inst'"):
        validate_checkpoint(Exl3Checkpoint.open(broken))
    undeclared = edited_checkpoint(valid_model, tmp_path / "undeclared", quant=lambda q: q.pop("codebook"))
    validate_checkpoint(Exl3Checkpoint.open(undeclared))  # without a declaration each set's marker decides
