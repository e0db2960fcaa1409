"""The teacher worker's cost of turning a vLLM ``prompt_logprobs`` response into top-k rows.

Run: ``python -m bench.vllm_parse`` (``--tokens N``, ``--repeats N``; about a minute at the defaults).

For one sequence of ``--tokens`` (4096) tokens and k = 20, 64, 256 it builds the body vLLM's OpenAI server
sends (compact JSON as starlette writes it; vocabulary 151,936; per position the prompt token first, then
the top k in rank order, each ``{logprob, rank, decoded_token}`` with float32 logprobs printed as Python
floats and token strings that include escapes and non-ASCII text). The prompt token is rank 1 half the
time, else log-uniform in rank over [1, 10,000], so it is an extra k+1-th item at about 33% / 27% / 20% of
positions for k = 20 / 64 / 256 (the table's "k+1" column). Then it times, on those bytes, the parser before row subsets
(``old_parse``: msgspec into string-keyed dicts, a Python ``sorted`` per position; a subset is cut from
the full result, as that parser built every row) and ``pipeline.teacher.vllm_parse.parse_completion``,
for all rows, the completion only (last 75% of the rows: one typed decode) and two assistant turns
(~30% of the rows: only the wanted positions decoded). Old and new alternate, best of ``--repeats``;
results are compared for equality first. Figures are microseconds per sequence token (the request's L).
"scan" is msgspec reading the body into raw per-position slices without building any object: a floor
for a parser that reads the whole answer (vLLM sends every position, at any k).
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import time
from collections.abc import Callable, Sequence
from datetime import date
from typing import Any, Final

import msgspec
import numpy as np
import numpy.typing as npt

from pipeline.teacher.base import MISALIGNED, ScoreFailure, ScoreOutcome, ScoreRequest, ScoreResult
from pipeline.teacher.vllm_parse import _RAW, parse_completion

VOCAB: Final = 151_936
KS: Final = (20, 64, 256)
WORDS: Final = [" the", "ing", "\n", "\n\n", " 12", "的", " résumé", '"', "\\", "\t", " {", "}", "<|im_end|>",
                " =", "Ġ", " def", "():", " return", " x", "é"]


# -- the baseline: pipeline/teacher/vllm_http.py's parser before row subsets (commit 12dbdfe) ------------


class _OldLogprob(msgspec.Struct):
    logprob: float
    rank: int | None = None


class _OldChoice(msgspec.Struct):
    prompt_logprobs: list[dict[str, _OldLogprob] | None] | None = None


class _OldCompletion(msgspec.Struct):
    choices: list[_OldChoice]


_OLD: Final = msgspec.json.Decoder(_OldCompletion)


def old_parse(content: bytes, tokens: npt.NDArray[np.int32], k: int) -> ScoreOutcome:
    """The old ``VLLMTeacher.parse`` + ``parse_prompt_logprobs``, verbatim but for names."""
    resp = _OLD.decode(content)
    if len(resp.choices) != 1 or resp.choices[0].prompt_logprobs is None:
        return ScoreFailure(f"{MISALIGNED}: response without prompt_logprobs", retryable=False)
    entries = resp.choices[0].prompt_logprobs
    n = int(tokens.shape[0])
    if len(entries) != n:
        return ScoreFailure(f"{MISALIGNED}: {len(entries)} prompt_logprobs entries for {n} tokens", retryable=False)
    if n and entries[0] is not None:
        return ScoreFailure(f"{MISALIGNED}: entry 0 is not null", retryable=False)
    ids = np.empty((max(n - 1, 0), k), np.int32)
    lps = np.empty((max(n - 1, 0), k), np.float32)
    sampled = np.empty(max(n - 1, 0), np.float32)
    toks = tokens.tolist()
    for p in range(1, n):
        entry = entries[p]
        if entry is None or len(entry) < k:
            got = "null" if entry is None else f"{len(entry)} items"
            return ScoreFailure(f"{MISALIGNED}: position {p} has {got} (k={k})", retryable=False)
        own = entry.get(str(toks[p]))
        if own is None:
            return ScoreFailure(f"{MISALIGNED}: position {p} lacks the prompt token {toks[p]}", retryable=False)
        sampled[p - 1] = own.logprob
        top = sorted(entry.items(), key=lambda kv: (-kv[1].logprob, kv[1].rank or 0))[:k]
        ids[p - 1] = [int(key) for key, _ in top]
        lps[p - 1] = [v.logprob for _, v in top]
    return ScoreResult(ids, lps, sampled)


def old_rows(content: bytes, req: ScoreRequest) -> ScoreOutcome:
    """What the old worker did for a row subset: every row built, then the subset cut out."""
    full = old_parse(content, req.tokens, req.k)
    if req.rows is None or isinstance(full, ScoreFailure):
        return full
    r = req.rows
    return ScoreResult(full.topk_ids[r], full.topk_logprobs[r], full.sampled_logprobs[r])


# -- the response ------------------------------------------------------------------------------------------


def response(n: int, k: int, seed: int = 0) -> tuple[npt.NDArray[np.int32], bytes]:
    """Tokens and vLLM's ``/v1/completions`` body with ``prompt_logprobs = k`` for them."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, n).astype(np.int32)
    # Descending float32 logprobs per position: a head near 0 and gaps that shrink down the ranks.
    head = -rng.exponential(0.7, (n, 1))
    gaps = rng.exponential(1.0, (n, k + 1)) / np.arange(1, k + 2) ** 0.7 + 1e-3  # no float32 ties
    lps = (head - np.cumsum(gaps, axis=1)).astype(np.float32).tolist()
    ranks = np.where(rng.random(n) < 0.5, 1, np.exp(rng.uniform(0, np.log(10_000), n)).astype(np.int64))
    entries: list[Any] = [None]
    for p in range(1, n):
        tok, rank = int(tokens[p]), int(ranks[p])
        top = rng.choice(VOCAB - 1, k, replace=False)
        top = top + (top >= tok)  # never the prompt token by accident
        if rank <= k:
            top[rank - 1] = tok
        own_lp = lps[p][rank - 1] if rank <= k else lps[p][k] - float(rng.exponential(1.0))
        items = {str(tok): {"logprob": own_lp, "rank": rank, "decoded_token": WORDS[tok % len(WORDS)]}}
        for j, t in enumerate(top.tolist()):
            items.setdefault(str(t), {"logprob": lps[p][j], "rank": j + 1, "decoded_token": WORDS[t % len(WORDS)]})
        entries.append(items)
    choice = {"index": 0, "text": "x", "logprobs": None, "finish_reason": "length", "stop_reason": None,
              "prompt_logprobs": entries}
    body = {"id": "cmpl-bench", "object": "text_completion", "created": 0, "model": "teacher", "choices": [choice],
            "usage": {"prompt_tokens": n, "total_tokens": n + 1, "completion_tokens": 1}}
    return tokens, json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def row_sets(n: int) -> dict[str, npt.NDArray[np.int32] | None]:
    r = n - 1
    turns = np.r_[np.arange(r // 5, 2 * r // 5), np.arange(3 * r // 5, 7 * r // 10)]
    return {"all": None, "last 75%": np.arange(r // 4, r, dtype=np.int32), "turns 30%": turns.astype(np.int32)}


def _same(a: ScoreOutcome, b: ScoreOutcome) -> None:
    if not (isinstance(a, ScoreResult) and isinstance(b, ScoreResult)):
        raise AssertionError(f"parse failed: {a} / {b}")
    pairs = [(a.topk_ids, b.topk_ids), (a.topk_logprobs, b.topk_logprobs), (a.sampled_logprobs, b.sampled_logprobs)]
    if not all(np.array_equal(x, y) for x, y in pairs):
        raise AssertionError("old and new parsers disagree")


def best_s(fns: Sequence[Callable[[], object]], repeats: int, min_s: float = 2.0) -> list[float]:
    """Best wall time of each function, run in alternation at least ``repeats`` times and for at least
    ``min_s`` seconds in all (load from other processes comes in bursts; the best run is the one it
    missed), after one untimed round (first touches of the heap pages the allocations grow into)."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    start, rounds = time.perf_counter(), 0
    while rounds < repeats or (time.perf_counter() - start < min_s and rounds < 100):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t)
        rounds += 1
    return best


def run(n: int, repeats: int) -> list[dict[str, Any]]:
    out = []
    for k in KS:
        tokens, content = response(n, k)
        entries = msgspec.json.decode(content)["choices"][0]["prompt_logprobs"][1:]
        extra = sum(len(e) > k for e in entries) / len(entries)
        for label, rows in row_sets(n).items():
            req = ScoreRequest(tokens, k, rows)
            _same(old_rows(content, req), parse_completion(content, req))
            fns: list[Callable[[], object]] = [functools.partial(old_rows, content, req),
                                               functools.partial(parse_completion, content, req),
                                               functools.partial(_RAW.decode, content)]
            old_s, new_s, scan_s = best_s(fns, repeats)
            out.append({"k": k, "rows": label, "n_rows": req.n_rows, "bytes_per_token": len(content) / n,
                        "extra": extra, "old_us": old_s / n * 1e6, "new_us": new_s / n * 1e6,
                        "scan_us": scan_s / n * 1e6})
    return out


def table(results: list[dict[str, Any]], n: int) -> str:
    lines = [f"vLLM prompt_logprobs parse, one sequence of {n} tokens, V={VOCAB:,}; us per sequence token "
             f"(best of runs); {date.today().isoformat()}, {platform.machine()} CPU, `python -m bench.vllm_parse`",
             "", "| k | rows | k+1 | JSON bytes/token | old us/token | new us/token | old/new | scan us/token |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['k']} | {r['rows']} ({r['n_rows']}) | {r['extra']:.0%} | {r['bytes_per_token']:,.0f} | "
                     f"{r['old_us']:.1f} | {r['new_us']:.1f} | {r['old_us'] / r['new_us']:.1f}x | {r['scan_us']:.1f} |")
    by = {(r["k"], r["rows"]): r for r in results}
    lo, hi = by[(KS[0], "all")], by[(KS[-1], "all")]
    size = hi["bytes_per_token"] / lo["bytes_per_token"]
    lines += ["", f"k={KS[-1]} / k={KS[0]} (all rows): old {hi['old_us'] / lo['old_us']:.1f}x, "
              f"new {hi['new_us'] / lo['new_us']:.1f}x, scan {hi['scan_us'] / lo['scan_us']:.1f}x "
              f"(JSON bytes {size:.1f}x); "
              f"new k={KS[-1]} / old k={KS[0]}: {hi['new_us'] / lo['old_us']:.1f}x"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.vllm_parse", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    print(table(run(args.tokens, args.repeats), args.tokens))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
