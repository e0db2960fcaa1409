"""Codec round trip versus a plain memory copy and the reference system's JSON (+gzip) wire format.

Run: ``python -m bench.codec`` (``--markdown`` prints the table for bench/RESULTS.md).

One scored group (8 sequences x 4096 tokens, k=20, vocab 32000) goes numpy -> wire -> numpy:

(a) ``encode`` + ``decode`` with structural checks only, (b) the same with full value validation,
(c) ``np.copy`` of a uint8 array as large as the encoded message (the bar the codec is held to),
(c') ``np.copyto`` into a preallocated buffer (pure bandwidth, for context), (d) the reference format:
nested lists (tokens, masks, inference_logprobs, distill ids/logprobs as [seq][pos][k+1]) through
``json.dumps``/``json.loads`` and back to numpy, (e) the same plus gzip level 9 both ways.
Parts of (a): (a1) ``encode`` (into a buffer sized up front), (a1') msgspec's plain ``Encoder.encode``
(what ``encode`` did before: a buffer regrown 1.5x at a time), (a2) ``decode`` with structural checks,
(a2') msgspec's decode alone.
Fast variants run in alternating blocks, so load changes on the machine hit them alike. (a), (a1),
(a1') and (c) run again after (d) and (e) (rows marked *): the ~40 MB of JSON those build and free
churn the malloc heap, which is where a regrown output buffer gets moved (copied) by ``realloc``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from datetime import date
from typing import Any

import msgspec
import numpy as np

from bench.provenance import cpu_model as cpu_model  # noqa: PLC0414 (re-exported: other rows import it from here)
from bench.provenance import git_commit
from schemas.build import synthetic_rollout, synthetic_scored
from schemas.codec import _DECODER, _ENCODER, decode, encode
from schemas.messages import ScoredGroup
from schemas.validate import Limits

SEQS, LEN, K, VOCAB = 8, 4096, 20, 32000


def reference_json(s: ScoredGroup) -> bytes:
    """numpy -> the reference ScoredDataGroup JSON: ``[seq][pos][k+1]`` distill entries per position.

    Entry 0 is empty, as there; so is the entry of every other position the payload holds no row for
    (with the default payloads, teacher rows ship for trained positions only, so prompt positions are
    empty). Entry ``r + 1`` holds row ``r``: the sampled token ``tokens[r + 1]`` and its logprob, then
    the top-k.
    """
    assert s.teacher is not None
    obj: dict[str, Any] = {"tokens": [], "masks": [], "inference_logprobs": [], "scores": [],
                           "distill_token_ids": [], "distill_logprobs": []}
    for seq, t in zip(s.group.sequences, s.teacher, strict=True):
        tok, mask = seq.tokens.numpy(), seq.loss_mask.numpy().astype(bool)
        lp = seq.logprobs.numpy() if seq.logprobs is not None else np.zeros(tok.shape, np.float32)
        obj["tokens"].append(tok.tolist())
        obj["masks"].append(np.where(mask, tok, -100).tolist())
        obj["inference_logprobs"].append(np.where(mask, lp, 1.0).tolist())
        obj["scores"].append(seq.score)
        rows = t.row_index(len(tok))
        ids = np.concatenate([tok[rows + 1, None], t.topk_ids.numpy()], axis=1)
        lps = np.concatenate([t.sampled_logprobs.numpy()[:, None], t.topk_logprobs.numpy()], axis=1)
        dense_ids: list[list[int]] = [[] for _ in range(len(tok))]
        dense_lps: list[list[float]] = [[] for _ in range(len(tok))]
        for r, i, p in zip(rows.tolist(), ids.tolist(), lps.tolist(), strict=True):
            dense_ids[r + 1], dense_lps[r + 1] = i, p
        obj["distill_token_ids"].append(dense_ids)
        obj["distill_logprobs"].append(dense_lps)
    return json.dumps(obj).encode()


def reference_rows(entries: list[list[Any]], dtype: type[np.generic]) -> np.ndarray[Any, Any]:
    """One sequence's distill entries -> ``[R, k+1]`` array of the positions that hold a row, in order."""
    held = [e for e in entries if e]
    return np.asarray(held, dtype) if held else np.zeros((0, 0), dtype)


def reference_back(data: bytes) -> list[tuple[np.ndarray[Any, Any], ...]]:
    """The reference JSON -> numpy arrays per sequence (tokens, masks, logprobs, distill ids, logprobs);
    the distill arrays hold the rows of the positions that have an entry (``reference_rows``)."""
    return reference_arrays(json.loads(data))


def reference_arrays(obj: dict[str, Any]) -> list[tuple[np.ndarray[Any, Any], ...]]:
    """One parsed reference group -> numpy arrays per sequence, as ``reference_back``."""
    return [
        (
            np.asarray(obj["tokens"][i], np.int32),
            np.asarray(obj["masks"][i], np.int32),
            np.asarray(obj["inference_logprobs"][i], np.float32),
            reference_rows(obj["distill_token_ids"][i], np.int32),
            reference_rows(obj["distill_logprobs"][i], np.float32),
        )
        for i in range(len(obj["tokens"]))
    ]


def timed(fns: dict[str, Callable[[], object]], rounds: int, block: int = 1) -> dict[str, list[float]]:
    """Seconds per call: ``rounds`` rounds, each running every function ``block`` times in a row.

    Blocks give each variant its steady state (caches as in a worker's loop); alternating rounds spread
    changes of machine load evenly over the variants.
    """
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(block):
                t0 = time.perf_counter()
                fn()
                out[name].append(time.perf_counter() - t0)
    return out


def run(rounds: int, block: int, ref_reps: int, gzip_reps: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    msg = synthetic_scored(synthetic_rollout(SEQS, LEN, vocab=VOCAB, seed=1), K, vocab=VOCAB)
    structural, full = Limits(check_values=False), Limits()
    data = encode(msg)
    assert data == _ENCODER.encode(msg)  # byte for byte what msgspec writes
    wire = np.frombuffer(data, np.uint8)
    dst = np.empty_like(wire)
    back = decode(data, full, expect=ScoredGroup)  # correctness first: the arrays come back
    assert back.teacher is not None and msg.teacher is not None
    assert np.array_equal(back.teacher[3].topk_logprobs.numpy(), msg.teacher[3].topk_logprobs.numpy())

    # The fast variants run before the reference builds ~40 MB of JSON strings; the encode variants and
    # the copy run again after it, on the heap that garbage leaves behind (rows marked *).
    fast = timed(
        {
            "a": lambda: decode(encode(msg), structural),
            "b": lambda: decode(encode(msg), full),
            "a1": lambda: encode(msg),
            "a1'": lambda: _ENCODER.encode(msg),
            "a2": lambda: decode(data, structural),
            "a2'": lambda: _DECODER.decode(data),
            "c": wire.copy,
            "c'": lambda: np.copyto(dst, wire),
        },
        rounds,
        block,
    )
    ref = reference_json(msg)
    ref_arrays = reference_back(ref)
    assert np.array_equal(ref_arrays[3][3][:, 1:], msg.teacher[3].topk_ids.numpy())
    assert np.array_equal(ref_arrays[3][4][:, 1:], msg.teacher[3].topk_logprobs.numpy())
    gz_bytes: list[int] = []

    def gzip_round_trip() -> list[tuple[np.ndarray[Any, Any], ...]]:
        z = gzip.compress(reference_json(msg), compresslevel=9)
        gz_bytes.append(len(z))
        return reference_back(gzip.decompress(z))

    slow = timed({"d": lambda: reference_back(reference_json(msg))}, ref_reps)
    slow |= timed({"e": gzip_round_trip}, gzip_reps)
    churned = timed(
        {
            "a*": lambda: decode(encode(msg), structural),
            "a1*": lambda: encode(msg),
            "a1'*": lambda: _ENCODER.encode(msg),
            "c*": wire.copy,
        },
        rounds,
        block,
    )
    times = fast | slow | churned
    sizes = dict.fromkeys(fast | churned, len(data)) | {"d": len(ref), "e": gz_bytes[-1]}
    labels = {
        "a": "codec, structural checks (Limits(check_values=False))",
        "b": "codec, full validation (default Limits)",
        "a1": "part of (a): encode only (buffer sized up front)",
        "a1'": "context: msgspec Encoder.encode (buffer regrown 1.5x; encode before this change)",
        "a2": "part of (a): decode + structural checks only",
        "a2'": "context: msgspec decode alone, no checks",
        "c": "memcpy: np.copy of uint8[encoded size]",
        "c'": "np.copyto into a preallocated buffer (context)",
        "d": "reference: nested lists + json.dumps/loads + np.asarray",
        "e": "reference + gzip level 9 both ways",
        "a*": "(a) after (d) and (e): malloc heap churned by their JSON",
        "a1*": "(a1) after (d) and (e)",
        "a1'*": "(a1') after (d) and (e)",
        "c*": "(c) after (d) and (e): the memcpy the * rows are compared with",
    }
    best_e = min(times["e"])
    rows = []
    for key, ts in times.items():
        c = times["c*" if key.endswith("*") else "c"]
        rows.append({
            "key": key,
            "label": labels[key],
            "runs": len(ts),
            "best_ms": min(ts) * 1e3,
            "median_ms": statistics.median(ts) * 1e3,
            "bytes": sizes[key],
            "memcpy_ratio_best": min(c) / min(ts),
            "memcpy_ratio_median": statistics.median(c) / statistics.median(ts),
            "x_faster_than_e": best_e / min(ts),
        })
    info = {
        "date": date.today().isoformat(),
        "commit": git_commit(),
        "cpu": cpu_model(),
        "nproc": os.cpu_count(),
        "load": os.getloadavg(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "msgspec": msgspec.__version__,
    }
    return rows, info


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| | variant | runs | best ms | median ms | bytes | memcpy/x (best) | memcpy/x (median) | x faster than (e) |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    body = [
        f"| ({r['key']}) | {r['label']} | {r['runs']} | {r['best_ms']:.3f} | {r['median_ms']:.3f} | {r['bytes']:,} "
        f"| {r['memcpy_ratio_best']:.2f} | {r['memcpy_ratio_median']:.2f} | {r['x_faster_than_e']:,.0f} |"
        for r in rows
    ]
    return "\n".join([head, *body])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=30, help="rounds over the fast variants (a, b, c, ...)")
    p.add_argument("--block", type=int, default=20, help="consecutive runs of one fast variant per round")
    p.add_argument("--ref-reps", type=int, default=3, help="runs of the reference JSON round trip (d)")
    p.add_argument("--gzip-reps", type=int, default=1, help="runs of the reference with gzip (e), ~10 s each")
    p.add_argument("--markdown", action="store_true", help="print only the markdown table and machine line")
    args = p.parse_args()
    rows, info = run(args.rounds, args.block, args.ref_reps, args.gzip_reps)
    load = ", ".join(f"{x:.2f}" for x in info["load"])
    machine = (
        f"{info['date']}, commit {info['commit']}; CPU {info['cpu']}, nproc {info['nproc']}, load average {load}; "
        f"Python {info['python']}, numpy {info['numpy']}, msgspec {info['msgspec']}"
    )
    if not args.markdown:
        print(f"one scored group: {SEQS} sequences x {LEN} tokens, k={K}, vocab {VOCAB}")
    print(machine + "\n")
    print(table(rows))
    a, churned = (next(r for r in rows if r["key"] == key) for key in ("a", "a*"))
    print(
        f"\ntargets: memcpy/codec >= 0.8: best {a['memcpy_ratio_best']:.2f}, median {a['memcpy_ratio_median']:.2f} "
        f"(churned heap: best {churned['memcpy_ratio_best']:.2f}, median {churned['memcpy_ratio_median']:.2f}); "
        f">= 1000x faster than (e): {a['x_faster_than_e']:,.0f}x"
    )


if __name__ == "__main__":
    main()
