"""Groups posted to the Atropos-compatible server: converted (``schemas.atropos``), held back while their
env's buffer cannot fill its group size, and put on the ``rollouts`` stream for the teacher workers.

* A group is converted and validated first: anything our wire cannot take is a ``DecodeError``, which
  the app answers with a 422 naming the field. Its ``distill_token_ids``/``distill_logprobs`` are left out:
  the teacher workers score every group (their arrays are what ``/batch`` hands out).
* A group of a registered env whose size differs from the env's ``group_size`` waits in that env's
  buffer until some of the buffered groups sum to it exactly (the earliest such set), as in the
  reference; those then go on, each as its own group.
* A group with more sequences than the registered batch size can never be batched: it goes to the DLQ
  (stage ``atropos``, replayable onto ``rollouts``) instead of being scored and then blocking the queue.
* Writes go through ``StreamProducer``, idempotent by group id, waiting while the stream is full
  (``BackpressureTimeout``: the app answers 503). A group's id is the client's idempotency key when it sends
  one (the group's ``group_id``, else the request's ``Idempotency-Key`` header, ``key#i`` for the i-th group
  of a list), and a fresh id otherwise: a key posted again is a *repeat*, dropped and reported; two groups
  of the same content without a key are two groups (greedy sampling and repeated prompts give identical
  groups, and they are data).
"""

from __future__ import annotations

import asyncio
import uuid
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Final

import msgspec
import redis.asyncio as aioredis
import structlog

from pipeline import metrics
from pipeline.config import StreamSettings
from pipeline.serve.atropos.bodies import ScoredData
from pipeline.serve.atropos.packing import pick_exact
from pipeline.serve.atropos.state import AtroposState, BufferedGroup, Trainer, env_field
from pipeline.transport.consumer import dead_letter_category, dead_letter_fields
from pipeline.transport.keys import Keys
from pipeline.transport.pools import PoolProducer
from pipeline.transport.producer import F_DATA, F_ID, F_TYPE, AddResult, is_written
from schemas import Limits, RolloutGroup, decode, encode
from schemas.atropos import rollout_group_from_atropos
from schemas.pools import pool_of

log = structlog.get_logger("distillq.serve.atropos")

STAGE: Final = "atropos"
_JSON: Final = msgspec.json.Encoder()
#: The prefix of the id a group posted without an idempotency key gets (a fresh one per post).
POSTED_PREFIX: Final = "atropos-"


def convert(posted: dict[str, Any], group_id: str | None, policy_version: int, limits: Limits) -> RolloutGroup:
    """The rollout group for a posted ScoredDataGroup (its distill arrays left for the teacher to redo). Per-token
    arrays of another length are accepted, as the reference server accepts them, and handed back verbatim."""
    return rollout_group_from_atropos(posted, group_id=group_id, policy_version=policy_version, limits=limits,
                                      strict_lengths=False)


def group_key(data: ScoredData, header_key: str | None, index: int | None) -> str | None:
    """The client's idempotency key for a posted group: its ``group_id``, else the request's
    ``Idempotency-Key`` (``key#i`` for group ``i`` of a list), else None."""
    if data.group_id:
        return data.group_id
    if not header_key:
        return None
    return header_key if index is None else f"{header_key}#{index}"


@dataclass(frozen=True, slots=True)
class Prepared:
    """A posted group, converted: the rollout group, the posted JSON (for ``/latest_example``), its env, and
    whether its id is the client's idempotency key (else a fresh id: it cannot be a repeat)."""

    group: RolloutGroup
    posted: bytes
    env_id: int | None
    keyed: bool = False


class Ingest:
    def __init__(self, redis: aioredis.Redis, keys: Keys, state: AtroposState, settings: StreamSettings, *,
                 shards: int = 1, limits: Limits | None = None, name: str = "atropos-server",
                 buffers_lock: AbstractAsyncContextManager[Any] | None = None) -> None:
        self.redis, self.keys, self.state, self.name = redis, keys, state, name
        self.limits = limits or settings.limits()
        self.producer = PoolProducer(redis, keys, settings, shards=shards)  # to the group's teacher pool
        # one buffer update at a time (read, pick, release, rewrite), across replicas with a SharedLock
        self._buffers = buffers_lock if buffers_lock is not None else asyncio.Lock()

    def prepare(self, data: ScoredData, t: Trainer, key: str | None = None) -> Prepared:
        """Convert one posted group (raises ``DecodeError`` for a group we cannot take); nothing is written.
        ``key``: the client's idempotency key (``group_key``), the group's id; without one the group gets a
        fresh id."""
        posted = data.reference_dict()
        group = convert(posted, key or f"{POSTED_PREFIX}{uuid.uuid4().hex}", t.step, self.limits)
        return Prepared(group, _JSON.encode(posted), data.env_id, keyed=key is not None)

    async def submit(self, p: Prepared, t: Trainer, envs: list[dict[str, Any]]) -> dict[str, Any]:
        """``{"status": "received"}``, ``{"status": "buffered", "buffer_size": n}``,
        ``{"status": "repeated"}`` (the group's idempotency key was posted before: dropped) or
        ``{"status": "dead_lettered", "reason": ...}``."""
        env_id = p.env_id
        if env_id is not None and 0 <= env_id < len(envs) and len(p.group.sequences) != envs[env_id]["group_size"]:
            return await self._buffer(env_id, int(envs[env_id]["group_size"]), p, t)
        return await self.send(p.group, p.posted, env_id, t)

    async def send(self, group: RolloutGroup, posted: bytes, env_id: int | None, t: Trainer) -> dict[str, Any]:
        n = len(group.sequences)
        if t.registered and 0 < t.batch_size < n:
            reason = f"oversize_group: {n} sequences > batch_size {t.batch_size}; it can never be part of a batch"
            await self._dead_letter(group, env_id, reason)
            return {"status": "dead_lettered", "reason": reason}
        created = await self.state.track(group.group_id, env_id, n)
        try:
            added = await self.producer.send(group)
        except BaseException:
            if created:
                await self.state.untrack(group.group_id)
            raise
        if added.result is AddResult.DUPLICATE:
            if created:  # the first copy already left the pipeline's streams: nothing of it is in flight
                await self.state.untrack(group.group_id)
            log.info("group_already_posted", group_id=group.group_id)
            return {"status": "repeated"}
        await self.state.set_latest(posted)
        return {"status": "received"}

    async def _posted(self, group_id: str, pool: str) -> bool:
        """Whether a group of this id was written to ``pool``'s rollouts stream (within the dedupe TTL)."""
        marker: bytes | None = await self.redis.get(self.producer.seen_key(group_id, pool))
        return is_written(marker)

    async def _buffer(self, env_id: int, size: int, p: Prepared, t: Trainer) -> dict[str, Any]:
        group, posted = p.group, p.posted
        encoded = await asyncio.to_thread(lambda: bytes(encode(group)))
        async with self._buffers:
            waiting = await self.state.buffered(env_id)
            pool = pool_of(group.group_overrides)
            if p.keyed and (any(b.group_id == group.group_id for b in waiting)
                            or await self._posted(group.group_id, pool)):
                log.info("group_already_posted", group_id=group.group_id)
                return {"status": "repeated"}
            await self.state.buffer(env_id, BufferedGroup(group.group_id, len(group.sequences), posted, encoded))
            waiting = await self.state.buffered(env_id)
            idx = pick_exact([b.sequences for b in waiting], size) or []
            for i in idx:  # sent before the buffer is rewritten: a crash in between re-sends, deduped by id
                b = waiting[i]
                released = await asyncio.to_thread(decode, b.group, self.limits, expect=RolloutGroup)
                await self.send(released, b.posted, env_id, t)
            if idx:
                taken = set(idx)
                waiting = [b for i, b in enumerate(waiting) if i not in taken]
                await self.state.set_buffer(env_id, waiting)
        return {"status": "buffered", "buffer_size": sum(b.sequences for b in waiting)}

    async def _dead_letter(self, group: RolloutGroup, env_id: int | None, reason: str) -> None:
        original = {F_TYPE: b"rollout", F_ID: group.group_id.encode(), F_DATA: bytes(encode(group))}
        fields = dead_letter_fields(STAGE, reason, "rollouts", "", self.name, original, env_id=env_field(env_id),
                                    sequences=len(group.sequences))
        await self.redis.xadd(self.keys.dlq, fields)  # type: ignore[arg-type]
        metrics.DEAD_LETTERED.labels(STAGE, dead_letter_category(reason)).inc()
        log.warning("group_dead_lettered", group_id=group.group_id, reason=reason)

