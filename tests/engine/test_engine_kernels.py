"""Backends other than the CPU default inside the real vLLM CPU engine (the default, the compiled CPU kernel,
serves every other engine test): Triton in its interpreter, where every EXL3 product, routed experts from both
tiers and every dense linear, goes through the Triton kernel; and the torch reference it is all tested against."""

from __future__ import annotations

import pytest

from vllm_expert_offload.testing.engine import EngineFailed, EngineSpec, generate_greedy

from support.engine_model import Model

pytestmark = pytest.mark.engine
TRITON_HALF_HOST = {"expert_offload": {"host_fraction": 0.5, "kernel": "triton"}}


def test_triton_backend_serves_reference_tokens_with_half_the_experts_on_host() -> None:
    """The readiness smoke (one full scheduler step of prompt) and, under Inductor, vLLM's warm-up forward run
    through Triton's interpreter too, so the batch is kept to 128 tokens (at vLLM's 4096 the start took over 16
    minutes), and only the 7- and 90-token prompts are served (with the 400-token one, four prefill chunks through the
    interpreter, this test took 330 s, without it 236 s; chunked prefill is served by every other backend's test)."""
    Model.get("qwen3_moe").check(first_prompts=2, block_size=64, additional_config=TRITON_HALF_HOST,
                                 extra_env={"TRITON_INTERPRET": "1"}, max_num_batched_tokens=128)


@pytest.mark.inductor
def test_torch_reference_backend_serves_reference_tokens_with_half_the_experts_on_host() -> None:
    torch_half_host = {"expert_offload": {"host_fraction": 0.5, "kernel": "torch"}}
    Model.get("qwen3_moe").check(block_size=128, additional_config=torch_half_host)


def test_triton_asked_for_without_the_interpreter_is_refused_at_startup() -> None:
    model = Model.get("qwen3_moe")
    spec = EngineSpec(model.exl3, model.prompts[:1], 1, additional_config=TRITON_HALF_HOST,
                      extra_env={"TRITON_INTERPRET": "0"})
    with pytest.raises(EngineFailed) as err:
        generate_greedy(spec)
    assert "kernel='triton' cannot run: Triton runs on CPU tensors only in its interpreter" in err.value.log
    assert "Loading weights" not in err.value.log  # refused before any weight was read
