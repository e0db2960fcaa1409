"""Sending dead-lettered or re-pushed groups through the pipeline again, never training one twice
(Redis I/O around the rules of ``pipeline.cli.deadletters``).

A group is trained at most once: the feeder's ``batches`` dedupe marker (``<batches>:seen:<group id>``,
holding the batch entry id) keeps it out of every later batch. That marker is cleared only with proof that
the group was not trained: a learner dead letter of the group out of the very batch the marker names (the
learner leaves a dead-lettered group out of its batch and deletes its payload, so a redelivery of that
batch cannot train it either). A marker written by the two-step path holds ``written`` instead of the entry
id; the batch is then the one whose entry id has the marker's write time (its TTL tells when it was set).
"""

from __future__ import annotations

from typing import Final

import redis.asyncio as aioredis

from pipeline.cli.deadletters import (
    ATROPOS_STAGE,
    ORIG,
    BatchState,
    NeedsCopy,
    PromptReplay,
    Refusal,
    Replay,
    batch_gate,
    family,
    first_look,
    from_copy,
    text,
)
from pipeline.cli.groupscan import batches_listing, find_entries, index_entries
from pipeline.config import StreamSettings
from pipeline.transport.claimcheck import encode_header
from pipeline.transport.keys import Keys, pool_stream
from pipeline.transport.pools import known_pools
from pipeline.transport.producer import ACKED, F_DATA, F_ID, WRITTEN, Added, StreamProducer, is_written, message_type
from schemas import DecodeError, Limits, Message, RolloutGroup, ScoredGroup, decode, encode
from schemas.pools import pool_of

#: How far (ms) a ``written`` marker's write time may be from its batch entry's id (same transaction).
WRITE_TIME_SLACK_MS: Final = 50


#: Dead-letter entry ids by group id (``dead_letter_index``): one pass over the DLQ for a command about many.
DeadLetterIndex = dict[str, list[str]]


async def dead_letter_index(redis: aioredis.Redis, keys: Keys) -> DeadLetterIndex:
    """Every dead letter's entry id by its group id, read in one pass."""
    return await index_entries(redis, keys.dlq, ORIG + F_ID)


async def dead_letters_of(redis: aioredis.Redis, keys: Keys, group_id: str, index: DeadLetterIndex | None = None
                          ) -> list[tuple[str, dict[bytes, bytes]]]:
    """Every dead letter of ``group_id``, oldest first (looked up in ``index`` when given: entries deleted since
    it was read are left out)."""
    out = []
    eids = index.get(group_id, []) if index is not None else await find_entries(redis, keys.dlq, group_id, ORIG + F_ID)
    for eid in eids:
        rows = await redis.xrange(keys.dlq, min=eid, max=eid)
        if rows:
            out.append((eid, dict(rows[0][1])))
    return out


def _ms(entry_id: str) -> int:
    return int(entry_id.split("-", 1)[0])


async def batch_state(redis: aioredis.Redis, keys: Keys, group_id: str, settings: StreamSettings,
                      dead: list[tuple[str, dict[bytes, bytes]]] | None = None,
                      index: DeadLetterIndex | None = None) -> BatchState:
    """Was ``group_id`` trained? (``BatchState``; ``dead``: its dead letters, if already read)."""
    mk = keys.seen("batches", group_id)
    raw, pttl = await redis.get(mk), await redis.pttl(mk)
    if raw is None:
        return BatchState("never")
    if not is_written(raw):
        return BatchState("in_flight")  # a feeder is writing the batch now
    marker = text(raw)
    dead = await dead_letters_of(redis, keys, group_id, index) if dead is None else dead
    excluded = {text(f.get(b"batch_entry")) for _, f in dead if text(f.get(b"stage")) == "learner"} - {""}
    if marker == WRITTEN:
        now_s, now_us = await redis.time()
        set_ms = now_s * 1000 + now_us // 1000 - (settings.dedupe_ttl_s * 1000 - int(pttl))
        named = [b for b in excluded if abs(_ms(b) - set_ms) <= WRITE_TIME_SLACK_MS]
        if named:
            return BatchState("excluded", named[0])
        held = [eid for eid, _ in await batches_listing(redis, keys, group_id)]
        return BatchState("in_flight", held[0]) if held else BatchState("unknown")
    entry = marker.removeprefix(ACKED)
    if entry in excluded:
        return BatchState("excluded", entry)
    if marker.startswith(ACKED):
        return BatchState("trained", entry)
    if await redis.xrange(keys.stream("batches"), min=entry, max=entry):
        return BatchState("in_flight", entry)
    return BatchState("lost", entry)  # batched, never acknowledged, and the entry is gone (deleted or trimmed)


async def find_copy(dead: list[tuple[str, dict[bytes, bytes]]], group_id: str, skip: str, limits: Limits
                    ) -> tuple[str, Message] | None:
    """Another dead letter of the group holding its valid bytes (a rollout, or a scored group whose rollout
    can be scored again); stale ones are left out (re-sending those gets them dropped again)."""
    for eid, f in dead:
        data = f.get(ORIG + F_DATA)
        if eid == skip or data is None or family(text(f.get(b"reason"))) == "stale":
            continue
        try:
            msg = decode(data, limits)
        except DecodeError:
            continue
        if isinstance(msg, RolloutGroup | ScoredGroup) and msg.group_id == group_id:
            return eid, msg
    return None


def _ttl_note(settings: StreamSettings) -> str:
    return f" (DISTILLQ_DEDUPE_TTL_S, {settings.dedupe_ttl_s / 3600:g} h after it was batched)"


async def assess(redis: aioredis.Redis, keys: Keys, entry_id: str, fields: dict[bytes, bytes], *,
                 to: str | None = None, force: bool = False, settings: StreamSettings | None = None,
                 index: DeadLetterIndex | None = None) -> Replay | PromptReplay | Refusal:
    """What ``dlq replay`` would do with one dead letter (``index``: the DLQ's, for a command about many).
    Reads only."""
    s = settings or StreamSettings()
    group_id = text(fields.get(ORIG + F_ID))
    plan = first_look(fields, to, s.limits(), force=force)
    dead: list[tuple[str, dict[bytes, bytes]]] | None = None
    if isinstance(plan, NeedsCopy):
        dead = await dead_letters_of(redis, keys, group_id, index)
        plan = from_copy(plan, group_id, await find_copy(dead, group_id, entry_id, s.limits()))
    if isinstance(plan, Refusal | PromptReplay) or plan.target == "batches":
        return plan
    state = await batch_state(redis, keys, group_id, s, dead, index)
    refused = batch_gate(group_id, state, _ttl_note(s))
    if refused is not None:
        return refused
    if state.verdict in ("excluded", "lost"):
        return Replay(plan.target, plan.msg, plan.origin, plan.rescore, clear_batches=True)
    return plan


async def clear_markers(redis: aioredis.Redis, keys: Keys, group_id: str, shards: int, *, batches: bool,
                        atropos: bool = False) -> None:
    """Forget that ``group_id`` was written to rollouts and scored (and why the feeder dropped it), so that it
    flows through the teacher and the feeder again; ``batches``: its batches marker too (only for a group
    proven untrained, see ``batch_state``); ``atropos``: the ``serve atropos`` queue's marker."""
    rollouts = [keys.seen(pool_stream(p), group_id, shards) for p in await known_pools(redis, keys)]  # every pool's
    doomed = [*rollouts, keys.seen("scored", group_id, shards), keys.dropped(group_id)]
    if batches:
        doomed.append(keys.seen("batches", group_id))
    if atropos:
        doomed.append(keys.atropos_seen(group_id))
    for key in doomed:
        await redis.delete(key)  # one key per call: they live in different slots on a cluster


async def send_again(redis: aioredis.Redis, keys: Keys, plan: Replay, settings: StreamSettings, shards: int, *,
                     stage: str = "") -> Added:
    """Clear the markers ``plan`` needs cleared, then write its message without the dedupe check."""
    msg = plan.msg
    gid = msg.group_id if isinstance(msg, RolloutGroup | ScoredGroup) else ""
    if gid:
        await clear_markers(redis, keys, gid, shards, batches=plan.clear_batches,
                            atropos=stage == ATROPOS_STAGE and plan.target == "scored")
    target = plan.target  # a group to be scored again goes to its teacher pool's stream
    if target == "rollouts" and isinstance(msg, RolloutGroup):
        target = pool_stream(pool_of(msg.group_overrides))
    producer = StreamProducer(redis, keys, target, settings, dedupe=False, shards=shards)
    payload = encode(msg)
    header = encode_header(msg, len(payload)) if producer.claim_check else None
    mid = gid or getattr(msg, "batch_id", "")
    return await producer.send_raw(payload, message_type(msg), mid, header=header)


async def admit_push(redis: aioredis.Redis, keys: Keys, group_id: str, shards: int,
                     settings: StreamSettings) -> Refusal | None:
    """For ``push --force``: clear what stops ``group_id`` from flowing again, or say why it must not."""
    state = await batch_state(redis, keys, group_id, settings)
    refused = batch_gate(group_id, state, _ttl_note(settings))
    if refused is not None:
        return refused
    await clear_markers(redis, keys, group_id, shards, batches=state.verdict in ("excluded", "lost"))
    return None
