"""Chunk-level reverse KL of cross-tokenizer payloads, in numpy: the feeder side of
``pipeline.learner.crosstok.chunk_reverse_kl_advantages`` (tests/unit/test_crossscore.py holds the two equal).

A payload from a teacher of another tokenizer (``TeacherPayload.chunk_last``, see ``schemas.messages``) gives the
teacher's log-probability ``q_c`` of each aligned chunk on the chunk's last row. Every trained token of chunk ``c``
gets the advantage ``coef * (q_c - s_c)``, with ``s_c`` the sum of the sampler's logprobs over the chunk's trained
tokens; a chunk with no teacher signal (``chunk_last`` 2) gets 0. ``sum(s_c - q_c)`` over a sequence's chunks with
signal is its single-sample reverse KL; ``chunk_kl`` returns it with the trained tokens of those chunks (the
``GroupHeader.kl_sum``/``kl_tokens`` of such a group).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from schemas.messages import Sequence, TeacherPayload


def chunk_reverse_kl_advantages(
    teacher_chunk_logprobs: npt.NDArray[Any], chunk_last: npt.NDArray[Any], student_logprobs: npt.NDArray[Any],
    mask: npt.NDArray[Any], coef: float = 1.0,
) -> npt.NDArray[np.float32]:
    """``[N]`` per-token ``coef * (q_c - s_c)`` (one sequence; the arguments as in
    ``pipeline.learner.crosstok.chunk_reverse_kl_advantages``: ``teacher_chunk_logprobs`` read where
    ``chunk_last``, ``nan`` there for a chunk with no signal; 0 outside ``mask``)."""
    adv, _, _ = _chunks(teacher_chunk_logprobs, chunk_last, student_logprobs, mask)
    out: npt.NDArray[np.float32] = (np.float32(coef) * adv).astype(np.float32)
    return out


def _chunks(q_last: npt.NDArray[Any], last: npt.NDArray[Any], student: npt.NDArray[Any],
            mask: npt.NDArray[Any]) -> tuple[npt.NDArray[np.float32], float, int]:
    """Per-token ``q_c - s_c`` (0 outside ``mask`` and in chunks without signal), the sum of ``s_c - q_c`` over
    chunks with signal, and their trained tokens."""
    n = last.shape[0]
    m = np.asarray(mask).astype(np.bool_)
    q_last = np.asarray(q_last, np.float32)
    ids, signal, known = _index(q_last, last)
    s = np.where(m, np.asarray(student, np.float32), np.float32(0.0))
    s_c = np.zeros(n, np.float32)
    np.add.at(s_c, ids, s)  # float32 sums, as the torch implementation's scatter_add
    q_c = np.zeros(n, np.float32)
    q_c[ids[signal]] = q_last[signal]
    diff = np.where(known, q_c - s_c, np.float32(0.0))
    adv = np.where(m, diff[ids], np.float32(0.0)).astype(np.float32)
    in_signal = m & known[ids]
    return adv, float((s_c[known] - q_c[known]).sum(dtype=np.float64)), int(in_signal.sum())


def _index(q_last: npt.NDArray[Any], last: npt.NDArray[Any]) -> tuple[
        npt.NDArray[np.int64], npt.NDArray[np.bool_], npt.NDArray[np.bool_]]:
    """Each position's chunk index, where a chunk with teacher signal ends (``last`` and ``q_last`` not ``nan``),
    and per chunk index whether that chunk has signal."""
    ends = np.asarray(last).astype(np.bool_)
    ids: npt.NDArray[np.int64] = np.cumsum(ends) - ends
    signal = ends & ~np.isnan(q_last)
    known = np.zeros(ends.shape[0], np.bool_)
    known[ids[signal]] = True
    return ids, signal, known


def dense(seq: Sequence, t: TeacherPayload) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.bool_]]:
    """A cross payload spread over the sequence's ``L`` token positions: ``(q, last)``, ``q[p]`` the chunk
    logprob on token ``p`` where its chunk ends there (``nan`` for a chunk with no signal), ``last[p]`` whether
    a chunk ends on token ``p`` (row ``p - 1``)."""
    assert t.chunk_last is not None
    n = seq.length
    rows = t.row_index(n).astype(np.int64) + 1
    cl: npt.NDArray[Any] = t.chunk_last.numpy()
    q = np.zeros(n, np.float32)
    last = np.zeros(n, np.bool_)
    last[rows] = cl > 0
    q[rows] = np.where(cl == 1, t.sampled_logprobs.numpy().astype(np.float32), np.float32(np.nan))
    return q, last


def sequence_advantages(seq: Sequence, t: TeacherPayload, coef: float) -> npt.NDArray[np.float32]:
    """``[L]`` chunk reverse-KL advantages of one sequence with a cross payload (0 without student logprobs)."""
    if seq.logprobs is None or seq.length <= 1:
        return np.zeros(seq.length, np.float32)
    q, last = dense(seq, t)
    return chunk_reverse_kl_advantages(q, last, seq.logprobs.numpy(), seq.loss_mask.numpy(), coef)


def chunk_kl(seq: Sequence, t: TeacherPayload) -> tuple[float, int]:
    """Sum over the chunks with teacher signal of ``s_c - q_c``, and the trained tokens in them."""
    if seq.logprobs is None or seq.length <= 1:
        return 0.0, 0
    q, last = dense(seq, t)
    _, total, tokens = _chunks(q, last, seq.logprobs.numpy(), seq.loss_mask.numpy())
    return total, tokens


def cross_shares(seqs: list[Sequence], payloads: list[TeacherPayload]) -> tuple[int, int, int, float]:
    """Of a group's cross payloads: trained rows, those in chunks with teacher signal, trained rows with a mapped
    top-k slot, and the sum over those rows of the mapped probability mass."""
    trained = aligned = topk_rows = 0
    mass = 0.0
    for seq, t in zip(seqs, payloads, strict=True):
        if t.chunk_last is None or t.topk_mapped is None or seq.length <= 1:
            continue
        q, last = dense(seq, t)
        m = seq.loss_mask.numpy().astype(np.bool_)
        ids, _, known = _index(q, last)
        trained += int(m.sum())
        aligned += int((m & known[ids]).sum())
        mapped = t.topk_mapped.numpy().astype(np.bool_)
        has = mapped.any(axis=1)
        topk_rows += int(has.sum())
        lps = t.topk_logprobs.numpy().astype(np.float64)
        mass += float(np.exp(np.where(mapped, lps, -np.inf)).sum())
    return trained, aligned, topk_rows, mass
