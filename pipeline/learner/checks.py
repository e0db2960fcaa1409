"""What the learner client tells a user who pointed it at the wrong place: Redis unreachable (one line),
or a namespace where no feeder ever ran (a warning naming the namespaces that have one)."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, ResponseError

from pipeline.errors import LearnerError
from pipeline.transport.connection import TRANSIENT, redis_error_line
from pipeline.transport.keys import Keys


class LearnerConnectionError(LearnerError, ConnectionError):
    """Redis cannot be reached (or refused the credentials); the message is one line, password masked."""


async def check_reachable(redis: aioredis.Redis, url: str | None) -> None:
    """PING, raising ``LearnerConnectionError`` with one line instead of redis-py's chain of errors."""
    try:
        await redis.ping()
    except (*TRANSIENT, AuthenticationError, ResponseError) as e:
        raise LearnerConnectionError(redis_error_line(e, url)) from None


def _str(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


async def namespace_hint(redis: aioredis.Redis, keys: Keys) -> str | None:
    """A one-line warning when ``keys.namespace`` has no feeder heartbeat and its batches stream never held
    an entry (a mistyped namespace waits forever otherwise); ``None`` when either exists."""
    async for _ in redis.scan_iter(match=keys.heartbeat_pattern("feeder"), count=500):
        return None
    stream = keys.stream("batches")
    try:
        info: Any = await redis.xinfo_stream(stream)
        added = int(info.get("entries-added", info.get(b"entries-added", info.get("length", 0))) or 0)
    except ResponseError:  # no such stream yet
        added = 0
    if added > 0:
        return None
    others = sorted({_str(k).split(":health:", 1)[0]
                     async for k in redis.scan_iter(match="*:health:feeder:*", count=500)} - {keys.namespace})
    hint = f"; namespaces with a feeder: {', '.join(others)}" if others else ""
    return (f"namespace {keys.namespace!r} has no feeder heartbeat and no batch was ever written to {stream}: "
            f"is the namespace right (--namespace / DISTILLQ_NAMESPACE)?{hint}")
