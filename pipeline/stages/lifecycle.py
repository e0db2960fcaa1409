"""One worker's lifecycle: what every long-running stage loop shares around its own loop body.

``WorkerLifecycle`` (``async with``) owns, for one run of a worker:

* the **stop event** it was given (``stopping``): the loop body reads until it is set;
* the **heartbeat**: ``Heartbeat`` writes ``health:<stage>:<consumer>`` (JSON: pid, host, start time, last
  beat, messages handled, outcome counts and the stage's own report) every interval with a TTL of three
  intervals (``ttl_ms``, also in the JSON: ``pipeline.stages.liveness`` reads ages on the Redis clock), from
  entry until stop; the task is cancelled on exit and the key deleted. The key is the consumer's claim on its
  name (``pipeline.transport.identity``): entry waits for another live holder to go or raises ``NameHeld``; a
  beat that finds the name taken sets stop, and exit then raises ``NameHeld``;
* **lease renewal** of in-flight entries, for a stage that holds them: ``renew_leases`` resets their idle
  time every third of ``claim_idle_ms`` from entry to exit, so nobody reclaims them while slow work runs;
* **Redis back-off**: ``redis_error`` counts a transient error (``distillq_redis_errors_total{stage}``),
  logs ``redis_unavailable`` with ``retry_in``, and waits the next delay (full jitter, base 0.1 s, cap
  5 s) or until stop; ``ok`` after a success resets the delays; ``pause`` waits without a count or log;
* **graceful shutdown**: work started with ``spawn`` is in flight (``in_flight`` counts its messages,
  ``wait_slot`` waits for one to finish); on exit the loop body has stopped reading, in-flight work gets
  ``grace_s`` to finish (``draining``) and what still runs is cancelled (``cancelled_in_flight``).
  ``within_grace`` gives the same grace period to any set of tasks.

Nothing here raises on a Redis error: the heartbeat and lease renewal count theirs and go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.exceptions import ResponseError

from pipeline import metrics
from pipeline.backoff import Backoff
from pipeline.transport.connection import TRANSIENT, is_redis_full, retry_transient
from pipeline.transport.identity import Claim
from pipeline.transport.keys import Keys
from pipeline.transport.sharding import Consumer

log = structlog.get_logger("distillq.lifecycle")


@dataclass
class RunStats:
    handled: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    started: float = field(default_factory=time.time)


def default_consumer_name(stage: str) -> str:
    return f"{stage}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


class Heartbeat:
    """Writes ``health:<stage>:<consumer>`` with a TTL of three intervals; the key is also the consumer's claim on
    its name (``pipeline.transport.identity``): ``claim`` takes it at start, each beat keeps it, ``clear`` frees it."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        stage: str,
        consumer: str,
        interval_s: float,
        extra: Callable[[], dict[str, object]] | None = None,
    ) -> None:
        self.redis, self.interval_s, self.extra = redis, interval_s, extra
        self.key = keys.heartbeat(stage, consumer)
        self.claim = Claim(redis, keys, self.key, f"{stage} consumer {consumer}")
        self.info: dict[str, object] = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}

    @property
    def ttl_ms(self) -> int:
        return int(self.interval_s * 3000)  # in the JSON too: readers age it on the Redis clock (stages.liveness)

    def _value(self, **extra: object) -> dict[str, object]:
        self.info.update(extra, ts=time.time(), ttl_ms=self.ttl_ms)
        return self.info

    async def take(self, stop: asyncio.Event | None = None, wait_s: float | None = None) -> None:
        """Claim the consumer name before the first read: waits up to ``wait_s`` (default: one TTL and one interval,
        so a killed holder's key expires meanwhile) for another live holder to go, else ``NameHeld``."""
        wait = self.claim.default_wait_s(self.ttl_ms, self.interval_s) if wait_s is None else wait_s
        await retry_transient(lambda: self.claim.take(lambda: self._value(handled=0, outcomes={}), self.ttl_ms,
                                                      wait), stop=stop, redis=self.redis)

    async def beat(self, **extra: object) -> bool:
        """One write; ``False`` when another process holds the name now (``claim.lost``)."""
        return await self.claim.write(self._value(**extra), self.ttl_ms) is None

    async def run(self, stop: asyncio.Event, stats: RunStats) -> None:
        while not stop.is_set():
            try:
                report = self.extra() if self.extra is not None else {}
                if not await self.beat(handled=stats.handled, outcomes=dict(stats.outcomes), **report):
                    stop.set()  # another process owns the name: stop reading and acking under it
                    return
            except TRANSIENT:
                metrics.REDIS_ERRORS.labels("heartbeat").inc()
            except ResponseError as e:  # Redis at maxmemory refuses the SET: the next beat tries again
                if not is_redis_full(e):
                    raise
                metrics.REDIS_ERRORS.labels("heartbeat").inc()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)

    async def clear(self) -> None:
        with contextlib.suppress(*TRANSIENT):
            await self.claim.release()


async def renew_leases(consumer: Consumer, claim_idle_ms: int, stage: str) -> None:
    """Keep a consumer's in-flight entries from looking idle (so nobody reclaims them) while slow work
    runs: resets their idle time every third of ``claim_idle_ms``. Runs until cancelled."""
    while True:
        await asyncio.sleep(claim_idle_ms / 3000)
        try:
            await consumer.touch()
        except (*TRANSIENT, ResponseError):  # a lease renewal never ends: the next one tries again
            metrics.REDIS_ERRORS.labels(stage).inc()


class WorkerLifecycle:
    """One run of a worker of ``stage`` until ``stop``: heartbeat, leases, back-off and shutdown (see the module).

    ``heartbeat`` (optional) is written with ``stats``; ``leases`` (optional) is the consumer whose in-flight
    entries are renewed every ``claim_idle_ms / 3``; ``grace_s`` is the time in-flight work gets on exit."""

    def __init__(
        self,
        stage: str,
        stop: asyncio.Event,
        stats: RunStats | None = None,
        *,
        heartbeat: Heartbeat | None = None,
        leases: Consumer | None = None,
        claim_idle_ms: int = 30_000,
        grace_s: float = 30.0,
        backoff: Backoff | None = None,
    ) -> None:
        self.stage, self.stop = stage, stop
        self.stats = RunStats() if stats is None else stats
        self.heartbeat, self.leases, self.claim_idle_ms, self.grace_s = heartbeat, leases, claim_idle_ms, grace_s
        self.backoff = Backoff() if backoff is None else backoff
        self.in_flight = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._slot_freed = asyncio.Event()
        self._background: list[asyncio.Task[None]] = []

    @property
    def stopping(self) -> bool:
        return self.stop.is_set()

    async def __aenter__(self) -> WorkerLifecycle:
        if self.heartbeat is not None:
            await self.heartbeat.take(self.stop)
            self._background.append(asyncio.create_task(self.heartbeat.run(self.stop, self.stats),
                                                     name=f"{self.stage}-heartbeat"))
        if self.leases is not None:
            self._background.append(asyncio.create_task(renew_leases(self.leases, self.claim_idle_ms, self.stage),
                                                     name=f"{self.stage}-leases"))
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            await self.drain()
        finally:
            for t in self._background:
                t.cancel()
            await asyncio.gather(*self._background, return_exceptions=True)
            self._background.clear()
            if self.heartbeat is not None:
                await self.heartbeat.clear()
                if (taken := self.heartbeat.claim.taken()) is not None and exc_type is None:
                    raise taken

    # ---- Redis back-off -----------------------------------------------------------------------------------

    def ok(self) -> None:
        """A Redis call succeeded: the next error waits the shortest delay again."""
        self.backoff.reset()

    async def redis_error(self, error: BaseException) -> float:
        """A transient Redis error: counted, logged (``redis_unavailable``), then the next delay waited (or until
        stop). Returns the delay."""
        metrics.REDIS_ERRORS.labels(self.stage).inc()
        delay = self.backoff.next_delay()
        event = "redis_full" if is_redis_full(error) else "redis_unavailable"
        log.warning(event, stage=self.stage, error=str(error), retry_in=round(delay, 2))
        await self.sleep(delay)
        return delay

    async def pause(self) -> None:
        """Wait the next back-off delay (or until stop), after a failure the caller has reported itself."""
        await self.sleep(self.backoff.next_delay())

    async def sleep(self, delay: float) -> None:
        """Wait ``delay`` seconds, or until stop."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stop.wait(), delay)

    # ---- in-flight work -----------------------------------------------------------------------------------

    def spawn(self, work: Coroutine[Any, Any, None], messages: int = 1) -> asyncio.Task[None]:
        """Run ``work`` (holding ``messages`` in-flight messages) as a task; a failure is logged (``batch_failed``)."""
        self.in_flight += messages
        metrics.IN_FLIGHT.labels(self.stage).set(self.in_flight)
        task = asyncio.create_task(work)
        self._tasks.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self._tasks.discard(t)
            self.in_flight -= messages
            metrics.IN_FLIGHT.labels(self.stage).set(self.in_flight)
            self._slot_freed.set()
            if not t.cancelled() and t.exception() is not None:
                log.error("batch_failed", stage=self.stage, exc_info=t.exception())

        task.add_done_callback(done)
        return task

    def slot_freed(self) -> None:
        """Wake ``wait_slot``: work in flight gave its slot back without finishing (it waits outside the slots)."""
        self._slot_freed.set()

    async def wait_slot(self) -> None:
        """Wait until spawned work finishes or stop is set."""
        self._slot_freed.clear()
        waiter = asyncio.create_task(self.stop.wait())
        slot = asyncio.create_task(self._slot_freed.wait())
        await asyncio.wait({waiter, slot}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        slot.cancel()

    async def until_stopped(self, task: asyncio.Future[Any]) -> bool:
        """Wait until ``task`` is done or stop is set; True if ``task`` is done."""
        stopper = asyncio.create_task(self.stop.wait())
        try:
            await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
        return task.done()

    async def within_grace(self, tasks: Iterable[asyncio.Future[Any]]) -> set[asyncio.Future[Any]]:
        """Wait up to ``grace_s`` for ``tasks`` to finish; those still running (not cancelled here)."""
        running = {t for t in tasks if not t.done()}
        if not running:
            return set()
        _done, pending = await asyncio.wait(running, timeout=self.grace_s)
        return pending

    async def drain(self) -> None:
        """The spawned work gets ``grace_s`` to finish; what still runs is cancelled, and waited for."""
        if not self._tasks:
            return
        log.info("draining", stage=self.stage, in_flight=self.in_flight, grace_s=self.grace_s)
        pending = await self.within_grace(set(self._tasks))
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
            log.warning("cancelled_in_flight", stage=self.stage, batches=len(pending))
