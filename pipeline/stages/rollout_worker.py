"""The rollout worker: prompt entries in (``prompts``, consumer group ``rollout``), one group each out on
``rollouts``, at least once, under ``WorkerLifecycle`` (heartbeat ``health:rollout:<consumer>``, lease renewal,
Redis back-off, graceful stop).

Per prompt entry (``max_jobs`` at once): the group is sampled (``RolloutStage.sample``), pushed with backpressure
(``group_pushed``) and only then is the entry acknowledged and the prompt's record marked ``done``. So:

* a prompt whose teacher pool's stream is at its cap (``max_backlog``) is not sampled until it has room
  (``pool_full_waiting``, then ``pool_has_room``): it waits leased, *outside* the ``max_jobs`` slots (up to
  ``PARKED_PER_JOB * max_jobs`` such prompts), so a pool whose teachers are down holds back its own prompts only
  and the other pools' prompts go on;
* with ``pace`` (``--max-ahead N``), a prompt starts only while the learner is close enough
  (``pipeline.transport.pacing``: no group trains more than N versions stale), waiting in its slot
  (``pacing_wait``);
* a push that waits past ``backpressure_timeout_s`` keeps waiting (``downstream_full``), its entry leased;
* a stop while sampling or waiting leaves the entry pending: in-flight prompts get ``shutdown_grace_s``, the rest
  are cancelled and another worker reclaims them after ``claim_idle_ms`` (as a killed worker's are);
* a sample that raises, or a group that cannot be attributed (``unattributable``), records the error on the
  prompt's record (``rollout_failed``) and leaves the entry pending after a backoff (``RETRY_BACKOFF``, the entry
  leased meanwhile): it is redelivered after ``claim_idle_ms`` and, on its ``max_deliveries``-th failure,
  dead-lettered with that error as its reason (``dlq replay`` sends it back); a Redis error while sampling is not
  the prompt's failure (it stays pending, uncounted);
* a redelivered prompt whose group was written already (the worker died between push and ack) is acknowledged
  without sampling; a second push of its group would be a duplicate anyway (the producer dedupes by group id).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
import structlog
from msgspec.structs import replace
from structlog.contextvars import bound_contextvars

from pipeline import metrics
from pipeline.backoff import BackoffPolicy
from pipeline.config import StreamSettings
from pipeline.stages.lifecycle import Heartbeat, RunStats, WorkerLifecycle, default_consumer_name
from pipeline.stages.rollout_stage import RolloutStage, keep_synced
from pipeline.stages.runloop import bookkeep, drained, send_waiting
from pipeline.transport.connection import TRANSIENT, retry_transient
from pipeline.transport.consumer import Delivery, StreamConsumer
from pipeline.transport.keys import Keys
from pipeline.transport.pacing import try_start
from pipeline.transport.pools import PoolProducer
from pipeline.transport.producer import MessageTooLarge, is_written
from pipeline.transport.prompts import STREAM, BadPrompt, PromptEntry, PromptJob, note
from schemas.pools import pool_of

log = structlog.get_logger("distillq.rollout")
#: How long a prompt whose sample failed stays leased before it is released for another try (by its delivery
#: count: up to 1, 2, 4, ... s, at most 30 s, full jitter); then it is reclaimed after ``claim_idle_ms``.
RETRY_BACKOFF = BackoffPolicy(base=1.0, cap=30.0)
#: How often a prompt waiting for room on its pool's stream looks again (up to, with jitter).
ROOM_BACKOFF = BackoffPolicy(base=0.05, cap=2.0)
#: Prompts that may wait for room on a full pool's stream outside the job slots, per job slot.
PARKED_PER_JOB = 8


class RolloutWorker:
    """``stage`` as a worker: prompts from the namespace's ``prompts`` stream, groups to its ``rollouts`` stream."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        stage: RolloutStage,
        settings: StreamSettings | None = None,
        *,
        consumer_name: str | None = None,
        shards: int = 1,
        max_jobs: int = 4,
        burst: bool = False,
        teacher: str | None = None,
        pace: tuple[int, int] | None = None,
    ) -> None:
        self.redis, self.keys, self.stage = redis, keys, stage
        self.settings = s = settings or StreamSettings()
        self.name = consumer_name or default_consumer_name("rollout")
        self.consumer = StreamConsumer(redis, keys, STREAM, self.name, s, stage="rollout")
        self.producer = PoolProducer(redis, keys, s, shards=shards)  # each group to its teacher pool
        self.shards, self.max_jobs, self.burst = shards, max_jobs, burst
        self.teacher = teacher  # the teacher pool of prompts that name none (``PromptJob.overrides``)
        self.stats = RunStats()
        self.pace = pace  # (max_ahead, groups_per_step): ``pipeline.transport.pacing``; None: no bound
        self.parked = 0  # prompts waiting for room on their pool's stream, not holding a job slot
        self._sampling = asyncio.Semaphore(max_jobs)
        self._life: WorkerLifecycle | None = None
        self.heartbeat = Heartbeat(redis, keys, "rollout", self.name, s.heartbeat_interval_s, stage.report)

    async def run(self, stop: asyncio.Event) -> RunStats:
        """Take prompts until ``stop`` (or, with ``burst``, until none is queued or pending)."""
        s = self.settings
        await retry_transient(self.consumer.ensure_group, stop=stop, redis=self.redis)
        life = WorkerLifecycle("rollout", stop, self.stats, heartbeat=self.heartbeat, leases=self.consumer,
                               claim_idle_ms=s.claim_idle_ms, grace_s=s.shutdown_grace_s)
        self._life = life
        log.info("stage_started", stage="rollout", consumer=self.name, stream=STREAM, burst=self.burst)
        try:
            async with keep_synced(self.stage.synced, stop), life:  # in-flight work drains before the sync stops
                await self._loop(life, stop)
                if life.in_flight:
                    log.info("rollout_worker_draining", grace_s=life.grace_s, in_flight=life.in_flight)
        finally:
            log.info("rollout_worker_stopped", groups=self.stats.outcomes["emitted"],
                     failed=self.stats.outcomes["failed"], outcomes=dict(self.stats.outcomes))
        return self.stats

    async def _loop(self, life: WorkerLifecycle, stop: asyncio.Event) -> None:
        while not stop.is_set():
            free = self.max_jobs - (life.in_flight - self.parked)
            if free <= 0:
                await life.wait_slot()
                continue
            try:
                batch = await self.consumer.read(free, block_ms=200 if self.burst else None)
                life.ok()
            except TRANSIENT as e:
                await life.redis_error(e)
                continue
            for d in batch:
                life.spawn(self._process(d, stop))
            if not batch and self.burst and not life.in_flight and await drained(self.consumer):
                return

    async def _process(self, d: Delivery, stop: asyncio.Event) -> None:
        try:
            with bound_contextvars(stream=STREAM, entry_id=d.entry_id, group_id=d.group_id, deliveries=d.deliveries):
                await self._one(d, stop)
        finally:
            self.consumer.release([d])  # whatever was not acked stays pending, reclaimable

    async def _one(self, d: Delivery, stop: asyncio.Event) -> None:
        metrics.QUEUE_LAG.labels("rollout").observe(d.age_s)
        try:
            entry = PromptEntry.from_fields(d.fields)
        except BadPrompt as e:
            metrics.DECODE_ERRORS.labels("rollout").inc()
            await self._bookkeep(functools.partial(self.consumer.dead_letter, d, f"decode_error: {e}"))
            self._count("dead_letter")
            return
        overrides = entry.job.overrides(self.teacher)
        job = entry.job if overrides is entry.job.group_overrides else replace(entry.job, group_overrides=overrides)
        pool = pool_of(overrides)
        if d.reclaimed and await self._written(entry.group_id, pool):
            await self._finish(d, entry, "already_emitted")
            return
        if not await self._room(pool, entry.group_id, stop) or not await self._paced(stop):
            return  # stopped while waiting for room: pending, another worker samples it later
        async with self._sampling:  # at most max_jobs sample and push at once, parked prompts back included
            await self._sample_and_push(d, entry, job, stop)

    async def _sample_and_push(self, d: Delivery, entry: PromptEntry, job: PromptJob, stop: asyncio.Event) -> None:
        try:
            group = await self.stage.sample(job, entry.epoch, entry.group_id)
        except TRANSIENT as e:  # Redis away while sampling: not the prompt's failure; pending, sampled again
            log.warning("redis_unavailable", stage="rollout", error=str(e))
            metrics.REDIS_ERRORS.labels("rollout").inc()
            return
        except Exception as e:
            log.warning("rollout_failed", error=str(e), exc_info=True)
            await self._failed(d, entry, f"rollout_failed: {type(e).__name__}: {e}", stop)
            return
        if group is None:  # counted by the stage (distillq_unattributed_samples_total), a failure here
            await self._failed(d, entry, "unattributable: the servers' weights changed under every sample", stop)
            return
        try:
            added = await send_waiting(self.producer, group, stop=stop, token=f"{STREAM}:{d.entry_id}", stage="rollout")
        except MessageTooLarge as e:
            await self._bookkeep(functools.partial(self.consumer.dead_letter, d, f"output_too_large: {e}"))
            self._count("dead_letter")
            return
        if added is None:
            return  # stopped while waiting for capacity: pending, another worker samples it again
        log.info("group_pushed", group_id=group.group_id, policy_version=group.policy_version,
                 result=added.result.value)
        await self._finish(d, entry, "emitted" if added.result.value == "added" else "duplicate")

    async def _room(self, pool: str, gid: str, stop: asyncio.Event) -> bool:
        """Wait while ``pool``'s stream (the shard ``gid`` goes to) holds ``max_backlog`` entries or more; the wait
        gives its job slot back while fewer than ``PARKED_PER_JOB * max_jobs`` prompts wait so. False: stopped."""
        stream = self.producer.for_pool(pool).stream
        key = self.keys.stream_for(stream, gid, self.shards)
        cap, parked, tries, since = self.settings.max_backlog, False, 0, time.monotonic()
        try:
            while True:
                if await retry_transient(lambda: self.redis.xlen(key), stop=stop) < cap:
                    if tries:
                        log.info("pool_has_room", pool=pool, stream=key, waited_s=round(time.monotonic() - since, 1))
                        metrics.BACKPRESSURE_WAIT.labels(stream).observe(time.monotonic() - since)
                    return True
                if stop.is_set():
                    return False
                if tries == 0:
                    log.info("pool_full_waiting", pool=pool, stream=key, cap=cap)
                    if self.parked < PARKED_PER_JOB * self.max_jobs and self._life is not None:
                        parked = True
                        self.parked += 1
                        self._life.slot_freed()
                tries += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), ROOM_BACKOFF.delay(tries))
        finally:
            if parked:
                self.parked -= 1

    async def _paced(self, stop: asyncio.Event) -> bool:
        """With ``pace``, wait until the learner is close enough for one more group to start (``try_start``),
        holding the job slot. False: stopped."""
        if self.pace is None:
            return True
        max_ahead, per_step = self.pace
        tries = 0
        while True:
            got = await retry_transient(lambda: try_start(self.redis, self.keys, max_ahead=max_ahead,
                                                          groups_per_step=per_step), stop=stop)
            if got.allowed:
                if tries:
                    log.info("pacing_resumed", version=got.version, started=got.started, bound=got.bound)
                return True
            if stop.is_set():
                return False
            if tries == 0:
                log.info("pacing_wait", version=got.version, started=got.started, bound=got.bound,
                         max_ahead=max_ahead)
            tries += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), ROOM_BACKOFF.delay(tries))

    async def _written(self, gid: str, pool: str) -> bool:
        marker = await retry_transient(lambda: self.redis.get(self.producer.seen_key(gid, pool)),
                                       deadline_s=60)
        return is_written(marker)

    async def _finish(self, d: Delivery, entry: PromptEntry, outcome: str) -> None:
        """Acknowledge the prompt entry, then mark its record done (a crash in between: redelivered, acked again)."""
        await self._bookkeep(lambda: self.consumer.ack([d]))
        await self._bookkeep(lambda: note(self.redis, self.keys, entry, "done", entry.group_id))
        self._count(outcome)

    async def _failed(self, d: Delivery, entry: PromptEntry, reason: str, stop: asyncio.Event) -> None:
        """A sample that failed: recorded and left pending after a backoff (``RETRY_BACKOFF`` by its delivery
        count, the entry leased meanwhile); dead-lettered with its reason on the last delivery."""
        self._count("failed")
        await self._bookkeep(lambda: note(self.redis, self.keys, entry, "error", reason[:500]))
        if d.deliveries >= self.settings.max_deliveries:
            why = f"{reason} (delivered {d.deliveries} times)"
            await self._bookkeep(functools.partial(self.consumer.dead_letter, d, why))
            self._count("dead_letter")
            return
        with contextlib.suppress(TimeoutError):  # a stop ends the wait: the entry stays pending either way
            await asyncio.wait_for(stop.wait(), RETRY_BACKOFF.delay(d.deliveries))

    async def _bookkeep(self, op: Callable[[], Awaitable[object]]) -> None:
        await bookkeep(self.redis, op, self.settings.shutdown_grace_s)

    def _count(self, outcome: str, n: int = 1) -> None:
        if outcome != "failed":
            self.stats.handled += n
        self.stats.outcomes[outcome] += n
        metrics.STAGE_MESSAGES.labels("rollout", outcome).inc(n)
