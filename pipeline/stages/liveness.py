"""Reading worker heartbeats by the Redis clock: how old each is, and how far its writer's clock is off.

A heartbeat (``pipeline.stages.lifecycle.Heartbeat``) is a key ``ns:health:<stage>:<consumer>`` holding JSON with
``ts`` (the writer's ``time.time()`` at the write) and ``ttl_ms`` (the TTL it set, three intervals). Its age is
read on the Redis clock alone: ``ttl_ms - PTTL`` is how long ago Redis stored it, so hosts whose clocks disagree
read the same age. Comparing ``ts`` with the Redis time of the write gives the writer's clock skew
(``skew_s``: positive when the writer's clock is ahead of Redis). A heartbeat without ``ttl_ms`` falls back to
``Redis TIME - ts`` and has no skew reading.

``worker --check`` and ``distillq stats`` both read heartbeats here, so they agree under clock skew.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final

import redis.asyncio as aioredis

from pipeline.transport.keys import Keys

#: A writer clock further than this from Redis's is named (``stats`` ``attention:``, ``--check``).
MAX_SKEW_S: Final = 5.0


@dataclass(frozen=True, slots=True)
class Beat:
    """One heartbeat as read: its key's stage and consumer, its JSON, its age on the Redis clock, the skew."""

    stage: str
    consumer: str
    info: dict[str, Any]
    age_s: float
    skew_s: float | None = None  # writer clock minus Redis clock at the write; None: not measurable


def _str(v: object) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def _num(v: object) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def parse_beat(keys: Keys, key: str, raw: bytes | str | None, pttl_ms: int | None, now: float) -> Beat | None:
    """A heartbeat key and its value, ``PTTL`` and the Redis time ``now`` (seconds); None if unreadable."""
    prefix = f"{keys.namespace}:health:"
    if raw is None or not key.startswith(prefix):
        return None
    stage, _, consumer = key[len(prefix):].partition(":")
    try:
        info = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(info, dict):
        return None
    ts, ttl = _num(info.get("ts")), _num(info.get("ttl_ms"))
    if ttl is not None and pttl_ms is not None and pttl_ms >= 0:
        age = max(0.0, (ttl - pttl_ms) / 1000)
        skew = None if ts is None else round(ts - (now - age), 3)
    else:
        age, skew = (0.0 if ts is None else max(0.0, now - ts)), None
    return Beat(stage=str(info.get("stage", stage)), consumer=consumer, info=info, age_s=round(age, 3), skew_s=skew)


def skew_note(consumer: str, skew_s: float | None, host: str = "", limit_s: float = MAX_SKEW_S) -> str | None:
    """``worker teacher-h-1 clock is 42 s ahead of Redis`` when the skew is above ``limit_s``; else None."""
    if skew_s is None or abs(skew_s) <= limit_s:
        return None
    side = "ahead of" if skew_s > 0 else "behind"
    where = f" (host {host})" if host else ""
    return f"worker {consumer}{where} clock is {abs(skew_s):.0f} s {side} Redis"


async def server_time(redis: aioredis.Redis) -> float:
    """The Redis server's clock, seconds."""
    sec, usec = await redis.time()
    return float(sec) + float(usec) / 1e6


async def read_beats(redis: aioredis.Redis, keys: Keys, stage: str = "*") -> tuple[float, list[Beat]]:
    """The Redis time and every readable heartbeat of ``stage`` (all stages by default), sorted by key."""
    names = sorted({_str(k) async for k in redis.scan_iter(match=keys.heartbeat_pattern(stage), count=500)})
    now = await server_time(redis)
    if not names:
        return now, []
    async with redis.pipeline(transaction=False) as p:  # not MGET: heartbeats span slots on a cluster
        for n in names:
            p.get(n)
            p.pttl(n)
        values: list[Any] = await p.execute()
    found = (parse_beat(keys, n, values[2 * i], _pttl(values[2 * i + 1]), now) for i, n in enumerate(names))
    return now, [b for b in found if b is not None]


def _pttl(v: object) -> int | None:
    return int(v) if isinstance(v, int) else None
