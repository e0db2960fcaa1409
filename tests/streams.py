"""Stream settings and pending-entry helpers shared by the tests that run stream stages in-process against Redis."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis

from pipeline.config import ENV_PREFIX, StreamSettings
from pipeline.transport.consumer import StreamConsumer
from pipeline.transport.sharding import ShardedConsumer

#: What ``fast`` sets: every wait of a stage in milliseconds, not the production seconds.
FAST: dict[str, Any] = dict(block_ms=100, claim_idle_ms=300, claim_interval_ms=50, heartbeat_interval_s=0.2,
                            shutdown_grace_s=1.0, backpressure_timeout_s=10.0)


#: What worker processes of the end-to-end tests get, and the in-test side (learner, producer) talking to them:
#: waits a few times ``FAST``'s, as a process starts and a loaded 2-core machine schedules it later than a task.
PROCESS: dict[str, Any] = dict(block_ms=200, claim_idle_ms=1000, claim_interval_ms=200, heartbeat_interval_s=0.5,
                               shutdown_grace_s=2.0)


def fast(**overrides: Any) -> StreamSettings:
    """``StreamSettings`` with ``FAST``'s values, then ``overrides`` (any ``StreamSettings`` field)."""
    return StreamSettings(**{**FAST, **overrides})


def process_settings(**overrides: Any) -> StreamSettings:
    """``StreamSettings`` with ``PROCESS``'s values, then ``overrides``: the in-test side of a process test."""
    return StreamSettings(**{**PROCESS, **overrides})


def process_env(**overrides: Any) -> dict[str, str]:
    """``PROCESS`` (then ``overrides``) as the ``DISTILLQ_*`` variables a worker process reads."""
    return {f"{ENV_PREFIX}{k.upper()}": str(v) for k, v in {**PROCESS, **overrides}.items()}


def leaping_clock(step_s: float = 60.0) -> Callable[[], float]:
    """A ``StreamConsumer`` clock that leaps ``step_s`` at every reading: each read of that consumer is past its
    ``claim_interval_ms`` (the throttle between two reclaims), so each read reclaims what is idle."""
    ticks = itertools.count()
    return lambda: next(ticks) * step_s


async def make_idle(consumer: StreamConsumer | ShardedConsumer, idle_ms: int = 3_600_000) -> int:
    """Set the idle time of every entry pending in ``consumer``'s group (each shard's, for a sharded one) to
    ``idle_ms`` with XCLAIM ... IDLE JUSTID to the consumer that holds it (owner and delivery count kept), as if
    that owner had been gone so long: a reclaim test needs no sleep. Returns how many entries it aged."""
    aged = 0
    for part in consumer.parts.values() if isinstance(consumer, ShardedConsumer) else [consumer]:
        r: aioredis.Redis = part.redis
        for p in await r.xpending_range(part.key, part.group, min="-", max="+", count=10_000):
            await r.xclaim(part.key, part.group, p["consumer"], 0, [p["message_id"]], idle=idle_ms, justid=True)
            aged += 1
    return aged
