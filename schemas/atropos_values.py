"""Value parsing for the reference (Atropos) layout: per-token lists, masks, messages, free-form dicts.

The pieces ``schemas.atropos`` builds a group from; every error names the input field (``tokens[2]``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Final

import msgspec
import numpy as np
import numpy.typing as npt

from schemas.validate import DecodeError, Limits

MASKED: Final = -100  # reference value of ``masks`` at positions not trained on
MASKED_LOGPROB: Final = 1.0  # reference value of ``inference_logprobs`` at masked positions
STASH: Final = "_atropos"  # metadata key holding what only the reference layout can carry
#: The keys of a ScoredDataGroup as the reference server stores and returns it, in its order.
ATROPOS_KEYS: Final = ("tokens", "masks", "scores", "advantages", "ref_logprobs", "messages", "generation_params",
                       "inference_logprobs", "overrides", "group_overrides", "images", "env_id", "distill_token_ids",
                       "distill_logprobs")
_I32_MAX: Final = 2**31 - 1
_DEFAULT_LIMITS: Final = Limits()

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]
Render = Callable[[F64, int], F64]

# Our validator's field names -> the reference's, so every error names a field of the input.
_RENAMES: Final = (
    (re.compile(r"^(?:scored\.)?group\.sequences\[(\d+)\]\.tokens"), r"tokens[\1]"),
    (re.compile(r"^(?:scored\.)?group\.sequences\[(\d+)\]\.(?:loss_mask|prompt_len)"), r"masks[\1]"),
    (re.compile(r"^(?:scored\.)?group\.sequences\[(\d+)\]\.logprobs"), r"inference_logprobs[\1]"),
    (re.compile(r"^(?:scored\.)?group\.sequences\[(\d+)\]\.(\w+)"), r"\2[\1]"),
    (re.compile(r"^scored\.teacher\[(\d+)\]\.(?:topk_ids|k|rows)"), r"distill_token_ids[\1]"),
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


def _per_token(obj: dict[str, Any], key: str, toks: list[I64], render: Render,
               *, strict: bool = True) -> tuple[list[F64 | None], bool]:
    """Per sequence, ``obj[key]``'s row as float64 where it has one number per token (else None), and
    whether the field must be kept verbatim: a row missing or of another length, a count other than one
    per sequence, or a value ``render`` (what ``to_atropos`` writes) would not give back. ``strict``
    refuses, naming the field, a row count other than one per sequence, a null row, and a row whose length
    is not the sequence's token count, instead of keeping them verbatim."""
    n = len(toks)
    if obj.get(key) is None:
        return [None] * n, False
    rows = _list(obj[key], key)
    if strict:
        if len(rows) != n:
            raise DecodeError(key, f"{len(rows)} rows for {n} sequences (one row per sequence)")
        for s, row in enumerate(rows):
            if row is None:
                raise DecodeError(f"{key}[{s}]", "null; give one number per token, or leave the field out")
            if len(_list(row, f"{key}[{s}]")) != toks[s].shape[0]:
                raise DecodeError(f"{key}[{s}]", f"{len(row)} values for {toks[s].shape[0]} tokens "
                                                 "(one per token)")
    verbatim = len(rows) != n  # then no row can be matched with a sequence
    out: list[F64 | None] = [None] * n
    for s, row in enumerate(rows):
        a = None if row is None else _numbers(_list(row, f"{key}[{s}]"), f"{key}[{s}]", ints=False)
        if a is not None and len(rows) == n and a.shape == toks[s].shape:
            out[s] = a
            verbatim = verbatim or not np.array_equal(render(a, s), a)
        else:
            verbatim = True
    return out, verbatim


def _objects(obj: dict[str, Any], key: str, n: int, check: Callable[[Any, str], Any]) -> tuple[list[Any], bool]:
    """Per sequence, ``obj[key]``'s entry passed through ``check`` (None when absent), and whether the field
    must be kept verbatim (an entry null, or a count other than one per sequence)."""
    if obj.get(key) is None:
        return [None] * n, False
    rows = _list(obj[key], key)
    out = [None if row is None else check(row, f"{key}[{s}]") for s, row in enumerate(rows)]
    if len(rows) != n or any(row is None for row in rows):
        return [None] * n, True
    return out, False


def _messages(row: Any, field: str) -> list[dict[str, Any]]:
    for i, m in enumerate(_list(row, field)):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DecodeError(f"{field}[{i}]", "a message must be an object with 'role' and 'content'")
    return _free_form(row, field, list[dict[str, Any]])  # type: ignore[no-any-return]


def _as_f32(a: F64, _s: int) -> F64:
    return a.astype(np.float32).astype(np.float64)


def _masks(masks: list[Any], toks: list[I64]) -> tuple[list[npt.NDArray[np.bool_]], bool]:
    """Trained positions per sequence (mask != -100, never position 0), and whether ``masks`` is exactly
    what ``to_atropos`` writes for them (-100, else the token id)."""
    loss, exact = [], True
    for s, tok in enumerate(toks):
        if tok.shape[0] == 0:
            raise DecodeError(f"tokens[{s}]", "empty sequence")
        row = _list(masks[s], f"masks[{s}]")
        if len(row) != tok.shape[0]:
            raise DecodeError(f"masks[{s}]", f"length {len(row)} != {tok.shape[0]} tokens")
        m = _numbers(row, f"masks[{s}]", ints=True)
        trained = m != MASKED
        trained[0] = False
        loss.append(trained)
        exact = exact and np.array_equal(np.where(trained, tok, MASKED), m)
    return loss, exact
