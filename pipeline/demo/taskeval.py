"""The held-out task metrics of a chat model on prompts with checkable answers.

Prompts are the rows of ``pipeline.demo.realtasks`` (``messages``, ``answer`` and ``accept``). Accuracy: each
is answered greedily with at most ``max_new`` tokens, in left-padded batches, and is right when
``realtasks.is_correct`` says so. Answer log-likelihood: the mean log-probability per token the model gives the
row's reference ``answer`` right after the generation prompt (teacher-forced), averaged over the rows: a
continuous measure of the same task, which moves while a weak model's greedy answers are all still wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pipeline.demo.realtasks import is_correct


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


@torch.inference_mode()
def answer_logprob(model: Any, tokenizer: Any, rows: Sequence[dict[str, Any]]) -> float:
    """Mean over ``rows`` of the mean log-probability (nats per token) of ``row["answer"]``'s tokens after the
    row's ``messages`` and the generation prompt."""
    if not rows:
        return float("nan")
    device = next(model.parameters()).device
    per_row: list[float] = []
    for r in rows:
        prompt: list[int] = tokenizer.apply_chat_template(r["messages"], tokenize=True, add_generation_prompt=True,
                                                          return_dict=False)
        answer: list[int] = tokenizer(r["answer"], add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt + answer], device=device)
        logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1].float(), -1)
        per_row.append(float(logp.gather(-1, ids[0, len(prompt):, None]).mean()))
    return sum(per_row) / len(per_row)
