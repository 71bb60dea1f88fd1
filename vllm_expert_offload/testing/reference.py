"""The independent reference: HF transformers on a dequantized dense twin, greedy, in float32."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ReferenceRun:
    tokens: list[list[int]]
    margins: list[list[float]]  # top-1 minus top-2 logit at each generated step


def hf_greedy(model_dir: str, prompts: list[list[int]], max_tokens: int) -> ReferenceRun:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
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
    matched: bool
    compared_steps: int
    stopped_early: list[str]  # why a prompt's comparison stopped before the end

    def __str__(self) -> str:
        return f"matched={self.matched} steps={self.compared_steps} early={self.stopped_early}"


def compare_greedy(reference: ReferenceRun, got: list[list[int]], min_margin: float = 1e-3) -> Comparison:
    """Token-by-token equality, stopping a prompt where the reference's own top-1/top-2 gap is so small
    that float rounding order may legitimately pick either token."""
    steps, notes = 0, []
    for i, (ref, gap, tokens) in enumerate(zip(reference.tokens, reference.margins, got)):
        for step, (r, g, t) in enumerate(zip(ref, gap, tokens)):
            if g < min_margin:
                notes.append(f"prompt {i}: step {step} margin {g:.2e} < {min_margin:g}, stopped")
                break
            if r != t:
                return Comparison(False, steps, notes + [f"prompt {i}: step {step} expected {r}, got {t}"])
            steps += 1
    return Comparison(True, steps, notes)
