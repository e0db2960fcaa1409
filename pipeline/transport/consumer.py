"""Consumer-group reads of one stage stream, with reclaim, dead-lettering and batched ack+delete.

* ``read`` first reclaims (XPENDING IDLE + XCLAIM) entries another consumer left pending longer than
  ``claim_idle_ms`` (at most every ``claim_interval_ms``), then reads new entries (XREADGROUP BLOCK COUNT).
* Each delivery carries its delivery count. A reclaimed entry delivered more than ``max_deliveries``
  times goes to the dead-letter stream instead of being handed out again.
* ``ack`` acknowledges and deletes a batch of entries in one round trip, so Redis memory does not grow
  with history and a stream's length equals its backlog (the producer's backpressure relies on it).
* ``dead_letter`` writes stage, reason and the original fields to the DLQ, then acks the entry (in that
  order: a crash between the two leaves a duplicate dead letter, never a lost entry).
* Claim-checked entries (``pipeline.transport.claimcheck``: a header and the key of the payload) are resolved on
  read, so ``Delivery.payload`` is the payload either way, and ``ack`` deletes the payload key with the
  entry. A consumer built with ``resolve_payloads=False`` (the feeder) reads headers only and passes the
  payloads on (``ack(..., keep_payloads=True)``). An entry whose payload key is gone is dead-lettered
  (``payload_missing``), never handed out.
* A consumer group that is gone (Redis restarted without its data, a failover to an empty replica, an
  ``XGROUP DESTROY`` by hand: NOGROUP) is created again (MKSTREAM, reading from the start) by the next
  ``read``, which returns nothing that time; what happened is logged (``consumer_group_recreated``) and
  recorded as an incident (``pipeline.transport.incidents``): ``redis_data_lost`` once per loss of the
  namespace's data (``pipeline.transport.resets``), ``stream_reset`` by a consumer whose in-flight entries
  went with it or that saw the stream hold entries (its length, read at each lease renewal and at most once a
  second while reading: how many waited and how long before the reset it was seen), ``group_destroyed`` when
  the stream was still there.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisClusterException, RedisError, ResponseError

from pipeline import metrics
from pipeline.config import StreamSettings
from pipeline.transport import incidents
from pipeline.transport.connection import TRANSIENT, is_cluster_client, is_nogroup, retry_transient
from pipeline.transport.keys import Keys
from pipeline.transport.producer import F_DATA, F_HEADER, F_ID, F_REF, F_TYPE, mark_acked
from pipeline.transport.resets import DataState, Sentinel

log = structlog.get_logger("distillq.consumer")


@dataclass(slots=True)
class Delivery:
    """One stream entry handed to this consumer."""

    entry_id: str
    fields: dict[bytes, bytes]
    deliveries: int = 1
    reclaimed: bool = False
    received_at: float = field(default_factory=time.time)
    shard: int = 0  # which shard of a sharded stream it came from

    @property
    def payload(self) -> bytes:
        return self.fields.get(F_DATA, b"")

    @property
    def header(self) -> bytes | None:
        """A claim-checked entry's header (``pipeline.transport.claimcheck``), else ``None``."""
        return self.fields.get(F_HEADER)

    @property
    def payload_key(self) -> str | None:
        """The key holding a claim-checked entry's payload, else ``None``."""
        ref = self.fields.get(F_REF)
        return ref.decode() if ref is not None else None

    @property
    def group_id(self) -> str:
        return self.fields.get(F_ID, b"").decode("utf-8", "replace")

    @property
    def mtype(self) -> str:
        return self.fields.get(F_TYPE, b"").decode("utf-8", "replace")

    @property
    def age_s(self) -> float:
        """Seconds since the entry was added (from its stream id)."""
        ms = int(self.entry_id.split("-", 1)[0])
        return max(0.0, self.received_at - ms / 1000)


async def resolve_payloads(redis: aioredis.Redis, entries: Sequence[dict[bytes, bytes]]) -> list[bool]:
    """Put each claim-checked entry's payload into its fields (``F_DATA``), in one MGET.

    All entries must come from one stream key (their payload keys share its hash slot). Returns, per
    entry, whether its payload is there (inline entries: always).
    """
    todo = [f for f in entries if F_REF in f and F_DATA not in f]
    values: list[bytes | None] = await redis.mget([f[F_REF] for f in todo]) if todo else []
    for f, v in zip(todo, values, strict=True):
        if v is not None:
            f[F_DATA] = v
    return [F_DATA in f for f in entries]


def dead_letter_fields(
    stage: str, reason: str, source: str, source_id: str, consumer: str, original: Mapping[bytes, bytes],
    **extra: str | int,
) -> dict[bytes | str, bytes | str | int]:
    """A dead-letter entry: who gave up, why, where the entry came from, and its fields (``orig_*``)."""
    fields: dict[bytes | str, bytes | str | int] = {
        "stage": stage, "reason": reason[:2000], "source": source, "source_id": source_id,
    }
    fields.update(extra)
    fields.update(consumer=consumer, at_ms=int(time.time() * 1000))
    for k, v in original.items():
        fields[b"orig_" + k] = v
    return fields


def dead_letter_category(reason: str) -> str:
    """The metric label of a dead-letter reason: its ``category:`` prefix."""
    return reason.split(":", 1)[0][:64]


def _entry_id(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


class StreamConsumer:
    """One consumer (``name``) of the consumer group that reads ``stream``."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        stream: str,
        name: str,
        settings: StreamSettings | None = None,
        *,
        stage: str | None = None,
        group: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        shard: int | None = None,
        shards: int = 1,
        resolve_payloads: bool = True,
    ) -> None:
        self.redis, self.keys, self.stream, self.name = redis, keys, stream, name
        self.resolve_payloads = resolve_payloads
        self._cluster = is_cluster_client(redis)
        self.settings = settings or StreamSettings()
        self.shard = shard
        self.key = keys.stream(stream, shard, shards)
        self.group = group or keys.consumer_group(stream)
        self.stage: str = stage or self.group
        self._clock = clock
        self._last_claim = float("-inf")
        self.owned: set[str] = set()  # entries handed out by this consumer and not yet settled
        self._own_cursor: str | None = "0"  # paging through our own pending entries; None when done
        self.sentinel = Sentinel(redis, keys)
        #: The stream's length (its backlog: acknowledged entries are deleted) at the last lease renewal, and when
        #: (``clock``): what a reset took with it beyond this consumer's own entries (``recover_group``).
        self.seen_length: int | None = None
        self.seen_at = 0.0

    async def ensure_group(self) -> bool:
        """Create the stream and its consumer group if missing (reading from the start); True if this call
        created the group. The first call also remembers the namespace's sentinel (``transport.resets``)."""
        if not self.sentinel.token:
            await self.sentinel.check()
        try:
            await self.redis.xgroup_create(self.key, self.group, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
            return False
        return True

    async def recover_group(self, error: BaseException) -> None:
        """The group is gone (``error``: NOGROUP): create it again and say what happened (see the module)."""
        held = len(self.owned)
        stream_there = bool(await self.redis.exists(self.key))
        data = await self.sentinel.check()
        created = await retry_transient(self.ensure_group, redis=self.redis)
        self.owned.clear()  # gone with the group: their acks find nothing, leases renew nothing
        self._own_cursor, self._last_claim = "0", float("-inf")
        log.warning("consumer_group_recreated", stream=self.stream, key=self.key, group=self.group,
                    consumer=self.name, error=str(error), stream_existed=stream_there, data=data.value,
                    in_flight_lost=held, created_here=created)
        metrics.REDIS_ERRORS.labels(self.stage).inc()
        ns = self.keys.namespace
        if data is DataState.LOST_HERE:
            await incidents.record(
                self.redis, self.keys, "redis_data_lost",
                f"Redis lost the data of namespace {ns} (restarted without persistence, flushed, or failed over "
                "to an empty replica): its streams, consumer groups and dedupe markers are gone",
                writer=self.name)
        known, ago = self.seen_length, self._clock() - self.seen_at
        self.seen_length = None
        if (held or known) and (data is not DataState.SAME or not stream_there):
            seen = "" if known is None else (f", and the stream held {known} entries (waiting or pending) when last "
                                             f"seen {ago:.0f} s before")
            await incidents.record(
                self.redis, self.keys, "stream_reset",
                f"stream {self.key} was reset: {held} entries pending at {self.name} are gone{seen}", writer=self.name,
                stream=self.stream, key=self.key, entries=held, stream_entries=known,
                seen_s_before=None if known is None else round(ago, 1))
        elif created and data is DataState.SAME and stream_there:
            await incidents.record(
                self.redis, self.keys, "group_destroyed",
                f"consumer group {self.group} of stream {self.key} was gone (destroyed by hand?): created again, "
                "its unacknowledged entries are read again from the start", writer=self.name,
                stream=self.stream, key=self.key, group=self.group)

    async def read(self, count: int, block_ms: int | None = None, *, block: bool = True) -> list[Delivery]:
        """Up to ``count`` deliveries: reclaimed ones first, then new ones (blocking if none and ``block``).

        If a step fails (Redis went away between the reclaim and the read, say), what the earlier steps
        took is released before the error propagates: an entry left in ``owned`` but never handed out
        would have its lease renewed and be skipped by every reclaim, stuck until the worker restarts."""
        if count <= 0:
            return []
        out: list[Delivery] = []
        try:
            return await self._read(count, block_ms, block, out)
        except ResponseError as e:
            self.release(out)
            if not is_nogroup(e):
                raise
            await self.recover_group(e)
            return []
        except BaseException:
            self.release(out)  # still pending in Redis: reclaimed once idle
            raise

    async def _read(self, count: int, block_ms: int | None, block: bool, out: list[Delivery]) -> list[Delivery]:
        if self._own_cursor is not None:
            # After a restart under the same name, our own unacknowledged entries come first.
            out += await self._read_own_pending(count)
        now = self._clock()
        if len(out) < count and now - self._last_claim >= self.settings.claim_interval_ms / 1000:
            self._last_claim = now
            out += await self.reclaim(count - len(out))
        if len(out) < count:
            wait = None if out or not block else max(1, self.settings.block_ms if block_ms is None else block_ms)
            resp = await self.redis.xreadgroup(
                self.group, self.name, {self.key: ">"}, count=count - len(out), block=wait
            )
            for _stream, entries in resp or ():
                for eid, fields in entries:
                    if fields is not None:
                        out.append(Delivery(_entry_id(eid), fields, shard=self.shard or 0))
                        self.owned.add(out[-1].entry_id)
        if out:
            metrics.CONSUMED.labels(self.stream, "new").inc(sum(not d.reclaimed for d in out))
            if self._clock() - self.seen_at >= 1.0:  # what a reset would take with it (at most once a second)
                await self._observe_length()
        if self.resolve_payloads and any(F_REF in d.fields and F_DATA not in d.fields for d in out):
            return await self._resolve(out)
        return out

    async def _resolve(self, out: list[Delivery]) -> list[Delivery]:
        """Fetch claim-checked payloads (one MGET: every key is in this stream's hash slot)."""
        present = await resolve_payloads(self.redis, [d.fields for d in out])
        for d, ok in zip(out, present, strict=True):
            if not ok:
                metrics.PAYLOAD_MISSING.labels(self.stage).inc()
                await self.dead_letter(d, f"payload_missing: key {d.payload_key} is gone (deleted or evicted)")
        return [d for d, ok in zip(out, present, strict=True) if ok]

    async def _read_own_pending(self, count: int) -> list[Delivery]:
        cursor = self._own_cursor or "0"
        resp: Any = await self.redis.xreadgroup(self.group, self.name, {self.key: cursor}, count=count)
        rows = [(_entry_id(eid), fields) for _stream, entries in resp or () for eid, fields in entries]
        if len(rows) < count:
            self._own_cursor = None
        if not rows:
            return []
        self._own_cursor = rows[-1][0] if self._own_cursor is not None else None
        gone = [eid for eid, fields in rows if not fields]  # deleted while pending: nothing left to do
        if gone:
            await self.redis.xack(self.key, self.group, *gone)
        live = [(eid, fields) for eid, fields in rows if fields]
        if not live:
            return []
        pending: Any = await self.redis.xpending_range(
            self.key, self.group, min=live[0][0], max=live[-1][0], count=len(live), consumername=self.name
        )
        counts = {_entry_id(p["message_id"]): int(p["times_delivered"]) for p in pending}
        out = []
        for eid, fields in live:
            d = Delivery(eid, fields, deliveries=max(2, counts.get(eid, 2)), reclaimed=True, shard=self.shard or 0)
            if d.deliveries > self.settings.max_deliveries:  # a crash loop under a stable name ends here
                await self.dead_letter(d, f"max_deliveries: delivered {d.deliveries} times without success")
                continue
            out.append(d)
        self.owned.update(d.entry_id for d in out)  # only once nothing can fail before they are handed out
        if out:
            log.info("own_pending_redelivered", stream=self.stream, consumer=self.name, count=len(out))
        return out

    async def reclaim(self, count: int) -> list[Delivery]:
        """Claim entries idle longer than ``claim_idle_ms`` (never our own in-flight ones).

        XPENDING (with IDLE) lists candidates with their delivery counts; XCLAIM with the same
        min-idle takes them, so two reclaimers never both get an entry. Entries delivered more than
        ``max_deliveries`` times are dead-lettered instead of handed out.
        """
        s = self.settings
        rows: Any = await self.redis.xpending_range(
            self.key, self.group, min="-", max="+", count=count + len(self.owned), idle=s.claim_idle_ms
        )
        counts = {_entry_id(r["message_id"]): int(r["times_delivered"]) for r in rows}
        ids = [eid for eid in counts if eid not in self.owned][:count]
        if not ids:
            return []
        claimed: Any = await self.redis.xclaim(self.key, self.group, self.name, s.claim_idle_ms, list[Any](ids))
        out: list[Delivery] = []
        for eid_raw, fields in claimed:
            eid = _entry_id(eid_raw)
            if fields is None:
                continue
            d = Delivery(eid, fields, deliveries=counts.get(eid, 1) + 1, reclaimed=True, shard=self.shard or 0)
            if d.deliveries > s.max_deliveries:
                await self.dead_letter(d, f"max_deliveries: delivered {d.deliveries} times without success")
            else:
                out.append(d)
        self.owned.update(d.entry_id for d in out)  # only once nothing can fail before they are handed out
        if out:
            metrics.CONSUMED.labels(self.stream, "reclaimed").inc(len(out))
            log.info("reclaimed", stream=self.stream, consumer=self.name, count=len(out))
        return out

    async def touch(self) -> None:
        """Reset the idle time of our in-flight entries (a lease renewal) so nobody reclaims them."""
        if self.owned:
            try:
                await self.redis.xclaim(self.key, self.group, self.name, 0, list[Any](self.owned), justid=True)
            except ResponseError as e:
                if not is_nogroup(e):  # the group is gone: the next read creates it again
                    raise
        await self._observe_length()

    async def _observe_length(self) -> None:
        """Best effort: a Redis (or a cluster node) that is away leaves the last length seen."""
        try:
            self.seen_length, self.seen_at = int(await self.redis.xlen(self.key)), self._clock()
        except (*TRANSIENT, RedisError, RedisClusterException):
            pass

    def release(self, deliveries: Sequence[Delivery]) -> None:
        """Stop owning entries we will not ack (they stay pending and become reclaimable)."""
        for d in deliveries:
            self.owned.discard(d.entry_id)

    async def ack(
        self, deliveries: Sequence[Delivery], *, keep_payloads: bool = False, then_delete: Sequence[str] = (),
        acked_markers: Sequence[str] = (),
    ) -> list[Delivery]:
        """Acknowledge and delete entries (and their claim-checked payloads unless ``keep_payloads``), in
        one round trip; then delete ``then_delete`` (keys elsewhere: in the same round trip on a single
        Redis, whose pipeline runs in order; after the ack on a cluster, where nodes run in parallel).
        ``acked_markers`` (dedupe markers in this stream's slot, of one delivery's groups) are set to
        ``acked:<entry id>``, keeping their TTL, in the same round trip (``mark_acked``).

        Returns those that were no longer pending (one XACK per id tells which): normally none; after a
        Redis restart that rolled back to an older state (``still_pending``), the entries it never had."""
        ids = [d.entry_id for d in deliveries]
        if not ids:
            return []
        blobs = [] if keep_payloads else [d.fields[F_REF] for d in deliveries if F_REF in d.fields]
        cluster = self._cluster
        async with self.redis.pipeline(transaction=False) as p:
            for i in ids:
                p.xack(self.key, self.group, i)
            p.xdel(self.key, *ids)
            mark_acked(p, acked_markers, ids[0])
            if blobs:
                p.delete(*blobs)
            if then_delete and not cluster:
                p.delete(*then_delete)
            acked = await p.execute()
        if then_delete and cluster:
            await self.redis.delete(*then_delete)
        self.owned.difference_update(ids)
        metrics.ACKED.labels(self.stream).inc(len(ids))
        return [d for d, n in zip(deliveries, acked, strict=False) if not int(n)]

    async def settle(self, entry_id: str, acked_markers: Sequence[str], then_delete: Sequence[str]) -> None:
        """After an entry was acknowledged elsewhere (learner ranks' script): mark its groups' markers acked, then
        delete ``then_delete`` (its payloads)."""
        async with self.redis.pipeline(transaction=False) as p:
            mark_acked(p, acked_markers, entry_id)
            if then_delete and not self._cluster:
                p.delete(*then_delete)
            await p.execute()
        if then_delete and self._cluster:
            await self.redis.delete(*then_delete)

    async def still_pending(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        """Those of ``deliveries`` still pending in the group (claimed by us again, their leases renewed).

        Redis restarted from an AOF that lacks its last writes (a host crash under ``appendfsync
        everysec``) rolls the streams back while workers keep what they read before: an entry read then may
        not exist any more, and neither may the payload key its header names. Those are dropped from
        ``owned`` and left out; whatever wrote them writes them again from its own input, which the same
        rollback left pending."""
        ids = [d.entry_id for d in deliveries]
        if not ids:
            return []
        try:
            got = await self.redis.xclaim(self.key, self.group, self.name, 0, list[Any](ids), justid=True)
        except ResponseError as e:
            if not is_nogroup(e):
                raise
            await self.recover_group(e)  # the group went with Redis's data (or by hand): none is pending now
            got = []
        alive = {x.decode() if isinstance(x, bytes) else str(x) for x in got}
        self.owned.difference_update(set(ids) - alive)
        return [d for d in deliveries if d.entry_id in alive]

    async def dead_letter(self, d: Delivery, reason: str) -> None:
        """Move an entry to the dead-letter stream with its stage and reason, then ack it."""
        if F_REF in d.fields and F_DATA not in d.fields:  # keep the payload with the dead letter
            blob = await self.redis.get(d.fields[F_REF])
            if blob is not None:
                d.fields[F_DATA] = blob
        fields = dead_letter_fields(self.stage, reason, self.stream, d.entry_id, self.name, d.fields,
                                    source_shard=d.shard, deliveries=d.deliveries)
        # Redis at maxmemory refuses the XADD: wait for room (logged ``redis_full``), never count it a failure
        await retry_transient(lambda: self.redis.xadd(self.keys.dlq, fields), deadline_s=0,  # type: ignore[arg-type]
                              redis=self.redis)
        await self.ack([d])
        metrics.DEAD_LETTERED.labels(self.stage, dead_letter_category(reason)).inc()
        log.warning("dead_lettered", stream=self.stream, entry_id=d.entry_id, group_id=d.group_id, reason=reason)

    async def pending_count(self) -> int:
        try:
            info: Any = await self.redis.xpending(self.key, self.group)
        except ResponseError as e:
            if not is_nogroup(e):
                raise
            return 0  # no group, nothing pending; the next read creates it
        return int(info["pending"])

    async def backlog(self) -> int:
        """Entries not yet acknowledged (pending plus never delivered)."""
        return int(await self.redis.xlen(self.key))

