"""Learner rank heartbeats: what each learner process is doing, for ``distillq stats``.

Every learner client (``Learner`` and ``AsyncLearner``, every rank) writes ``Keys.learner_health(consumer, rank)``
every ``StreamSettings.heartbeat_interval_s`` with a TTL of three intervals, from its first read until it closes
(the key is then deleted; a killed process's key expires). The key is also the process's claim on its consumer
name and rank (``pipeline.transport.identity``): a second live process under the same name and rank is refused,
and a process whose name was taken stops before its next read or ack. The value is JSON:

=====================  ==========================================================================================
field                  meaning
=====================  ==========================================================================================
``rank``, ``world_size``  this process's rank and the number of learner ranks it belongs to (1: no ranks)
``consumer``           its consumer name in the ``learner`` group (learner ranks share one)
``host``, ``pid``      where it runs; ``started``: its clock when the client was made
``step``               batches this process acknowledged (``ack`` returned ``True``)
``held``               batches handed to the caller and not yet acknowledged (a prefetched batch not yet
                       handed out is not counted)
``held_s``             how long the oldest of them had been held when the beat was written (``None``: none held)
``last_ack_s``         how long before the beat this process last acknowledged a batch (``None``: never)
``published_version``  the policy version this process last published (``None``: it published none; with
                       ranks, usually only rank 0 publishes)
``delivered_version``  the policy version at delivery of the last batch handed out: the version its groups'
                       staleness was judged against (``None``: no batch yet)
``ts``, ``ttl_ms``     the writer's clock at the write and the TTL it set
=====================  ==========================================================================================

Durations are measured on the writer's monotonic clock and aged by the reader on the Redis clock (``ttl_ms -
PTTL``, as ``pipeline.stages.liveness`` ages worker heartbeats), so hosts whose clocks disagree read the same.

Writing is best effort: each beat is retried (``retry_transient``) for at most one interval, and a beat that
still fails is counted (``distillq_redis_errors_total{stage="learner"}``) and logged once per outage
(``learner_heartbeat_failed``, then ``learner_heartbeat_resumed``); it never blocks or fails training.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.exceptions import ResponseError

from pipeline import metrics
from pipeline.transport.connection import TRANSIENT, retry_transient
from pipeline.transport.identity import Claim
from pipeline.transport.keys import Keys

log = structlog.get_logger("distillq.learner")

#: Heartbeat TTL in intervals: a process that stops beating is gone from ``stats`` after this many.
TTL_INTERVALS = 3


@dataclass
class LearnerProgress:
    """What one learner process has done, as its heartbeat reports it (monotonic times)."""

    step: int = 0
    held: dict[str, float] = field(default_factory=dict)  # entry id -> when it was handed out
    last_ack: float | None = None
    published_version: int | None = None
    delivered_version: int | None = None

    def handed(self, entry_id: str, delivered_version: float | None) -> None:
        """A batch was handed to the caller (again: its hold time runs from the first hand-out)."""
        self.held.setdefault(entry_id, time.monotonic())
        if delivered_version is not None:
            self.delivered_version = int(delivered_version)

    def acked(self, entry_id: str, counted: bool) -> None:
        """The caller acknowledged a batch; ``counted``: the ack was not refused (ranks: a rank restarted)."""
        self.held.pop(entry_id, None)
        if counted:
            self.step += 1
            self.last_ack = time.monotonic()

    def report(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "step": self.step,
            "held": len(self.held),
            "held_s": round(now - min(self.held.values()), 3) if self.held else None,
            "last_ack_s": None if self.last_ack is None else round(now - self.last_ack, 3),
            "published_version": self.published_version,
            "delivered_version": self.delivered_version,
        }


class LearnerHeartbeat:
    """Writes one learner process's heartbeat (see the module) every ``interval_s`` until cancelled."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, consumer: str, rank: int, world_size: int,
                 interval_s: float, progress: LearnerProgress) -> None:
        self.redis, self.interval_s, self.progress = redis, interval_s, progress
        self.key = keys.learner_health(consumer, rank)
        self.claim = Claim(redis, keys, self.key, f"learner consumer {consumer} rank {rank}")
        self.info: dict[str, Any] = {"rank": rank, "world_size": world_size, "consumer": consumer,
                                     "host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        self._failing = False

    @property
    def ttl_ms(self) -> int:
        return max(1, int(self.interval_s * TTL_INTERVALS * 1000))

    def _value(self) -> dict[str, Any]:
        return {**self.info, **self.progress.report(), "ts": time.time(), "ttl_ms": self.ttl_ms}

    async def take(self, wait_s: float | None = None) -> None:
        """Claim this consumer name and rank (``pipeline.transport.identity``) before the first read: waits up to
        ``wait_s`` (default: one TTL and one interval) for another live holder to go, else ``NameHeld``."""
        wait = self.claim.default_wait_s(self.ttl_ms, self.interval_s) if wait_s is None else wait_s
        await retry_transient(lambda: self.claim.take(self._value, self.ttl_ms, wait), redis=self.redis)

    async def beat(self) -> None:
        """One write; a name another process holds now is left to it (``claim.lost`` is set)."""
        await self.claim.write(self._value(), self.ttl_ms)

    def owned(self) -> None:
        """Raise ``NameHeld`` if another process took this name: this one must neither read nor ack under it."""
        if (taken := self.claim.taken()) is not None:
            raise taken

    async def beat_once(self) -> bool:
        """One beat, retried for at most one interval; ``False`` (counted, logged once per outage) if it failed."""
        try:
            await retry_transient(self.beat, deadline_s=self.interval_s, redis=self.redis, wait_when_full=False)
        except (*TRANSIENT, ResponseError) as e:
            metrics.REDIS_ERRORS.labels("learner").inc()
            if not self._failing:
                log.warning("learner_heartbeat_failed", key=self.key, error=str(e), retry_in=self.interval_s)
            self._failing = True
            return False
        if self._failing:
            log.info("learner_heartbeat_resumed", key=self.key)
        self._failing = False
        return True

    async def run(self) -> None:
        """Beat every ``interval_s`` until cancelled."""
        while True:
            await self.beat_once()
            await asyncio.sleep(self.interval_s)

    async def clear(self, timeout_s: float = 2.0) -> None:
        """Delete the key if this process still holds it (best effort, at most ``timeout_s``): it is leaving."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.claim.release(), timeout_s)


@dataclass(frozen=True, slots=True)
class RankBeat:
    """One learner rank's heartbeat as read: its fields, durations aged to the read on the Redis clock."""

    consumer: str
    rank: int
    world_size: int
    host: str
    pid: int
    step: int
    held: int
    held_s: float | None  # the oldest batch held, as of the read
    last_ack_s: float | None  # since the last ack, as of the read (None: never)
    published_version: int | None
    delivered_version: int | None
    age_s: float  # since the beat was written, on the Redis clock


def _int(v: object, default: int | None = None) -> int | None:
    return int(v) if isinstance(v, int | float) and not isinstance(v, bool) else default


def _later(v: object, age_s: float) -> float | None:
    return None if _int(v) is None else round(float(v) + age_s, 3)  # type: ignore[arg-type]


def parse_rank_beat(raw: bytes | str | None, pttl_ms: int | None) -> RankBeat | None:
    """A learner heartbeat's value and ``PTTL``; ``None`` if unreadable. Its age is ``ttl_ms - PTTL``."""
    if raw is None:
        return None
    try:
        info = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(info, dict) or _int(info.get("rank")) is None:
        return None
    ttl = _int(info.get("ttl_ms"))
    age = max(0.0, (ttl - pttl_ms) / 1000) if ttl is not None and pttl_ms is not None and pttl_ms >= 0 else 0.0
    return RankBeat(
        consumer=str(info.get("consumer", "")), rank=_int(info["rank"], 0) or 0,
        world_size=_int(info.get("world_size"), 1) or 1, host=str(info.get("host", "")),
        pid=_int(info.get("pid"), 0) or 0, step=_int(info.get("step"), 0) or 0, held=_int(info.get("held"), 0) or 0,
        held_s=_later(info.get("held_s"), age), last_ack_s=_later(info.get("last_ack_s"), age),
        published_version=_int(info.get("published_version")), delivered_version=_int(info.get("delivered_version")),
        age_s=round(age, 3),
    )


def _str(v: object) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


async def read_rank_beats(redis: aioredis.Redis, keys: Keys) -> list[RankBeat]:
    """Every readable learner heartbeat of the namespace, by consumer and rank."""
    names = sorted({_str(k) async for k in redis.scan_iter(match=keys.learner_health(), count=500)})
    if not names:
        return []
    async with redis.pipeline(transaction=False) as p:  # not MGET: the keys span slots on a cluster
        for n in names:
            p.get(n)
            p.pttl(n)
        values: list[Any] = await p.execute()
    found = (parse_rank_beat(values[2 * i], values[2 * i + 1] if isinstance(values[2 * i + 1], int) else None)
             for i in range(len(names)))
    return sorted((b for b in found if b is not None), key=lambda b: (b.consumer, b.rank))


def missing_ranks(beats: list[RankBeat]) -> dict[str, tuple[int, list[int]]]:
    """Per consumer name whose ranks heartbeat: ``(world_size, the ranks below it without a heartbeat)``, for
    those with any missing (the world size is the largest one its beats report)."""
    out: dict[str, tuple[int, list[int]]] = {}
    for consumer in sorted({b.consumer for b in beats}):
        mine = [b for b in beats if b.consumer == consumer]
        world = max(b.world_size for b in mine)
        gone = sorted(set(range(world)) - {b.rank for b in mine})
        if gone:
            out[consumer] = (world, gone)
    return out
