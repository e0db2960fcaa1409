"""The learner's side of the pipeline: iterate train batches, ack after the optimiser step, publish
the policy version.

    from pipeline.learner.client import Learner
    with Learner("redis://127.0.0.1:6379/0") as learner:        # sync; AsyncLearner for asyncio
        version = learner.policy_version()
        for batch in learner.batches():
            loss = step(to_torch(batch.batch))                  # pipeline.learner.torch_batch.to_torch
            learner.ack(batch)                                  # unacked batches are redelivered
            version += 1
            learner.publish_policy_version(version)             # after the new weights are in place

Batches are read through the ``learner`` consumer group under a stable consumer name (default
``learner-0``): a restarted learner first gets back every batch it had read but not acknowledged.
The feeder writes batches by reference (``BatchManifest``): the client fetches the groups' payloads in
one round trip, validates every value, computes the per-token advantages (``pipeline.stages.batching``) and
deletes the payloads when the batch is acknowledged. A group whose payload is invalid or gone is
dead-lettered (stage ``learner``, with its bytes) and left out of the batch; the rest trains. By
default the next batch is read in the background while the caller trains on the current one
(``prefetch``). Arrays are zero-copy numpy views into the received payloads.

Staleness is checked when a batch is handed out: a group sampled more than ``max_staleness`` versions
before the current policy version (the feeder's bound, stamped on the batch, unless the learner names
its own) is dead-lettered (``stale: ...``) or, with ``on_stale="deliver"``, handed out and counted; the
batch's stats give the staleness at delivery of the groups handed to this process (with ranks, this rank's
part; ``pipeline.learner.parts``). The leases of the batches
handed out and not yet acknowledged are renewed in the background, so a long step keeps its batch.

With ``world_size > 1`` the client is one of ``world_size`` learner ranks that share each batch
(``pipeline.learner.ranks``): each gets its part, and the batch is acknowledged once all have acked it.

Every client (each rank) writes a heartbeat from its first read until it closes: step, batches held, versions,
the age of its last ack (``pipeline.learner.health``); ``distillq stats`` lists the ranks from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar

import msgspec
import redis.asyncio as aioredis
import structlog

from pipeline import metrics
from pipeline.backoff import Backoff
from pipeline.config import StreamSettings, redis_settings
from pipeline.learner.batch import LearnerBatch, _Raw
from pipeline.learner.checks import check_reachable, namespace_hint
from pipeline.learner.health import LearnerHeartbeat, LearnerProgress
from pipeline.learner.parts import (
    FEEDER,
    StalenessBound,
    batch_part,
    delivery_stats,
    is_stale,
    manifest_part,
    resolve_bound,
    select_groups,
)
from pipeline.learner.ranks import RankGroup
from pipeline.stages.batching import materialize
from pipeline.stages.lifecycle import renew_leases
from pipeline.transport.connection import TRANSIENT, connect, is_cluster_client, retry_transient
from pipeline.transport.consumer import Delivery, StreamConsumer, dead_letter_category, dead_letter_fields
from pipeline.transport.keys import Keys
from pipeline.transport.producer import F_DATA, F_ID, F_TYPE
from schemas import BatchManifest, DecodeError, GroupRef, Limits, ScoredGroup, TrainBatch, decode

__all__ = ["AsyncLearner", "Learner", "LearnerBatch"]  # LearnerBatch lives in pipeline.learner.batch

log = structlog.get_logger("distillq.learner")
T = TypeVar("T")


class AsyncLearner:
    """asyncio learner client."""

    def __init__(
        self,
        redis_url: str | None = None,
        *,
        namespace: str | None = None,
        consumer_name: str = "learner-0",
        settings: StreamSettings | None = None,
        redis: aioredis.Redis | None = None,
        limits: Limits | None = None,
        prefetch: bool = True,
        rank: int = 0,
        world_size: int = 1,
        max_staleness: StalenessBound = FEEDER,
        on_stale: Literal["dead_letter", "deliver"] = "dead_letter",
    ) -> None:
        """``prefetch``: fetch, validate and weigh the next batch in the background while the caller works
        on the current one (it is read, so it stays pending until acked, like any batch handed out).

        ``rank``/``world_size``: this process is rank ``rank`` of ``world_size`` learner ranks that share
        each batch (all with the same ``consumer_name``); no prefetch then. ``max_staleness``: the bound
        checked at delivery (``"feeder"``: the feeder's, stamped on each batch; ``-1``: none).
        ``on_stale``: dead-letter a stale group (default) or hand it out anyway (counted in the stats)."""
        rs = redis_settings(redis_url, namespace)
        self.keys = Keys(rs.namespace)
        self._url = rs.redis_url if redis is None else None
        self._own = redis is None
        self.redis = redis if redis is not None else connect(rs)
        self.settings = settings or StreamSettings()
        self.consumer = StreamConsumer(self.redis, self.keys, "batches", consumer_name, self.settings, stage="learner")
        # Full validation of every group (the feeder reads headers only; this is where values are checked).
        self.limits = limits or self.settings.limits()
        self._cluster = is_cluster_client(self.redis)
        self._ready = False
        self.rank, self.world_size = rank, world_size
        self._ranks = RankGroup(self.redis, self.keys, self.consumer, rank, world_size) if world_size > 1 else None
        self.prefetch = prefetch and self._ranks is None
        if on_stale not in ("dead_letter", "deliver"):
            raise ValueError(f"on_stale must be 'dead_letter' or 'deliver', got {on_stale!r}")
        self.max_staleness, self.on_stale = max_staleness, on_stale
        self._ahead: asyncio.Task[_Raw | None] | None = None
        self._lease: asyncio.Task[None] | None = None
        self._hinted = False
        self.progress = LearnerProgress()
        self._heartbeat = LearnerHeartbeat(self.redis, self.keys, consumer_name, rank, world_size,
                                           self.settings.heartbeat_interval_s, self.progress)
        self._beating: asyncio.Task[None] | None = None

    async def check(self) -> None:
        """Raise ``LearnerConnectionError`` (one line) unless Redis answers."""
        await check_reachable(self.redis, self._url)

    async def start(self) -> None:
        """Join the ``learner`` group and claim this consumer name and rank (``NameHeld`` while another live
        process holds them), then renew leases and heartbeat. The first read does it if this was not called; the
        sync ``Learner`` does it when made, so a refused process has done nothing (published no weights) yet."""
        await self._ensure_ready()

    async def _ensure_ready(self) -> None:
        if self._ready:
            return
        await self.check()
        await retry_transient(self.consumer.ensure_group, redis=self.redis)
        await self._heartbeat.take()  # one live process per consumer name and rank, else NameHeld
        # Renew the leases of batches handed out and not acked: a step longer than the reclaim idle time
        # keeps its batch (as the workers do with their in-flight entries).
        self._lease = asyncio.ensure_future(renew_leases(self.consumer, self.settings.claim_idle_ms, "learner"))
        # The rank's heartbeat (best effort: a failed beat is counted and logged, never raised).
        self._beating = asyncio.ensure_future(self._heartbeat.run())
        self._ready = True

    async def _hint(self) -> None:
        """Once, after a read that found nothing: warn when the namespace looks mistyped."""
        if self._hinted:
            return
        self._hinted = True
        with contextlib.suppress(Exception):
            if (why := await namespace_hint(self.redis, self.keys)) is not None:
                log.warning("no_feeder_in_namespace", hint=why)

    async def next_batch(self, timeout_s: float | None = None) -> LearnerBatch | None:
        """The next batch (redelivered ones first), or ``None`` after ``timeout_s`` without one.

        With ``prefetch``, the next batch's entry and payloads are read while this one is decoded and
        while the caller trains on it, so Redis and the network work in parallel with the learner.
        """
        if self._ranks is not None:
            return await self._next_ranked(timeout_s)
        loop = asyncio.get_running_loop()
        end = None if timeout_s is None else loop.time() + timeout_s
        while True:
            left = None if end is None else max(0.0, end - loop.time())
            if not self.prefetch:
                raw = await self._read(left)
            else:
                if self._ahead is None:
                    self._ahead = self._start_read()
                try:
                    raw = await asyncio.wait_for(asyncio.shield(self._ahead), left)
                except TimeoutError:
                    return None  # the read goes on; a later call gets its batch
                except BaseException:
                    if self._ahead.done():  # it failed: the next call starts afresh
                        self._ahead = None
                    raise
                self._ahead = self._start_read()  # the next one, in the background
            if raw is None:
                return None
            got = await self._build(raw)
            if got is not None:
                return got

    def _start_read(self) -> asyncio.Task[_Raw | None]:
        task = asyncio.ensure_future(self._read(None))
        # Its error, if any, is raised by the next call; mark it seen so an abandoned one is not logged.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    async def _next_ranked(self, timeout_s: float | None) -> LearnerBatch | None:
        """The current batch of the learner ranks, this rank's part of it (``pipeline.learner.ranks``)."""
        assert self._ranks is not None
        await self._ensure_ready()
        while True:
            cur = await self._ranks.next(timeout_s, self._read_for_ranks)
            if cur is None:
                return None
            eid = cur.entry_id
            rows: Any = await retry_transient(functools.partial(self.redis.xrange, self.consumer.key, eid, eid),
                                              redis=self.redis)
            if not rows or not rows[0][1]:
                await retry_transient(functools.partial(self._ranks.drop, eid), redis=self.redis)
                continue
            d = Delivery(cur.entry_id, rows[0][1], reclaimed=cur.redelivered)
            msg = decode(d.payload, self.limits)  # the reading rank checked that it decodes
            assert isinstance(msg, BatchManifest | TrainBatch)
            self.consumer.owned.add(d.entry_id)  # its lease is renewed while this rank holds it
            if isinstance(msg, TrainBatch):
                raw = _Raw(d, batch_part(msg, self.rank, self.world_size), [], cur.version, (), cur.generation,
                           tuple(g.group_id for g in msg.groups))
            else:
                part = manifest_part(msg, self.rank, self.world_size)
                wanted = [r.key for r in part.refs]
                fetch = functools.partial(self._mget, wanted)
                payloads = await retry_transient(fetch, redis=self.redis) if wanted else []
                raw = _Raw(d, part, payloads, cur.version, tuple(r.key for r in msg.refs), cur.generation,
                           tuple(r.group_id for r in msg.refs))
            got = await self._build(raw)
            assert got is not None  # a rank's part is handed out even when empty
            return got

    async def _read_for_ranks(self, block_s: float) -> tuple[Delivery, int] | None:
        """On the rank that reads for all: the next entry that decodes, with the current policy version."""
        raw = await self._read(block_s, fetch=False)
        if raw is None:
            return None
        return raw.delivery, await self.policy_version()

    async def _mget(self, keys: list[str]) -> list[bytes | None]:
        return await (self.redis.mget_nonatomic(keys) if self._cluster else self.redis.mget(keys))  # type: ignore[attr-defined,no-any-return]

    async def _read(self, timeout_s: float | None, *, fetch: bool = True) -> _Raw | None:
        """The next batch entry, decoded, with its groups' payloads fetched (one MGET); not validated yet."""
        await self._ensure_ready()
        loop = asyncio.get_running_loop()
        end = None if timeout_s is None else loop.time() + timeout_s
        backoff = Backoff()
        while True:
            self._heartbeat.owned()
            block = self.settings.block_ms if end is None else max(1, int(1000 * min(1.0, end - loop.time())))
            try:
                got = await self.consumer.read(1, block_ms=block)
                backoff.reset()
            except TRANSIENT as e:  # Redis away (restarting, failing over): wait for it, never fail the caller
                delay = backoff.next_delay()
                metrics.REDIS_ERRORS.labels("learner").inc()
                log.warning("redis_unavailable", stage="learner", error=str(e), retry_in=round(delay, 2))
                await asyncio.sleep(delay if end is None else max(0.0, min(delay, end - loop.time())))
                if end is not None and loop.time() >= end:
                    return None
                continue
            for d in got:
                try:
                    msg = decode(d.payload, self.limits)
                    if not isinstance(msg, BatchManifest | TrainBatch):
                        raise DecodeError("t", f"expected a BatchManifest or TrainBatch, got a {type(msg).__name__}")
                except DecodeError as e:
                    await retry_transient(functools.partial(self.consumer.dead_letter, d, f"decode_error: {e}"),
                                          redis=self.redis)
                    continue
                if isinstance(msg, TrainBatch) or not fetch:
                    return _Raw(d, msg, [])
                keys = [r.key for r in msg.refs]
                try:
                    payloads = await retry_transient(functools.partial(self._mget, keys), redis=self.redis)
                except BaseException:
                    self.consumer.release([d])  # not handed out: pending, so a later read reclaims it
                    raise
                return _Raw(d, msg, payloads)
            await self._hint()
            if end is not None and loop.time() >= end:
                return None

    async def _build(self, raw: _Raw) -> LearnerBatch | None:
        """Validate, check for staleness and weigh a batch's groups; ``None`` (batch settled) if none is
        usable. With learner ranks, ``raw`` holds this rank's part, which is handed out even when empty."""
        d, m = raw.delivery, raw.msg
        version = raw.version if raw.version is not None else await self.policy_version()
        bound = resolve_bound(m.stats, self.max_staleness)
        ranked = self._ranks is not None
        if isinstance(m, TrainBatch):
            keep = [i for i, g in enumerate(m.groups) if not is_stale(g.group.policy_version, version, bound)]
            if self.on_stale == "dead_letter" and len(keep) < len(m.groups):
                for i in sorted(set(range(len(m.groups))) - set(keep)):
                    log.warning("stale_group_left_out", batch_id=m.batch_id, group_id=m.groups[i].group_id,
                                reason=self._stale_reason(m.groups[i].group.policy_version, version, bound))
                    self._count_stale()
                m2 = select_groups(m, keep)
            else:
                m2 = m
            stats = delivery_stats(m.stats, [g.group.policy_version for g in m2.groups], version,
                                   len(m.groups) - len(m2.groups))
            return self._batch(d, msgspec.structs.replace(m2, stats=stats), (), raw.generation,
                               raw.all_groups or tuple(g.group_id for g in m.groups))
        groups: list[ScoredGroup] = []
        dropped = 0
        for ref, data in zip(m.refs, raw.payloads, strict=True):
            if data is None:
                metrics.PAYLOAD_MISSING.labels("learner").inc()
                await self._dead_letter_group(d, m, ref, None, f"payload_missing: key {ref.key} is gone")
                continue
            try:
                g = decode(data, self.limits, expect=ScoredGroup)
                if g.group_id != ref.group_id:
                    raise DecodeError("group.group_id", f"{g.group_id!r} != the batch's reference {ref.group_id!r}")
            except DecodeError as e:
                metrics.DECODE_ERRORS.labels("learner").inc()
                await self._dead_letter_group(d, m, ref, data, f"decode_error: {e}")
                continue
            gv = g.group.policy_version
            if self.on_stale == "dead_letter" and is_stale(gv, version, bound):
                self._count_stale()
                await self._dead_letter_group(d, m, ref, data, self._stale_reason(gv, version, bound))
                dropped += 1
                continue
            groups.append(g)
        keys = raw.all_keys if ranked else tuple(r.key for r in m.refs)
        if not groups and not ranked:
            log.warning("batch_without_usable_groups", batch_id=m.batch_id, groups=len(m.refs))
            await retry_transient(lambda: self.consumer.ack([d]), redis=self.redis)
            return None
        stats = delivery_stats(m.stats, [g.group.policy_version for g in groups], version, dropped)
        named = raw.all_groups if ranked else tuple(r.group_id for r in m.refs)
        return self._batch(d, materialize(msgspec.structs.replace(m, stats=stats), groups), keys, raw.generation,
                           named)

    def _batch(self, d: Delivery, b: TrainBatch, keys: tuple[str, ...], generation: int,
               named: tuple[str, ...]) -> LearnerBatch:
        self.progress.handed(d.entry_id, (b.stats or {}).get("delivered_version"))
        return LearnerBatch(d.entry_id, b, d.reclaimed, d, keys, self.rank, self.world_size, generation, named)

    @staticmethod
    def _stale_reason(group_version: int, version: int, bound: int | None) -> str:
        return (f"stale: sampled by policy version {group_version}, {version - group_version} versions behind "
                f"version {version} at delivery (max_staleness {bound})")

    @staticmethod
    def _count_stale() -> None:
        metrics.DEAD_LETTERED.labels("learner", "stale").inc()

    async def _dead_letter_group(
        self, d: Delivery, m: BatchManifest, ref: GroupRef, data: bytes | None, reason: str
    ) -> None:
        """One group of a batch to the DLQ (its bytes, if any, replayable onto ``scored``), then delete it."""
        original = {F_TYPE: b"scored", F_ID: ref.group_id.encode(), **({F_DATA: data} if data is not None else {})}
        fields = dead_letter_fields("learner", reason, "scored", ref.entry_id, self.consumer.name, original,
                                    batch_id=m.batch_id, batch_entry=d.entry_id)
        await retry_transient(lambda: self.redis.xadd(self.keys.dlq, fields), redis=self.redis)  # type: ignore[arg-type]
        await retry_transient(lambda: self.redis.delete(ref.key), redis=self.redis)
        metrics.DEAD_LETTERED.labels("learner", dead_letter_category(reason)).inc()
        log.warning("group_dead_lettered", batch_id=m.batch_id, group_id=ref.group_id, reason=reason)

    async def batches(self, timeout_s: float | None = None) -> AsyncIterator[LearnerBatch]:
        """Batches until none arrives within ``timeout_s`` (forever if ``None``)."""
        while (b := await self.next_batch(timeout_s)) is not None:
            yield b

    async def ack(self, batch: LearnerBatch) -> bool:
        """Call after the optimiser step: the batch will not be delivered again, and its groups' payloads
        are deleted (after the batch is settled: a crash in between leaves them behind, never a batch
        without its groups).

        Learner ranks: counts this rank's ack; the batch is settled when every rank of one generation has
        acked it. ``False`` when the ack is refused because a rank restarted meanwhile: every rank then gets
        the whole batch again from ``next_batch``."""
        await retry_transient(self._heartbeat.claim.check, redis=self.redis)  # still this process's name?
        self._heartbeat.owned()
        # Its groups' batches markers record the ack (``acked:<entry>``): what says "trained", never the absence of
        # the entry (a stream deleted or trimmed by hand loses entries no learner acknowledged).
        marks = [self.keys.seen("batches", g) for g in batch.entry_groups]
        if self._ranks is None:  # safe to repeat: XACK and XDEL by entry id, marks, DEL of its payloads
            await retry_transient(lambda: self.consumer.ack([batch.delivery], then_delete=batch.payload_keys,
                                                            acked_markers=marks), redis=self.redis)
            self.progress.acked(batch.entry_id, True)
            return True
        ranks = self._ranks  # a repeat after a lost reply is answered as refused or counted: never a double ack
        res = await retry_transient(lambda: ranks.ack(batch.entry_id, batch.generation), redis=self.redis)
        self.consumer.owned.discard(batch.entry_id)
        self.progress.acked(batch.entry_id, res > 0)
        if res == 2:
            await retry_transient(lambda: self.consumer.settle(batch.entry_id, marks, batch.payload_keys),
                                  redis=self.redis)
            metrics.ACKED.labels("batches").inc()
        return res > 0

    async def publish_policy_version(self, version: int) -> None:
        """Set the policy version (retried while Redis is away or full: a SET is safe to repeat)."""
        await retry_transient(lambda: self.redis.set(self.keys.policy_version, int(version)), redis=self.redis)
        self.progress.published_version = int(version)

    async def policy_version(self) -> int:
        raw = await retry_transient(lambda: self.redis.get(self.keys.policy_version), redis=self.redis)
        return int(raw) if raw is not None else 0

    async def aclose(self) -> None:
        """Stop prefetching (a batch it already read stays pending and comes back), delete the heartbeat
        (best effort) and close."""
        for task in (self._ahead, self._lease, self._beating):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        if self._beating is not None:
            await self._heartbeat.clear()
        self._ahead = self._lease = self._beating = None
        if self._own:
            await self.redis.aclose()

    async def __aenter__(self) -> AsyncLearner:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def publish_weights(self, model: Any, version: int, directory: str | Path, keep: int = 3,
                              **kwargs: Any) -> Path | None:
        """Write ``model`` as ``version`` into ``directory`` and publish it (``pipeline.learner.publish``)."""
        from pipeline.learner.publish import publish_weights

        loop = asyncio.get_running_loop()

        def announce(v: int) -> None:  # runs in the writer's thread; the version goes out on this loop
            asyncio.run_coroutine_threadsafe(self.publish_policy_version(v), loop).result()

        return await asyncio.to_thread(publish_weights, model, version, directory, keep, publish=announce, **kwargs)


class Learner:
    """Synchronous learner client: an ``AsyncLearner`` on an event loop in a background thread, so the
    next batch is fetched and validated while the caller's optimiser step runs."""

    def __init__(
        self,
        redis_url: str | None = None,
        *,
        namespace: str | None = None,
        consumer_name: str = "learner-0",
        settings: StreamSettings | None = None,
        redis: aioredis.Redis | None = None,
        limits: Limits | None = None,
        prefetch: bool = True,
        rank: int = 0,
        world_size: int = 1,
        max_staleness: StalenessBound = FEEDER,
        on_stale: Literal["dead_letter", "deliver"] = "dead_letter",
    ) -> None:
        """The arguments of ``AsyncLearner``, with the same defaults. Raises ``LearnerConnectionError`` (one line)
        unless Redis answers, ``NameHeld`` while another live process holds this consumer name and rank."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="distillq-learner", daemon=True)
        self._thread.start()
        make = functools.partial(
            AsyncLearner, redis_url, namespace=namespace, consumer_name=consumer_name, settings=settings, redis=redis,
            limits=limits, prefetch=prefetch, rank=rank, world_size=world_size, max_staleness=max_staleness,
            on_stale=on_stale)
        try:
            self._client: AsyncLearner = self._call(_make(make))
            self._call(self._client.check())  # one line (LearnerConnectionError) when Redis is unreachable
            self._call(self._client.start())  # one live process per name and rank (NameHeld), before any work
        except BaseException:
            if hasattr(self, "_client"):
                self._call(self._client.aclose())
            self._stop_loop()
            raise

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def next_batch(self, timeout_s: float | None = None) -> LearnerBatch | None:
        return self._call(self._client.next_batch(timeout_s))

    def batches(self, timeout_s: float | None = None) -> Iterator[LearnerBatch]:
        while (b := self.next_batch(timeout_s)) is not None:
            yield b

    def ack(self, batch: LearnerBatch) -> bool:
        return self._call(self._client.ack(batch))

    def publish_policy_version(self, version: int) -> None:
        self._call(self._client.publish_policy_version(version))

    def policy_version(self) -> int:
        return self._call(self._client.policy_version())

    @property
    def rank(self) -> int:
        return self._client.rank

    @property
    def world_size(self) -> int:
        return self._client.world_size

    @property
    def client(self) -> AsyncLearner:
        """The ``AsyncLearner`` this client drives (on its own event loop thread)."""
        return self._client

    def close(self) -> None:
        try:
            self._call(self._client.aclose())
        finally:
            self._stop_loop()

    def __enter__(self) -> Learner:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def publish_weights(self, model: Any, version: int, directory: str | Path, keep: int = 3,
                        **kwargs: Any) -> Path | None:
        """Write ``model`` as ``version`` into ``directory`` and publish it (``pipeline.learner.publish``)."""
        from pipeline.learner.publish import publish_weights

        return publish_weights(model, version, directory, keep, publish=self.publish_policy_version, **kwargs)


async def _make(make: Callable[[], AsyncLearner]) -> AsyncLearner:
    """Build the client on its loop (its Redis connection belongs to that loop)."""
    return make()
