"""Validation of decoded messages. Every failure is a ``DecodeError`` naming the field.

Two levels:

* structural (always): dtypes, shapes, byte lengths, lengths consistent across fields, k within the
  bound, sequence counts, schema version. O(number of arrays), reading only array headers.
* values (``Limits.check_values``, on by default): logprobs finite, teacher logprobs in
  ``(Limits.logprob_floor, Limits.logprob_tolerance]`` (``teacher_logprob_problem``), ids non-negative and
  below the vocabulary, masks 0/1, and the teacher position convention spot-checked on a spread of rows (the
  sampled token's logprob agrees with its top-k entry, rows are sorted). Single-pass reductions. A cross-tokenizer
  payload (``TeacherPayload.chunk_last``/``topk_mapped``, see ``schemas.messages``) skips the spot check, which does
  not hold for chunk sums and mapped slots, and gets its own: ``chunk_last`` in {0, 1, 2} and ending every trained
  span, ``sampled_logprobs`` 0.0 off chunk ends, ``topk_mapped`` 0/1 with the mapped slots first and sorted.

Teacher logprobs: a genuine one is at most 0 and, at temperature 1 (teachers score raw logits), a few tens
to about -100 at the very least likely token of a 151,936-token vocabulary (float32 or bfloat16 logits of a
trained model span well under +-100, so ``log_softmax`` stays well above -200; a top-k tail is far higher
still). ``LOGPROB_FLOOR`` (-1000) leaves a margin of ten; at or below it is a sentinel, not a logprob:
vLLM's server writes -9999.0 for a logprob of -inf. A value at or below the floor, above
``logprob_tolerance`` (float rounding may leave a log-softmax a hair above 0), NaN or infinite raises
``InvalidLogprobs``; the teacher stage drops such a group's payload as ``invalid_logprobs``, and every reader
(feeder, learner) refuses it again, so no such value reaches a batch.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Final, NoReturn

import numpy as np
import numpy.typing as npt

from schemas.arrays import (
    _DTYPES,
    _ITEMSIZE,
    FLOAT16,
    FLOAT16_MAX_RELATIVE_ERROR,
    FLOAT32,
    INT32,
    UINT8,
    Array,
    ArrayError,
)
from schemas.errors import WireFormatError
from schemas.messages import (
    SCHEMA_VERSION,
    BatchManifest,
    DistillStatus,
    Message,
    RolloutGroup,
    ScoredGroup,
    Sequence,
    TeacherPayload,
    TrainBatch,
)
from schemas.pools import TEACHER_FIELD, pool_problem

MiB = 1 << 20

_I32 = (INT32,)
_U8 = (UINT8,)
_F32 = (FLOAT32,)
_LOGPROB = (FLOAT32, FLOAT16)
_I32_DTYPE = np.dtype(INT32)
_F32_DTYPE = np.dtype(FLOAT32)
_UNSIGNED = {INT32: np.dtype("<u4")}  # same-size unsigned view of each id dtype
_INT32_LIMIT = 1 << 31
_MAX, _MIN, _ALL, _ANY = np.maximum.reduce, np.minimum.reduce, np.logical_and.reduce, np.logical_or.reduce

#: One checked teacher payload: ``(name, topk_ids [rows, k], topk_logprobs [rows, k], sampled_logprobs)``.
_Payload = tuple[str, npt.NDArray[np.generic], npt.NDArray[np.generic], npt.NDArray[np.generic]]
#: A payload queued for the position-convention spot check: ``(name, topk_ids, topk_logprobs, sampled,
#: labels, rows)``, ``labels[j]`` the token row ``j`` predicts and ``rows`` the payload's row indices
#: (``None``: row ``j`` is row ``j``), used to name the row in errors.
_Convention = tuple[str, npt.NDArray[np.generic], npt.NDArray[np.generic], npt.NDArray[np.generic],
                    npt.NDArray[np.generic], npt.NDArray[np.generic] | None]


#: Teacher logprobs at or below this are refused (see the module docstring for why -1000).
LOGPROB_FLOOR: Final = -1000.0


class DecodeError(WireFormatError, ValueError):
    """A message is not a valid distillq message. ``field`` names where it went wrong."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class InvalidLogprobs(DecodeError):
    """A teacher logprob that is NaN, infinite, above 0 or at/below ``Limits.logprob_floor``."""


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds a reader enforces. Configure them from settings; defaults suit most deployments."""

    max_bytes: int = 512 * MiB
    max_k: int = 256
    max_seq_len: int = 1 << 20
    max_sequences: int = 4096
    vocab_size: int | None = None
    check_values: bool = True
    check_rows: int = 32  # teacher rows spot-checked for the position convention
    logprob_tolerance: float = 1e-3  # how far above 0 a logprob may be (float rounding)
    logprob_floor: float = LOGPROB_FLOOR  # a teacher logprob at or below it is a sentinel (vLLM's -9999)


def _bad_array(a: Array, name: str, dtypes: tuple[str, ...], ndim: int) -> NoReturn:
    try:
        a.check(name)
    except ArrayError as e:
        raise DecodeError(name, str(e).split(": ", 1)[-1]) from None
    if a.dtype not in dtypes:
        raise DecodeError(name, f"dtype {a.dtype} (expected {' or '.join(dtypes)})")
    raise DecodeError(name, f"shape {a.shape} has {len(a.shape)} dims (expected {ndim})")


def _shape(a: Array, name: str, field: str, dtypes: tuple[str, ...], ndim: int) -> tuple[int, ...]:
    """Check dtype, dims and byte length from the header alone; the field name is built only on error."""
    shape = a.shape
    if a.dtype in dtypes and len(shape) == ndim:
        size = _ITEMSIZE[a.dtype]
        for d in shape:
            if d < 0:
                break
            size *= d
        else:
            data = a.data
            if data.nbytes == size and data.ndim == 1 and data.itemsize == 1:
                return shape
    _bad_array(a, name + field, dtypes, ndim)


def _finite(x: npt.NDArray[np.generic], name: str, field: str = "") -> None:
    """No inf or nan in ``x`` (float32 or float16); the field name ``name + field`` is built only on error."""
    if not x.size:
        return
    # float16: exponent bits all ones <=> inf or nan (float16 arithmetic is slow). float32: one pass,
    # faster than a float64 sum or min+max on the unaligned views decoding yields. The ufunc reductions
    # are called directly: ``ndarray.all``/``max`` add a Python-level wrapper per call.
    if x.dtype == np.float16:
        ok = int(_MAX(np.bitwise_and(x.view(np.uint16), 0x7C00), axis=None)) != 0x7C00
    else:
        ok = bool(_ALL(np.isfinite(x), axis=None))
    if not ok:
        bad = int(np.flatnonzero(~np.isfinite(x.reshape(-1)))[0])
        raise DecodeError(name + field, f"non-finite value at flat index {bad}")


@functools.lru_cache(maxsize=64)
def _f16_bounds(floor: float, ceiling: float) -> tuple[int, int]:
    """float16 bit patterns for ``teacher_logprob_problem``: the largest int16 view of a value ``<= ceiling``,
    and the smallest uint16 view of a negative value ``<= floor``."""
    top = np.float16(ceiling)
    if float(top) > ceiling:
        top = np.nextafter(top, np.float16(-np.inf))
    low = np.float16(floor)
    if float(low) > floor:
        low = np.nextafter(low, np.float16(-np.inf))
    return int(np.array(top, np.float16).view(np.int16)), int(np.array(low, np.float16).view(np.uint16))


def teacher_logprob_problem(x: npt.NDArray[np.generic], limits: Limits) -> tuple[int, float] | None:
    """``(flat index, value)`` of the first value of ``x`` (teacher logprobs, float32 or float16) that is NaN,
    infinite, above ``limits.logprob_tolerance`` or at/below ``limits.logprob_floor``; None when all are valid
    (``logprob_fault`` says what is wrong with the value).

    Two reductions on the fast path. float32: min and max (NaN propagates, so it fails both comparisons).
    float16 (whose arithmetic is slow): on the bits, a non-negative value above the ceiling (or +inf, +NaN) has
    the larger int16 view, a negative value at or below the floor (or -inf, -NaN) the larger uint16 view.
    """
    if not x.size:
        return None
    floor, ceiling = limits.logprob_floor, limits.logprob_tolerance
    if x.dtype == np.float16:
        top, low = _f16_bounds(floor, ceiling)
        if int(_MAX(x.view(np.int16), axis=None)) <= top and int(_MAX(x.view(np.uint16), axis=None)) < low:
            return None
    elif float(_MIN(x, axis=None)) > floor and float(_MAX(x, axis=None)) <= ceiling:
        return None
    flat = x.reshape(-1).astype(np.float64)
    i = int(np.flatnonzero(~((flat > floor) & (flat <= ceiling)))[0])
    return i, float(flat[i])


def logprob_fault(v: float, limits: Limits) -> str:
    """What is wrong with a logprob ``teacher_logprob_problem`` found."""
    if not math.isfinite(v):
        return "not finite"
    if v > limits.logprob_tolerance:
        return "above 0"
    return f"at or below the floor {limits.logprob_floor:g} (a sentinel such as vLLM's -9999, not a logprob)"


def _logprobs(x: npt.NDArray[np.generic], name: str, field: str, limits: Limits) -> None:
    """Raise ``InvalidLogprobs`` naming ``name + field`` unless ``teacher_logprob_problem`` finds none."""
    bad = teacher_logprob_problem(x, limits)
    if bad is None:
        return
    i, v = bad
    if not math.isfinite(v):
        raise InvalidLogprobs(name + field, f"non-finite value at flat index {i}")
    raise InvalidLogprobs(name + field, f"logprob {v:g} at flat index {i} {logprob_fault(v, limits)}")


def _ids(x: npt.NDArray[np.generic], name: str, field: str, limits: Limits) -> None:
    """Token ids (int32) in ``[0, vocab_size)`` (``>= 0`` without a vocabulary), in one pass.

    Viewed as unsigned, a negative int32 is ``>= 2**31``, so the unsigned maximum is below
    ``min(vocab_size, 2**31)`` exactly when every id is in range; the minimum (and, with a vocabulary,
    the maximum) is computed only to name the offending id.
    """
    if not x.size:
        return
    vocab = limits.vocab_size
    bound = _INT32_LIMIT if vocab is None else min(vocab, _INT32_LIMIT)
    if int(_MAX(x.view(_UNSIGNED[x.dtype.str]), axis=None)) < bound:
        return
    lo = int(_MIN(x, axis=None))
    if lo < 0:
        raise DecodeError(name + field, f"negative token id {lo}")
    raise DecodeError(name + field, f"token id {int(_MAX(x, axis=None))} outside vocabulary of {vocab}")


def _per_token(a: Array | None, name: str, field: str, n: int, limits: Limits) -> None:
    if a is None:
        return
    if _shape(a, name, field, _F32, 1)[0] != n:
        raise DecodeError(name + field, f"length {a.shape[0]} != {n} tokens")
    if limits.check_values:
        _finite(np.frombuffer(a.data, _F32_DTYPE), name, field)


def validate_sequence(seq: Sequence, name: str, limits: Limits) -> None:
    n = _shape(seq.tokens, name, ".tokens", _I32, 1)[0]
    if n < 1 or n > limits.max_seq_len:
        raise DecodeError(f"{name}.tokens", f"length {n} outside [1, {limits.max_seq_len}]")
    if _shape(seq.loss_mask, name, ".loss_mask", _U8, 1)[0] != n:
        raise DecodeError(f"{name}.loss_mask", f"length {seq.loss_mask.shape[0]} != {n} tokens")
    if not 0 <= seq.prompt_len <= n:
        raise DecodeError(f"{name}.prompt_len", f"{seq.prompt_len} outside [0, {n}]")
    _per_token(seq.logprobs, name, ".logprobs", n, limits)
    _per_token(seq.advantages, name, ".advantages", n, limits)
    _per_token(seq.ref_logprobs, name, ".ref_logprobs", n, limits)
    for i, (start, end) in enumerate(seq.spans or ()):
        if not 0 < start <= end <= n:
            raise DecodeError(f"{name}.spans[{i}]", f"[{start}, {end}) outside (0, {n}]")
    if limits.check_values:
        _ids(np.frombuffer(seq.tokens.data, _I32_DTYPE), name, ".tokens", limits)
        mask = np.frombuffer(seq.loss_mask.data, np.uint8)
        if int(_MAX(mask)) > 1:
            raise DecodeError(f"{name}.loss_mask", "values must be 0 or 1")
        if _ANY(mask[: max(seq.prompt_len, 1)]):
            raise DecodeError(f"{name}.loss_mask", "prompt positions (and position 0) must be 0")


def _row_index(t: TeacherPayload, mask: npt.NDArray[np.generic], name: str) -> npt.NDArray[np.int32] | None:
    """``t.rows`` checked against a sequence with loss mask ``mask`` (``[L]``): strictly increasing rows in
    ``[0, L - 1)`` that include every trained row. ``None`` when the payload holds all rows."""
    if t.rows is None:
        return None
    _shape(t.rows, name, ".rows", _I32, 1)
    idx: npt.NDArray[np.int32] = np.frombuffer(t.rows.data, _I32_DTYPE)
    n_rows = mask.shape[0] - 1
    if idx.shape[0] and (int(idx[0]) < 0 or int(idx[-1]) >= n_rows or not _ALL(idx[1:] > idx[:-1])):
        raise DecodeError(f"{name}.rows", f"must be strictly increasing rows in [0, {n_rows})")
    held = np.zeros(max(n_rows, 0), np.bool_)
    held[idx] = True
    missing = np.flatnonzero(mask[1:].astype(np.bool_) & ~held)
    if missing.shape[0]:
        r = int(missing[0])
        raise DecodeError(f"{name}.rows", f"trained row {r} (loss_mask[{r + 1}] = 1) has no teacher row")
    return idx


def _teacher(t: TeacherPayload, mask: npt.NDArray[np.generic], name: str, limits: Limits) -> _Payload | None:
    """Check one payload against a sequence with loss mask ``mask`` (``[L]``); return its arrays for the
    convention check."""
    if not 1 <= t.k <= limits.max_k:
        raise DecodeError(f"{name}.k", f"{t.k} outside [1, {limits.max_k}]")
    idx = _row_index(t, mask, name)
    n = mask.shape[0] - 1 if idx is None else idx.shape[0]
    what = "L-1 rows of k, logits-aligned" if idx is None else "one row of k per entry of rows"
    rows = (n, t.k)
    if _shape(t.topk_ids, name, ".topk_ids", _I32, 2) != rows:
        shape = t.topk_ids.shape
        raise DecodeError(f"{name}.topk_ids", f"shape {shape} != {rows} ({what})")
    if _shape(t.topk_logprobs, name, ".topk_logprobs", _LOGPROB, 2) != rows:
        shape = t.topk_logprobs.shape
        raise DecodeError(f"{name}.topk_logprobs", f"shape {shape} != {rows} ({what})")
    if _shape(t.sampled_logprobs, name, ".sampled_logprobs", _F32, 1) != (n,):
        shape = t.sampled_logprobs.shape
        raise DecodeError(f"{name}.sampled_logprobs", f"shape {shape} != ({n},)")
    cross = t.chunk_last is not None or t.topk_mapped is not None
    if cross:
        for field, a, want in ((".chunk_last", t.chunk_last, (n,)), (".topk_mapped", t.topk_mapped, rows)):
            if a is None:
                raise DecodeError(name + field, "missing: a cross-tokenizer payload carries chunk_last and "
                                                "topk_mapped together")
            if _shape(a, name, field, _U8, len(want)) != want:
                raise DecodeError(name + field, f"shape {a.shape} != {want}")
    if not limits.check_values:
        return None
    # Flat views (the shapes were just checked): the value checks need no shape, the convention
    # check reshapes the two it indexes by row.
    ids = np.frombuffer(t.topk_ids.data, _I32_DTYPE)
    lps = np.frombuffer(t.topk_logprobs.data, _DTYPES[t.topk_logprobs.dtype])
    sampled = np.frombuffer(t.sampled_logprobs.data, _F32_DTYPE)
    _ids(ids, name, ".topk_ids", limits)
    _logprobs(lps, name, ".topk_logprobs", limits)
    _logprobs(sampled, name, ".sampled_logprobs", limits)
    if cross:  # the position convention does not hold (chunk sums, mapped slots): its own checks instead
        _cross(t, mask, idx, lps.reshape(rows), sampled, name, limits)
        return None
    return name, ids.reshape(rows), lps.reshape(rows), sampled


def _cross(t: TeacherPayload, mask: npt.NDArray[np.generic], idx: npt.NDArray[np.int32] | None,
           lps: npt.NDArray[Any], sampled: npt.NDArray[np.generic], name: str, limits: Limits) -> None:
    """A cross-tokenizer payload's values: ``chunk_last`` in {0, 1, 2} and not 0 on the last row of a trained
    span (a chunk never straddles trained and untrained tokens); ``sampled_logprobs`` 0.0 where ``chunk_last !=
    1``; ``topk_mapped`` 0/1 with the mapped slots first and sorted by logprob (within ``logprob_tolerance``)."""
    assert t.chunk_last is not None and t.topk_mapped is not None  # checked by the caller
    last = np.frombuffer(t.chunk_last.data, np.uint8)
    if last.size and int(_MAX(last)) > 2:
        raise DecodeError(f"{name}.chunk_last", "values must be 0, 1 or 2")
    off = last != 1
    if _ANY(sampled[off] != 0.0):
        j = int(np.flatnonzero(off & (sampled != 0.0))[0])
        raise DecodeError(f"{name}.sampled_logprobs", f"entry {j} is {float(sampled[j]):g} where chunk_last is "
                                                      f"{int(last[j])} (must be 0.0: no chunk ends there)")
    trained = mask[1:].astype(np.bool_)
    ends = np.flatnonzero(trained & ~np.append(trained[1:], False))  # the last row of each trained span
    at = ends if idx is None else np.searchsorted(idx, ends)
    if at.shape[0] and _ANY(last[at] == 0):
        r = int(ends[np.flatnonzero(last[at] == 0)[0]])
        raise DecodeError(f"{name}.chunk_last", f"row {r} ends a trained span inside a chunk (must be 1 or 2)")
    mapped: npt.NDArray[Any] = np.frombuffer(t.topk_mapped.data, np.uint8).reshape(lps.shape)
    if mapped.size and int(_MAX(mapped, axis=None)) > 1:
        raise DecodeError(f"{name}.topk_mapped", "values must be 0 or 1")
    if int(lps.shape[1]) > 1:
        early = mapped[:, 1:] > mapped[:, :-1]
        if _ANY(early, axis=None):
            j = int(np.flatnonzero(_ANY(early, axis=1))[0])
            raise DecodeError(f"{name}.topk_mapped", f"entry {j}: an empty slot before a mapped one (mapped first)")
        rise = (lps[:, 1:].astype(np.float32) - lps[:, :-1].astype(np.float32)) > limits.logprob_tolerance
        rise &= mapped[:, 1:].view(np.bool_)
        if _ANY(rise, axis=None):
            j = int(np.flatnonzero(_ANY(rise, axis=1))[0])
            raise DecodeError(f"{name}.topk_logprobs", f"entry {j}: mapped slots not sorted by logprob, highest "
                                                      "first")


def _convention_part(part: _Payload, t: TeacherPayload, tokens: npt.NDArray[np.generic]) -> _Convention:
    """``part`` with the labels its rows predict (``tokens[r + 1]``) and its row indices."""
    if t.rows is None:
        return (*part, tokens[1:], None)
    idx = np.frombuffer(t.rows.data, _I32_DTYPE)
    return (*part, tokens.take(idx + 1), idx)


@functools.lru_cache(maxsize=1024)
def _spot_rows(n_rows: int, m: int) -> npt.NDArray[np.intp]:
    """``m`` distinct rows evenly spread over ``n_rows`` (first and last included)."""
    rows = np.arange(m) * (n_rows - 1) // max(m - 1, 1)
    rows.flags.writeable = False  # shared by every caller
    return rows


def _check_convention(parts: list[_Convention], limits: Limits) -> None:
    """Row r must describe token r+1: its sampled logprob matches its top-k entry or lies below row r.

    Spot-checks up to ``limits.check_rows`` evenly spread rows of every payload, all payloads at once
    (they share k): rows sorted (within ``logprob_tolerance``) and the sampled logprob agreeing with the
    sampled token's top-k entry, or not above the row's last entry when the token is not in the top k (that
    no logprob is above 0 is checked on every value by ``_logprobs`` first). Each part is ``(name, topk_ids,
    topk_logprobs, sampled_logprobs, labels, rows)`` (see ``_Convention``) with the top-k arrays shaped
    ``[R, k]``.
    """
    picked: list[tuple[str, npt.NDArray[np.generic], float]] = []
    g_ids, g_lps, g_sampled, g_labels = [], [], [], []
    check_rows = limits.check_rows
    for name, ids, lps, sampled, labels_of, index in parts:
        n_rows = ids.shape[0]
        if n_rows:
            rows = _spot_rows(n_rows, min(check_rows, n_rows))
            named = rows if index is None else index.take(rows)
            picked.append((name, named, FLOAT16_MAX_RELATIVE_ERROR if lps.dtype == np.float16 else 0.0))
            g_ids.append(ids.take(rows, 0))
            g_lps.append(lps.take(rows, 0))
            g_sampled.append(sampled.take(rows))
            g_labels.append(labels_of.take(rows))
    if not picked:
        return
    r_ids = np.concatenate(g_ids)
    r_lps = np.concatenate(g_lps, dtype=np.float64)
    r_sampled = np.concatenate(g_sampled, dtype=np.float64)
    labels = np.concatenate(g_labels)
    m, k = r_lps.shape
    atol = limits.logprob_tolerance
    tol: float | npt.NDArray[np.float64] = atol
    if any(p[2] for p in picked):  # float16 top-k: its rounding error grows with the magnitude
        tol = atol + np.repeat([p[2] for p in picked], [len(p[1]) for p in picked]) * np.abs(r_sampled)

    def fail(flat: npt.NDArray[np.bool_], field: str, reason: str) -> NoReturn:
        i = int(np.flatnonzero(flat)[0])
        for name, rows, _ in picked:
            if i < len(rows):
                raise DecodeError(f"{name}.{field}", reason.format(r=int(rows[i]), token=int(labels[i])))
            i -= len(rows)
        raise AssertionError("unreachable")  # pragma: no cover

    if k > 1:
        rise = r_lps[:, 1:] - r_lps[:, :-1]
        if _MAX(rise, axis=None) > atol:
            fail(_ANY(rise > atol, axis=1), "topk_logprobs", "row {r} is not sorted by logprob, highest first")
    hit = (r_ids == labels[:, None]).reshape(-1)
    at = np.arange(0, m * k, k)
    at += hit.reshape(m, k).argmax(axis=1)  # flat index of each row's first hit (its start when none)
    # In the top k: |entry - sampled| within tolerance. Not in it: sampled not above the row's last entry.
    err = np.where(hit.take(at), np.abs(r_lps.reshape(-1).take(at) - r_sampled), r_sampled - r_lps[:, -1])
    bad = err > tol
    if _ANY(bad):
        fail(
            bad,
            "sampled_logprobs",
            "row {r} disagrees with top-k for token {token}: "
            "teacher arrays must be logits-aligned (row r predicts tokens[r+1])",
        )


def validate_rollout(g: RolloutGroup, limits: Limits, name: str = "group") -> None:
    if not g.group_id:
        raise DecodeError(f"{name}.group_id", "empty")
    if not 1 <= len(g.sequences) <= limits.max_sequences:
        got = len(g.sequences)
        raise DecodeError(f"{name}.sequences", f"{got} sequences outside [1, {limits.max_sequences}]")
    for i, s in enumerate(g.sequences):
        validate_sequence(s, f"{name}.sequences[{i}]", limits)
    k = g.overrides.get("teacher_top_k")
    if k is not None and (not isinstance(k, int) or isinstance(k, bool)):
        raise DecodeError(f"{name}.group_overrides.teacher_top_k", f"must be an integer, got {k!r}")
    pool = g.overrides.get(TEACHER_FIELD)
    if pool is not None and (problem := pool_problem(pool)) is not None:
        raise DecodeError(f"{name}.group_overrides.{TEACHER_FIELD}", problem)


def validate_teacher_part(s: ScoredGroup, limits: Limits, name: str = "scored") -> None:
    """The teacher half of a scored group, assuming its rollout half (``s.group``) is valid.

    Status and payloads agree (an OK group has one payload per sequence, each with the group's k; any
    other status has none, and DROPPED has a reason), every payload has its sequence's shapes and valid
    values, and the position convention holds on the spot-checked rows. ``validate_scored`` runs it
    after ``validate_rollout``; the teacher stage runs it alone on the groups it scores, whose rollout
    half was validated when it was decoded.
    """
    if s.status is DistillStatus.OK:
        teacher, seqs = s.teacher, s.group.sequences
        if teacher is None or len(teacher) != len(seqs):
            got = "none" if teacher is None else len(teacher)
            raise DecodeError(f"{name}.teacher", f"{got} payloads for {len(seqs)} sequences")
        parts: list[_Convention] = []
        for i, (t, seq) in enumerate(zip(teacher, seqs, strict=True)):
            if t.k != s.k:
                raise DecodeError(f"{name}.teacher[{i}].k", f"{t.k} != group k {s.k}")
            part = _teacher(t, seq.loss_mask.numpy(), f"{name}.teacher[{i}]", limits)
            if part is not None:
                parts.append(_convention_part(part, t, seq.tokens.numpy()))
        if parts:
            _check_convention(parts, limits)
    elif s.teacher is not None:
        raise DecodeError(f"{name}.teacher", f"payload present with status {s.status.value}")
    elif s.status is DistillStatus.DROPPED and not s.reason:
        raise DecodeError(f"{name}.reason", "a dropped payload needs a reason")


def validate_scored(s: ScoredGroup, limits: Limits, name: str = "scored") -> None:
    validate_rollout(s.group, limits, f"{name}.group")
    if (problem := pool_problem(s.pool)) is not None:
        raise DecodeError(f"{name}.pool", problem)
    validate_teacher_part(s, limits, name)


def validate_batch(b: TrainBatch, limits: Limits) -> None:
    seqs = [seq for g in b.groups for seq in g.group.sequences]
    if len(b.advantages) != len(seqs):
        raise DecodeError("batch.advantages", f"{len(b.advantages)} arrays for {len(seqs)} sequences")
    for i, g in enumerate(b.groups):
        validate_scored(g, limits, f"batch.groups[{i}]")
    for i, (a, seq) in enumerate(zip(b.advantages, seqs, strict=True)):
        _per_token(a, f"batch.advantages[{i}]", "", seq.length, limits)


def validate(msg: Message, limits: Limits) -> None:
    """Raise ``DecodeError`` unless ``msg`` is a valid message under ``limits``.

    The reference implementation of every rule; ``validate_decoded`` is the fast path in front of it.
    """
    if msg.schema > SCHEMA_VERSION or msg.schema < 1:
        raise DecodeError("schema", f"version {msg.schema} not supported (this reader: 1..{SCHEMA_VERSION})")
    if isinstance(msg, RolloutGroup):
        validate_rollout(msg, limits)
    elif isinstance(msg, ScoredGroup):
        validate_scored(msg, limits)
    elif isinstance(msg, BatchManifest):
        validate_manifest(msg, limits)
    else:
        validate_batch(msg, limits)


def validate_manifest(m: BatchManifest, limits: Limits) -> None:
    """A batch by reference: at least one group, each named once with a key and tokens >= 0; finite weights and
    stats."""
    if not 1 <= len(m.refs) <= limits.max_sequences:
        raise DecodeError("batch.refs", f"{len(m.refs)} groups outside [1, {limits.max_sequences}]")
    seen: set[str] = set()
    for i, r in enumerate(m.refs):
        if not r.group_id or not r.key:
            raise DecodeError(f"batch.refs[{i}]", "empty group id or payload key")
        if r.tokens < 0:
            raise DecodeError(f"batch.refs[{i}].tokens", f"negative: {r.tokens}")
        if r.group_id in seen:
            raise DecodeError(f"batch.refs[{i}]", f"group {r.group_id!r} appears twice")
        seen.add(r.group_id)
    for name, v in (("kl_coef", m.kl_coef), ("reward_weight", m.reward_weight), *(m.stats or {}).items()):
        if not math.isfinite(v):
            raise DecodeError(f"batch.{name}", f"not finite: {v}")
