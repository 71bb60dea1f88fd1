"""One tiny EXL3 checkpoint with its HF reference tokens, shared by the engine tests (engine starts are slow,
so every run made on a model is kept for the whole session)."""

from __future__ import annotations

import os
import random

from vllm_expert_offload.testing.engine import EngineSpec, generate_greedy
from vllm_expert_offload.testing.reference import ReferenceRun, compare_greedy, hf_greedy
from vllm_expert_offload.testing.tiny_models import build_tiny_model

from .reference_twin import checked_dense_twin

MAX_TOKENS = 24
# vLLM's CPU CI backend switch (vllm/platforms/cpu.py): set, a compiled engine runs Dynamo's graph without Inductor
# and skips the warm-up forward (tests/engine/conftest.py decides per test).
CPU_CI_BACKEND = "VLLM_CPU_CI_ENV"
# Prompt sets (seeds of _prompts) picked for wide reference margins (measured with transformers 5.19): every greedy
# step of every prompt is decided by a top-1/top-2 logit gap of at least 9.8e-3 on qwen3_moe and mixtral and
# 1.4e-2 on the crop fixture, ten times the 1e-3 cut-off and more. Every step is compared, and a fixture or library
# change that narrows a gap below the cut-off fails the per-prompt minimum instead of quietly comparing fewer steps.
PROMPT_SEED = 28
# Experts 320 wide: at TP 2 each rank holds 160 channels, so rank 1 starts 32 channels into a 128-block.
CROP_OVERRIDES = {"moe_intermediate_size": 320}
CROP_PROMPT_SEED = 13


def prompts_for(seed: int) -> list[list[int]]:
    """Three prompts, the longest spanning more than three 128-token blocks."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 700) for _ in range(n)] for n in (7, 90, 400)]


class Model:
    """One tiny checkpoint, its reference tokens, and every engine run made on it (engine starts are slow)."""

    _cache: dict[tuple, "Model"] = {}

    def __init__(self, arch: str, overrides: dict, prompt_seed: int) -> None:
        self.exl3 = str(build_tiny_model(None, arch, config_overrides=overrides))
        self.prompts = prompts_for(prompt_seed)
        self.reference = hf_greedy(str(checked_dense_twin(self.exl3)), self.prompts, MAX_TOKENS)
        self.runs: dict[str, list[list[int]]] = {}

    @classmethod
    def get(cls, arch: str, overrides: dict | None = None, prompt_seed: int = PROMPT_SEED) -> "Model":
        key = (arch, repr(sorted((overrides or {}).items())), prompt_seed)
        if key not in cls._cache:
            cls._cache[key] = cls(arch, overrides or {}, prompt_seed)
        return cls._cache[key]

    def generate(self, first_prompts: int | None = None, **engine_kwargs) -> list[list[int]]:
        """`first_prompts` serves only that many of the prompts (shortest first), for engines too slow for all."""
        key = repr((first_prompts, sorted(engine_kwargs.items()), os.environ.get(CPU_CI_BACKEND)))  # compile too
        if key not in self.runs:
            spec = EngineSpec(self.exl3, self.prompts[:first_prompts], MAX_TOKENS, **engine_kwargs)
            self.runs[key] = generate_greedy(spec)
        return self.runs[key]

    def check(self, first_prompts: int | None = None, **engine_kwargs) -> list[list[int]]:
        got = self.generate(first_prompts, **engine_kwargs)
        reference = ReferenceRun(self.reference.tokens[:first_prompts], self.reference.margins[:first_prompts])
        result = compare_greedy(reference, got, min_steps=MAX_TOKENS)
        margins = [f"{min(m):.2e}" for m in reference.margins]
        print(f"{self.exl3} {engine_kwargs}: {result}; smallest reference margin per prompt {margins}")
        assert result.matched, str(result)
        return got
