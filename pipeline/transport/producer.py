"""Producer: one XADD per message, with backpressure and idempotent hand-off.

Every write checks, atomically on the stream's hash slot, in a small Lua script that never sees a large
payload (Redis's Lua copies every argument byte: about 5x the CPU of a plain XADD per byte, measured in
bench/RESULTS.md): if a dedupe marker of any of the message's ids says *written*, report the duplicate;
if another writer holds it (*pending*), wait; if the stream holds ``max_backlog`` entries or more, wait
("full"; nothing is ever trimmed to make room). Three ways to write, by message:

* **Small** (up to ``SMALL_MESSAGE_BYTES``: headers-sized messages, train batch manifests) and every
  message on Redis Cluster (redis-py offers no MULTI there): one script, ``_ADD``, checks and writes, one
  round trip; the payload passes through Lua, where that costs less than a round trip.
* **Claim-checked** (``scored``: the payload goes to its own key, the entry carries a header): one round
  trip, pipelined: ``SET payload-key payload PX RESERVE_MS`` then ``_ADD``, which checks, adds the header
  entry, gives the payload key its lifetime (``payload_ttl_s``: orphans expire) and marks the markers with the
  entry id; on a duplicate or a full stream it deletes the payload key instead. A crash between the two leaves
  a key that expires. After a wait (full stream, another writer), the send goes on with the two steps below, so
  that a waiting producer does not re-send its payload each time it retries.
* **Large inline** (``rollouts``): two round trips. 1. ``_RESERVE`` reserves the markers with this
  send's token for ``RESERVE_MS``. 2. ``MULTI`` / [``SET`` payload] / ``XADD`` / ``SET`` markers
  ``written`` / ``ZREM`` the reservation / ``EXEC``: the entry and its markers appear together or not at
  all. A crash between the steps leaves a reservation that expires, after which a redelivered message is
  written normally. A duplicate of such a message reports ``written``, not the entry id: the id is not
  known inside the MULTI, and the round trip that used to record it afterwards cost more than it told.

A group or rollout is deduplicated by its group id; a train batch by the ids of all its groups, so a
group reaches the learner in at most one batch even when a restarted feeder re-batches it.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import itertools
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import redis.asyncio as aioredis
import structlog
from redis.exceptions import NoScriptError, ResponseError

from pipeline import metrics
from pipeline.config import StreamSettings
from pipeline.errors import TransportError
from pipeline.transport.claimcheck import CLAIM_CHECKED, encode_header
from pipeline.transport.connection import Backoff, is_cluster_client, is_redis_full, memory_use, retry_transient
from pipeline.transport.keys import Keys
from schemas import BatchManifest, Message, RolloutGroup, ScoredGroup, TrainBatch, encode

log = structlog.get_logger("distillq.producer")

#: How long a reservation holds a dedupe marker before a crashed writer's claim expires.
RESERVE_MS: Final = 30_000
_PENDING: Final = "pending:"
#: A marker's value after a two-step write: the entry id is not known inside the MULTI (reading it back in
#: Lua would copy the whole entry), so a later duplicate reports this instead of the id.
WRITTEN: Final = "written"
#: A ``batches`` marker's value once a learner acknowledged the batch entry it names (``acked:<entry id>``): the
#: record that the group was trained (``pipeline.cli.recovery.batch_state``).
ACKED: Final = "acked:"


# KEYS: markers of one slot; ARGV[1]: the value. Each marker that exists takes it, keeping its TTL.
_MARK: Final = "for i = 1, #KEYS do redis.call('SET', KEYS[i], ARGV[1], 'XX', 'KEEPTTL') end return #KEYS"


def mark_acked(pipe: Any, markers: Sequence[str], entry_id: str) -> None:
    """Queue on ``pipe`` the rewrite of ``markers`` (one hash slot) to ``acked:<entry_id>``, keeping their TTL (an
    expired one stays expired): one EVAL, not a command per marker (redis-py packs each command in Python)."""
    if markers:
        pipe.eval(_MARK, len(markers), *markers, ACKED + entry_id)

# KEYS: stream, its reservations (sorted set: token -> expiry ms), dedupe markers...; ARGV: cap, token, reserve_ms.
# Returns {code, marker value, marker index}: 1 reserved, 2 written already, 3 another writer, 0 full.
# The cap counts outstanding reservations too, so concurrent writers cannot overshoot it.
_RESERVE: Final = """
for i = 3, #KEYS do
  local v = redis.call('GET', KEYS[i])
  if v and v ~= ARGV[2] then
    if string.sub(v, 1, 8) == 'pending:' then return {3, v, i - 3} end
    return {2, v, i - 3}
  end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local cap = tonumber(ARGV[1])
if cap > 0 then
  local held = redis.call('ZCARD', KEYS[2])
  if redis.call('ZSCORE', KEYS[2], ARGV[2]) then held = held - 1 end
  if redis.call('XLEN', KEYS[1]) + held >= cap then return {0, '', -1} end
end
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[2])
for i = 3, #KEYS do redis.call('SET', KEYS[i], ARGV[2], 'PX', ARGV[3]) end
return {1, '', -1}
"""

# One round trip: the same checks, and the write in the script too. ARGV[4], the payload mode: 0 no payload
# key; 1 SET ARGV[5] into KEYS[3] (small messages, Redis Cluster); 2 KEYS[3] was just SET by this send with
# a TTL (claim-checked fast path): set its TTL to the payload's on success, DEL it when refusing, code 4 if it is
# missing. KEYS: stream, its reservations, [payload key if ARGV[4] > 0], markers...; ARGV: cap, token, ttl ms,
# mode, payload for the payload key (or ''), the payload key's TTL (ms), entry fields... Returns {code, value,
# marker index} as _RESERVE, with 1 meaning *written* and value the entry id.
_ADD: Final = """
local mode = tonumber(ARGV[4])
local first = 3
if mode > 0 then first = 4 end
local function refuse(r)
  if mode == 2 then redis.call('DEL', KEYS[3]) end
  return r
end
for i = first, #KEYS do
  local v = redis.call('GET', KEYS[i])
  if v and v ~= ARGV[2] then
    if string.sub(v, 1, 8) == 'pending:' then return refuse({3, v, i - first}) end
    return refuse({2, v, i - first})
  end
end
local cap = tonumber(ARGV[1])
if cap > 0 then
  local t = redis.call('TIME')
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
  local held = redis.call('ZCARD', KEYS[2])
  if redis.call('ZSCORE', KEYS[2], ARGV[2]) then held = held - 1 end
  if redis.call('XLEN', KEYS[1]) + held >= cap then return refuse({0, '', -1}) end
end
if mode == 2 and redis.call('EXISTS', KEYS[3]) == 0 then return {4, '', -1} end
redis.call('ZREM', KEYS[2], ARGV[2])
if mode == 1 then redis.call('SET', KEYS[3], ARGV[5], 'PX', ARGV[6]) end
local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 7))
if mode == 2 then redis.call('PEXPIRE', KEYS[3], ARGV[6]) end
for i = first, #KEYS do redis.call('SET', KEYS[i], id, 'PX', ARGV[3]) end
return {1, id, -1}
"""

#: ``send_raw``'s code for a pass refused because Redis is at ``maxmemory`` (the scripts' codes are 0-4).
_REDIS_FULL: Final = 5

#: Messages up to this size are written by one script (``_ADD``), larger ones in two steps.
SMALL_MESSAGE_BYTES: Final = 32 * 1024

#: Stream entry fields: message type, group (or batch) id, msgpack payload; on claim-checked streams
#: (``pipeline.transport.claimcheck``) a header and the payload's key instead of the payload.
F_TYPE: Final = b"t"
F_ID: Final = b"gid"
F_DATA: Final = b"d"
F_HEADER: Final = b"h"
F_REF: Final = b"p"


class BackpressureTimeout(TransportError, TimeoutError):
    """The stream stayed at its backlog cap for longer than the configured timeout."""


class MessageTooLarge(TransportError, ValueError):
    """The encoded message exceeds ``max_message_bytes``; it is refused before reaching Redis."""


class ProducerStopped(TransportError, RuntimeError):
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
    return {RolloutGroup: b"rollout", ScoredGroup: b"scored", TrainBatch: b"batch", BatchManifest: b"batch"}[type(msg)]


def is_written(marker: bytes | None) -> bool:
    """Whether a dedupe marker records a completed write (not absent, not a pending reservation)."""
    return marker is not None and not marker.startswith(_PENDING.encode())


def dedupe_ids(msg: Message) -> list[str]:
    if isinstance(msg, TrainBatch):
        return [g.group_id for g in msg.groups]
    if isinstance(msg, BatchManifest):
        return [r.group_id for r in msg.refs]
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
        self._reserve = redis.register_script(_RESERVE)
        self._add = redis.register_script(_ADD)
        self._cluster = is_cluster_client(redis)  # no MULTI there: one script does it all
        self.claim_check = stream in CLAIM_CHECKED  # header in the entry, payload in its own key
        # Unique names for payload keys and reservations: a random prefix per producer and a counter
        # (uuid4 per name cost a system call and ~15 us, twice per scored group).
        self._prefix, self._serial = uuid.uuid4().hex[:12], itertools.count()
        self._produced, self._produced_bytes = metrics.PRODUCED.labels(stream), metrics.PRODUCED_BYTES.labels(stream)

    async def send(self, msg: Message, *, stop: asyncio.Event | None = None, token: str | None = None) -> Added:
        """Encode and add ``msg``; waits while the stream is full. Idempotent by group id.

        ``token`` names the reservation: a stage passes one derived from its input entry, so that after a
        crash between reservation and write, the redelivered input resumes the same reservation.
        """
        payload = encode(msg)
        header = encode_header(msg, len(payload)) if self.claim_check else None
        return await self.send_raw(payload, message_type(msg), message_id(msg), dedupe_ids(msg), stop=stop,
                                   token=token, header=header)

    async def send_raw(
        self,
        payload: bytes | memoryview,
        mtype: bytes,
        mid: str,
        dedupe: list[str] | None = None,
        *,
        stop: asyncio.Event | None = None,
        token: str | None = None,
        header: bytes | None = None,
    ) -> Added:
        """Add an encoded message. On a claim-checked stream ``header`` (``transport.claimcheck``) is required."""
        s = self.settings
        if len(payload) > s.max_message_bytes:
            raise MessageTooLarge(f"{mtype.decode()} {mid}: {len(payload)} bytes exceeds max_message_bytes="
                                  f"{s.max_message_bytes} (DISTILLQ_MAX_MESSAGE_BYTES)")
        ids = (dedupe if dedupe is not None else [mid]) if self.dedupe else []
        key = self.keys.stream_for(self.stream, mid, self.shards)
        if key != self.key and ids != [mid]:
            raise ValueError("a sharded stream dedupes by the message's own id only")
        markers = [self.keys.seen(self.stream, i, self.shards) for i in ids]
        reservations = self.keys.reservations(key)
        blob: tuple[str, bytes | memoryview] | None = None  # (payload key, payload) on a claim-checked stream
        if self.claim_check:
            if header is None:
                raise ValueError(f"stream {self.stream!r} is claim-checked: send_raw needs the group's header")
            blob = (self.keys.payload(key, mid, self._unique()), payload)
            fields: dict[bytes, bytes | memoryview | str] = {F_TYPE: mtype, F_ID: mid, F_HEADER: header, F_REF: blob[0]}
        else:
            fields = {F_TYPE: mtype, F_ID: mid, F_DATA: payload}
        token = f"{_PENDING}{token or self._unique()}"
        single = self._cluster or len(payload) <= SMALL_MESSAGE_BYTES
        fast = blob is not None and not single  # claim-checked: SET + _ADD in one round trip, until a wait
        loop = asyncio.get_running_loop()
        deadline = loop.time() + s.backpressure_timeout_s
        backoff = Backoff(base=0.01, cap=0.5)
        waited_since: float | None = None
        why, why_code = "", 0
        while True:
            op = self._attempt(fast, single, key, reservations, markers, token, fields, payload, blob, mid)
            code, value, index = await self._pass(op, stop, max(1.0, deadline - loop.time()))
            written = single or fast
            fast = False  # after a refusal, wait with the small script only, then write in two steps
            if code == 1:
                entry = value.decode() if written else await self._write_retrying(key, fields, markers, token, blob)
                self._produced.inc()
                self._produced_bytes.inc(len(payload))
                if waited_since is not None:
                    metrics.BACKPRESSURE_WAIT.labels(self.stream).observe(time.monotonic() - waited_since)
                return Added(AddResult.ADDED, entry)
            if code == 2:
                metrics.DEDUPED.labels(self.stream).inc()
                return Added(AddResult.DUPLICATE, value.decode(), int(index))
            if waited_since is None:
                waited_since = time.monotonic()
            if code != why_code:  # a wait begins, or its cause changes: name it once
                why, why_code = await self._log_wait(code, mid), code
            if stop is not None and stop.is_set():
                raise ProducerStopped(f"stop requested while waiting for capacity on {self.stream!r}")
            if loop.time() >= deadline:
                raise self._timed_out(code, why)
            await asyncio.sleep(min(backoff.next_delay() + 0.005, max(0.0, deadline - loop.time())))

    async def _pass(self, op: Callable[[], Awaitable[Any]], stop: asyncio.Event | None,
                    deadline_s: float) -> tuple[int, bytes, int]:
        """One pass of ``send_raw``'s loop: the scripts' ``(code, value, index)``, transient errors retried;
        Redis at ``maxmemory`` gives ``_REDIS_FULL`` (backpressure, with its cause named)."""
        try:
            code, value, index = await retry_transient(op, stop=stop, deadline_s=deadline_s, wait_when_full=False)
        except ResponseError as e:
            if not is_redis_full(e):
                raise
            return _REDIS_FULL, b"", -1
        return int(code), value, int(index)

    async def _log_wait(self, code: int, mid: str) -> str:
        """Log a wait (``backpressure_wait``, or ``redis_full`` with used/maxmemory); its cause."""
        cause = await self._wait_cause(code)
        if code == _REDIS_FULL:
            log.warning("redis_full", stream=self.stream, reason=cause, group_id=mid)
        else:
            log.info("backpressure_wait", stream=self.stream, reason=cause, group_id=mid)
        return cause

    def _timed_out(self, code: int, why: str) -> BackpressureTimeout:
        s = self.settings
        if code == _REDIS_FULL:
            return BackpressureTimeout(f"stream {self.stream!r}: {why} for {s.backpressure_timeout_s:.0f} s")
        return BackpressureTimeout(f"stream {self.stream!r} held >= {s.max_backlog} unconsumed entries for "
                                   f"{s.backpressure_timeout_s:.0f} s; is its consumer running?")

    async def _wait_cause(self, code: int) -> str:
        """Why a send waits, for its log line: another writer, the stream's cap, or Redis's memory."""
        if code == 3:
            return "another writer holds the group"
        if code != _REDIS_FULL:
            return f"stream at its cap of {self.settings.max_backlog}"
        mem = await memory_use(self.redis)
        used, cap = mem.get("used_memory"), mem.get("maxmemory")
        size = f" (used {used} of {cap} bytes)" if used is not None and cap else ""
        return f"Redis at maxmemory{size}: writes are refused until memory is freed"

    def _unique(self) -> str:
        """A name no other send of any producer uses: this producer's random prefix and a serial number."""
        return f"{self._prefix}{next(self._serial):x}"

    def _attempt(
        self, fast: bool, single: bool, key: str, reservations: str, markers: list[str], token: str,
        fields: dict[bytes, bytes | memoryview | str], payload: bytes | memoryview,
        blob: tuple[str, bytes | memoryview] | None, mid: str,
    ) -> Callable[[], Awaitable[Any]]:
        """The check (and, for ``fast`` or ``single``, the write) of one pass of ``send_raw``'s loop."""
        s = self.settings
        if fast:
            return functools.partial(self._add_claim_checked, key, reservations, markers, token, fields, payload, mid)
        if single:
            flat = [x for kv in fields.items() for x in kv]
            return functools.partial(self._add, keys=[key, reservations, *([blob[0]] if blob else []), *markers],
                                     args=[s.max_backlog, token, s.dedupe_ttl_s * 1000, int(blob is not None),
                                           blob[1] if blob else b"", s.payload_ttl_s * 1000, *flat])
        return functools.partial(self._reserve, keys=[key, reservations, *markers],
                                 args=[s.max_backlog, token, RESERVE_MS])

    async def _write_retrying(
        self, key: str, fields: dict[bytes, bytes | memoryview | str], markers: list[str], token: str,
        blob: tuple[str, bytes | memoryview] | None = None,
    ) -> str:
        attempts = 0

        async def write() -> str:
            nonlocal attempts
            attempts += 1
            return await self._write(key, fields, markers, token, blob, retry=attempts > 1)

        return await retry_transient(write, deadline_s=60)

    async def _write(
        self, key: str, fields: dict[bytes, bytes | memoryview | str], markers: list[str], token: str,
        blob: tuple[str, bytes | memoryview] | None = None, *, retry: bool = False,
    ) -> str:
        """XADD (and SET the claim-checked payload) and mark the reserved markers ``written``, atomically
        (MULTI/EXEC: same hash slot).

        Safe to retry after an ambiguous failure (EXEC ran, the reply was lost): if the first marker no
        longer holds this send's token, the write happened and is not repeated.
        """
        if markers and retry:
            current: bytes | None = await self.redis.get(markers[0])
            if current is not None and current.decode() != token:
                return current.decode()  # written by this send already
        async with self.redis.pipeline(transaction=True) as p:
            if blob is not None:
                p.set(blob[0], blob[1], px=self.settings.payload_ttl_s * 1000)
            p.xadd(key, fields)  # type: ignore[arg-type]
            for m in markers:
                p.set(m, WRITTEN, px=self.settings.dedupe_ttl_s * 1000)
            p.zrem(self.keys.reservations(key), token)  # the reservation now counts as the entry itself
            res = await p.execute()
        xadd = res[1 if blob is not None else 0]
        return xadd.decode() if isinstance(xadd, bytes) else str(xadd)

    async def _add_claim_checked(
        self, key: str, reservations: str, markers: list[str], token: str,
        fields: dict[bytes, bytes | memoryview | str], payload: bytes | memoryview, mid: str,
    ) -> list[Any]:
        """One round trip: SET a fresh payload key with a TTL, then ``_ADD`` in mode 2 (see the module doc).

        Each attempt uses its own payload key, so a retry after a lost reply never deletes the key an entry
        written by the earlier attempt references; an unreferenced key expires after ``RESERVE_MS``.
        """
        s = self.settings
        pkey = self.keys.payload(key, mid, self._unique())
        flat = [x for kv in {**fields, F_REF: pkey}.items() for x in kv]
        for attempt in range(2):
            async with self.redis.pipeline(transaction=False) as p:
                p.set(pkey, payload, px=RESERVE_MS)
                args: list[Any] = [*markers, s.max_backlog, token, s.dedupe_ttl_s * 1000, 2, b"",
                                   s.payload_ttl_s * 1000, *flat]
                p.evalsha(self._add.sha, 3 + len(markers), key, reservations, pkey, *args)
                stored, reply = await p.execute(raise_on_error=False)
            if isinstance(reply, NoScriptError) and attempt == 0:  # script cache flushed (Redis restarted)
                await self.redis.script_load(_ADD)
                continue
            for r in (stored, reply):
                if isinstance(r, Exception):
                    raise r
            if int(reply[0]) == 4:  # the SET did not take (cannot happen without an error above)
                raise ResponseError(f"payload key {pkey} missing after SET")
            return list(reply)
        raise AssertionError("unreachable")  # pragma: no cover
