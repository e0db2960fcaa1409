"""Constructors from numpy arrays, and a synthetic group generator for tests and benchmarks."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence as Seq
from typing import Any

import numpy as np
import numpy.typing as npt

from schemas.arrays import FLOAT16, FLOAT32, INT32, UINT8, Array
from schemas.messages import DistillStatus, RolloutGroup, ScoredGroup, Sequence, TeacherPayload


def no_teacher_reason(group_overrides: dict[str, Any] | None) -> str | None:
    """Why a group gets no teacher at all (``group_overrides.teacher_top_k`` of -1 or below), e.g.
    ``"teacher_top_k=-3: no teacher"``; None when it gets one."""
    k = (group_overrides or {}).get("teacher_top_k")
    if isinstance(k, int) and not isinstance(k, bool) and k <= -1:
        return f"teacher_top_k={k}: no teacher"
    return None


def make_sequence(
    tokens: npt.ArrayLike,
    loss_mask: npt.ArrayLike,
    *,
    prompt_len: int | None = None,
    logprobs: npt.ArrayLike | None = None,
    score: float = 0.0,
    overrides: dict[str, Any] | None = None,
    messages: list[dict[str, Any]] | None = None,
    advantages: npt.ArrayLike | None = None,
    ref_logprobs: npt.ArrayLike | None = None,
) -> Sequence:
    """Build a ``Sequence``; ``prompt_len`` defaults to the first trainable position. Every per-token array
    must hold one value per token: otherwise ``ValueError`` naming it (``logprobs: 5 values for 8 tokens``)."""
    tok = np.asarray(tokens, dtype=np.int32)
    mask = np.asarray(loss_mask).astype(np.uint8)
    for name, a in (("loss_mask", mask), ("logprobs", logprobs), ("advantages", advantages),
                    ("ref_logprobs", ref_logprobs)):
        shape = None if a is None else np.shape(a)
        if shape is not None and shape != tok.shape:
            what = f"{shape[0]} values" if len(shape) == 1 else f"shape {shape}"
            raise ValueError(f"{name}: {what} for {tok.shape[0] if tok.ndim == 1 else tok.shape} tokens "
                             "(one per token)")
    if prompt_len is None:
        nz = np.flatnonzero(mask)
        prompt_len = int(nz[0]) if nz.size else int(tok.shape[0])

    def f32(a: npt.ArrayLike | None) -> Array | None:
        return None if a is None else Array.from_numpy(np.asarray(a), FLOAT32)

    lp = None
    if logprobs is not None:
        lp = np.where(mask.astype(bool), np.asarray(logprobs, dtype=np.float32), np.float32(0.0))
    return Sequence(
        tokens=Array.from_numpy(tok, INT32),
        loss_mask=Array.from_numpy(mask, UINT8),
        prompt_len=prompt_len,
        logprobs=f32(lp),
        score=float(score),
        overrides=overrides,
        messages=messages,
        advantages=f32(advantages),
        ref_logprobs=f32(ref_logprobs),
    )


def make_teacher(
    topk_ids: npt.ArrayLike,
    topk_logprobs: npt.ArrayLike,
    sampled_logprobs: npt.ArrayLike,
    *,
    fp16: bool = False,
    rows: npt.ArrayLike | None = None,
) -> TeacherPayload:
    """A payload from ``[R, k]`` top-k arrays and ``[R]`` sampled logprobs; ``rows`` names the ``R`` rows
    (``None``: all ``L - 1``)."""
    ids = np.asarray(topk_ids, dtype=np.int32)
    return TeacherPayload(
        k=int(ids.shape[1]),
        topk_ids=Array.from_numpy(ids, INT32),
        topk_logprobs=Array.from_numpy(np.asarray(topk_logprobs), FLOAT16 if fp16 else FLOAT32),
        sampled_logprobs=Array.from_numpy(np.asarray(sampled_logprobs), FLOAT32),
        rows=None if rows is None else Array.from_numpy(np.asarray(rows, dtype=np.int32), INT32),
    )


def trained_rows(seq: Sequence) -> npt.NDArray[np.int32]:
    """The teacher rows the learner trains on: ``r`` with ``loss_mask[r + 1] == 1``."""
    return np.flatnonzero(seq.loss_mask.numpy()[1:]).astype(np.int32)


def synthetic_rollout(
    num_seqs: int = 8,
    seq_len: int | Seq[int] = 64,
    *,
    vocab: int = 1000,
    prompt_len: int = 8,
    group_id: str | None = None,
    policy_version: int = 0,
    seed: int = 0,
    group_overrides: dict[str, Any] | None = None,
) -> RolloutGroup:
    """A random but valid rollout group (sequences may have unequal lengths)."""
    rng = np.random.default_rng(seed)
    lens = [seq_len] * num_seqs if isinstance(seq_len, int) else list(seq_len)
    seqs = []
    for n in lens:
        tok = rng.integers(0, vocab, n, dtype=np.int32)
        mask = np.zeros(n, np.uint8)
        mask[min(prompt_len, n - 1) :] = 1
        mask[0] = 0
        lp = -rng.exponential(1.0, n).astype(np.float32)
        seqs.append(make_sequence(tok, mask, logprobs=lp, score=float(rng.random())))
    return RolloutGroup(
        group_id=group_id or uuid.uuid4().hex,
        sequences=seqs,
        policy_version=policy_version,
        created_at=time.time(),
        group_overrides=group_overrides,
    )


def synthetic_teacher(
    seq: Sequence, k: int, *, vocab: int = 1000, seed: int = 0, fp16: bool = False, all_rows: bool = False
) -> TeacherPayload:
    """A random teacher payload that obeys the position convention for ``seq``: the trained rows only,
    or every row with ``all_rows``."""
    rng = np.random.default_rng(seed)
    tok = seq.tokens.numpy()
    index = np.arange(tok.shape[0] - 1, dtype=np.int32) if all_rows else trained_rows(seq)
    rows = index.shape[0]
    ids = np.empty((rows, k), np.int32)
    for r in range(rows):  # distinct ids per row
        ids[r] = rng.choice(vocab, size=k, replace=False)
    lps = np.sort(-rng.exponential(2.0, (rows, k)).astype(np.float32), axis=1)[:, ::-1]
    sampled = lps[:, -1] - rng.exponential(1.0, rows).astype(np.float32)
    hit = ids == tok[index + 1, None]
    has = hit.any(axis=1)
    sampled[has] = lps[has, hit[has].argmax(axis=1)]
    if fp16:
        lps16 = lps.astype(np.float16).astype(np.float32)
        sampled[has] = lps16[has, hit[has].argmax(axis=1)]
    return make_teacher(ids, lps, sampled, fp16=fp16, rows=None if all_rows else index)


def synthetic_scored(
    rollout: RolloutGroup, k: int = 20, *, vocab: int = 1000, seed: int = 0, all_rows: bool = False
) -> ScoredGroup:
    seqs = rollout.sequences
    return ScoredGroup(
        group=rollout,
        status=DistillStatus.OK,
        teacher=[synthetic_teacher(s, k, vocab=vocab, seed=seed + i, all_rows=all_rows) for i, s in enumerate(seqs)],
        k=k,
        teacher_id="synthetic",
        scored_at=time.time(),
    )
