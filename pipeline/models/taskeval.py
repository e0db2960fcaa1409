"""The held-out task metric of a chat model: greedy answers to prompts with checkable answers, and accuracy.

Prompts are the rows of ``pipeline.models.realtasks`` (``messages`` and ``accept``); each is answered greedily
with at most ``max_new`` tokens, in left-padded batches, and is right when ``realtasks.is_correct`` says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pipeline.models.realtasks import is_correct


@torch.inference_mode()
def greedy_answers(model: Any, tokenizer: Any, rows: Sequence[dict[str, Any]], *, max_new: int = 16,
                   batch_size: int = 16) -> list[str]:
    """The greedy completion of each row's ``messages`` (chat template, generation prompt), decoded."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = next(model.parameters()).device
    answers: list[str] = []
    for i in range(0, len(rows), batch_size):
        prompts: list[list[int]] = [
            tokenizer.apply_chat_template(r["messages"], tokenize=True, add_generation_prompt=True, return_dict=False)
            for r in rows[i:i + batch_size]
        ]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for j, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new,
                             do_sample=False, pad_token_id=pad_id, eos_token_id=tokenizer.eos_token_id)
        answers += tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    return answers


def task_accuracy(model: Any, tokenizer: Any, rows: Sequence[dict[str, Any]], *, max_new: int = 16) -> float:
    """Fraction of ``rows`` whose greedy answer contains one of the row's accepted answers."""
    if not rows:
        return float("nan")
    answers = greedy_answers(model, tokenizer, rows, max_new=max_new)
    return sum(is_correct(a, r["accept"]) for a, r in zip(answers, rows, strict=True)) / len(rows)
