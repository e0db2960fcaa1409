"""The transformers teacher at real shapes: peak memory, time per token, and tokens computed per group.

Run: ``python -m bench.hf_teacher`` (``--markdown`` adds the date and CPU line for bench/RESULTS.md).

The model is the real-vocabulary tiny model (``ensure_real_vocab_model``: random Llama, hidden 64, 2 layers,
vocabulary 151,936); k = 64. Every case runs in its own fresh subprocess, which loads the model, resets
its peak RSS (``/proc/self/clear_refs``), scores, and reports ``VmHWM - VmRSS(loaded)``:

* **new, 8 x 4096**: one group, a 1024-token prompt shared by 8 sequences of 3072 completion tokens each,
  the completion rows requested (what ``Scorer`` asks for), ``HFTeacher`` defaults.
* **new, 8 x 1024, all rows**: 8 unrelated random sequences, every row: the old code's workload.
* **old, 8 x 1024**: the previous ``HFTeacher._forward`` algorithm (``bench.teacher.bare``) as the baseline: full
  ``[tokens, V]`` logits, float32 log-softmax over all rows, top-k. Run with ``--old-batch-tokens`` padded
  tokens per forward (default 2048, two sequences; 8192 scores all 8 at once and peaks near 15 GB).
* **counts**: a 1024-token prompt + 8 x 1024 completions, completion rows: tokens through the base model
  and rows through lm_head against ``G x L`` and ``G x (L - 1)``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from datetime import date
from typing import Any

import numpy as np

K = 64
GROUP = 8


def _status(field: str) -> float:
    """A ``/proc/self/status`` field in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> float:
    """Reset VmHWM to the current RSS (Linux ``clear_refs`` 5); returns the RSS in MiB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def group_requests(prompt: int, completion: int, vocab: int, seed: int = 0) -> list[Any]:
    """One group: ``GROUP`` sequences sharing a ``prompt``-token prompt, completion rows requested."""
    from pipeline.teacher.base import ScoreRequest

    rng = np.random.default_rng(seed)
    shared = rng.integers(0, vocab, prompt, dtype=np.int32)
    n = prompt + completion
    rows = np.arange(prompt - 1, n - 1, dtype=np.int32)  # row r predicts tokens[r + 1]: the completion tokens
    return [
        ScoreRequest(np.concatenate([shared, rng.integers(0, vocab, completion, dtype=np.int32)]), K, rows)
        for _ in range(GROUP)
    ]


async def _new(model: Any, reqs: list[Any]) -> dict[str, Any]:
    from pipeline.teacher.base import ScoreResult
    from pipeline.teacher.hf import HFTeacher

    teacher = HFTeacher(model=model)
    await teacher.start()
    base_tokens, base_rows = teacher.tokens_computed, teacher.rows_computed  # the start-up probes
    t0 = time.perf_counter()
    out = teacher.score_sync(reqs)
    seconds = time.perf_counter() - t0
    assert all(isinstance(o, ScoreResult) for o in out)
    res = {
        "seconds": seconds,
        "tokens_computed": teacher.tokens_computed - base_tokens,
        "rows_computed": teacher.rows_computed - base_rows,
        "sharing": teacher.sharing,
    }
    await teacher.close()
    return res


def run_case(case: str, threads: int, old_budget: int) -> dict[str, Any]:
    """One case in this process: load, reset the peak, score, measure."""
    import torch

    from pipeline.demo.tinymodels import ensure_real_vocab_model
    from pipeline.models.weights import load_causal_lm

    torch.set_num_threads(threads)
    model = load_causal_lm(ensure_real_vocab_model())
    vocab = int(model.config.vocab_size)
    rng = np.random.default_rng(1)
    if case == "old-1024":
        from bench.teacher import bare  # the algorithm before row selection and chunking

        seqs = [rng.integers(0, vocab, 1024, dtype=np.int32) for _ in range(GROUP)]
        rss0 = _reset_peak()
        t0 = time.perf_counter()
        rows = bare(model, seqs, K, old_budget)
        res: dict[str, Any] = {"seconds": time.perf_counter() - t0, "tokens_computed": GROUP * 1024}
        res["rows_computed"] = rows
    else:
        from pipeline.teacher.base import ScoreRequest

        if case == "new-1024-all":
            reqs = [ScoreRequest(rng.integers(0, vocab, 1024, dtype=np.int32), K) for _ in range(GROUP)]
        else:
            reqs = group_requests(1024, 3072 if case == "new-4096" else 1024, vocab)
        rss0 = _reset_peak()
        res = asyncio.run(_new(model, reqs))
        res["rows"] = sum(r.n_rows for r in reqs)
    res["peak_mib"] = _status("VmHWM") - rss0
    res["tokens"] = GROUP * (4096 if case == "new-4096" else 2048 if case == "counts" else 1024)
    res["case"] = case
    return res


def _spawn(case: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.hf_teacher", "--case", case, "--threads", str(args.threads),
           "--old-batch-tokens", str(args.old_batch_tokens)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"case {case} failed:\n{proc.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def table(res: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    new, allr, old, cnt = res["new-4096"], res["new-1024-all"], res["old-1024"], res["counts"]
    rows_full = GROUP * 4095
    lines = [
        f"vocab 151,936, k={K}, hidden 64, {args.threads} torch threads; HFTeacher defaults (chunk_positions 256, "
        f"max_batch_tokens 16384, min_shared_prefix 32); old code at {args.old_batch_tokens} padded tokens per forward",
        "",
        "| case | peak RSS above model | wall s | ms / token | ms / row | rows scored |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r, label in ((new, "(a) new: 1 group 8 x 4096, prompt 1024 shared, completion rows"),
                     (allr, "new: 8 x 1024 unrelated, all rows (the old workload)"),
                     (old, "(b) old unchunked: 8 x 1024, all rows")):  # fmt: skip
        rows = r["rows_computed"]
        lines.append(
            f"| {label} | {r['peak_mib']:,.0f} MiB | {r['seconds']:.2f} | {1e3 * r['seconds'] / r['tokens']:.3f} | "
            f"{1e3 * r['seconds'] / rows:.3f} | {rows:,} |"
        )
    speed = (old["seconds"] / old["tokens"]) / (new["seconds"] / new["tokens"])
    lines += [
        "",
        f"(a) target <= 1,536 MiB: **{'met' if new['peak_mib'] <= 1536 else 'NOT met'}** ({new['peak_mib']:,.0f} MiB; "
        f"the [tokens, V] float32 logits alone would be {GROUP * 4096 * 151936 * 4 / 2**20:,.0f} MiB). "
        f"(b) time per sequence token, new at 8 x 4096 vs old at 8 x 1024: **{speed:.1f}x** faster "
        f"(rows {new['rows_computed']:,} of {rows_full:,}, sharing {'on' if new['sharing'] else 'off'}).",
        "",
        "| (c) one group: prompt 1024 + 8 x 1024 completions | computed | G x full length | ratio |",
        "|---|---:|---:|---:|",
        f"| tokens through the base model | {cnt['tokens_computed']:,} | {GROUP * 2048:,} | "
        f"{cnt['tokens_computed'] / (GROUP * 2048):.1%} |",
        f"| rows through lm_head | {cnt['rows_computed']:,} | {GROUP * 2047:,} | "
        f"{cnt['rows_computed'] / (GROUP * 2047):.1%} |",
    ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--old-batch-tokens", type=int, default=2048, help="old code: padded tokens per forward")
    p.add_argument("--case", choices=["new-4096", "new-1024-all", "old-1024", "counts"], help=argparse.SUPPRESS)
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, args.threads, args.old_batch_tokens)))
        return
    res = {c: _spawn(c, args) for c in ("new-4096", "new-1024-all", "old-1024", "counts")}
    if args.markdown:
        from bench.codec import cpu_model

        load = os.getloadavg()[0]
        print(f"{date.today().isoformat()}, {cpu_model()}, load average {load:.1f} at the end, "
              "`python -m bench.hf_teacher --markdown`\n")  # fmt: skip
    print(table(res, args))


if __name__ == "__main__":
    main()
