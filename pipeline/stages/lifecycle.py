"""What every long-running worker shares around its loop body: the heartbeat key, lease renewal of
in-flight entries, run statistics and default consumer names.

``Heartbeat`` writes ``health:<stage>:<consumer>`` (JSON: pid, host, start time, last beat, messages
handled, outcome counts and the stage's own report) with a TTL of three intervals; ``renew_leases``
keeps a consumer's in-flight entries from looking idle while slow work runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from pipeline import metrics
from pipeline.transport.connection import TRANSIENT
from pipeline.transport.sharding import Consumer


@dataclass
class RunStats:
    handled: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    started: float = field(default_factory=time.time)


def default_consumer_name(stage: str) -> str:
    return f"{stage}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


class Heartbeat:
    """Writes ``health:<stage>:<consumer>`` with a TTL of three intervals."""

    def __init__(
        self, redis: aioredis.Redis, key: str, interval_s: float, extra: Callable[[], dict[str, object]] | None = None
    ) -> None:
        self.redis, self.key, self.interval_s, self.extra = redis, key, interval_s, extra
        self.info: dict[str, object] = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}

    async def beat(self, **extra: object) -> None:
        self.info.update(extra, ts=time.time())
        await self.redis.set(self.key, json.dumps(self.info), px=int(self.interval_s * 3000))

    async def run(self, stop: asyncio.Event, stats: RunStats) -> None:
        while not stop.is_set():
            try:
                report = self.extra() if self.extra is not None else {}
                await self.beat(handled=stats.handled, outcomes=dict(stats.outcomes), **report)
            except TRANSIENT:
                metrics.REDIS_ERRORS.labels("heartbeat").inc()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)

    async def clear(self) -> None:
        with contextlib.suppress(*TRANSIENT):
            await self.redis.delete(self.key)


async def renew_leases(consumer: Consumer, claim_idle_ms: int, stage: str) -> None:
    """Keep a consumer's in-flight entries from looking idle (so nobody reclaims them) while slow work
    runs: resets their idle time every third of ``claim_idle_ms``. Runs until cancelled."""
    while True:
        await asyncio.sleep(claim_idle_ms / 3000)
        try:
            await consumer.touch()
        except TRANSIENT:
            metrics.REDIS_ERRORS.labels(stage).inc()
