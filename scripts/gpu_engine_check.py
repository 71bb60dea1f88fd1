"""Engine part of scripts/gpu-check.sh: the tiny EXL3 MoE served by the CUDA engine with each backend, half
and all of the experts in the host tier, at block 64 and 128, on Model Runner V2 (vLLM's CUDA default) and V1
(VLLM_USE_V2_MODEL_RUNNER=0); greedy tokens compared with HF on the dense twin (float32). Triton runs without
--enforce-eager (torch.compile + CUDA graphs), the torch reference with it. Each run also reports, per rank, the
peak GPU memory allocated while the MoE layers loaded beside the plan's tiers and vLLM's measured weight memory.

`--fp8-mixed`: instead, a tiny mixed pack (EXL3 routed experts, block-FP8 attention delegated to vLLM's `fp8`;
docs/models.md) in bfloat16 with every expert on host. vLLM's fp8 quantizes activations per 1x128 group, so tokens
cannot equal the float32 reference throughout; a wrongly loaded delegate (an uninitialized scale) emits garbage from
the first token, so every prompt must agree for its first FP8_PREFIX tokens, and the full comparison is printed."""

from __future__ import annotations

import random
import sys

from vllm_expert_offload.integration.startup.worker_rpc import MEMORY_REPORT
from vllm_expert_offload.testing.engine import EngineSpec, generate_report, generate_timed
from vllm_expert_offload.testing.reference import compare_greedy, hf_greedy
from vllm_expert_offload.testing.tiny_models import build_dense_twin, build_fp8_mixed_model, build_tiny_model

MAX_TOKENS = 24
MIN_STEPS = 8  # per prompt; these random prompts were not chosen for wide reference margins
FP8_PREFIX = 4
# Loading may briefly hold one layer's tensors twice (checkpoint copy and placed copy), never the whole model: the
# peak allocated while the MoE layers loaded must stay within this factor of what vLLM measured the weights at.
LOADING_PEAK_FACTOR = 1.5
# (VLLM_USE_V2_MODEL_RUNNER, kernel, enforce_eager, block size, host fraction): four engine starts fit the budget.
RUNS = (
    ("1", "triton", False, 64, 1.0),
    ("1", "triton", False, 128, 0.5),
    ("1", "torch", True, 128, 0.5),
    ("0", "triton", False, 64, 1.0),
)


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 700) for _ in range(n)] for n in (7, 300, 600)]


def fp8_mixed() -> int:
    model = str(build_fp8_mixed_model("qwen3_moe", layer_bits={1: 2}))
    prompts = _prompts()
    reference = hf_greedy(str(build_dense_twin(model)), prompts, MAX_TOKENS)
    env = {"VLLM_TARGET_DEVICE": "cuda", "TRITON_INTERPRET": "0"}
    spec = EngineSpec(model, prompts, MAX_TOKENS, dtype="bfloat16", extra_env=env,
                      additional_config={"expert_offload": {"host_fraction": 1.0, "kernel": "triton"}})
    try:
        tokens, seconds = generate_timed(spec)
    except RuntimeError as exc:
        print(f"fp8 mixed pack: engine failed\n{exc}", flush=True)
        return 1
    prefixes = [next((i for i, (r, t) in enumerate(zip(ref, got)) if r != t), len(ref))
                for ref, got in zip(reference.tokens, tokens)]
    print(f"fp8 mixed pack (bf16, all experts on host): {len(prompts) * MAX_TOKENS / seconds:.1f} tok/s, "
          f"tokens equal to the float32 reference for the first {prefixes} steps; "
          f"{compare_greedy(reference, tokens, min_steps=0)}", flush=True)
    return 0 if min(prefixes) >= FP8_PREFIX else 1


def _loading_peak_ok(ranks: list[dict]) -> bool:
    """Peak GPU memory while loading beside the plan's GPU tier and the weight memory vLLM measured, per rank."""
    ok = True
    for rank in ranks:
        peak, weights = rank["loading_peak_bytes"], rank["model_memory_usage"]
        within = weights is not None and peak <= LOADING_PEAK_FACTOR * weights
        ok &= within
        measured = "unmeasured" if weights is None else f"{weights / 2**20:.1f} MiB"
        print(f"  rank {rank['tp_rank']}: loading peak {peak / 2**20:.1f} MiB, weights {measured} "
              f"(GPU-tier experts {rank['gpu_tier_expert_bytes'] / 2**20:.1f} MiB, host tier "
              f"{rank['host_tier_expert_bytes'] / 2**20:.1f} MiB): {'ok' if within else 'FAIL'} "
              f"(limit {LOADING_PEAK_FACTOR}x the weights)", flush=True)
    return ok


def main() -> int:
    model = str(build_tiny_model(None, "qwen3_moe"))
    prompts = _prompts()
    reference = hf_greedy(str(build_dense_twin(model)), prompts, MAX_TOKENS)
    failures = 0
    for runner, kernel, eager, block, host_fraction in RUNS:
        offload = {"expert_offload": {"host_fraction": host_fraction, "kernel": kernel}}
        env = {"VLLM_TARGET_DEVICE": "cuda", "TRITON_INTERPRET": "0", "VLLM_USE_V2_MODEL_RUNNER": runner}
        spec = EngineSpec(model, prompts, MAX_TOKENS, block_size=block, additional_config=offload,
                          enforce_eager=eager, extra_env=env, rpc_after=[(MEMORY_REPORT, [])])
        try:
            report = generate_report(spec)
        except RuntimeError as exc:
            failures += 1
            print(f"runner V{2 if runner == '1' else 1} {kernel}: engine failed\n{exc}", flush=True)
            continue
        tokens, seconds = report["tokens"], report["generate_s"]
        result = compare_greedy(reference, tokens, min_steps=MIN_STEPS)
        failures += not result.matched
        print(f"runner V{2 if runner == '1' else 1} {kernel:7s} eager={eager!s:5s} block {block:3d} "
              f"host {host_fraction:.1f}: {len(prompts) * MAX_TOKENS / seconds:7.1f} tok/s  {result}", flush=True)
        failures += not _loading_peak_ok(report["rpc"][0])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(fp8_mixed() if sys.argv[1:] == ["--fp8-mixed"] else main())
