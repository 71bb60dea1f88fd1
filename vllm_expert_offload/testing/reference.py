"""The independent reference: HF transformers on a dequantized dense twin, greedy, in float32."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ReferenceRun:
    tokens: list[list[int]]
    margins: list[list[float]]  # top-1 minus top-2 logit at each generated step


def hf_model(model: str | torch.nn.Module) -> torch.nn.Module:
    """HF transformers' model of a checkpoint directory in float32, or an HF model already built (e.g. modified)."""
    if isinstance(model, torch.nn.Module):
        return model
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


def hf_greedy(model_dir: str | torch.nn.Module, prompts: list[list[int]], max_tokens: int) -> ReferenceRun:
    model = hf_model(model_dir)
    tokens, margins = [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out, gaps = [], []
            for _ in range(max_tokens):
                logits = model(ids).logits[0, -1].float()
                top2 = torch.topk(logits, 2).values
                nxt = int(torch.argmax(logits))
                out.append(nxt)
                gaps.append(float(top2[0] - top2[1]))
                ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
            tokens.append(out)
            margins.append(gaps)
    return ReferenceRun(tokens, margins)


@dataclass
class Comparison:
    """Outcome of a greedy comparison: how many steps each prompt had compared, and what went wrong."""

    steps: list[int]  # per prompt: steps compared before the end or a margin stop
    failures: list[str]  # mismatches, missing prompts or tokens, prompts with too few compared steps
    stopped_early: list[str]  # why a prompt's comparison stopped before the end

    @property
    def matched(self) -> bool:
        return not self.failures

    def __str__(self) -> str:
        return (f"matched={self.matched} steps per prompt={self.steps} failures={self.failures} "
                f"early={self.stopped_early}")


def _compare_prompt(
    i: int, ref: list[int], margins: list[float], tokens: list[int], min_margin: float
) -> tuple[int, list[str], list[str]]:
    """(steps compared, failures, early-stop notes) for prompt `i`."""
    failures = [] if len(tokens) == len(ref) else [f"prompt {i}: {len(tokens)} tokens, expected {len(ref)}"]
    for step, (r, gap, t) in enumerate(zip(ref, margins, tokens)):
        if gap < min_margin:
            return step, failures, [f"prompt {i}: step {step} margin {gap:.2e} < {min_margin:g}, stopped"]
        if r != t:
            return step, failures + [f"prompt {i}: step {step} expected {r}, got {t}"], []
    return min(len(ref), len(tokens)), failures, []


def compare_greedy(
    reference: ReferenceRun, got: list[list[int]], *, min_steps: int, min_margin: float = 1e-3
) -> Comparison:
    """Token-by-token equality, stopping a prompt where the reference's own top-1/top-2 gap is so small
    that float rounding order may legitimately pick either token.

    Every prompt must come back with the reference's length and have at least `min_steps` steps compared:
    a per-prompt floor, because a sum over prompts lets one well-covered prompt hide others that were cut
    short, returned empty or stopped at their first step."""
    if len(got) != len(reference.tokens):
        return Comparison([], [f"{len(got)} prompts returned, expected {len(reference.tokens)}"], [])
    steps, failures, notes = [], [], []
    for i, (ref, margins, tokens) in enumerate(zip(reference.tokens, reference.margins, got)):
        compared, bad, early = _compare_prompt(i, ref, margins, tokens, min_margin)
        steps.append(compared)
        failures += bad
        notes += early
        if compared < min_steps and not bad:
            failures.append(f"prompt {i}: {compared} steps compared, at least {min_steps} required")
    return Comparison(steps, failures, notes)


def teacher_forced_gaps(
    model_dir: str | torch.nn.Module, prompts: list[list[int]], got: list[list[int]]
) -> list[list[float]]:
    """Per prompt and step: HF's best logit minus HF's logit for the token the engine chose, on the engine's own
    sequence. Where exact greedy equality cannot hold over many steps (vLLM's DeepSeek-V4 runs bf16 with an fp8
    KV cache), this still scores every step: a right model stays near HF's best, a wrong one falls to a random
    token's gap."""
    model = hf_model(model_dir)
    gaps = []
    with torch.no_grad():
        for prompt, tokens in zip(prompts, got):
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:len(prompt) - 1 + len(tokens)]
            chosen = logits[torch.arange(len(tokens)), torch.tensor(tokens)]
            gaps.append((logits.max(dim=-1).values - chosen).tolist())
    return gaps
