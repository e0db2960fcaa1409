"""The continuous task metric: the log-likelihood a model gives the reference answers of held-out rows."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoTokenizer

from pipeline.demo.taskeval import answer_logprob
from pipeline.demo.tinymodels import arithmetic_problem, ensure_tiny_models
from pipeline.models.weights import load_causal_lm


@pytest.mark.slow  # trains the tiny student for real (a minute on 2 cores)
def test_training_on_the_answers_raises_their_log_likelihood() -> None:
    import random

    tiny = ensure_tiny_models()
    model, tok = load_causal_lm(tiny.student), AutoTokenizer.from_pretrained(str(tiny.tokenizer))
    rng = random.Random(3)
    rows = []
    for _ in range(4):
        q, a = arithmetic_problem(rng, "heldout")
        rows.append({"messages": [{"role": "user", "content": q}], "answer": a, "accept": [a]})
    before = answer_logprob(model, tok, rows)
    assert before < 0 and math.isfinite(before)

    # the metric by hand for one row: mean log p(answer token | prefix) after the generation prompt
    prompt = tok.apply_chat_template(rows[0]["messages"], tokenize=True, add_generation_prompt=True,
                                     return_dict=False)
    answer = tok(rows[0]["answer"], add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + answer])).logits[0].float()
    by_hand = sum(float(torch.log_softmax(logits[len(prompt) - 1 + i], -1)[t]) for i, t in enumerate(answer))
    assert math.isclose(answer_logprob(model, tok, rows[:1]), by_hand / len(answer), rel_tol=1e-5)

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(10):  # a few steps of likelihood training on exactly those answers
        loss = -sum(
            torch.log_softmax(model(torch.tensor([p + a])).logits[0, len(p) - 1:-1].float(), -1)
            .gather(-1, torch.tensor(a)[:, None]).mean()
            for p, a in (
                (tok.apply_chat_template(r["messages"], tokenize=True, add_generation_prompt=True, return_dict=False),
                 tok(r["answer"], add_special_tokens=False)["input_ids"]) for r in rows)
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert answer_logprob(model, tok, rows) > before + 0.5


def test_no_rows_is_nan() -> None:
    tiny = ensure_tiny_models()
    assert math.isnan(answer_logprob(load_causal_lm(tiny.student), AutoTokenizer.from_pretrained(str(tiny.tokenizer)),
                                     []))
