"""Conversion to and from the reference system's ScoredDataGroup JSON (atropos).

Reference layout (see docs of ``schemas.messages``): per-token lists ``[seq][pos]``; ``masks`` holds -100
where a token is not trained on, else the token id; ``inference_logprobs`` holds 1.0 at masked positions;
``distill_token_ids``/``distill_logprobs`` are ``[seq][pos][k or k+1]`` with entry ``p`` the teacher's
distribution for token ``p`` (entry 0 empty), actual token first, unsorted. Our teacher arrays are
logits-aligned (row ``r`` = their entry ``r + 1``), exactly ``k`` per row, sorted by logprob.

``to_atropos`` also writes a few extra keys (``group_id``, ``policy_version``, ``task_id``,
``created_at``, ``metadata``, ``discard``, ``distill_status``, ``distill_reason``, ``distill_top_k``,
``distill_sampled_logprobs``, ``teacher_id``, ``scored_at``) that ``rollout_from_atropos`` reads back, so
our messages survive a round trip through this format. Unknown keys (``images``) are ignored.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from itertools import chain
from typing import Any, Final

import msgspec
import numpy as np
import numpy.typing as npt

from schemas.build import make_sequence, make_teacher
from schemas.messages import DistillStatus, RolloutGroup, ScoredGroup, Sequence, TeacherPayload
from schemas.validate import DecodeError, Limits, validate

MASKED: Final = -100  # reference value of ``masks`` at positions not trained on
MASKED_LOGPROB: Final = 1.0  # reference value of ``inference_logprobs`` at masked positions
_I32_MAX: Final = 2**31 - 1
_DEFAULT_LIMITS: Final = Limits()

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]

# Our validator's field names -> the reference's, so every error names a field of the input.
_RENAMES: Final = (
    (re.compile(r"^(?:scored\.)?group\.sequences\[(\d+)\]\.tokens"), r"tokens[\1]"),
    (re.compile(r"^(?:scored\.)?group\.sequences\[(\d+)\]\.(?:loss_mask|prompt_len)"), r"masks[\1]"),
    (re.compile(r"^(?:scored\.)?group\.sequences\[(\d+)\]\.logprobs"), r"inference_logprobs[\1]"),
    (re.compile(r"^(?:scored\.)?group\.sequences\[(\d+)\]\.(\w+)"), r"\2[\1]"),
    (re.compile(r"^scored\.teacher\[(\d+)\]\.(?:topk_ids|k)"), r"distill_token_ids[\1]"),
    (re.compile(r"^scored\.teacher\[(\d+)\]\.\w+"), r"distill_logprobs[\1]"),
    (re.compile(r"^(?:scored\.)?group\.sequences$"), "tokens"),
    (re.compile(r"^(?:scored\.)?group\."), ""),
)


def _rename(field: str) -> str:
    for pattern, repl in _RENAMES:
        new, n = pattern.subn(repl, field, count=1)
        if n:
            return new
    return field


def _list(x: object, field: str) -> list[Any]:
    if not isinstance(x, list):
        raise DecodeError(field, f"expected a list, got {type(x).__name__}")
    return x


def _free_form(x: object, field: str, kind: Any) -> Any:
    """``x`` if our wire carries it as ``kind`` (string keys, integers within 64 bits), else DecodeError."""
    try:
        return msgspec.msgpack.decode(msgspec.msgpack.encode(x), type=kind)
    except (msgspec.ValidationError, OverflowError, TypeError, ValueError) as e:
        raise DecodeError(field, f"cannot be carried: {e}") from None


def _dict_or_none(x: object, field: str) -> dict[str, Any] | None:
    if x is not None and not isinstance(x, dict):
        raise DecodeError(field, f"expected an object or null, got {type(x).__name__}")
    return _free_form(x, field, dict[str, Any] | None)  # type: ignore[no-any-return]


def _per_seq(obj: dict[str, Any], key: str, n: int) -> list[Any] | None:
    """``obj[key]`` as a list of ``n`` entries, or None when absent or null."""
    x = obj.get(key)
    if x is None:
        return None
    entries = _list(x, key)
    if len(entries) != n:
        raise DecodeError(key, f"{len(entries)} entries for {n} sequences")
    return entries


def _numbers(x: list[Any], field: str | Callable[[int], str], *, ints: bool) -> npt.NDArray[Any]:
    """A flat list of JSON numbers as int64 or float64 (finite), rejecting bools, strings and nesting.

    ``field`` names the list, or maps an index in it to the name of the field holding that item.
    """
    name = field if callable(field) else lambda _: field
    where = "" if callable(field) else " at index {i}"
    allowed = (int,) if ints else (int, float)
    if not set(map(type, x)) <= set(allowed):
        i = next(i for i, v in enumerate(x) if type(v) not in allowed)
        what = "an integer" if ints else "a number"
        raise DecodeError(name(i), f"item {x[i]!r:.40}{where.format(i=i)} is not {what}")
    try:
        a = np.array(x, dtype=np.int64 if ints else np.float64)
    except OverflowError:
        i = next(i for i, v in enumerate(x) if not -(2**63) <= v < 2**63)
        raise DecodeError(name(i), f"integer {x[i]}{where.format(i=i)} out of range") from None
    if not ints and not np.isfinite(a).all():
        i = int(np.flatnonzero(~np.isfinite(a))[0])
        raise DecodeError(name(i), f"non-finite value {a[i]}{where.format(i=i)}")
    return a


def _ids(a: I64, field: str | Callable[[int], str]) -> I64:
    if a.size and (a.min() < 0 or a.max() > _I32_MAX):
        i = int(np.flatnonzero((a < 0) | (a > _I32_MAX))[0])
        name, where = (field(i), "") if callable(field) else (field, f" at index {i}")
        raise DecodeError(name, f"token id {int(a[i])}{where} outside [0, {_I32_MAX}]")
    return a


def _row(seqs: list[Any], s: int, key: str, n: int, *, ints: bool) -> npt.NDArray[Any]:
    row = _list(seqs[s], f"{key}[{s}]")
    if len(row) != n:
        raise DecodeError(f"{key}[{s}]", f"length {len(row)} != {n} tokens")
    return _numbers(row, f"{key}[{s}]", ints=ints)


def _sequence(obj: dict[str, Any], s: int, n_seqs: int) -> Sequence:
    tokens_all, masks_all = obj["tokens"], obj["masks"]
    tok = _ids(_numbers(_list(tokens_all[s], f"tokens[{s}]"), f"tokens[{s}]", ints=True), f"tokens[{s}]")
    n = tok.shape[0]
    if n == 0:
        raise DecodeError(f"tokens[{s}]", "empty sequence")
    mask = _row(masks_all, s, "masks", n, ints=True) != MASKED
    mask[0] = False
    opt: dict[str, npt.NDArray[Any] | None] = {}
    for key in ("inference_logprobs", "advantages", "ref_logprobs"):
        seqs = _per_seq(obj, key, n_seqs)
        opt[key] = None if seqs is None or seqs[s] is None else _row(seqs, s, key, n, ints=False)
    overrides = _per_seq(obj, "overrides", n_seqs)
    messages = _per_seq(obj, "messages", n_seqs)
    msgs = None if messages is None else messages[s]
    if msgs is not None and not all(isinstance(m, dict) for m in _list(msgs, f"messages[{s}]")):
        raise DecodeError(f"messages[{s}]", "expected a list of message objects")
    msgs = _free_form(msgs, f"messages[{s}]", list[dict[str, Any]] | None)
    score = _numbers([obj["scores"][s]], f"scores[{s}]", ints=False)[0]
    return make_sequence(
        tok,
        mask,
        logprobs=opt["inference_logprobs"],
        score=float(score),
        overrides=None if overrides is None else _dict_or_none(overrides[s], f"overrides[{s}]"),
        messages=msgs,
        advantages=opt["advantages"],
        ref_logprobs=opt["ref_logprobs"],
    )


def _flat_rows(entries: list[Any], key: str, s: int) -> tuple[I64, list[Any]]:
    """Lengths of entries 1.. (entry 0 must be empty) and their items flattened."""
    if entries and entries[0] is not None and entries[0] != []:
        raise DecodeError(f"{key}[{s}][0]", "entry 0 must be empty or null (it has no prefix)")
    rows = entries[1:]
    lengths = np.empty(len(rows), np.int64)
    for p, e in enumerate(rows, start=1):
        if not isinstance(e, list) or not e:
            raise DecodeError(f"{key}[{s}][{p}]", f"expected a non-empty list, got {e!r:.40}")
        lengths[p - 1] = len(e)
    return lengths, list(chain.from_iterable(rows))


def _teacher_rows(obj: dict[str, Any], s: int, tok: npt.NDArray[np.generic]) -> tuple[I64, I64, F64, F64]:
    """One sequence's entries 1.. as row lengths, padded ``[L-1, width]`` ids/logprobs, sampled logprobs."""
    n = tok.shape[0]
    ids_e = _list(obj["distill_token_ids"][s], f"distill_token_ids[{s}]")
    lps_e = _list(obj["distill_logprobs"][s], f"distill_logprobs[{s}]")
    for key, e in (("distill_token_ids", ids_e), ("distill_logprobs", lps_e)):
        if len(e) != n:
            raise DecodeError(f"{key}[{s}]", f"{len(e)} entries != {n} tokens (one per token, entry 0 empty)")
    lengths, flat_ids = _flat_rows(ids_e, "distill_token_ids", s)
    lengths_lp, flat_lps = _flat_rows(lps_e, "distill_logprobs", s)
    if not np.array_equal(lengths, lengths_lp):
        p = int(np.flatnonzero(lengths != lengths_lp)[0]) + 1
        raise DecodeError(f"distill_logprobs[{s}][{p}]", f"{len(lps_e[p])} logprobs for {len(ids_e[p])} ids")
    ends = np.cumsum(lengths)

    def at(key: str) -> Callable[[int], str]:  # flat item index -> the entry holding it
        return lambda i: f"{key}[{s}][{int(np.searchsorted(ends, i, side='right')) + 1}]"

    ids = _ids(_numbers(flat_ids, at("distill_token_ids"), ints=True), at("distill_token_ids"))
    lps = _numbers(flat_lps, at("distill_logprobs"), ints=False)
    rows = lengths.shape[0]
    width = int(lengths.max()) if rows else 1
    pad_ids = np.full((rows, width), -1, np.int64)
    pad_lps = np.full((rows, width), -np.inf)
    row = np.repeat(np.arange(rows), lengths)
    col = np.arange(ids.shape[0]) - np.repeat(ends - lengths, lengths)
    pad_ids[row, col], pad_lps[row, col] = ids, lps
    hit = pad_ids == tok[1:, None]
    sampled = pad_lps[np.arange(rows), hit.argmax(axis=1)]
    missing = ~hit.any(axis=1)
    if missing.any():  # only our own output lacks the sampled token; it then carries its logprob aside
        extra = _per_seq(obj, "distill_sampled_logprobs", len(obj["tokens"]))
        given = None if extra is None else extra[s]
        if not isinstance(given, list) or len(given) != n:
            p = int(np.flatnonzero(missing)[0]) + 1
            raise DecodeError(
                f"distill_token_ids[{s}][{p}]", f"sampled token {int(tok[p])} has no logprob in the entry"
            )
        sampled[missing] = _numbers(given[1:], f"distill_sampled_logprobs[{s}]", ints=False)[missing]
    return lengths, pad_ids, pad_lps, sampled


def _group_k(obj: dict[str, Any], group: RolloutGroup, lengths: list[I64], limits: Limits) -> int:
    """k: our ``distill_top_k``, else ``group_overrides.teacher_top_k``, else the shortest entry."""
    key, k = "distill_top_k", obj.get("distill_top_k")
    if k is None:
        key, k = "group_overrides.teacher_top_k", group.overrides.get("teacher_top_k")
    if k is None:
        widths = [int(n.min()) for n in lengths if n.size]
        if not widths:
            raise DecodeError("distill_token_ids", "no teacher entries and no group_overrides.teacher_top_k")
        key, k = "distill_token_ids", min(widths)
    if not isinstance(k, int) or isinstance(k, bool):
        raise DecodeError(key, f"must be an integer, got {k!r}")
    k = max(k, 1)  # the reference raises values below 1 to 1
    if k > limits.max_k:
        raise DecodeError(key, f"k={k} exceeds the cap of {limits.max_k}")
    return k


def _top_k(obj: dict[str, Any], group: RolloutGroup, limits: Limits) -> ScoredGroup:
    n_seqs = len(group.sequences)
    for key in ("distill_token_ids", "distill_logprobs"):
        if _per_seq(obj, key, n_seqs) is None:
            raise DecodeError(key, "missing while the other distill array is present")
    rows = [_teacher_rows(obj, s, seq.tokens.numpy()) for s, seq in enumerate(group.sequences)]
    k = _group_k(obj, group, [r[0] for r in rows], limits)
    teachers: list[TeacherPayload] = []
    for s, (lengths, ids, lps, sampled) in enumerate(rows):
        if (lengths < k).any():
            p = int(np.flatnonzero(lengths < k)[0]) + 1
            reason = f"{int(lengths[p - 1])} entries, fewer than k={k}"
            raise DecodeError(f"distill_token_ids[{s}][{p}]", reason)
        order = np.argsort(-lps, axis=1, kind="stable")[:, :k]  # stable: ties keep the reference order
        top_ids = np.take_along_axis(ids, order, axis=1).reshape(-1, k)
        top_lps = np.take_along_axis(lps, order, axis=1).reshape(-1, k)
        teachers.append(make_teacher(top_ids, top_lps, sampled))
    return ScoredGroup(
        group=group,
        status=DistillStatus.OK,
        teacher=teachers,
        k=k,
        teacher_id=str(obj.get("teacher_id") or ""),
        scored_at=_float(obj, "scored_at"),
    )


def _float(obj: dict[str, Any], key: str) -> float:
    v = obj.get(key) or 0.0
    if not isinstance(v, int | float) or isinstance(v, bool):
        raise DecodeError(key, f"must be a number, got {v!r:.40}")
    return float(v)


def _convert(
    obj: object, group_id: str | None, policy_version: int, limits: Limits
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
    env_id, version = obj.get("env_id") or 0, obj.get("policy_version", policy_version)
    for key, v in (("env_id", env_id), ("policy_version", version)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise DecodeError(key, f"must be an integer, got {v!r}")
    gid = obj.get("group_id") or group_id or uuid.uuid4().hex
    if not isinstance(gid, str):
        raise DecodeError("group_id", f"must be a string, got {gid!r}")
    group = RolloutGroup(
        group_id=gid,
        sequences=[_sequence(obj, s, n_seqs) for s in range(n_seqs)],
        env_id=env_id,
        task_id=str(obj.get("task_id") or ""),
        policy_version=version,
        created_at=_float(obj, "created_at"),
        group_overrides=_dict_or_none(obj.get("group_overrides"), "group_overrides"),
        generation_params=_dict_or_none(obj.get("generation_params"), "generation_params"),
        metadata=_dict_or_none(obj.get("metadata"), "metadata"),
        discard=bool(obj.get("discard", False)),
    )
    if obj.get("distill_token_ids") is None and obj.get("distill_logprobs") is None:
        return group
    return _top_k(obj, group, limits)


def rollout_from_atropos(
    obj: dict[str, Any],
    *,
    group_id: str | None = None,
    policy_version: int = 0,
    limits: Limits | None = None,
) -> RolloutGroup | ScoredGroup:
    """Convert one ScoredDataGroup; a ``ScoredGroup`` (status OK) when it carries distill arrays.

    ``group_id`` and ``policy_version`` in ``obj`` win over the arguments. Raises ``DecodeError`` naming
    the input field (``tokens[2]``, ``distill_logprobs[0][5]``) for any bad input; the result is
    validated with ``limits`` (default ``Limits()``).
    """
    lim = limits or _DEFAULT_LIMITS
    try:
        with np.errstate(over="ignore", invalid="ignore"):  # out-of-range floats become inf: rejected below
            msg = _convert(obj, group_id, policy_version, lim)
        validate(msg, lim)
    except DecodeError as e:
        raise DecodeError(_rename(e.field), e.reason) from None
    except (ValueError, TypeError, IndexError, KeyError, OverflowError, AttributeError) as e:  # defensive
        raise DecodeError("group", f"invalid: {type(e).__name__}: {e}") from None
    return msg


def _opt(arrays: list[npt.NDArray[Any] | None]) -> list[Any] | None:
    return None if all(a is None for a in arrays) else [None if a is None else a.tolist() for a in arrays]


def to_atropos(msg: RolloutGroup | ScoredGroup) -> dict[str, Any]:
    """The reference ScoredDataGroup for ``msg`` (plain lists, JSON-ready), plus our extra keys."""
    scored = msg if isinstance(msg, ScoredGroup) else None
    g = msg.group if isinstance(msg, ScoredGroup) else msg
    seqs = g.sequences
    toks = [s.tokens.numpy() for s in seqs]
    masks = [s.loss_mask.numpy().astype(bool) for s in seqs]
    lps = [None if s.logprobs is None else np.where(m, s.logprobs.numpy(), MASKED_LOGPROB)
           for s, m in zip(seqs, masks, strict=True)]
    out: dict[str, Any] = {
        "tokens": [t.tolist() for t in toks],
        "masks": [np.where(m, t, MASKED).tolist() for t, m in zip(toks, masks, strict=True)],
        "scores": [s.score for s in seqs],
        "advantages": _opt([None if s.advantages is None else s.advantages.numpy() for s in seqs]),
        "ref_logprobs": _opt([None if s.ref_logprobs is None else s.ref_logprobs.numpy() for s in seqs]),
        "inference_logprobs": _opt(lps),
        "messages": None if all(s.messages is None for s in seqs) else [s.messages for s in seqs],
        "overrides": None if all(s.overrides is None for s in seqs) else [s.overrides for s in seqs],
        "generation_params": g.generation_params,
        "group_overrides": g.group_overrides,
        "env_id": g.env_id,
        "group_id": g.group_id,
        "policy_version": g.policy_version,
        "task_id": g.task_id,
        "created_at": g.created_at,
        "metadata": g.metadata,
        "discard": g.discard,
        "distill_token_ids": None,
        "distill_logprobs": None,
    }
    if scored is None:
        return out
    out.update(
        distill_status=scored.status.value,
        distill_reason=scored.reason,
        teacher_id=scored.teacher_id,
        scored_at=scored.scored_at,
    )
    teachers = scored.teacher
    if scored.status is DistillStatus.OK and teachers is not None:
        out.update(
            distill_top_k=scored.k,
            distill_token_ids=[[[], *t.topk_ids.numpy().tolist()] for t in teachers],
            distill_logprobs=[[[], *t.topk_logprobs.numpy().astype(np.float64).tolist()] for t in teachers],
            distill_sampled_logprobs=[[None, *t.sampled_logprobs.numpy().tolist()] for t in teachers],
        )
    return out
