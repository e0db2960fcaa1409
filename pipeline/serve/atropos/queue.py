"""The Atropos-compatible server's queue: scored groups in, whole-group batches out, with leases.

**In.** The server reads the ``scored`` stream in the feeder's consumer group (it takes the feeder's and
the learner client's place on its namespace: run no feeder there, or the two split the groups). Each
entry's header (group id, sequences) and payload key go onto ``{ns:atropos}:queue``, a stream whose
order is arrival order, and the ``scored`` entry is acknowledged, leaving the payload in its key. The
move is idempotent: a script puts the group on the queue only if its ``seen`` marker is new, so a crash
between the two steps (the entry comes back to this consumer name on restart) queues it once.

**Out.** ``take`` forms one batch (``packing.pick_batch``), fetches and validates its payloads,
and commits it in one script: the queue entries are deleted (all of them, or none if one is gone), the
step advances, and with a lease the batch is recorded with a deadline. Without a lease the payloads are
deleted next (at most once, as the reference); with one they stay until ``ack``, and a batch whose lease
runs out is handed out again (same batch id) before any new batch, up to ``max_deliveries`` times. If one
of its groups is gone or invalid by then, the batch is not handed out short: that group is dead-lettered,
the lease dropped, and the rest go back in front of the queue (``front``) to be batched again. A running
count of queued groups per ``env|sequences`` (``counts``, kept by the same scripts) answers ``/status``
without reading the queue.

**Dead letters** (stage ``atropos``, on the DLQ with the payload, replayable onto ``scored``): a group
with more sequences than the batch size, one whose payload is gone or invalid, and the groups of a batch
leased ``max_deliveries`` times without an ack.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import redis.asyncio as aioredis
import structlog

from pipeline import metrics
from pipeline.config import StreamSettings
from pipeline.serve.atropos.packing import Queued, minimum_sequences, pick_batch
from pipeline.serve.atropos.queue_scripts import COMMIT, ENQUEUE, RECOUNT, REMOVE
from pipeline.serve.atropos.state import AtroposState, Trainer, env_field, env_of
from pipeline.stages.lifecycle import Heartbeat, WorkerLifecycle
from pipeline.transport.claimcheck import decode_header
from pipeline.transport.connection import TRANSIENT, is_cluster_client
from pipeline.transport.consumer import Delivery, dead_letter_category, dead_letter_fields
from pipeline.transport.keys import Keys
from pipeline.transport.producer import F_DATA, F_ID, F_TYPE
from pipeline.transport.sharding import make_consumer
from schemas import DecodeError, Limits, ScoredGroup, decode

log = structlog.get_logger("distillq.serve.atropos")

STAGE: Final = "atropos"
#: Queue entries looked at per batch (the oldest); a batch is formed from these.
SCAN: Final = 10_000
RECONCILE_S: Final = 10.0

@dataclass(frozen=True, slots=True)
class Handout:
    """A batch handed out: its groups in queue order, the lease's batch id (None: no lease) and how many
    times this batch has been handed out."""

    groups: list[ScoredGroup]
    batch_id: str | None = None
    deliveries: int = 1
    lease_s: float | None = None


def _queued(entry_id: bytes | str, f: dict[bytes, bytes]) -> Queued:
    eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return Queued(eid, f[b"gid"].decode(), f[b"key"].decode(), int(f[b"n"]), env_of(f.get(b"env")),
                  f.get(b"src", b"").decode())


def _front_order(entry_id: bytes) -> tuple[int, int]:
    ms, _, seq = entry_id.decode().partition("-")
    return int(ms), int(seq or 0)


class AtroposQueue:
    def __init__(self, redis: aioredis.Redis, keys: Keys, state: AtroposState, settings: StreamSettings, *,
                 consumer_name: str = "atropos-server", shards: int = 1, limits: Limits | None = None) -> None:
        self.redis, self.keys, self.state, self.settings = redis, keys, state, settings
        self.limits = limits or settings.limits()
        self.shards = shards
        self.consumer = make_consumer(redis, keys, "scored", consumer_name, settings, stage=STAGE, shards=shards,
                                      resolve_payloads=False)
        self.k_queue, self.k_leases = keys.atropos("queue"), keys.atropos("leases")
        self.k_deadlines = keys.atropos("lease_deadlines")
        self.k_front, self.k_counts = keys.atropos("front"), keys.atropos("counts")
        self._enqueue = redis.register_script(ENQUEUE)
        self._commit = redis.register_script(COMMIT)
        self._remove = redis.register_script(REMOVE)
        self._recount = redis.register_script(RECOUNT)
        self._cluster = is_cluster_client(redis)

    # ---- scored -> queue ----------------------------------------------------------------------------------

    async def run_mover(self, stop: asyncio.Event, heartbeat: Heartbeat | None = None) -> None:
        """Move scored groups onto the queue until ``stop``; survives Redis outages (retries with backoff).
        ``heartbeat`` (the replica's) is written while the mover runs and deleted when it ends."""
        reconciled, ready = time.monotonic(), False
        async with WorkerLifecycle(STAGE, stop, heartbeat=heartbeat, grace_s=self.settings.shutdown_grace_s) as life:
            while not stop.is_set():
                try:
                    if not ready:
                        await self.consumer.ensure_group()
                        await self._recount(keys=[self.k_counts, self.k_queue, self.k_front])
                        ready = True
                    for d in await self.consumer.read(self.settings.read_count,
                                                      block_ms=min(self.settings.block_ms, 500)):
                        await self.move(d)
                    if time.monotonic() - reconciled > RECONCILE_S:
                        reconciled = time.monotonic()
                        await self.state.reconcile_inflight()
                    life.ok()
                except TRANSIENT as e:
                    await life.redis_error(e)
                except Exception as e:  # never die silently: a stopped mover would starve every trainer
                    ready = ready and "NOGROUP" not in str(e)  # the stream was deleted: create its group again
                    log.error("mover_error", stage=STAGE, error=f"{type(e).__name__}: {e}")
                    await life.pause()

    async def move(self, d: Delivery) -> str:
        """One scored entry onto the queue: ``queued``, ``duplicate``, ``discarded`` or ``dead_letter``."""
        try:
            sequences, key = self._header(d)
        except DecodeError as e:
            metrics.DECODE_ERRORS.labels(STAGE).inc()
            await self.consumer.dead_letter(d, f"decode_error: {e}")
            return "dead_letter"
        fields: list[str | int] = ["gid", d.group_id, "key", key, "n", sequences, "src", d.entry_id]
        keys = [self.keys.atropos_seen(d.group_id), self.state.k_discard, self.state.k_inflight,
                self.state.k_inflight_at, self.k_queue, self.keys.atropos_env(d.group_id), self.k_counts]
        res = await self._enqueue(keys=keys, args=[d.group_id, self.settings.dedupe_ttl_s * 1000, key, sequences,
                                                   *fields])
        if res == 1:
            await self.consumer.ack([d], keep_payloads=True)
            return "queued"
        same_entry = isinstance(res, bytes) and res.decode() == key  # this entry, moved before a crash
        await self.consumer.ack([d], keep_payloads=same_entry)
        return "duplicate" if res != 2 else "discarded"

    def _header(self, d: Delivery) -> tuple[int, str]:
        """Sequences and payload key of an entry (``pipeline.transport.claimcheck``); a ``DecodeError`` for an
        entry without a header or a payload key, or whose header names another group."""
        if d.header is None:
            raise DecodeError("h", "missing: a scored entry carries a header and its payload's key")
        h = decode_header(d.header)
        if d.payload_key is None or h.group_id != d.group_id:
            raise DecodeError("h", "claim-checked entry without a payload key, or of another group")
        return h.sequences, d.payload_key

    # ---- the queue ----------------------------------------------------------------------------------------

    async def queued(self, count: int | None = SCAN) -> list[Queued]:
        """The queued groups in order: those put back in front (``f:`` ids), then the queue's entries."""
        front: dict[bytes, bytes] = await self.redis.hgetall(self.k_front)  # type: ignore[misc]
        out = []
        for eid in sorted(front, key=_front_order):
            gid, key, n, env, src = json.loads(front[eid])
            out.append(Queued(f"f:{eid.decode()}", gid, key, int(n), env_of(env), src))
        rows: list[Any] = await self.redis.xrange(self.k_queue, count=count)
        return out + [_queued(eid, f) for eid, f in rows]

    async def items(self) -> list[tuple[int | None, int]]:
        """(env id, sequences) of every queued group, from the running counts (no scan of the queue)."""
        counts: dict[bytes, bytes] = await self.redis.hgetall(self.k_counts)  # type: ignore[misc]
        out: list[tuple[int | None, int]] = []
        for field, c in counts.items():
            env, _, n = field.decode().rpartition("|")
            out += [(env_of(env), int(n))] * max(int(c), 0)
        return out

    async def _mget(self, keys: list[str]) -> list[bytes | None]:
        if not keys:
            return []
        got: list[bytes | None] = await (self.redis.mget_nonatomic(keys) if self._cluster  # type: ignore[attr-defined]
                                         else self.redis.mget(keys))
        return got

    async def _load(self, picked: Sequence[Queued]) -> tuple[list[ScoredGroup], list[tuple[Queued, bytes | None, str]]]:
        """Decode and validate the payloads of ``picked`` (in a worker thread): the groups, and (group, bytes,
        reason) of the bad."""
        return await asyncio.to_thread(self._check, picked, await self._mget([q.key for q in picked]))

    def _check(self, picked: Sequence[Queued], payloads: list[bytes | None]
               ) -> tuple[list[ScoredGroup], list[tuple[Queued, bytes | None, str]]]:
        good: list[ScoredGroup] = []
        bad: list[tuple[Queued, bytes | None, str]] = []
        for q, data in zip(picked, payloads, strict=True):
            if data is None:
                metrics.PAYLOAD_MISSING.labels(STAGE).inc()
                bad.append((q, None, f"payload_missing: key {q.key} is gone"))
                continue
            try:
                g = decode(data, self.limits, expect=ScoredGroup)
                if g.group_id != q.group_id:
                    raise DecodeError("group.group_id", f"{g.group_id!r} != the queued {q.group_id!r}")
            except DecodeError as e:
                metrics.DECODE_ERRORS.labels(STAGE).inc()
                bad.append((q, data, f"decode_error: {e}"))
                continue
            good.append(g)
        return good, bad

    async def dead_letter(self, q: Queued, reason: str, data: bytes | None = None) -> None:
        """``q`` to the DLQ with its payload (replayable onto ``scored``), then off the queue and deleted."""
        if data is None:
            data = await self.redis.get(q.key)
        original: dict[bytes, bytes] = {F_TYPE: b"scored", F_ID: q.group_id.encode()}
        if data is not None:
            original[F_DATA] = data
        fields = dead_letter_fields(STAGE, reason, "scored", q.source_id, self.consumer.name, original,
                                    env_id=env_field(q.env_id), sequences=q.sequences)
        await self.redis.xadd(self.keys.dlq, fields)  # type: ignore[arg-type]
        await self._remove(keys=[self.k_queue, self.k_front, self.k_counts], args=[q.entry_id])
        await self.redis.delete(q.key)
        metrics.DEAD_LETTERED.labels(STAGE, dead_letter_category(reason)).inc()
        log.warning("group_dead_lettered", group_id=q.group_id, reason=reason)

    # ---- batches ------------------------------------------------------------------------------------------

    async def take(self, t: Trainer, envs: list[dict[str, Any]], lease_s: float | None) -> Handout | None:
        """The next batch: an expired lease's first, else a new one from the queue; None if none is ready."""
        again = await self._redeliver(lease_s)
        if again is not None or t.batch_size < 1:
            return again
        for _ in range(8):  # a retry per dead-lettered payload or lost race; more would mean a broken queue
            queue = []
            for q in await self.queued():
                if q.sequences > t.batch_size:
                    await self.dead_letter(q, f"oversize_group: {q.sequences} sequences > batch_size "
                                              f"{t.batch_size}; it can never be part of a batch")
                else:
                    queue.append(q)
            idx = pick_batch(queue, t.batch_size, minimum_sequences(envs, t.batch_size, queue))
            if idx is None:
                return None
            picked = [queue[i] for i in idx]
            groups, bad = await self._load(picked)
            for q, data, reason in bad:
                await self.dead_letter(q, reason, data)
            if bad:
                continue
            batch_id = uuid.uuid4().hex if lease_s else None
            record = json.dumps(self._record(picked, 1, lease_s)) if lease_s else ""
            deadline = int((time.time() + (lease_s or 0)) * 1000)
            args: list[str | int] = [len(picked), *[q.entry_id for q in picked], record, deadline, batch_id or ""]
            keys = [self.k_queue, self.state.k_trainer, self.k_leases, self.k_deadlines, self.k_front, self.k_counts]
            step = await self._commit(keys=keys, args=args)
            if int(step) < 0:
                continue
            if batch_id is None:
                await self.redis.delete(*[q.key for q in picked])
            return Handout(groups, batch_id, 1, lease_s)
        return None

    @staticmethod
    def _record(picked: Sequence[Queued], deliveries: int, lease_s: float | None) -> dict[str, Any]:
        return {"groups": [[q.entry_id, q.group_id, q.key, q.sequences, env_field(q.env_id), q.source_id]
                           for q in picked], "deliveries": deliveries, "lease_s": lease_s}

    async def _redeliver(self, lease_s: float | None) -> Handout | None:
        """The oldest batch whose lease ran out, handed out again (its groups dead-lettered instead once it
        has been handed out ``max_deliveries`` times). A batch of which a group is gone or invalid is not
        handed out short: that group is dead-lettered and the rest go back in front of the queue, to be
        batched again (``take``), as the oldest groups."""
        while True:
            due: list[bytes] = await self.redis.zrangebyscore(self.k_deadlines, "-inf", int(time.time() * 1000),
                                                              start=0, num=1)
            if not due:
                return None
            batch_id = due[0].decode()
            raw: bytes | None = await self.redis.hget(self.k_leases, batch_id)  # type: ignore[misc]
            if raw is None:
                await self.redis.zrem(self.k_deadlines, batch_id)
                continue
            rec = json.loads(raw)
            picked = [Queued(e, g, k, int(n), env_of(env), src) for e, g, k, n, env, src in rec["groups"]]
            deliveries = int(rec["deliveries"]) + 1
            if deliveries > self.settings.max_deliveries:
                for q in picked:
                    await self.dead_letter(q, f"lease_expired: batch {batch_id} handed out {deliveries - 1} times "
                                              "without an ack")
                await self._drop_lease(batch_id)
                continue
            groups, bad = await self._load(picked)
            if bad:
                for q, data, reason in bad:
                    await self.dead_letter(q, reason, data)
                dropped = {b[0] for b in bad}
                await self._put_back(batch_id, [q for q in picked if q not in dropped])
                continue
            log.warning("lease_expired_redelivered", batch_id=batch_id, deliveries=deliveries)
            if lease_s:
                async with self.redis.pipeline(transaction=True) as p:
                    p.hset(self.k_leases, batch_id, json.dumps(self._record(picked, deliveries, lease_s)))
                    p.zadd(self.k_deadlines, {batch_id: int((time.time() + lease_s) * 1000)})
                    await p.execute()
                return Handout(groups, batch_id, deliveries, lease_s)
            await self._drop_lease(batch_id)
            await self.redis.delete(*[q.key for q in picked])
            return Handout(groups, None, deliveries)

    async def _put_back(self, batch_id: str, kept: Sequence[Queued]) -> None:
        """Drop a lease and put its ``kept`` groups in front of the queue (in one transaction)."""
        async with self.redis.pipeline(transaction=True) as p:
            p.hdel(self.k_leases, batch_id)
            p.zrem(self.k_deadlines, batch_id)
            for q in kept:
                env, n = env_field(q.env_id), str(q.sequences)
                p.hset(self.k_front, q.entry_id.removeprefix("f:"), json.dumps([q.group_id, q.key, n, env,
                                                                              q.source_id]))
                p.hincrby(self.k_counts, f"{env}|{n}", 1)
            await p.execute()
        log.warning("lease_expired_put_back", batch_id=batch_id, groups=len(kept))

    async def _drop_lease(self, batch_id: str) -> None:
        async with self.redis.pipeline(transaction=True) as p:
            p.hdel(self.k_leases, batch_id)
            p.zrem(self.k_deadlines, batch_id)
            await p.execute()

    async def ack(self, batch_id: str) -> bool:
        """Settle a leased batch (its payloads deleted); False if no such lease is held."""
        raw: bytes | None = await self.redis.hget(self.k_leases, batch_id)  # type: ignore[misc]
        if raw is None:
            return False
        await self._drop_lease(batch_id)
        keys = [g[2] for g in json.loads(raw)["groups"]]
        if keys:
            await self.redis.delete(*keys)
        return True

    async def clear(self) -> int:
        """Empty the queue and drop every lease, deleting their payloads (``/reset_data``). Returns the
        groups removed."""
        queued = await self.queued(None)
        leased: dict[bytes, bytes] = await self.redis.hgetall(self.k_leases)  # type: ignore[misc]
        payloads = [q.key for q in queued] + [g[2] for raw in leased.values() for g in json.loads(raw)["groups"]]
        for i in range(0, len(payloads), 500):
            await self.redis.delete(*payloads[i : i + 500])
        await self.redis.delete(self.k_queue, self.k_leases, self.k_deadlines, self.k_front, self.k_counts)
        return len(payloads)
