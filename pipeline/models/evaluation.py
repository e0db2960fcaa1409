"""Held-out evaluation: the student's exact reverse KL to the teacher on its own samples.

For each held-out prompt, the student samples a completion (temperature 1, on-policy); at every
completion position the full-vocabulary KL(student || teacher) of the next-token distributions is
computed; the result is the mean over all completion positions of all prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pipeline.models.kvcache import output_cache, with_cache


@torch.inference_mode()
def sample_completion(
    model: Any, prompt_ids: list[int], max_new: int, eos_ids: set[int], gen: torch.Generator
) -> list[int]:
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], device=device)
    out: list[int] = []
    past = None
    step_input = ids
    for _ in range(max_new):
        res = model(step_input, **with_cache(model, past), use_cache=True)
        past = output_cache(res)
        probs = torch.softmax(res.logits[0, -1].float(), -1).cpu()  # the generator lives on the CPU
        tok = int(torch.multinomial(probs, 1, generator=gen))
        out.append(tok)
        if tok in eos_ids:
            break
        step_input = torch.tensor([[tok]], device=device)
    return out


@torch.inference_mode()
def reverse_kl_on_prompts(
    student: Any, teacher: Any, prompts: Sequence[list[int]], *, max_new: int = 8, eos_ids: Sequence[int] = (2,),
    seed: int = 0,
) -> float:
    """Mean exact KL(student || teacher) over the completion positions of student samples."""
    gen = torch.Generator().manual_seed(seed)
    total, count = 0.0, 0
    for prompt in prompts:
        completion = sample_completion(student, prompt, max_new, set(eos_ids), gen)
        if not completion:
            continue
        ids = torch.tensor([prompt + completion], device=next(student.parameters()).device)
        start = len(prompt) - 1  # logits at position p predict token p + 1
        ls = torch.log_softmax(student(ids).logits[0, start:-1].float(), -1)
        lt = torch.log_softmax(teacher(ids).logits[0, start:-1].float(), -1)
        kl = (ls.exp() * (ls - lt)).sum(-1)
        total += float(kl.sum())
        count += kl.numel()
    return total / max(count, 1)
