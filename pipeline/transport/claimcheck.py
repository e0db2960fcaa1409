"""Claim check for scored groups: the stream entry carries a small header, the payload its own key.

A ``scored`` entry holds ``t``, ``gid``, ``h`` (an encoded ``GroupHeader``) and ``p`` (the key of the
encoded ``ScoredGroup``, in the stream's hash slot, see ``Keys.payload``). The producer writes both in one
transaction. The feeder batches from headers alone and writes a ``BatchManifest`` of payload keys; the
learner client fetches the payloads once and deletes them when it acknowledges the batch. So a group's
bytes go teacher -> Redis -> learner and are decoded once, instead of being read, re-encoded and written
again by the feeder.

Who deletes a payload key: the learner client on batch ack; any consumer that acks or dead-letters a
``scored`` entry it read with its payload (``StreamConsumer`` with ``resolve_payloads``); the feeder when it
drops a group (stale, or no distill payload with ``missing_distill=drop``).
"""

from __future__ import annotations

import time
from typing import Final

import msgspec

from schemas import DecodeError, DistillStatus, GroupHeader, Message, ScoredGroup
from schemas.crosschunks import chunk_kl, cross_shares
from schemas.messages import SCHEMA_VERSION
from schemas.pools import pool_problem

#: Streams whose entries reference their payload (the rest carry it inline in field ``d``).
CLAIM_CHECKED: Final = frozenset({"scored"})

_ENC: Final = msgspec.msgpack.Encoder()
_DEC: Final = msgspec.msgpack.Decoder(GroupHeader)
MAX_HEADER_BYTES: Final = 4096


def group_kl(g: ScoredGroup) -> tuple[float, int]:
    """Sum over trainable positions of ``student - teacher`` sampled-token logprob, and the count.

    Sequences with ``set_advantage_to_zero`` are left out (they carry no signal at all), as in
    ``pipeline.stages.batching.batch_advantages``: with ``reward_weight=0`` the sum here is ``-sum(advantages) /
    kl_coef`` over the same positions (tests/unit/test_batching.py pins the two together).

    A cross-tokenizer payload (``TeacherPayload.chunk_last``): the sum over its aligned chunks with teacher signal
    of ``s_c - q_c`` (student minus teacher log-probability of the chunk) and the trained tokens in those chunks
    (``schemas.crosschunks.chunk_kl``), so the per-token figure is the completion's reverse KL per token.
    """
    if g.teacher is None:
        return 0.0, 0
    total, n = 0.0, 0
    for s, t in zip(g.group.sequences, g.teacher, strict=True):
        if s.logprobs is None or s.length <= 1 or (s.overrides or {}).get("set_advantage_to_zero"):
            continue
        if t.chunk_last is not None:
            c_sum, c_n = chunk_kl(s, t)
            total, n = total + c_sum, n + c_n
            continue
        m = s.loss_mask.numpy()[1:].astype(bool)
        q = t.dense_sampled(s.length)[m]
        student = s.logprobs.numpy()[1:][m]
        total += float((student - q).sum(dtype="<f8"))
        n += int(m.sum())
    return total, n


def header_of(g: ScoredGroup, payload_bytes: int = 0) -> GroupHeader:
    seqs = g.group.sequences
    kl_sum, kl_n = group_kl(g) if g.status is DistillStatus.OK else (0.0, 0)
    trained = aligned = topk_rows = 0
    mass = 0.0
    if g.status is DistillStatus.OK and g.teacher and g.teacher[0].chunk_last is not None:
        trained, aligned, topk_rows, mass = cross_shares(seqs, g.teacher)
    return GroupHeader(
        group_id=g.group_id, policy_version=g.group.policy_version, status=g.status, sequences=len(seqs),
        tokens=sum(s.length for s in seqs), longest=max((s.length for s in seqs), default=0), kl_sum=kl_sum,
        kl_tokens=kl_n, payload_bytes=payload_bytes, created_at=g.group.created_at or time.time(), pool=g.pool,
        schema=g.schema, cross_tokens=trained, cross_aligned=aligned, cross_topk_rows=topk_rows,
        cross_topk_mass=mass,
    )


def encode_header(msg: Message, payload_bytes: int = 0) -> bytes:
    if not isinstance(msg, ScoredGroup):
        raise TypeError(f"only scored groups travel by claim check, not {type(msg).__name__}")
    return _ENC.encode(header_of(msg, payload_bytes))


def decode_header(data: bytes) -> GroupHeader:
    """Decode and check a header; anything invalid is a ``DecodeError`` naming the field."""
    if len(data) > MAX_HEADER_BYTES:
        raise DecodeError("h", f"{len(data)} bytes exceeds the header cap of {MAX_HEADER_BYTES}")
    try:
        h = _DEC.decode(data)
    except msgspec.ValidationError as e:
        raise DecodeError("h", f"invalid: {e}") from None
    except (msgspec.DecodeError, RecursionError, ValueError, TypeError, OverflowError) as e:
        raise DecodeError("h", f"malformed msgpack: {e}") from None
    if h.schema > SCHEMA_VERSION or h.schema < 1:
        raise DecodeError("h.schema", f"version {h.schema} not supported (this reader: 1..{SCHEMA_VERSION})")
    for name in ("sequences", "tokens", "longest", "kl_tokens", "payload_bytes", "policy_version", "cross_tokens",
                 "cross_aligned", "cross_topk_rows"):
        if getattr(h, name) < 0:
            raise DecodeError(f"h.{name}", f"negative: {getattr(h, name)}")
    if h.sequences < 1 or h.longest > h.tokens or h.tokens > h.sequences * h.longest:
        raise DecodeError("h.tokens", f"{h.sequences} sequences, {h.tokens} tokens, longest {h.longest}: inconsistent")
    if h.kl_sum != h.kl_sum or abs(h.kl_sum) == float("inf"):
        raise DecodeError("h.kl_sum", "not finite")
    if not 0.0 <= h.cross_topk_mass <= h.cross_topk_rows * (1.0 + 1e-3):
        raise DecodeError("h.cross_topk_mass", f"{h.cross_topk_mass} outside [0, cross_topk_rows]")
    if (problem := pool_problem(h.pool)) is not None:
        raise DecodeError("h.pool", problem)
    return h
