"""Teacher worker efficiency: ``Scorer`` + ``HFTeacher`` versus the bare batched forward + top-k.

Run: ``python -m bench.teacher`` (``--markdown`` prints the table for bench/RESULTS.md).

Both sides score the same sequences (default 64 sequences of 128-512 tokens in 8 groups of 8, k=20)
with the same model and the same token budget per forward. (a) bare: sort by length, pad, one forward
per chunk, float32 log-softmax, ``torch.topk``, gather of the prompt token, arrays to numpy; nothing
else. (b) the stage: ``Scorer.score_groups`` on ``RolloutGroup`` messages with the HF backend (packing,
worker thread, result checks, payload building, stats). Repeats alternate a/b so load changes on the
machine hit both alike; the table gives the minimum and median wall time and the median process CPU
time (less sensitive to other load on a shared machine). Target: (b) >= 90% of (a)'s tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass, field
from datetime import date
from typing import Any

import numpy as np
import torch

from bench.codec import cpu_model
from pipeline.demo.tinymodels import ensure_tiny_models
from pipeline.models.weights import load_causal_lm
from pipeline.stages.scoring import Scorer, ScoringConfig
from pipeline.teacher.base import plan_chunks
from pipeline.teacher.hf import HFTeacher
from schemas.build import make_sequence
from schemas.messages import RolloutGroup


def make_groups(n_groups: int, per_group: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[RolloutGroup]:
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(n_groups):
        seqs = []
        for _ in range(per_group):
            n = int(rng.integers(lo, hi + 1))
            mask = np.zeros(n, np.uint8)
            mask[16:] = 1
            seqs.append(make_sequence(rng.integers(0, vocab, n, dtype=np.int32), mask))
        groups.append(RolloutGroup(group_id=f"g{g}", sequences=seqs))
    return groups


def bare(model: Any, seqs: list[np.ndarray], k: int, budget: int) -> int:
    """Batched forward + top-k of every sequence; returns the number of rows scored.

    The teacher's algorithm before row selection and chunking (full logits, a float32 log-softmax over
    ``[tokens, V]``): the baseline of ``bench.hf_teacher`` too. Each chunk's tensors are freed before the
    next forward, so a peak-memory reading is that of one chunk."""
    lens = [len(s) for s in seqs]
    rows = 0
    with torch.inference_mode():
        for chunk in plan_chunks(lens, budget):
            width = max(lens[i] for i in chunk)
            ids = np.zeros((len(chunk), width), np.int64)
            mask = np.zeros_like(ids)
            for j, i in enumerate(chunk):
                ids[j, : lens[i]] = seqs[i]
                mask[j, : lens[i]] = 1
            t_ids, t_mask = torch.from_numpy(ids), torch.from_numpy(mask)
            logits = model(input_ids=t_ids, attention_mask=t_mask).logits[:, :-1]
            keep = t_mask[:, 1:].bool()
            logp = torch.log_softmax(logits[keep].float(), dim=-1)
            top = torch.topk(logp, k, dim=-1, sorted=True)
            sampled = logp.gather(-1, t_ids[:, 1:][keep].unsqueeze(-1)).squeeze(-1)
            top.values.numpy(), top.indices.to(torch.int32).numpy(), sampled.numpy()
            rows += int(keep.sum())
            del logits, logp, top, sampled
    return rows


def build_model(vocab: int | None) -> Any:
    tiny = ensure_tiny_models()
    if vocab is None:
        return load_causal_lm(tiny.teacher)
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(tiny.teacher))
    cfg.vocab_size = vocab
    torch.manual_seed(0)
    model: Any = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)  # type: ignore[no-untyped-call]
    return model.eval()


@dataclass
class Timings:
    """Per-repeat wall-clock and process CPU seconds of each path."""

    wall: dict[str, list[float]] = field(default_factory=lambda: {"bare": [], "scorer": []})
    cpu: dict[str, list[float]] = field(default_factory=lambda: {"bare": [], "scorer": []})


async def run(args: argparse.Namespace) -> tuple[Timings, int, int]:
    """Timings, total tokens, vocabulary size."""
    torch.set_num_threads(args.threads)
    model = build_model(args.vocab)
    vocab = int(model.config.vocab_size)
    groups = make_groups(args.groups, args.per_group, args.min_len, args.max_len, vocab)
    seqs = [s.tokens.numpy().astype(np.int32) for g in groups for s in g.sequences]
    teacher = HFTeacher(model=model, max_batch_tokens=args.budget, num_threads=args.threads)
    await teacher.start()
    scorer = Scorer(teacher, ScoringConfig(default_k=args.k, max_batch_tokens=args.budget))
    t = Timings()
    for rep in range(args.repeats + 1):  # the first round warms up and is not counted
        for name in ("bare", "scorer") if rep % 2 == 0 else ("scorer", "bare"):
            w0, c0 = time.perf_counter(), time.process_time()
            if name == "bare":
                bare(model, seqs, args.k, args.budget)
            else:
                out = await scorer.score_groups(groups)
                assert all(s.status.value == "ok" for s in out)
            if rep:
                t.wall[name].append(time.perf_counter() - w0)
                t.cpu[name].append(time.process_time() - c0)
    await teacher.close()
    return t, sum(len(s) for s in seqs), vocab


def table(t: Timings, args: argparse.Namespace, tokens: int, vocab: int) -> str:
    head = (
        f"{args.groups} groups x {args.per_group} sequences of {args.min_len}-{args.max_len} tokens ({tokens} tokens), "
        f"k={args.k}, vocab {vocab}, {args.budget} padded tokens per forward, {args.threads} torch threads, "
        f"{args.repeats} interleaved repeats"
    )
    lines = [
        head,
        "",
        "| path | wall s, min | wall s, median | CPU s, median | tokens/s (min wall) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, label in (("bare", "(a) bare batched forward + top-k"), ("scorer", "(b) Scorer + HFTeacher")):
        w, c = t.wall[name], t.cpu[name]
        lines.append(
            f"| {label} | {min(w):.3f} | {statistics.median(w):.3f} | {statistics.median(c):.3f} | "
            f"{tokens / min(w):,.0f} |"
        )
    ratio = [f(t.wall["bare"]) / f(t.wall["scorer"]) for f in (min, statistics.median)]
    cpu = statistics.median(t.cpu["bare"]) / statistics.median(t.cpu["scorer"])
    lines.append(f"| **(b)/(a) throughput** | **{ratio[0]:.1%}** | {ratio[1]:.1%} | {cpu:.1%} | |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--per-group", type=int, default=8)
    p.add_argument("--min-len", type=int, default=128)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--k", type=int, default=20)
    p.add_argument("--budget", type=int, default=8192, help="padded tokens per forward")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--vocab", type=int, default=None, help="random model of the tiny shape with this vocabulary")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args()
    timings, tokens, vocab = asyncio.run(run(args))
    text = table(timings, args, tokens, vocab)
    if args.markdown:
        print(f"{date.today().isoformat()}, {cpu_model()}\n")
    print(text)


if __name__ == "__main__":
    main()
