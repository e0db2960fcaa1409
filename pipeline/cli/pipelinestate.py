"""The pipeline state ``distillq stats`` shows beside the streams: the policy version, the backlog cap and which
streams are full, the rollout job queue, and consumers holding entries without a live heartbeat (when those
entries become reclaimable). Reads only.
"""

from __future__ import annotations

import contextlib
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from pipeline.cli.namespaces import absent_note
from pipeline.cli.streamstats import Snapshot, collect
from pipeline.config import StreamSettings
from pipeline.transport.keys import Keys

#: Consumer groups whose readers write a heartbeat (the learner client writes none).
BEATING_GROUPS = ("teacher", "feeder")
_PENDING_SAMPLE = 100  # pending entries read per consumer without a heartbeat, to find the most idle


async def collect_all(redis: aioredis.Redis, keys: Keys, streams: list[str], *, window_s: float = 60.0,
                      jobs_redis: aioredis.Redis | None = None) -> Snapshot:
    """``streamstats.collect`` plus the pipeline state: everything ``distillq stats`` shows."""
    snap = await collect(redis, keys, streams, window_s=window_s)
    await add_pipeline_state(redis, keys, snap, jobs_redis=jobs_redis)
    return snap


async def add_pipeline_state(redis: aioredis.Redis, keys: Keys, snap: Snapshot, *,
                             jobs_redis: aioredis.Redis | None = None) -> None:
    settings = StreamSettings()
    snap.max_backlog = settings.max_backlog
    raw = await redis.get(keys.policy_version)
    with contextlib.suppress(ValueError, TypeError):
        snap.policy_version = None if raw is None else int(raw)
    try:
        snap.rollout_jobs = int(await (jobs_redis or redis).zcard(keys.arq_queue))
    except (RedisError, OSError):  # a jobs Redis that is away must not hide the rest
        snap.rollout_jobs = None
    for s in snap.streams.values():
        s.full = s.name != "dlq" and not s.key.startswith("(") and s.length >= settings.max_backlog
    for name, s in snap.streams.items():  # a sharded total is full when any shard is
        if s.key.startswith("("):
            s.full = any(p.full for n, p in snap.streams.items() if n.startswith(f"{name}:"))
    live = {w.consumer for w in snap.workers}
    claim_s = settings.claim_idle_ms / 1000
    for s in snap.streams.values():
        if s.key.startswith("("):
            continue  # the shards' rows are read themselves
        for g in s.groups:
            for c in g.consumer_list:
                if g.name not in BEATING_GROUPS:
                    continue
                c.heartbeat = c.name in live
                if c.heartbeat or not c.pending:
                    continue
                idle = await _most_idle_s(redis, s.key, g.name, c.name)
                c.reclaim_in_s = None if idle is None else round(max(0.0, claim_s - idle), 1)
    snap.namespace_note = await absent_note(redis, keys)


async def _most_idle_s(redis: aioredis.Redis, key: str, group: str, consumer: str) -> float | None:
    try:
        rows: Any = await redis.xpending_range(key, group, min="-", max="+", count=_PENDING_SAMPLE,
                                               consumername=consumer)
    except ResponseError:
        return None
    return max((int(r["time_since_delivered"]) / 1000 for r in rows), default=None)
