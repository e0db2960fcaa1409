"""Fast structural verdict for freshly decoded messages, in front of ``schemas.validate``.

``validate_decoded`` is what ``schemas.codec.decode`` calls: with ``check_values=False`` a flat yes/no
check runs first, and only a message it does not accept (or any message when values are checked) goes
through ``validate``, which raises the precise ``DecodeError``.
"""

from __future__ import annotations

import numpy as np

from schemas.arrays import FLOAT16, FLOAT32, INT32, UINT8, Array
from schemas.messages import SCHEMA_VERSION, DistillStatus, Message, RolloutGroup, ScoredGroup, Sequence, TrainBatch
from schemas.pools import TEACHER_FIELD, pool_problem
from schemas.validate import Limits, validate

# --- fast structural path for decoded messages -------------------------------------------------------
#
# ``validate`` walks every array through functions that can name the failing field; for a 5.7 MB group
# (48 arrays) that is ~19 us of Python, a sixth of a memory copy of the message on a machine with a big
# cache. The functions below give only a verdict, with one flat loop per message and a handful of
# attribute reads and comparisons per array: every expected shape is a tuple built once per sequence,
# which one ``==`` checks (dims, their count, and non-negativity, since the lengths it is built from are
# checked first); byte lengths are compared with the shape's product directly. They return True only
# when ``validate`` with ``check_values=False`` would accept the message; anything else (including any
# doubt) goes to ``validate``, which then raises the precise ``DecodeError``. So the rules live in
# ``validate`` and the fast path can only be stricter, never laxer (tests/unit/test_codec*.py compare
# the two on valid and mutated messages).
#
# They assume what ``schemas.codec.decode`` guarantees: every ``Array.data`` is a flat byte view
# (msgspec slices it out of the 1-D byte buffer that decode hands it), so ``len(data)`` is its byte
# length (and reads faster than ``data.nbytes``).


_I32 = np.dtype("<i4")


def _sequences_ok(seqs: list[Sequence], max_len: int) -> bool:
    for s in seqs:
        a = s.tokens
        shape = a.shape
        if len(shape) != 1 or a.dtype != INT32:
            return False
        n = shape[0]
        if not 0 < n <= max_len or len(a.data) != 4 * n:
            return False
        one = (n,)
        a = s.loss_mask
        if a.shape != one or a.dtype != UINT8 or len(a.data) != n or not 0 <= s.prompt_len <= n:
            return False
        n4 = 4 * n
        # Unrolled: a loop over a tuple of the three costs a third more here.
        f = s.logprobs
        if f is not None and (f.shape != one or f.dtype != FLOAT32 or len(f.data) != n4):
            return False
        f = s.advantages
        if f is not None and (f.shape != one or f.dtype != FLOAT32 or len(f.data) != n4):
            return False
        f = s.ref_logprobs
        if f is not None and (f.shape != one or f.dtype != FLOAT32 or len(f.data) != n4):
            return False
        if s.spans and not all(0 < start <= end <= n for start, end in s.spans):
            return False
    return True


def _held_rows(rows: Array, seq: Sequence) -> int:
    """How many rows ``rows`` names if they are valid for ``seq`` (see ``validate._row_index``), else -1."""
    n_rows = seq.tokens.shape[0] - 1
    r = rows.shape[0] if len(rows.shape) == 1 else -1
    if r < 0 or rows.dtype != INT32 or len(rows.data) != 4 * r:
        return -1
    idx = np.frombuffer(rows.data, _I32)
    if r and (idx[0] < 0 or idx[-1] >= n_rows or not (idx[1:] > idx[:-1]).all()):
        return -1
    held = np.zeros(n_rows, np.bool_)
    held[idx] = True
    trained = np.frombuffer(seq.loss_mask.data, np.uint8)[1:].view(np.bool_)
    return -1 if (trained & ~held).any() else r


def _rollout_ok(g: RolloutGroup, limits: Limits) -> bool:
    seqs = g.sequences
    if not g.group_id or not 0 < len(seqs) <= limits.max_sequences or not _sequences_ok(seqs, limits.max_seq_len):
        return False
    if g.group_overrides:
        k = g.group_overrides.get("teacher_top_k")
        if k is not None and type(k) is not int:
            return False
        pool = g.group_overrides.get(TEACHER_FIELD)
        if pool is not None and pool_problem(pool) is not None:
            return False
    return True


def _scored_ok(s: ScoredGroup, limits: Limits) -> bool:
    if not _rollout_ok(s.group, limits) or pool_problem(s.pool) is not None:
        return False
    teacher = s.teacher
    if s.status is not DistillStatus.OK:
        return teacher is None and (s.status is not DistillStatus.DROPPED or bool(s.reason))
    seqs = s.group.sequences
    k = s.k
    if teacher is None or len(teacher) != len(seqs) or not 0 < k <= limits.max_k:
        return False
    for t, seq in zip(teacher, seqs, strict=True):
        rows = seq.tokens.shape[0] - 1
        if t.rows is not None:
            rows = _held_rows(t.rows, seq)
            if rows < 0:
                return False
        shape = (rows, k)
        nb = 4 * rows * k
        a = t.topk_ids
        if t.k != k or a.shape != shape or a.dtype != INT32 or len(a.data) != nb:
            return False
        a = t.topk_logprobs
        if a.shape != shape or len(a.data) != (nb if a.dtype == FLOAT32 else nb // 2 if a.dtype == FLOAT16 else -1):
            return False
        a = t.sampled_logprobs
        if a.shape != (rows,) or a.dtype != FLOAT32 or len(a.data) != 4 * rows:
            return False
        c, m = t.chunk_last, t.topk_mapped  # a cross-tokenizer payload: both, uint8 [rows] and [rows, k]
        if (c is not None or m is not None) and (
                c is None or m is None or c.shape != (rows,) or c.dtype != UINT8 or len(c.data) != rows
                or m.shape != shape or m.dtype != UINT8 or len(m.data) != rows * k):
            return False
    return True


def _batch_ok(b: TrainBatch, limits: Limits) -> bool:
    advantages = b.advantages
    i = 0
    for g in b.groups:
        if not _scored_ok(g, limits):
            return False
        for seq in g.group.sequences:
            if i == len(advantages):
                return False
            a = advantages[i]
            n = seq.tokens.shape[0]
            if a.shape != (n,) or a.dtype != FLOAT32 or len(a.data) != 4 * n:
                return False
            i += 1
    return i == len(advantages)


def _structure_ok(msg: Message, limits: Limits) -> bool:
    """True only if ``validate(msg, replace(limits, check_values=False))`` would pass (decoded ``msg``)."""
    if not 0 < msg.schema <= SCHEMA_VERSION:
        return False
    if isinstance(msg, ScoredGroup):
        return _scored_ok(msg, limits)
    if isinstance(msg, RolloutGroup):
        return _rollout_ok(msg, limits)
    if isinstance(msg, TrainBatch):
        return _batch_ok(msg, limits)
    return False


def validate_decoded(msg: Message, limits: Limits) -> None:
    """``validate`` for a message fresh from msgspec (arrays are flat byte views): same errors, faster.

    Structural checks alone (``check_values=False``) take the fast path when the message is valid; value
    checks and every error go through ``validate``.
    """
    if limits.check_values or not _structure_ok(msg, limits):
        validate(msg, limits)
