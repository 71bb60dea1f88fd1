"""Bad checkpoints refused by the real engine at startup, by tensor name, before any weight is read (the checks
themselves are tested without an engine in tests/exl3/test_checkpoint_refusal.py and test_mixed_packs.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_expert_offload.testing.engine import EngineFailed, EngineSpec, generate_greedy
from vllm_expert_offload.testing.tiny_models import FP8_DELEGATE, build_tiny_model

from support.edited_checkpoint import edited_checkpoint

pytestmark = pytest.mark.engine
EXPERT = "model.layers.1.mlp.experts.5"


def _declare_fp8(q: dict) -> None:
    q.pop("non_routed_dtype_policy")
    q["non_routed_quantization"] = FP8_DELEGATE


def test_engine_refuses_before_loading(tmp_path: Path) -> None:
    """Checked on the child's whole log: an absence is only evidence if the log reaches back to the engine's start,
    which the line vLLM prints on reading the config (before any loading) shows."""
    valid = build_tiny_model(None, "qwen3_moe")
    broken = edited_checkpoint(valid, tmp_path / "broken", lambda t: t.pop(f"{EXPERT}.down_proj.svh"))
    with pytest.raises(EngineFailed) as err:
        generate_greedy(EngineSpec(str(broken), [[1, 2, 3]], max_tokens=1))
    log = err.value.log
    assert "Resolved architecture: Qwen3MoeForCausalLM" in log
    assert f"EXL3 checkpoint refused: {EXPERT}.down_proj.svh: missing" in log
    assert "Loading safetensors checkpoint shards" not in log and "Loading weights took" not in log


def test_engine_refuses_fp8_declared_for_bf16_before_loading(tmp_path: Path) -> None:
    """The silent-garbage case vLLM does not catch: refused at startup, by tensor name, before any weight loads."""
    mixed = build_tiny_model(None, "qwen3_moe", layer_bits={1: 2})
    broken = edited_checkpoint(mixed, tmp_path / "edited", quant=_declare_fp8)
    with pytest.raises(RuntimeError) as err:
        generate_greedy(EngineSpec(str(broken), [[1, 2, 3]], max_tokens=1))
    log = str(err.value)
    assert "EXL3 checkpoint refused: model.layers.0.self_attn.k_proj.weight: stored as BF16, but " \
        "quantization_config.non_routed_quantization declares fp8" in log
    assert "Loading safetensors checkpoint shards" not in log
