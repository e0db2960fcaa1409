"""Readable summaries of stream entries (pure: no Redis), shared by ``tail``, ``dlq`` and ``stats``."""

from __future__ import annotations

import functools
import itertools
import json
import time
from typing import Any, Protocol

from pipeline.config import StreamSettings
from pipeline.transport.claimcheck import decode_header
from pipeline.transport.producer import F_DATA, F_HEADER, F_ID, F_REF, F_TYPE
from schemas import (
    BatchManifest,
    DecodeError,
    Limits,
    Message,
    RolloutGroup,
    ScoredGroup,
    Sequence,
    TeacherPayload,
    TrainBatch,
    decode,
)
from schemas.crosschunks import cross_shares


def _s(b: bytes | None) -> str:
    return b.decode("utf-8", "replace") if b is not None else ""


def entry_age_s(entry_id: str, now: float | None = None) -> float:
    ms = int(entry_id.split("-", 1)[0])
    return max(0.0, (now or time.time()) - ms / 1000)


def summarize_message(msg: Message) -> dict[str, Any]:
    if isinstance(msg, RolloutGroup):
        return {
            "type": "rollout", "group_id": msg.group_id, "sequences": len(msg.sequences),
            "lengths": [s.length for s in msg.sequences], "policy_version": msg.policy_version,
            "env_id": msg.env_id, "scores": [round(s.score, 4) for s in msg.sequences],
            "group_overrides": msg.group_overrides, "discard": msg.discard,
        }
    if isinstance(msg, ScoredGroup):
        out = summarize_message(msg.group)
        out.update(type="scored", status=msg.status.value, reason=msg.reason, k=msg.k, teacher_id=msg.teacher_id,
                   teacher={"pool": msg.pool, "model": msg.teacher_id, "k": msg.k})
        if msg.teacher and msg.teacher[0].cross:  # a teacher of another tokenizer: how much of its signal maps
            trained, aligned, rows, mass = cross_shares(msg.group.sequences, msg.teacher)
            out["cross"] = {"aligned_share": round(aligned / trained, 4) if trained else None,
                            "topk_mapped_mass": round(mass / rows, 4) if rows else None}
        return out
    if isinstance(msg, BatchManifest):
        return {
            "type": "batch", "batch_id": msg.batch_id, "groups": len(msg.refs),
            "group_ids": [r.group_id for r in msg.refs], "policy_version": msg.policy_version,
            "kl_coef": msg.kl_coef, "tokens": int((msg.stats or {}).get("tokens", 0)), "stats": msg.stats,
            "by_reference": True,
        }
    assert isinstance(msg, TrainBatch)
    return {
        "type": "batch", "batch_id": msg.batch_id, "groups": len(msg.groups),
        "group_ids": [g.group_id for g in msg.groups], "policy_version": msg.policy_version,
        "kl_coef": msg.kl_coef, "tokens": sum(g.group.num_tokens for g in msg.groups), "stats": msg.stats,
    }


def decode_entry(fields: dict[bytes, bytes], limits: Limits | None = None) -> Message | DecodeError:
    try:
        return decode(fields.get(F_DATA, b""), limits or StreamSettings().limits())
    except DecodeError as e:
        return e


def summarize_entry(entry_id: str, fields: dict[bytes, bytes], now: float | None = None) -> dict[str, Any]:
    """One JSON-ready summary of a stream entry (dead letters included)."""
    base: dict[str, Any] = {"entry_id": entry_id, "age_s": round(entry_age_s(entry_id, now), 3)}
    if b"reason" in fields and b"stage" in fields:  # a dead letter
        base.update(
            type="dead_letter", stage=_s(fields.get(b"stage")), reason=_s(fields.get(b"reason")),
            source=_s(fields.get(b"source")), source_id=_s(fields.get(b"source_id")),
            group_id=_s(fields.get(b"orig_" + F_ID)), deliveries=int(fields.get(b"deliveries", b"0") or 0),
            bytes=len(fields.get(b"orig_" + F_DATA, b"")),
        )
        return base
    base["bytes"] = len(fields.get(F_DATA, b""))
    if F_DATA not in fields and F_HEADER in fields:  # claim-checked, payload not fetched or already gone
        try:
            h = decode_header(fields[F_HEADER])
        except DecodeError as e:
            base.update(type=_s(fields.get(F_TYPE)), group_id=_s(fields.get(F_ID)), error=str(e))
            return base
        base.update(type=_s(fields.get(F_TYPE)), group_id=h.group_id, sequences=h.sequences, tokens=h.tokens,
                    policy_version=h.policy_version, status=h.status.value, bytes=h.payload_bytes, pool=h.pool,
                    payload=f"not available ({_s(fields.get(F_REF))})")
        return base
    msg = decode_entry(fields)
    if isinstance(msg, DecodeError):
        base.update(type=_s(fields.get(F_TYPE)), group_id=_s(fields.get(F_ID)), error=str(msg))
    else:
        base.update(summarize_message(msg))
    return base


def one_line(summary: dict[str, Any]) -> str:
    """A compact human line for a summary."""
    t = summary.get("type", "?")
    head = f"{summary['entry_id']}  {t:<11} "
    if t == "dead_letter":
        return head + (f"group={summary['group_id']} stage={summary['stage']} from={summary['source']} "
                       f"deliveries={summary['deliveries']} reason={summary['reason']}")
    if "error" in summary:
        return head + f"group={summary.get('group_id')} UNDECODABLE: {summary['error']}"
    if t == "batch":
        return head + (f"batch={summary['batch_id']} groups={summary['groups']} tokens={summary['tokens']} "
                       f"policy_v={summary['policy_version']} kl_coef={summary['kl_coef']:.4g}")
    line = head + (f"group={summary['group_id']} seqs={summary['sequences']} lens={summary['lengths']} "
                   f"policy_v={summary['policy_version']} {summary['bytes'] / 1024:.1f} KiB")
    if t == "scored":
        line += f" status={summary['status']} k={summary['k']}"
        if summary.get("teacher"):
            line += f" teacher={summary['teacher']['pool']}:{summary['teacher']['model']}"
        if summary.get("reason"):
            line += f" reason={summary['reason']}"
        if summary.get("cross"):
            line += (f" aligned={summary['cross']['aligned_share']}"
                     f" topk_mapped_mass={summary['cross']['topk_mapped_mass']}")
    return line


# --- token-level view (``distillq tail --decode``) -------------------------------------------------

TRAIN_OPEN, TRAIN_CLOSE = "⟦", "⟧"  # mark trainable text in the completion


class TokenDecoder(Protocol):
    """What ``decode_sequence`` needs from a tokenizer (a transformers tokenizer fits)."""

    def decode(self, token_ids: list[int]) -> str: ...

    def __len__(self) -> int: ...


def sequences_of(msg: Message) -> list[tuple[Sequence, TeacherPayload | None]]:
    """Every sequence of a message with its teacher payload (None when there is none)."""
    if isinstance(msg, RolloutGroup):
        return [(s, None) for s in msg.sequences]
    if isinstance(msg, BatchManifest):
        return []  # groups by reference: decode the scored entries instead
    groups = [msg] if isinstance(msg, ScoredGroup) else msg.groups
    out: list[tuple[Sequence, TeacherPayload | None]] = []
    for g in groups:
        teacher: list[TeacherPayload | None] = [None] * len(g.group.sequences)
        if g.teacher is not None:
            teacher = list(g.teacher)
        out += list(zip(g.group.sequences, teacher, strict=True))
    return out


def _text(tok: TokenDecoder, ids: list[int]) -> str:
    if any(i >= len(tok) for i in ids):
        return "".join(_text(tok, [i]) if i < len(tok) else f"<{i}?>" for i in ids)
    return tok.decode(ids)


def _segments(ids: list[int], mask: list[int], prompt_len: int, tok: TokenDecoder) -> list[dict[str, Any]]:
    """Runs of equal loss mask, split at the end of the prompt."""
    cuts = sorted({0, len(ids), min(prompt_len, len(ids))} | {p for p in range(1, len(ids)) if mask[p] != mask[p - 1]})
    return [
        {"start": a, "end": b, "part": "prompt" if a < prompt_len else "completion", "trainable": bool(mask[a]),
         "text": _text(tok, ids[a:b])}
        for a, b in itertools.pairwise(cuts) if b > a
    ]


#: A cross-tokenizer payload's ``chunk_last`` values as ``--decode`` names them (``schemas.messages``).
CHUNK_KINDS = ("inside", "last", "no_signal")


def _chunk_starts(rows: list[int], last: list[int]) -> list[int]:
    """Per payload row of a cross-tokenizer payload, the position of the first token of its token's chunk (a
    chunk starts after a row that ends one, or where the held rows skip, at an untrained token)."""
    out: list[int] = []
    for j, r in enumerate(rows):
        starts = j == 0 or rows[j - 1] != r - 1 or last[j - 1] != 0
        out.append(r + 1 if starts else out[-1])
    return out


def _positions(seq: Sequence, t: TeacherPayload, tok: TokenDecoder, top: int, all_positions: bool
               ) -> list[dict[str, Any]]:
    """Teacher row r describes token r + 1: one row per (trainable) position p = r + 1. A cross-tokenizer payload
    (``t.cross``) has no per-token teacher logprob: its rows give the chunk (``chunk``: inside, last or no_signal;
    ``chunk_start``), on a chunk's last token the teacher's log-probability of the whole chunk (``chunk_logprob``)
    and the student's (``student_chunk_logprob``), and as top-k the mapped slots only (empty ones are padding)."""
    ids = seq.tokens.numpy().tolist()
    mask = seq.loss_mask.numpy().tolist()
    student = seq.logprobs.numpy().tolist() if seq.logprobs is not None else None
    top_ids, top_lps = t.topk_ids.numpy(), t.topk_logprobs.numpy()
    sampled = t.sampled_logprobs.numpy()
    index = t.row_index(len(ids)).tolist()
    held = {int(r): j for j, r in enumerate(index)}  # row -> payload row
    mapped = t.topk_mapped.numpy().astype(bool) if t.topk_mapped is not None else None
    last = t.chunk_last.numpy().tolist() if t.chunk_last is not None else None
    starts = _chunk_starts(index, last) if last is not None else []
    rows = []
    for p in range(1, len(ids)):
        if not (all_positions or mask[p]):
            continue
        j = held.get(p - 1)  # None: the payload holds no row here (an untrained position)
        slots = [] if j is None else list(zip(top_ids[j, :], top_lps[j, :], strict=True))
        if j is not None and mapped is not None:
            slots = [s for s, m in zip(slots, mapped[j].tolist(), strict=True) if m]
        row: dict[str, Any] = {
            "pos": p, "token_id": ids[p], "token": _text(tok, [ids[p]]), "trainable": bool(mask[p]),
            "student_logprob": None if student is None else round(float(student[p]), 4),
            "teacher_logprob": None if j is None or last is not None else round(float(sampled[j]), 4),
            "topk": [{"id": int(i), "token": _text(tok, [int(i)]), "logprob": round(float(lp), 4)}
                     for i, lp in slots[:top]],
        }
        if last is not None:
            row.update(chunk=None, chunk_start=None, chunk_logprob=None, student_chunk_logprob=None)
            if j is not None:
                kind = CHUNK_KINDS[last[j]]
                row.update(chunk=kind, chunk_start=starts[j])
                if kind == "last":
                    row["chunk_logprob"] = round(float(sampled[j]), 4)
                if kind != "inside" and student is not None:
                    row["student_chunk_logprob"] = round(float(sum(student[starts[j] : p + 1])), 4)
        rows.append(row)
    return rows


def decode_sequence(msg: Message, tok: TokenDecoder, seq: int = 0, *, top: int = 5,
                    all_positions: bool = False) -> dict[str, Any]:
    """Sequence ``seq`` of ``msg`` as text (masked vs trainable parts), with the teacher's view per position."""
    pairs = sequences_of(msg)
    if not 0 <= seq < len(pairs):
        return {"seq": seq, "sequences": len(pairs), "error": f"no sequence {seq} (message has {len(pairs)})"}
    s, teacher = pairs[seq]
    ids = s.tokens.numpy().tolist()
    mask = s.loss_mask.numpy().tolist()
    segments = _segments(ids, mask, s.prompt_len, tok)
    completion = "".join(
        f"{TRAIN_OPEN}{g['text']}{TRAIN_CLOSE}" if g["trainable"] else g["text"]
        for g in segments if g["part"] == "completion"
    )
    out: dict[str, Any] = {
        "seq": seq, "sequences": len(pairs), "length": len(ids), "prompt_len": s.prompt_len,
        "trainable": int(sum(mask)), "score": s.score, "prompt": _text(tok, ids[: s.prompt_len]),
        "completion": completion, "segments": segments,
    }
    if teacher is not None:
        out["k"] = teacher.k
        out["cross"] = teacher.cross  # a teacher of another tokenizer: chunks, mapped top-k slots
        out["positions"] = _positions(s, teacher, tok, top, all_positions)
    return out


def _lp(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def format_decoded(d: dict[str, Any]) -> list[str]:
    """Human lines for ``decode_sequence`` output (indented, to follow a ``one_line`` summary)."""
    if "error" in d:
        return [f"  {d['error']}"]
    q = functools.partial(json.dumps, ensure_ascii=False)
    lines = [
        f"  seq {d['seq']} of {d['sequences']}: {d['length']} tokens, prompt {d['prompt_len']}, "
        f"trainable {d['trainable']}, score {d['score']:.4g}",
        f"  prompt:     {q(d['prompt'])}",
        f"  completion: {q(d['completion'])}   ({TRAIN_OPEN}trainable{TRAIN_CLOSE}, the rest masked)",
    ]
    if "positions" not in d:
        return lines
    shown = max((len(row["topk"]) for row in d["positions"]), default=0)
    if d.get("cross"):
        return lines + _cross_lines(d, shown)
    lines.append(f"  {'pos':>5}  {'token':<14} {'train':<5} {'student':>8} {'teacher':>8}  "
                 f"teacher top-{shown} of {d['k']} (token logprob)")
    for row in d["positions"]:
        topk = "  ".join(f"{q(e['token'])} {e['logprob']:.3f}" for e in row["topk"])
        lines.append(f"  {row['pos']:>5}  {q(row['token']):<14} {'*' if row['trainable'] else '':<5} "
                     f"{_lp(row['student_logprob']):>8} {_lp(row['teacher_logprob']):>8}  {topk}")
    return lines


def _chunk_cell(row: dict[str, Any]) -> str:
    """``12-14`` on a chunk's last token (``12-14 none`` without teacher signal), ``…`` inside one."""
    if row["chunk"] is None:
        return ""
    if row["chunk"] == "inside":
        return "…"
    span = str(row["pos"]) if row["chunk_start"] == row["pos"] else f"{row['chunk_start']}-{row['pos']}"
    return span + (" none" if row["chunk"] == "no_signal" else "")


def _cross_lines(d: dict[str, Any], shown: int) -> list[str]:
    """The position table of a cross-tokenizer payload: per chunk, the teacher's and the student's log-probability
    of the whole chunk on its last token; the mapped top-k slots only."""
    q = functools.partial(json.dumps, ensure_ascii=False)
    lines = [
        "  teacher of another tokenizer: one log-probability per chunk (positions A-B), the teacher's and the "
        "student's, on its last token; top-k: the slots mapped to student ids",
        f"  {'pos':>5}  {'token':<14} {'train':<5} {'student':>8} {'chunk':<12} {'s chunk':>8} {'t chunk':>8}  "
        f"teacher top-{shown} mapped of {d['k']} (token logprob)",
    ]
    for row in d["positions"]:
        topk = "  ".join(f"{q(e['token'])} {e['logprob']:.3f}" for e in row["topk"])
        s_chunk = _lp(row["student_chunk_logprob"]) if row["chunk"] in ("last", "no_signal") else ""
        t_chunk = _lp(row["chunk_logprob"]) if row["chunk"] in ("last", "no_signal") else ""
        lines.append(f"  {row['pos']:>5}  {q(row['token']):<14} {'*' if row['trainable'] else '':<5} "
                     f"{_lp(row['student_logprob']):>8} {_chunk_cell(row):<12} {s_chunk:>8} {t_chunk:>8}  {topk}")
    return lines
