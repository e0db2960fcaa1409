"""Readable summaries of stream entries (pure: no Redis), shared by ``tail``, ``dlq`` and ``stats``."""

from __future__ import annotations

import time
from typing import Any

from pipeline.producer import F_DATA, F_ID, F_TYPE
from schemas import DecodeError, Limits, Message, RolloutGroup, ScoredGroup, TrainBatch, decode


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
        out.update(type="scored", status=msg.status.value, reason=msg.reason, k=msg.k, teacher_id=msg.teacher_id)
        return out
    assert isinstance(msg, TrainBatch)
    return {
        "type": "batch", "batch_id": msg.batch_id, "groups": len(msg.groups),
        "group_ids": [g.group_id for g in msg.groups], "policy_version": msg.policy_version,
        "kl_coef": msg.kl_coef, "tokens": sum(g.group.num_tokens for g in msg.groups), "stats": msg.stats,
    }


def decode_entry(fields: dict[bytes, bytes], limits: Limits | None = None) -> Message | DecodeError:
    try:
        return decode(fields.get(F_DATA, b""), limits or Limits())
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
    line = (f"group={summary['group_id']} seqs={summary['sequences']} lens={summary['lengths']} "
            f"policy_v={summary['policy_version']} {summary['bytes'] / 1024:.1f} KiB")
    if t == "scored":
        line += f" status={summary['status']} k={summary['k']}"
        if summary.get("reason"):
            line += f" reason={summary['reason']}"
    return line
