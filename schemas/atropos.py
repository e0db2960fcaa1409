"""Conversion to and from the reference system's ScoredDataGroup JSON (atropos).

Reference layout: per-token lists ``[seq][pos]``; ``masks`` holds -100 where a token is not trained on,
else a label (the token id, by convention); ``inference_logprobs`` holds 1.0 at masked positions;
``distill_token_ids``/``distill_logprobs`` are ``[seq][pos][k or k+1]``, entry ``p`` the teacher's
distribution for token ``p`` (entry 0 empty), the actual token first (added as item k + 1 when outside the
top k, as vLLM's prompt logprobs do). Our teacher arrays are logits-aligned (row ``r`` = their entry
``r + 1``), exactly ``k`` per row, sorted by logprob, and may hold only some rows (``TeacherPayload.rows``):
an entry without a row is ``[]``.

A group scored by a teacher of another tokenizer (``TeacherPayload.chunk_last``/``topk_mapped``) has chunk
log-probabilities and mapped top-k slots, and the reference layout has no chunks: ``to_atropos`` writes an entry
only where the teacher's view of the student token is per token (``_cross_entries``: the mapped slots with the
actual token first, empty slots left out), marks the group's ``teacher`` record ``"cross_tokenizer": true``, and
``rollout_from_atropos`` refuses the distill arrays of such a record.

Values a client sends come back equal: whatever our wire cannot carry exactly (float64 values, masks
other than -100/token id, per-sequence lists of another length, ``images``, ``env_id: null``) is kept
verbatim in ``metadata["_atropos"]`` and written back from there by ``to_atropos``. ``to_atropos`` also
writes extra keys (``group_id``, ``policy_version``, ``task_id``, ``created_at``, ``metadata``,
``discard``, ``distill_status``, ``distill_reason``, ``distill_top_k``, ``teacher_id``, ``scored_at``; and
``teacher``, the record of the teacher that scored it: ``{"pool", "model", "k"}``) that
``rollout_from_atropos`` reads back; the reference server drops them, and what it keeps (``ATROPOS_KEYS``)
decodes on its own.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from schemas.atropos_values import (
    _DEFAULT_LIMITS,
    ATROPOS_KEYS,
    F64,
    I64,
    MASKED,
    MASKED_LOGPROB,
    STASH,
    Render,
    _as_f32,
    _dict_or_none,
    _free_form,
    _ids,
    _list,
    _masks,
    _messages,
    _numbers,
    _objects,
    _per_token,
    _rename,
)
from schemas.build import make_sequence, make_teacher, no_teacher_reason
from schemas.messages import CHUNK_LAST, DistillStatus, RolloutGroup, ScoredGroup, TeacherPayload
from schemas.pools import pool_of, pool_problem
from schemas.validate import DecodeError, Limits, validate

__all__ = ["ATROPOS_KEYS", "CROSS_KEY", "DERIVED_PREFIX", "MASKED", "MASKED_LOGPROB", "STASH", "content_group_id",
           "rollout_from_atropos", "rollout_group_from_atropos", "to_atropos"]

#: In a scored group's ``teacher`` record: its teacher has another tokenizer than the student, so its distill
#: entries are the per-token part of a chunk-level payload (``to_atropos``); such entries are not read back.
CROSS_KEY: Final = "cross_tokenizer"
#: The prefix of a group id derived from the group's content (``content_group_id``).
DERIVED_PREFIX = "sha256-"


def content_group_id(obj: dict[str, Any]) -> str:
    """A stable group id for a ScoredDataGroup without one: the SHA-256 of its canonical JSON (keys sorted, no
    spaces), so the same group sent again (a retried post, a file pushed twice) gets the same id and is
    deduplicated."""
    canonical = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return DERIVED_PREFIX + hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _rollout(obj: dict[str, Any], gid: str, version: int, strict: bool) -> RolloutGroup:
    """The rollout half of ``obj`` (checked: tokens, masks and scores, one per sequence; with ``strict``, the
    per-token float arrays too)."""
    n_seqs = len(obj["tokens"])
    toks = [_ids(_numbers(_list(t, f"tokens[{s}]"), f"tokens[{s}]", ints=True), f"tokens[{s}]")
            for s, t in enumerate(obj["tokens"])]
    verbatim: dict[str, Any] = {}
    loss, masks_exact = _masks(obj["masks"], toks)
    if not masks_exact:
        verbatim["masks"] = obj["masks"]
    inf_render: Render = lambda a, s: np.where(loss[s], _as_f32(a, s), MASKED_LOGPROB)  # noqa: E731
    floats: dict[str, list[F64 | None]] = {}
    for key, render in (("inference_logprobs", inf_render), ("advantages", _as_f32), ("ref_logprobs", _as_f32)):
        floats[key], keep = _per_token(obj, key, toks, render, strict=strict)
        if keep:
            verbatim[key] = _free_form(obj[key], key, list[list[float] | None])
    messages, keep = _objects(obj, "messages", n_seqs, _messages)
    if keep:
        verbatim["messages"] = _free_form(obj["messages"], "messages", list[Any])
    overrides, keep = _objects(obj, "overrides", n_seqs, _dict_or_none)
    if keep:
        verbatim["overrides"] = _free_form(obj["overrides"], "overrides", list[Any])
    if obj.get("images") is not None:
        verbatim["images"] = _free_form(obj["images"], "images", Any)
    scores = _numbers(obj["scores"], lambda s: f"scores[{s}]", ints=False)
    env_id = obj.get("env_id")
    if env_id is None:
        verbatim["env_id"] = None
    meta = _dict_or_none(obj.get("metadata"), "metadata")
    if meta is not None:
        meta.pop(STASH, None)
    if verbatim:
        meta = {**(meta or {}), STASH: {"fields": verbatim, "metadata_null": meta is None}}
    seqs = [make_sequence(tok, loss[s], logprobs=floats["inference_logprobs"][s], score=float(scores[s]),
                          overrides=overrides[s], messages=messages[s], advantages=floats["advantages"][s],
                          ref_logprobs=floats["ref_logprobs"][s]) for s, tok in enumerate(toks)]
    return RolloutGroup(
        group_id=gid,
        sequences=seqs,
        env_id=0 if env_id is None else env_id,
        task_id=str(obj.get("task_id") or ""),
        policy_version=version,
        created_at=_float(obj, "created_at"),
        group_overrides=_dict_or_none(obj.get("group_overrides"), "group_overrides"),
        generation_params=_dict_or_none(obj.get("generation_params"), "generation_params"),
        metadata=meta,
        discard=bool(obj.get("discard", False)),
    )


def _entries(obj: dict[str, Any], key: str, s: int, n: int) -> list[Any]:
    e = _list(obj[key][s], f"{key}[{s}]")
    if len(e) != n:
        raise DecodeError(f"{key}[{s}]", f"{len(e)} entries != {n} tokens (one per token, entry 0 empty)")
    if e and e[0] is not None and e[0] != []:
        raise DecodeError(f"{key}[{s}][0]", "entry 0 must be empty or null (it has no prefix)")
    for p, x in enumerate(e[1:], start=1):
        if not isinstance(x, list):
            raise DecodeError(f"{key}[{s}][{p}]", f"expected a list, got {x!r:.40}")
    return e


@dataclass(frozen=True, slots=True)
class _Rows:
    """One sequence's non-empty entries: their rows, lengths, padded ids/logprobs and sampled logprobs."""

    rows: npt.NDArray[np.int64] | None  # None: every row 0..L-2 has an entry
    lengths: I64
    ids: I64
    lps: F64
    sampled: F64
    first_lowest: bool  # in every entry the first item's logprob is <= all others'


def _teacher_rows(obj: dict[str, Any], s: int, tok: npt.NDArray[np.generic]) -> _Rows:
    n = tok.shape[0]
    ids_e = _entries(obj, "distill_token_ids", s, n)
    lps_e = _entries(obj, "distill_logprobs", s, n)
    held = [p for p in range(1, n) if ids_e[p] or lps_e[p]]
    lengths = np.array([len(ids_e[p]) for p in held], np.int64)
    for p in held:
        if len(ids_e[p]) != len(lps_e[p]):
            key = "distill_token_ids" if not ids_e[p] else "distill_logprobs"
            raise DecodeError(f"{key}[{s}][{p}]", f"{len(lps_e[p])} logprobs for {len(ids_e[p])} ids")
    ends = np.cumsum(lengths)

    def at(key: str) -> Callable[[int], str]:  # flat item index -> the entry holding it
        return lambda i: f"{key}[{s}][{held[int(np.searchsorted(ends, i, side='right'))]}]"

    flat_ids = list(chain.from_iterable(ids_e[p] for p in held))
    ids = _ids(_numbers(flat_ids, at("distill_token_ids"), ints=True), at("distill_token_ids"))
    lps = _numbers(list(chain.from_iterable(lps_e[p] for p in held)), at("distill_logprobs"), ints=False)
    rows, width = len(held), int(lengths.max()) if held else 1
    pad_ids, pad_lps = np.full((rows, width), -1, np.int64), np.full((rows, width), -np.inf)
    row_of = np.repeat(np.arange(rows), lengths)
    col = np.arange(ids.shape[0]) - np.repeat(ends - lengths, lengths)
    pad_ids[row_of, col], pad_lps[row_of, col] = ids, lps
    labels = tok[np.array(held, np.int64)]
    hit = pad_ids == labels[:, None]
    sampled = pad_lps[np.arange(rows), hit.argmax(axis=1)]
    missing = ~hit.any(axis=1)
    if missing.any():  # only our own older output lacks the sampled token; it then carries its logprob aside
        extra = obj.get("distill_sampled_logprobs")
        given = extra[s] if isinstance(extra, list) and len(extra) == len(obj["tokens"]) else None
        if not isinstance(given, list) or len(given) != n:
            raise DecodeError(f"distill_token_ids[{s}][{held[int(np.flatnonzero(missing)[0])]}]",
                              f"sampled token {int(labels[missing][0])} has no logprob in the entry")
        sampled[missing] = _numbers([given[p] for p in held], f"distill_sampled_logprobs[{s}]", ints=False)[missing]
    others = (col_grid := np.arange(width)) >= 1
    rest = np.where(others & (col_grid < lengths[:, None]), pad_lps, np.inf).min(axis=1, initial=np.inf)
    first_lowest = bool((pad_lps[:, 0] <= rest).all()) and not missing.any()
    index = None if len(held) == n - 1 else np.array(held, np.int64) - 1
    return _Rows(index, lengths, pad_ids, pad_lps, sampled, first_lowest)


def _group_k(obj: dict[str, Any], group: RolloutGroup, rows: list[_Rows], limits: Limits) -> int:
    """k: our ``distill_top_k``, else the shortest entry (one less when every entry has the same length and
    its first item, the actual token, lowest: the token then lies outside the top k everywhere), capped
    by ``group_overrides.teacher_top_k``."""
    key, k = "distill_top_k", obj.get("distill_top_k")
    override = group.overrides.get("teacher_top_k")
    if override is not None and (not isinstance(override, int) or isinstance(override, bool)):
        raise DecodeError("group_overrides.teacher_top_k", f"must be an integer, got {override!r}")
    if k is None:
        k = _inferred_k(rows, ambiguous_below=override is None)
        key = "distill_token_ids"
        if override is not None:
            key, k = "group_overrides.teacher_top_k", max(override, 1) if k is None else min(max(override, 1), k)
        elif k is None:
            raise DecodeError("distill_token_ids", "no teacher entries and no group_overrides.teacher_top_k")
    if not isinstance(k, int) or isinstance(k, bool):
        raise DecodeError(key, f"must be an integer, got {k!r}")
    k = max(k, 1)  # the reference raises values below 1 to 1
    if k > limits.max_k:
        raise DecodeError(key, f"k={k} exceeds the cap of {limits.max_k}")
    return k


def _inferred_k(rows: list[_Rows], *, ambiguous_below: bool) -> int | None:
    """The shortest entry; one less when ``ambiguous_below`` and every entry has that length with its first
    item (the actual token) lowest: the token then lies outside the top k everywhere. None: no entries."""
    widths = [r.lengths for r in rows if r.lengths.size]
    if not widths:
        return None
    shortest = min(int(w.min()) for w in widths)
    same = all(int(w.max()) == shortest for w in widths)
    if ambiguous_below and same and shortest > 1 and all(r.first_lowest for r in rows):
        return shortest - 1
    return shortest


def _no_teacher(group: RolloutGroup) -> str | None:
    """Why the reference would carry no distill arrays for ``group`` (skip flag, or a k of -1 or below)."""
    if group.overrides.get("skip_teacher_top_k"):
        return "skip_teacher_top_k"
    return no_teacher_reason(group.group_overrides)


def _top_k(obj: dict[str, Any], group: RolloutGroup, limits: Limits) -> ScoredGroup:
    n_seqs = len(group.sequences)
    for key in ("distill_token_ids", "distill_logprobs"):
        if obj.get(key) is None:
            raise DecodeError(key, "missing while the other distill array is present")
        if len(_list(obj[key], key)) != n_seqs:
            raise DecodeError(key, f"{len(obj[key])} entries for {n_seqs} sequences")
    skip = _no_teacher(group)
    if skip is not None:
        return ScoredGroup(group=group, status=DistillStatus.SKIPPED, reason=skip)
    rows = [_teacher_rows(obj, s, seq.tokens.numpy()) for s, seq in enumerate(group.sequences)]
    k = _group_k(obj, group, rows, limits)
    teachers: list[TeacherPayload] = []
    for s, (r, seq) in enumerate(zip(rows, group.sequences, strict=True)):
        if (r.lengths < k).any():
            j = int(np.flatnonzero(r.lengths < k)[0])
            p = j + 1 if r.rows is None else int(r.rows[j]) + 1
            raise DecodeError(f"distill_token_ids[{s}][{p}]", f"{int(r.lengths[j])} entries, fewer than k={k}")
        lps = r.lps.copy()
        labels = seq.tokens.numpy()[1:] if r.rows is None else seq.tokens.numpy()[r.rows + 1]
        extra = (r.lengths == k + 1) & (r.ids[:, 0] == labels)  # the actual token added in front of the top k
        lps[extra, 0] = -np.inf
        order = np.argsort(-lps, axis=1, kind="stable")[:, :k]  # stable: ties keep the reference order
        top_ids = np.take_along_axis(r.ids, order, axis=1).reshape(-1, k)
        top_lps = np.take_along_axis(r.lps, order, axis=1).reshape(-1, k)
        teachers.append(make_teacher(top_ids, top_lps, r.sampled, rows=r.rows))
    return ScoredGroup(group=group, status=DistillStatus.OK, teacher=teachers, k=k,
                       teacher_id=str(obj.get("teacher_id") or ""), scored_at=_float(obj, "scored_at"),
                       pool=_pool(obj))


def _pool(obj: dict[str, Any]) -> str:
    """The pool of a scored group's ``teacher`` record (``to_atropos``), else its ``group_overrides.teacher``."""
    record = obj.get("teacher")
    name = record.get("pool") if isinstance(record, dict) else None
    if name is None:
        overrides = obj.get("group_overrides")
        return pool_of(overrides if isinstance(overrides, dict) else None)
    if (problem := pool_problem(name)) is not None:
        raise DecodeError("teacher.pool", problem)
    return str(name)


def _float(obj: dict[str, Any], key: str) -> float:
    v = obj.get(key) or 0.0
    if not isinstance(v, int | float) or isinstance(v, bool):
        raise DecodeError(key, f"must be a number, got {v!r:.40}")
    return float(v)


def _convert(
    obj: object, group_id: str | None, policy_version: int, limits: Limits, strict: bool
) -> RolloutGroup | ScoredGroup:
    if not isinstance(obj, dict):
        raise DecodeError("group", f"expected a JSON object, got {type(obj).__name__}")
    for key in ("tokens", "masks", "scores"):
        if key not in obj:
            raise DecodeError(key, "missing")
    n_seqs = len(_list(obj["tokens"], "tokens"))
    for key in ("masks", "scores"):
        if len(_list(obj[key], key)) != n_seqs:
            raise DecodeError(key, f"{len(obj[key])} entries for {n_seqs} sequences")
    env_id, version = obj.get("env_id"), obj.get("policy_version", policy_version)
    for key, v in (("env_id", 0 if env_id is None else env_id), ("policy_version", version)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise DecodeError(key, f"must be an integer, got {v!r}")
    gid = obj.get("group_id") or group_id or content_group_id(obj)
    if not isinstance(gid, str):
        raise DecodeError("group_id", f"must be a string, got {gid!r}")
    group = _rollout(obj, gid, version, strict)
    if obj.get("distill_token_ids") is None and obj.get("distill_logprobs") is None:
        return group
    record = obj.get("teacher")
    if isinstance(record, dict) and record.get(CROSS_KEY):
        raise DecodeError(f"teacher.{CROSS_KEY}", "a teacher of another tokenizer scored this group: its distill "
                          "entries hold only the per-token part of its chunk-level signal and cannot be read back "
                          "as a scored group; leave out distill_token_ids and distill_logprobs to send the rollout")
    return _top_k(obj, group, limits)


def rollout_from_atropos(
    obj: dict[str, Any],
    *,
    group_id: str | None = None,
    policy_version: int = 0,
    limits: Limits | None = None,
    strict_lengths: bool = True,
) -> RolloutGroup | ScoredGroup:
    """Convert one ScoredDataGroup; a ``ScoredGroup`` when it carries distill arrays (status OK, or SKIPPED
    when ``group_overrides`` says no teacher: ``skip_teacher_top_k``, or ``teacher_top_k <= -1``).

    ``group_id`` and ``policy_version`` in ``obj`` win over the arguments; without either group id, the id
    is derived from the content (``content_group_id``), so a group sent twice is one group. Raises
    ``DecodeError`` naming the input field (``tokens[2]``, ``distill_logprobs[0][5]``) for any bad input;
    the result is validated with ``limits`` (default ``Limits()``).

    ``strict_lengths`` (the default) refuses ``inference_logprobs``, ``advantages`` or ``ref_logprobs``
    unless each holds one row per sequence and one number per token (``inference_logprobs[0]: 5 values for
    8 tokens``): a short row would otherwise reach the learner as no student logprobs at all. With
    ``strict_lengths=False`` (the Atropos API server, which accepts what the reference server accepts),
    such a field is kept verbatim for ``to_atropos`` and left out of the wire's sequences.
    """
    lim = limits or _DEFAULT_LIMITS
    try:
        with np.errstate(over="ignore", invalid="ignore"):  # out-of-range floats become inf: rejected below
            msg = _convert(obj, group_id, policy_version, lim, strict_lengths)
        validate(msg, lim)
    except DecodeError as e:
        raise DecodeError(_rename(e.field), e.reason) from None
    except (ValueError, TypeError, IndexError, KeyError, OverflowError, AttributeError) as e:  # defensive
        raise DecodeError("group", f"invalid: {type(e).__name__}: {e}") from None
    return msg


def rollout_group_from_atropos(
    obj: dict[str, Any],
    *,
    group_id: str | None = None,
    policy_version: int = 0,
    limits: Limits | None = None,
    strict_lengths: bool = True,
) -> RolloutGroup:
    """The rollout group of one ScoredDataGroup, for the teacher workers to score: its distill arrays are
    left out before converting (never parsed), everything else as ``rollout_from_atropos`` (validated; an
    id derived from the rest of the content when none is given)."""
    rollout = {k: v for k, v in obj.items() if k not in ("distill_token_ids", "distill_logprobs")}
    msg = rollout_from_atropos(rollout, group_id=group_id, policy_version=policy_version, limits=limits,
                               strict_lengths=strict_lengths)
    assert isinstance(msg, RolloutGroup)  # without distill arrays the conversion gives a rollout group
    return msg


def _floats(arrays: list[npt.NDArray[Any] | None]) -> list[Any] | None:
    """One list per sequence; null unless every sequence has the field (the reference takes no null rows)."""
    return None if any(a is None for a in arrays) else [a.tolist() for a in arrays]  # type: ignore[union-attr]


def _objs(values: list[Any], empty: Any) -> list[Any] | None:
    return None if all(v is None for v in values) else [empty if v is None else v for v in values]


def _distill(scored: ScoredGroup, toks: list[npt.NDArray[np.generic]]) -> tuple[list[Any], list[Any]]:
    """Entries in the reference layout: ``[]`` at 0 and where a payload holds no row, else the actual token
    first, then the rest of the top k by logprob (k + 1 items when the actual token is outside the top k); a
    cross-tokenizer payload's as ``_cross_entries``."""
    all_ids: list[Any] = []
    all_lps: list[Any] = []
    for t, tok in zip(scored.teacher or [], toks, strict=True):
        if t.cross:  # a teacher of another tokenizer: its per-token part only
            c_ids, c_lps = _cross_entries(t, tok)
            all_ids.append(c_ids)
            all_lps.append(c_lps)
            continue
        n, k = tok.shape[0], scored.k
        rows = t.row_index(n)
        ids, lps = t.topk_ids.numpy(), t.topk_logprobs.numpy().astype(np.float64)
        sampled = t.sampled_logprobs.numpy().astype(np.float64)
        label = tok[rows + 1].astype(np.int64)
        hit = ids == label[:, None]
        has, pos = hit.any(axis=1), hit.argmax(axis=1)
        rest = np.arange(max(k - 1, 0)) + (np.arange(max(k - 1, 0)) >= pos[:, None])  # columns other than pos
        order = np.concatenate([pos[:, None], rest], axis=1)
        in_ids = np.take_along_axis(ids, order, axis=1).tolist()
        in_lps = np.take_along_axis(lps, order, axis=1).tolist()
        out_ids = np.concatenate([label[:, None], ids], axis=1).tolist()
        out_lps = np.concatenate([sampled[:, None], lps], axis=1).tolist()
        e_ids: list[Any] = [[] for _ in range(n)]
        e_lps: list[Any] = [[] for _ in range(n)]
        for j, (r, inside) in enumerate(zip(rows.tolist(), has.tolist(), strict=True)):
            e_ids[r + 1], e_lps[r + 1] = (in_ids[j], in_lps[j]) if inside else (out_ids[j], out_lps[j])
        all_ids.append(e_ids)
        all_lps.append(e_lps)
    return all_ids, all_lps


def _cross_entries(t: TeacherPayload, tok: npt.NDArray[np.generic]) -> tuple[list[Any], list[Any]]:
    """A cross-tokenizer payload in the reference layout, one sequence: entries only where the teacher's view of
    the next student token is per token. At a row with mapped top-k slots whose token is among them, the mapped
    slots, the actual token first; at a row whose token is a chunk of its own with teacher signal, the actual token
    with the chunk's logprob (the teacher's log-probability of that token's text) first, then the mapped slots.
    Every other entry is ``[]``: empty slots are padding, and a chunk of several tokens has one logprob for all of
    them, which is no token's."""
    n = tok.shape[0]
    assert t.chunk_last is not None and t.topk_mapped is not None  # a cross payload (validated together)
    rows = t.row_index(n).tolist()
    ids, lps = t.topk_ids.numpy(), t.topk_logprobs.numpy().astype(np.float64)
    mapped = t.topk_mapped.numpy().astype(np.bool_)
    last = t.chunk_last.numpy().tolist()
    sampled = t.sampled_logprobs.numpy().astype(np.float64).tolist()
    e_ids: list[Any] = [[] for _ in range(n)]
    e_lps: list[Any] = [[] for _ in range(n)]
    for j, r in enumerate(rows):
        first = j == 0 or rows[j - 1] != r - 1 or last[j - 1] != 0  # token r + 1 starts its chunk
        label = int(tok[r + 1])
        m_ids, m_lps = ids[j][mapped[j]].tolist(), lps[j][mapped[j]].tolist()
        if label in m_ids:
            h = m_ids.index(label)
            e_ids[r + 1] = [label, *m_ids[:h], *m_ids[h + 1 :]]
            e_lps[r + 1] = [m_lps[h], *m_lps[:h], *m_lps[h + 1 :]]
        elif first and last[j] == CHUNK_LAST:
            e_ids[r + 1], e_lps[r + 1] = [label, *m_ids], [sampled[j], *m_lps]
    return e_ids, e_lps


def to_atropos(msg: RolloutGroup | ScoredGroup) -> dict[str, Any]:
    """The reference ScoredDataGroup for ``msg`` (plain lists, JSON-ready; ``ATROPOS_KEYS`` first), plus our
    extra keys. What ``rollout_from_atropos`` kept verbatim comes back verbatim."""
    scored = msg if isinstance(msg, ScoredGroup) else None
    g = msg.group if isinstance(msg, ScoredGroup) else msg
    meta = dict(g.metadata) if g.metadata is not None else None
    stash = meta.pop(STASH, None) if meta is not None else None
    kept: dict[str, Any] = stash.get("fields", {}) if isinstance(stash, dict) else {}
    if isinstance(stash, dict) and stash.get("metadata_null") and not meta:
        meta = None
    seqs = g.sequences
    toks = [s.tokens.numpy() for s in seqs]
    loss = [s.loss_mask.numpy().astype(bool) for s in seqs]

    def field(key: str, render: Callable[[], Any]) -> Any:
        return kept[key] if key in kept else render()

    out: dict[str, Any] = {
        "tokens": [t.tolist() for t in toks],
        "masks": field("masks", lambda: [np.where(m, t, MASKED).tolist() for t, m in zip(toks, loss, strict=True)]),
        "scores": [s.score for s in seqs],
        "advantages": field("advantages", lambda: _floats([None if s.advantages is None else s.advantages.numpy()
                                                           for s in seqs])),
        "ref_logprobs": field("ref_logprobs", lambda: _floats([None if s.ref_logprobs is None
                                                               else s.ref_logprobs.numpy() for s in seqs])),
        "messages": field("messages", lambda: _objs([s.messages for s in seqs], [])),
        "generation_params": g.generation_params,
        "inference_logprobs": field("inference_logprobs", lambda: _floats([
            None if s.logprobs is None else np.where(m, s.logprobs.numpy(), MASKED_LOGPROB)
            for s, m in zip(seqs, loss, strict=True)])),
        "overrides": field("overrides", lambda: _objs([s.overrides for s in seqs], {})),
        "group_overrides": g.group_overrides,
        "images": kept.get("images"),
        "env_id": field("env_id", lambda: g.env_id),
        "distill_token_ids": None,
        "distill_logprobs": None,
        "group_id": g.group_id,
        "policy_version": g.policy_version,
        "task_id": g.task_id,
        "created_at": g.created_at,
        "metadata": meta,
        "discard": g.discard,
    }
    if scored is None:
        return out
    teacher: dict[str, Any] = {"pool": scored.pool, "model": scored.teacher_id, "k": scored.k}
    if scored.teacher and any(t.cross for t in scored.teacher):
        teacher[CROSS_KEY] = True  # entries per token where the teacher's view is per token only (``_cross_entries``)
    out.update(distill_status=scored.status.value, distill_reason=scored.reason, teacher_id=scored.teacher_id,
               scored_at=scored.scored_at, teacher=teacher)
    if scored.status is DistillStatus.OK and scored.teacher is not None:
        out["distill_token_ids"], out["distill_logprobs"] = _distill(scored, toks)
        out["distill_top_k"] = scored.k
    return out
