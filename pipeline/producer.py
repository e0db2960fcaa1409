"""Producer: one XADD per message, with backpressure and idempotent hand-off.

A Lua script does, atomically on the stream's hash slot:
  1. if a dedupe marker of any of the message's ids exists -> report which (no XADD);
  2. if the stream holds ``max_backlog`` entries or more -> report "full" (nothing written);
  3. XADD the entry and set the dedupe markers (with a TTL) to its entry id.
A group or rollout is deduplicated by its group id; a train batch by the ids of all its groups, so a
group reaches the learner in at most one batch even when a restarted feeder re-batches it.
When full, the producer waits (backing off) and retries until ``backpressure_timeout_s``, then raises
``BackpressureTimeout``. It never trims: unconsumed entries are never deleted to make room.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass
from typing import Final

import redis.asyncio as aioredis
import structlog

from pipeline import metrics
from pipeline.config import StreamSettings
from pipeline.connection import Backoff, retry_transient
from pipeline.keys import Keys
from schemas import Message, RolloutGroup, ScoredGroup, TrainBatch, encode

log = structlog.get_logger("distillq.producer")

_ADD: Final = """
for i = 2, #KEYS do
  local seen = redis.call('GET', KEYS[i])
  if seen then return {2, seen, i - 2} end
end
local cap = tonumber(ARGV[1])
if cap > 0 and redis.call('XLEN', KEYS[1]) >= cap then return {0, '', -1} end
local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 3))
for i = 2, #KEYS do redis.call('SET', KEYS[i], id, 'PX', ARGV[2]) end
return {1, id, -1}
"""

#: Stream entry fields: message type, group (or batch) id, msgpack payload.
F_TYPE: Final = b"t"
F_ID: Final = b"gid"
F_DATA: Final = b"d"


class BackpressureTimeout(TimeoutError):
    """The stream stayed at its backlog cap for longer than the configured timeout."""


class MessageTooLarge(ValueError):
    """The encoded message exceeds ``max_message_bytes``; it is refused before reaching Redis."""


class ProducerStopped(RuntimeError):
    """``stop`` was set while waiting for stream capacity; nothing was written."""


class AddResult(enum.Enum):
    ADDED = "added"
    DUPLICATE = "duplicate"


@dataclass(frozen=True, slots=True)
class Added:
    result: AddResult
    entry_id: str
    duplicate_index: int = -1  # for DUPLICATE: which of the dedupe ids was already written


def message_type(msg: Message) -> bytes:
    return {RolloutGroup: b"rollout", ScoredGroup: b"scored", TrainBatch: b"batch"}[type(msg)]


def dedupe_ids(msg: Message) -> list[str]:
    if isinstance(msg, TrainBatch):
        return [g.group_id for g in msg.groups]
    return [message_id(msg)]


def message_id(msg: Message) -> str:
    if isinstance(msg, RolloutGroup):
        return msg.group_id
    if isinstance(msg, ScoredGroup):
        return msg.group.group_id
    return msg.batch_id


class StreamProducer:
    """Writes messages to one stage stream of a pipeline."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        stream: str,
        settings: StreamSettings | None = None,
        *,
        dedupe: bool = True,
        shards: int = 1,
    ) -> None:
        self.redis, self.keys, self.stream = redis, keys, stream
        self.settings = settings or StreamSettings()
        self.dedupe = dedupe
        self.shards = shards
        self.key = keys.stream(stream)  # the unsharded key; see keys.stream_for
        self._script = redis.register_script(_ADD)

    async def send(self, msg: Message, *, stop: asyncio.Event | None = None) -> Added:
        """Encode and add ``msg``; waits while the stream is full. Idempotent by group id."""
        return await self.send_raw(encode(msg), message_type(msg), message_id(msg), dedupe_ids(msg), stop=stop)

    async def send_raw(
        self,
        payload: bytes,
        mtype: bytes,
        mid: str,
        dedupe: list[str] | None = None,
        *,
        stop: asyncio.Event | None = None,
    ) -> Added:
        s = self.settings
        if len(payload) > s.max_message_bytes:
            raise MessageTooLarge(f"{mtype.decode()} {mid}: {len(payload)} bytes exceeds max_message_bytes="
                                  f"{s.max_message_bytes} (DISTILLQ_MAX_MESSAGE_BYTES)")
        ids = (dedupe if dedupe is not None else [mid]) if self.dedupe else []
        key = self.keys.stream_for(self.stream, mid, self.shards)
        if key != self.key and ids != [mid]:
            raise ValueError("a sharded stream dedupes by the message's own id only")
        keys = [key, *(self.keys.seen(self.stream, i, self.shards) for i in ids)]
        args: list[bytes | str | int] = [
            s.max_backlog, s.dedupe_ttl_s * 1000, F_TYPE, mtype, F_ID, mid, F_DATA, payload,
        ]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + s.backpressure_timeout_s
        backoff = Backoff(base=0.01, cap=0.5)
        waited_since: float | None = None
        while True:
            code, entry, index = await retry_transient(
                lambda: self._script(keys=keys, args=args),
                stop=stop,
                deadline_s=max(1.0, deadline - loop.time()),
            )
            if code == 1:
                metrics.PRODUCED.labels(self.stream).inc()
                metrics.PRODUCED_BYTES.labels(self.stream).inc(len(payload))
                if waited_since is not None:
                    metrics.BACKPRESSURE_WAIT.labels(self.stream).observe(time.monotonic() - waited_since)
                return Added(AddResult.ADDED, entry.decode())
            if code == 2:
                metrics.DEDUPED.labels(self.stream).inc()
                return Added(AddResult.DUPLICATE, entry.decode(), int(index))
            if waited_since is None:
                waited_since = time.monotonic()
                log.info("backpressure_wait", stream=self.stream, cap=s.max_backlog, group_id=mid)
            if stop is not None and stop.is_set():
                raise ProducerStopped(f"stop requested while waiting for capacity on {self.stream!r}")
            if loop.time() >= deadline:
                raise BackpressureTimeout(
                    f"stream {self.stream!r} held >= {s.max_backlog} unconsumed entries for "
                    f"{s.backpressure_timeout_s:.0f} s; is its consumer running?"
                )
            await asyncio.sleep(min(backoff.next_delay() + 0.005, max(0.0, deadline - loop.time())))
