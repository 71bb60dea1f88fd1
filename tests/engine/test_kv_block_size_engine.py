"""The KV-cache block-size fix on the real CPU engine (the rules and hooks are tested without one in
tests/integration/test_kv_block_sizes.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.engine
def test_cpu_engine_serves_at_a_block_size_its_backend_lacks(tmp_path: Path) -> None:
    """End to end on the CPU build (Model Runner V1, plugin loaded by vLLM itself): CPU_ATTN takes multiples
    of 32, so upstream refuses --block-size 16 at worker init ("No common block size for 16"). With the fix
    the group runs on 32-token blocks and generates, over several blocks, the tokens it generates at 64."""
    from vllm_expert_offload.testing.engine import EngineSpec, generate_greedy
    from vllm_expert_offload.testing.tiny_models import build_hf_model

    (tmp_path / "model").mkdir()
    model = str(build_hf_model(tmp_path / "model", "qwen3_moe"))
    prompts = [list(range(5, 41))]
    tokens = {size: generate_greedy(EngineSpec(model, prompts, max_tokens=40, block_size=size)) for size in (16, 64)}
    assert len(tokens[16][0]) == 40 and tokens[16] == tokens[64]
