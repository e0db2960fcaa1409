"""Brief supervised training of the tiny teacher on the synthetic arithmetic task (for the demo), so
the student has something to learn from it. Cached next to the untrained models."""

from __future__ import annotations

import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pipeline.demo.tinymodels import TinyModels, all_problems
from pipeline.models.weights import load_causal_lm, share_files


def chat_ids(tokenizer: object, question: str, answer: str | None = None) -> list[int]:
    messages = [{"role": "user", "content": question}]
    if answer is not None:
        messages.append({"role": "assistant", "content": answer})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=answer is None)  # type: ignore[attr-defined]
    ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    return ids


def train_teacher(
    tiny: TinyModels, *, steps: int = 150, batch: int = 64, lr: float = 5e-3, seed: int = 0,
    progress: Callable[[int, float], None] | None = None,
    problems: list[tuple[str, str]] | None = None, name: str = "teacher",
) -> Path:
    """Train the teacher on ``a+b=`` problems (or ``problems``, cached as ``name``); returns the trained model dir
    (cached)."""
    out = tiny.root / f"{name}-trained-{steps}"
    if (out / "DONE").exists():
        return out
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny.teacher))
    model = load_causal_lm(tiny.teacher)
    model.train()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    texts = [tok.apply_chat_template([{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                                     tokenize=False) for q, a in problems or all_problems()]
    pool: list[list[int]] = tok(texts, add_special_tokens=False)["input_ids"]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    for step in range(steps):
        rows = rng.choices(pool, k=batch)
        width = max(len(r) for r in rows)
        ids = torch.zeros((batch, width), dtype=torch.long)
        att = torch.zeros((batch, width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            att[i, : len(r)] = 1
        labels = ids.masked_fill(att == 0, -100)
        loss = model(input_ids=ids, attention_mask=att, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if progress is not None:
            progress(step, float(loss.detach()))  # float() of a tensor that requires grad warns
    model.eval()
    tmp = out.with_suffix(f".tmp{time.time_ns()}")
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    (tmp / "DONE").write_text("ok\n")
    share_files(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
