"""The run loop every consuming stage shares.

Shape: a stop ``asyncio.Event``; reads never ask for more than the free in-flight slots; each read
batch is handled by the stage's pure logic (``StageLogic.handle``) in its own task; outputs are
written (idempotently, with backpressure) before inputs are acknowledged; a heartbeat key shows
health; on stop, reading ends, in-flight work gets ``shutdown_grace_s`` to finish, and whatever is
still running is cancelled and stays pending for another consumer to reclaim (the heartbeat, lease
renewal, back-off and shutdown are ``pipeline.stages.lifecycle.WorkerLifecycle``'s; the loop body is here).

Failure handling: an undecodable entry goes to the DLQ at once; an exception in stage logic leaves
the batch pending (it is redelivered after ``claim_idle_ms`` and dead-lettered after
``max_deliveries``); a transient Redis error backs off and retries; nothing crashes the worker.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import redis.asyncio as aioredis
import structlog
from structlog.contextvars import bound_contextvars

from pipeline import metrics
from pipeline.config import StreamSettings
from pipeline.stages.lifecycle import Heartbeat, RunStats, WorkerLifecycle, default_consumer_name
from pipeline.transport.connection import TRANSIENT, retry_transient
from pipeline.transport.consumer import Delivery
from pipeline.transport.keys import Keys
from pipeline.transport.producer import (
    Added,
    AddResult,
    BackpressureTimeout,
    MessageTooLarge,
    ProducerStopped,
    StreamProducer,
    is_written,
)
from pipeline.transport.sharding import Consumer, make_consumer
from schemas import DecodeError, Message, RolloutGroup, ScoredGroup, TrainBatch, decode

__all__ = ["Ack", "DeadLetter", "Emit", "Outcome", "Retry", "StageLogic", "StageRunner", "bookkeep", "drained",
           "send_waiting"]

log = structlog.get_logger("distillq.runloop")
M_in = TypeVar("M_in", bound=RolloutGroup | ScoredGroup | TrainBatch, contravariant=True)
M = TypeVar("M", bound=RolloutGroup | ScoredGroup | TrainBatch)


@dataclass(frozen=True, slots=True)
class Emit:
    """Write ``msg`` to the output stream, then acknowledge the input."""

    msg: Message


@dataclass(frozen=True, slots=True)
class Ack:
    """Acknowledge the input without output (counted under ``reason``)."""

    reason: str


@dataclass(frozen=True, slots=True)
class DeadLetter:
    reason: str


@dataclass(frozen=True, slots=True)
class Retry:
    """Leave the input pending: it is reclaimed later, and dead-lettered after max deliveries."""

    reason: str


Outcome = Emit | Ack | DeadLetter | Retry


class StageLogic(Protocol[M_in]):
    """Pure stage logic: no Redis. One outcome per input message, in order."""

    name: str

    async def handle(self, msgs: Sequence[M_in]) -> Sequence[Outcome]: ...


async def send_waiting(producer: StreamProducer, msg: Message, *, stop: asyncio.Event, token: str,
                       stage: str) -> Added | None:
    """Write ``msg`` to ``producer``'s stream, waiting as long as it is full (``downstream_full`` logged at each
    backpressure timeout: the caller's input stays leased meanwhile); None when stopped while waiting.
    ``token`` names the write's reservation after the input entry: a redelivery after a crash between
    reservation and write resumes it instead of waiting for it to expire. ``MessageTooLarge`` propagates."""
    while True:
        try:
            return await producer.send(msg, stop=stop, token=token)
        except ProducerStopped:
            return None
        except BackpressureTimeout as e:
            log.error("downstream_full", stage=stage, error=str(e))


async def bookkeep(redis: aioredis.Redis, op: Callable[[], Awaitable[object]], grace_s: float) -> None:
    """Acks, dead letters and other records of an input's fate: shielded from cancellation and retried over
    Redis outages (at least 30 s, or ``grace_s``); Redis at maxmemory is waited out (``redis_full``), the entry
    kept, never counted as a failed delivery."""
    await asyncio.shield(retry_transient(op, deadline_s=max(30.0, grace_s), redis=redis))


async def drained(consumer: Consumer) -> bool:
    """Nothing pending and nothing waiting on ``consumer``'s stream (False when Redis cannot say)."""
    try:
        return await consumer.pending_count() == 0 and await consumer.backlog() == 0
    except TRANSIENT:
        return False


class StageRunner(Generic[M]):
    """Runs ``logic`` over ``input_stream``, writing outcomes to ``output_stream``."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        logic: StageLogic[M],
        input_type: type[M],
        input_stream: str,
        output_stream: str | None,
        settings: StreamSettings | None = None,
        *,
        consumer_name: str | None = None,
        shards: int = 1,
        assigned: Sequence[int] | None = None,
    ) -> None:
        self.redis, self.keys, self.logic, self.input_type = redis, keys, logic, input_type
        self.settings = s = settings or StreamSettings()
        self.stage = logic.name
        self.name = consumer_name or default_consumer_name(self.stage)
        self.consumer = make_consumer(redis, keys, input_stream, self.name, s, stage=self.stage, shards=shards,
                                      assigned=assigned)
        self.shards = shards
        self.producer = StreamProducer(redis, keys, output_stream, s, shards=shards) if output_stream else None
        self.output_stream = output_stream
        self.limits = s.limits()
        self.stats = RunStats()
        self.heartbeat = Heartbeat(redis, keys, self.stage, self.name, s.heartbeat_interval_s,
                                   getattr(logic, "report", None))
        self._life: WorkerLifecycle | None = None

    @property
    def in_flight(self) -> int:
        """Messages being handled now."""
        return self._life.in_flight if self._life is not None else 0

    async def run(self, stop: asyncio.Event, *, burst: bool = False, max_messages: int | None = None) -> RunStats:
        """Consume until ``stop`` is set (or, with ``burst``, until the input is drained)."""
        s = self.settings
        await retry_transient(self.consumer.ensure_group, stop=stop, redis=self.redis)
        log.info("stage_started", stage=self.stage, consumer=self.name, stream=self.consumer.stream, burst=burst)
        self._life = life = WorkerLifecycle(self.stage, stop, self.stats, heartbeat=self.heartbeat,
                                            leases=self.consumer, claim_idle_ms=s.claim_idle_ms,
                                            grace_s=s.shutdown_grace_s)
        try:
            async with life:
                while not stop.is_set():
                    if max_messages is not None and self.stats.handled + life.in_flight >= max_messages:
                        if not life.in_flight:
                            break
                        await life.wait_slot()
                        continue
                    free = s.max_in_flight - life.in_flight
                    if free <= 0:
                        await life.wait_slot()
                        continue
                    want = min(free, s.read_count)
                    if max_messages is not None:
                        want = min(want, max_messages - self.stats.handled - life.in_flight)
                    try:
                        batch = await self.consumer.read(want, block_ms=min(s.block_ms, 200) if burst else None)
                        life.ok()
                    except TRANSIENT as e:
                        await life.redis_error(e)
                        continue
                    if batch:
                        life.spawn(self._process(batch, stop), len(batch))
                    elif burst and not life.in_flight and await drained(self.consumer):
                        break
        finally:
            log.info("stage_stopped", stage=self.stage, consumer=self.name, handled=self.stats.handled,
                     outcomes=dict(self.stats.outcomes))
        return self.stats

    async def _process(self, batch: list[Delivery], stop: asyncio.Event) -> None:
        try:
            await self._process_batch(batch, stop)
        finally:
            self.consumer.release(batch)  # whatever was not acked stays pending, reclaimable

    async def _process_batch(self, batch: list[Delivery], stop: asyncio.Event) -> None:
        t0 = time.perf_counter()
        todo = await self._skip_already_emitted(batch)
        good: list[tuple[Delivery, M]] = []
        for d in todo:
            metrics.QUEUE_LAG.labels(self.stage).observe(d.age_s)
            try:
                with bound_contextvars(stream=self.consumer.stream, entry_id=d.entry_id, group_id=d.group_id):
                    good.append((d, decode(d.payload, self.limits, expect=self.input_type)))
            except DecodeError as e:
                metrics.DECODE_ERRORS.labels(self.stage).inc()
                await self._bookkeep(functools.partial(self.consumer.dead_letter, d, f"decode_error: {e}"))
                self._count("dead_letter")
        if good:
            outcomes = await self._handle(good)
            if outcomes is None and len(good) > 1:  # isolate the failing message(s)
                for one in good:
                    single = await self._handle([one])
                    if single is not None:
                        await self._apply([one], single, stop)
            elif outcomes is not None:
                await self._apply(good, outcomes, stop)
        metrics.STAGE_LATENCY.labels(self.stage).observe(time.perf_counter() - t0)

    async def _handle(self, good: list[tuple[Delivery, M]]) -> Sequence[Outcome] | None:
        """Run the stage logic; ``None`` when it raised (the inputs then stay pending)."""
        try:
            outcomes = await self.logic.handle([m for _, m in good])
            if len(outcomes) != len(good):
                raise RuntimeError(f"{self.stage} returned {len(outcomes)} outcomes for {len(good)} inputs")
            return outcomes
        except Exception:
            log.exception("stage_logic_failed", stage=self.stage, entries=[d.entry_id for d, _ in good])
            metrics.STAGE_MESSAGES.labels(self.stage, "error").inc(len(good))
            self.stats.outcomes["error"] += len(good)
            return None  # left pending: reclaimed later, dead-lettered after max_deliveries

    async def _skip_already_emitted(self, batch: list[Delivery]) -> list[Delivery]:
        """Redelivered entries whose output was already written are acked without work."""
        if self.producer is None or not any(d.reclaimed for d in batch):
            return batch
        redo = [d for d in batch if d.reclaimed]
        keys = [self.keys.seen(self.producer.stream, d.group_id, self.shards) for d in redo]
        async with self.redis.pipeline(transaction=False) as p:
            for k in keys:
                p.get(k)
            seen = await p.execute()
        # A pending reservation is not a write: its writer may have died before XADD (handled below).
        done = [d for d, s in zip(redo, seen, strict=True) if is_written(s)]
        if done:
            await self.consumer.ack(done)
            self._count("already_emitted", len(done))
        return [d for d in batch if all(d is not x for x in done)]

    async def _apply(self, good: list[tuple[Delivery, M]], outcomes: Sequence[Outcome], stop: asyncio.Event) -> None:
        acks: list[Delivery] = []
        for (d, _), o in zip(good, outcomes, strict=True):
            with bound_contextvars(stream=self.consumer.stream, entry_id=d.entry_id, group_id=d.group_id,
                                   deliveries=d.deliveries):
                if not await self._apply_one(d, o, acks, stop):
                    break  # stopped while waiting for capacity: the rest stay pending for another consumer
        if acks:
            await self._bookkeep(lambda: self.consumer.ack(acks))

    async def _apply_one(self, d: Delivery, o: Outcome, acks: list[Delivery], stop: asyncio.Event) -> bool:
        """Carry out one outcome; acks are collected in ``acks``. False if stopped while waiting."""
        if isinstance(o, Emit):
            if self.producer is None:
                raise RuntimeError(f"{self.stage} emitted but has no output stream")
            try:
                added = await send_waiting(self.producer, o.msg, stop=stop, stage=self.stage,
                                           token=f"{self.consumer.stream}:{d.shard}:{d.entry_id}")
            except MessageTooLarge as e:
                await self._bookkeep(functools.partial(self.consumer.dead_letter, d, f"output_too_large: {e}"))
                self._count("dead_letter")
                return True
            if added is None:
                return False
            acks.append(d)
            if added.result is AddResult.DUPLICATE:
                # Another consumer wrote this group's output first (this one's lease was taken while it worked):
                # the work is named, not counted as a second group emitted.
                log.info("already_emitted", stage=self.stage, written_as=added.entry_id)
                self._count("already_emitted")
            else:
                log.debug("emitted", stage=self.stage)
                self._count("emitted")
        elif isinstance(o, Ack):
            acks.append(d)
            self._count(o.reason)
        elif isinstance(o, DeadLetter):
            await self._bookkeep(functools.partial(self.consumer.dead_letter, d, o.reason))
            self._count("dead_letter")
        else:
            self._count("retry")
        return True

    async def _bookkeep(self, op: Callable[[], Awaitable[object]]) -> None:
        await bookkeep(self.redis, op, self.settings.shutdown_grace_s)

    def _count(self, outcome: str, n: int = 1) -> None:
        self.stats.handled += n
        self.stats.outcomes[outcome] += n
        metrics.STAGE_MESSAGES.labels(self.stage, outcome).inc(n)
