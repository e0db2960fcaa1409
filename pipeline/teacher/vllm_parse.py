"""vLLM ``prompt_logprobs`` responses -> ``ScoreResult`` rows, vectorised.

A ``/v1/completions`` answer holds one ``prompt_logprobs`` entry per prompt token: entry 0 is null, entry
``p`` maps token ids (string keys) to ``{logprob, rank, decoded_token}`` for the top k of position ``p``
plus, when it is not among them, the prompt token itself (k or k+1 items, the prompt token first). Our
row ``r`` is entry ``r + 1``.

The bytes are decoded by msgspec into typed structs that keep only ``logprob`` (``rank`` and
``decoded_token`` are skipped without building objects), with integer keys. When a request wants a
minority of the rows (``ScoreRequest.rows``), positions are first cut into raw JSON slices and only the
wanted ones are decoded. The wanted rows then go through numpy at once: item counts, the prompt token's
logprob, the ``[R, k(+1)]`` matrices, and one stable descending ``argsort`` per matrix; no per-position
Python sort. ``topk_rows`` is shared with the SGLang parser.
"""

from __future__ import annotations

from itertools import chain
from operator import attrgetter
from typing import Final, cast

import msgspec
import numpy as np
import numpy.typing as npt

from pipeline.teacher.base import (
    MISALIGNED,
    ScoreFailure,
    ScoreOutcome,
    ScoreRequest,
    ScoreResult,
    empty_result,
    rows_sorted,
)

#: Largest token id a result can carry (int32).
MAX_ID: Final = np.iinfo(np.int32).max
#: Wanting fewer than this fraction of the rows decodes only the wanted positions (from raw slices);
#: above it one typed decode of the whole answer is cheaper. Measured 2026-11-24 on a 2-core CPU VM,
#: 2,048 tokens (the ``bench.vllm_parse`` response) at k = 20 and 256: the two cost the same near 70%;
#: at 30% the raw-slice path takes 0.6x the time, at 90% 1.1-1.2x.
SPARSE_BELOW: Final = 0.7


class Logprob(msgspec.Struct, gc=False):
    """One ``{logprob, rank, decoded_token}`` item; only ``logprob`` is decoded."""

    logprob: float


Entry = dict[int, Logprob] | None


class _Choice(msgspec.Struct):
    prompt_logprobs: list[Entry] | None = None


class _Completion(msgspec.Struct):
    choices: list[_Choice]


class _RawChoice(msgspec.Struct):
    prompt_logprobs: list[msgspec.Raw] | None = None


class _RawCompletion(msgspec.Struct):
    choices: list[_RawChoice]


_FULL: Final = msgspec.json.Decoder(_Completion)
_RAW: Final = msgspec.json.Decoder(_RawCompletion)
_ENTRY: Final = msgspec.json.Decoder(Entry)
_LOGPROB: Final = attrgetter("logprob")


def misaligned(why: str) -> ScoreFailure:
    return ScoreFailure(f"{MISALIGNED}: {why}", retryable=False)


def parse_completion(content: bytes, req: ScoreRequest) -> ScoreOutcome:
    """A ``/v1/completions`` response body -> the rows ``req`` wants (``misaligned`` on a bad answer)."""
    n, rows = int(req.tokens.shape[0]), req.row_index()
    if req.rows is None or rows.shape[0] >= SPARSE_BELOW * max(n - 1, 1):
        full = _FULL.decode(content).choices
        if len(full) != 1 or full[0].prompt_logprobs is None:
            return misaligned("response without prompt_logprobs")
        return parse_prompt_logprobs(full[0].prompt_logprobs, req.tokens, req.k, req.rows)
    raw = _RAW.decode(content).choices
    if len(raw) != 1 or raw[0].prompt_logprobs is None:
        return misaligned("response without prompt_logprobs")
    slices = raw[0].prompt_logprobs
    problem = _length_problem(len(slices), n, None if n == 0 else _ENTRY.decode(slices[0]))
    if problem:
        return misaligned(problem)
    return _rows_from_entries([_ENTRY.decode(slices[r + 1]) for r in rows.tolist()], rows, req.tokens, req.k)


def parse_prompt_logprobs(
    entries: list[Entry], tokens: npt.NDArray[np.int32], k: int, rows: npt.NDArray[np.int32] | None = None
) -> ScoreOutcome:
    """Decoded ``prompt_logprobs`` (``len(tokens)`` entries) -> rows ``rows`` (all when ``None``)."""
    n = int(tokens.shape[0])
    problem = _length_problem(len(entries), n, entries[0] if entries else None)
    if problem:
        return misaligned(problem)
    if rows is None:
        return _rows_from_entries(entries[1:], np.arange(max(n - 1, 0), dtype=np.int32), tokens, k)
    return _rows_from_entries([entries[r + 1] for r in rows.tolist()], rows, tokens, k)


def _length_problem(got: int, n: int, first: object) -> str | None:
    if got != n:
        return f"{got} prompt_logprobs entries for {n} tokens"
    if first is not None:
        return "entry 0 is not null"
    return None


def _rows_from_entries(
    entries: list[Entry], rows: npt.NDArray[np.int32], tokens: npt.NDArray[np.int32], k: int
) -> ScoreOutcome:
    """The wanted entries (entry ``i`` is row ``rows[i]``, position ``rows[i] + 1``) -> a result."""
    if not entries:
        return empty_result(k)
    if None in entries:
        return misaligned(f"position {int(rows[entries.index(None)]) + 1} has null (k={k})")
    dicts = cast(list[dict[int, Logprob]], entries)  # no None left
    r = len(dicts)
    counts = np.fromiter(map(len, dicts), np.int64, r)
    bad = np.flatnonzero((counts < k) | (counts > k + 1))
    if bad.size:
        i = int(bad[0])
        return misaligned(f"position {int(rows[i]) + 1} has {int(counts[i])} items (k={k})")
    wanted = tokens[rows.astype(np.int64) + 1]
    own = list(map(dict.get, dicts, wanted.tolist()))
    if None in own:
        i = own.index(None)
        return misaligned(f"position {int(rows[i]) + 1} lacks the prompt token {int(wanted[i])}")
    sampled = np.fromiter(map(_LOGPROB, cast(list[Logprob], own)), np.float32, r)  # no None left
    total = int(counts.sum())
    ids = np.fromiter(chain.from_iterable(dicts), np.int64, total)
    lps = np.fromiter(map(_LOGPROB, chain.from_iterable(map(dict.values, dicts))), np.float32, total)
    out = topk_rows(ids, lps, counts, k)
    if isinstance(out, str):
        return misaligned(out)
    return ScoreResult(out[0], out[1], sampled)


def topk_rows(
    ids: npt.NDArray[np.int64], lps: npt.NDArray[np.float32], counts: npt.NDArray[np.int64], k: int
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.float32]] | str:
    """Rows of ``counts[i]`` (k or k+1) items, flattened -> ``[R, k]`` ids and logprobs sorted descending.

    Rows shorter than the longest are padded with ``-inf`` (last after sorting). The sort is a stable
    descending argsort, so equal logprobs keep the server's order; rows already sorted with exactly k
    items (SGLang's answers) are not sorted again. Returns a problem string for an id outside int32.
    """
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) > MAX_ID):
        return f"token id {int(ids.min()) if int(ids.min()) < 0 else int(ids.max())} outside [0, {MAX_ID}]"
    r, m = int(counts.shape[0]), int(counts.max())
    if int(counts.min()) == m:
        id_mat, lp_mat = ids.reshape(r, m), lps.reshape(r, m)
    else:
        filled = np.arange(m) < counts[:, None]
        id_mat = np.zeros((r, m), np.int64)
        lp_mat = np.full((r, m), -np.inf, np.float32)
        id_mat[filled] = ids  # row-major order: exactly the flattened items, row after row
        lp_mat[filled] = lps
    if m == k and rows_sorted(lp_mat):
        return id_mat.astype(np.int32), np.ascontiguousarray(lp_mat)
    order = np.argsort(-lp_mat, axis=1, kind="stable")[:, :k]
    top_ids = np.take_along_axis(id_mat, order, axis=1).astype(np.int32)
    return top_ids, np.take_along_axis(lp_mat, order, axis=1)
