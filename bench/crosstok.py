"""Cross-tokenizer alignment cost against the teacher's forward pass, side by side in one run.

Run: ``python -m bench.crosstok`` (``--quick``: fewer and shorter sequences).

A teacher of another tokenizer pays, per group, for ``pipeline.teacher.crosstok``: the student's completion
re-encoded by the teacher's tokenizer, the byte check, the alignment into chunks, and the chunk sums and top-k
mapping (``chunk_logprobs``, ``map_topk`` at k=64). That cost is measured per student token on 8 sequences x 1024
tokens of real text (the real task set's prompts and answers and code, repeated to length) with real tokenizers:
student SmolLM2 (49,152 ids), teacher Qwen2 (151,936) and Llama's SentencePiece (32,000). Against it: ms per token
of ``HFTeacher`` scoring the same 8 x 1024 shape with the bench's wide model (hidden 1024, vocabulary 151,936,
2 layers, bfloat16, k=64), in the same run. Target: alignment under 5% of the HF teacher's time.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import numpy as np

from bench.provenance import header, run_info

K = 64


def corpus_ids(tokenizer: Any, length: int, n: int) -> list[list[int]]:
    """``n`` sequences of ``length`` student tokens of realistic text (task prompts, answers, code, prose)."""
    from pipeline.demo import realtasks

    parts = [r["messages"][-1]["content"] + " " + str(r["answer"]) + "\n" for r in realtasks.load()]
    parts += ["def add(a: int, b: int) -> int:\n    return a + b\n", "Voilà, le café coûte 3,50 €. 東京は首都です。\n"]
    ids = tokenizer("".join(parts), add_special_tokens=False)["input_ids"]
    while len(ids) < length * n:
        ids = ids + ids
    return [ids[i * length:(i + 1) * length] for i in range(n)]


def align_ms_per_token(seqs: list[list[int]], student: Any, teacher: Any, reps: int) -> dict[str, float]:
    from pipeline.teacher.crosstok import VocabBytes, align, chunk_logprobs, map_topk, retokenize, vocab_map

    t0 = time.perf_counter()
    sv, tv = VocabBytes.of(student), VocabBytes.of(teacher)
    vmap = vocab_map(tv, sv)
    startup_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    best = float("inf")
    one_to_one = tokens = 0
    for _ in range(reps):
        t0 = time.perf_counter()
        for ids in seqs:
            r = retokenize(ids, sv, teacher, tv)
            a = align(r)
            n_t = len(r.teacher_ids)
            chunk_logprobs(a, -rng.random(n_t))
            rows = a.boundary_starts(len(ids))
            rows = rows[rows >= 0]
            map_topk(rng.integers(0, len(tv), (len(rows), K)), np.log(rng.dirichlet(np.ones(K), len(rows))), vmap)
            one_to_one += int((a.student[a.one_to_one(), 1] - a.student[a.one_to_one(), 0]).sum())
            tokens += len(ids)
        best = min(best, time.perf_counter() - t0)
    n = sum(len(s) for s in seqs)
    return {"ms_per_token": 1000 * best / n, "startup_s": startup_s, "one_to_one": one_to_one / tokens}


async def hf_ms_per_token(n: int, length: int, reps: int) -> float:
    from bench.teacher_k import build_wide_model
    from pipeline.teacher.base import ScoreRequest
    from pipeline.teacher.hf import HFTeacher

    model = build_wide_model(1024, 2)
    rng = np.random.default_rng(0)
    reqs = [ScoreRequest(rng.integers(0, 151_936, length).astype(np.int32), K) for _ in range(n)]
    hf = HFTeacher(model, min_shared_prefix=0, chunk_positions=None, dtype="bfloat16")
    await hf.start()
    try:
        await hf.score([ScoreRequest(reqs[0].tokens[:512], K)])
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            await hf.score(reqs)
            best = min(best, time.perf_counter() - t0)
    finally:
        await hf.close()
    return 1000 * best / sum(r.n_rows for r in reqs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.crosstok", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 x 256 tokens, one round")
    p.add_argument("--reps", type=int, default=2)
    args = p.parse_args(argv)
    n, length, reps = (2, 256, 1) if args.quick else (8, 1024, args.reps)
    from pipeline.demo.vocabs import load_vocab, smollm2_tokenizer

    print(header("cross-tokenizer alignment against the HF teacher's forward", run_info()))
    student = smollm2_tokenizer()
    seqs = corpus_ids(student, length, n)
    hf = asyncio.run(hf_ms_per_token(n, length, reps))
    print(f"HF teacher (hidden 1024, 2 layers, vocabulary 151,936, bf16, k={K}), {n} x {length}: "
          f"{hf:.3f} ms per token")
    print("| student -> teacher | align ms/token | / HF teacher | one-to-one tokens | vocab tables (once) |")
    print("|---|---|---|---|---|")
    for name in ("qwen2", "llama-spm"):
        got = align_ms_per_token(seqs, student, load_vocab(name), reps)
        print(f"| smollm2 -> {name} | {got['ms_per_token']:.4f} | {got['ms_per_token'] / hf:.1%} | "
              f"{got['one_to_one']:.1%} | {got['startup_s']:.1f} s |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
