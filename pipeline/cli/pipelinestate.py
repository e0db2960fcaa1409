"""The pipeline state ``distillq stats`` shows beside the streams: the policy version, the learner ranks (their
heartbeats, ``pipeline.learner.health``), the backlog cap and which streams are full, the rollout job queue,
consumers holding entries without a live heartbeat (when those entries become reclaimable), Redis's memory, the
dead letters by stage and the recent incidents. Reads only.
"""

from __future__ import annotations

import contextlib
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from pipeline.cli.namespaces import absent_note
from pipeline.cli.streamstats import IncidentStats, RedisMemory, Snapshot, collect
from pipeline.config import StreamSettings
from pipeline.learner.health import read_rank_beats
from pipeline.transport import incidents
from pipeline.transport.audit import audit_streams
from pipeline.transport.keys import Keys

#: Consumer groups whose readers write a worker heartbeat (the learner client writes its own, per rank).
BEATING_GROUPS = ("teacher", "feeder", "rollout")
_PENDING_SAMPLE = 100  # pending entries read per consumer without a heartbeat, to find the most idle
#: Newest dead letters read to count them by stage.
DLQ_SAMPLE = 1000
#: Recent incidents read (newest first) and how far back.
INCIDENT_COUNT, INCIDENT_SINCE_S = 50, 86400.0


async def collect_all(redis: aioredis.Redis, keys: Keys, streams: list[str], *, window_s: float = 60.0,
                      hold_warn_s: float = 300.0) -> Snapshot:
    """``streamstats.collect`` plus the pipeline state: everything ``distillq stats`` shows."""
    snap = await collect(redis, keys, streams, window_s=window_s)
    snap.hold_warn_s = hold_warn_s
    await add_pipeline_state(redis, keys, snap)
    snap.memory = await redis_memory(redis)
    snap.dead_letters_by_stage = await dead_letters_by_stage(redis, keys) if snap.dead_letters else {}
    with contextlib.suppress(ResponseError):  # a user allowed to read only: the feeder audits too
        await audit_streams(redis, keys, writer="distillq stats")  # entries lost by hand become incidents now
    snap.incidents = await recent_incidents(redis, keys, snap.time)
    return snap


async def redis_memory(redis: aioredis.Redis) -> RedisMemory | None:
    """``INFO memory`` and the OOM count of ``INFO errorstats``; None where unreadable (a cluster client, whose
    INFO answers per node, or a server that refuses INFO)."""
    try:
        mem: Any = await redis.info("memory")
        errors: Any = await redis.info("errorstats")
    except (RedisError, OSError):
        return None
    if not isinstance(mem, dict) or "used_memory" not in mem:
        return None
    oom = errors.get("errorstat_OOM") if isinstance(errors, dict) else None
    return RedisMemory(used_bytes=int(mem["used_memory"]), max_bytes=int(mem.get("maxmemory", 0) or 0),
                       policy=str(mem.get("maxmemory_policy", "noeviction")),
                       oom_errors=int(oom.get("count", 0)) if isinstance(oom, dict) else 0)


async def dead_letters_by_stage(redis: aioredis.Redis, keys: Keys) -> dict[str, int]:
    """The newest ``DLQ_SAMPLE`` dead letters counted by the stage that wrote them."""
    out: dict[str, int] = {}
    rows: Any = await redis.xrevrange(keys.dlq, count=DLQ_SAMPLE)
    for _, fields in rows:
        stage = fields.get(b"stage", b"?").decode("utf-8", "replace")
        out[stage] = out.get(stage, 0) + 1
    return out


async def recent_incidents(redis: aioredis.Redis, keys: Keys, now: float) -> list[IncidentStats]:
    """The incidents of the last ``INCIDENT_SINCE_S`` (newest first, at most ``INCIDENT_COUNT``)."""
    found = await incidents.recent(redis, keys, since_s=INCIDENT_SINCE_S, count=INCIDENT_COUNT)
    return [IncidentStats(kind=i.kind, text=i.text, ts=i.ts, writer=i.writer, age_s=round(max(0.0, now - i.ts), 1))
            for i in found]


async def add_pipeline_state(redis: aioredis.Redis, keys: Keys, snap: Snapshot) -> None:
    settings = StreamSettings()
    snap.max_backlog = settings.max_backlog
    snap.claim_idle_s = settings.claim_idle_ms / 1000
    raw = await redis.get(keys.policy_version)
    with contextlib.suppress(ValueError, TypeError):
        snap.policy_version = None if raw is None else int(raw)
    snap.rollout_jobs = await _rollout_jobs(redis, keys, snap)
    snap.learners = await read_rank_beats(redis, keys)
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


async def _rollout_jobs(redis: aioredis.Redis, keys: Keys, snap: Snapshot) -> int | None:
    """Prompts waiting for or being sampled by rollout workers: the ``prompts`` stream's length (acknowledged
    entries are deleted); None when unreadable."""
    prompts = snap.streams.get("prompts")
    if prompts is not None:
        return prompts.length
    try:
        return int(await redis.xlen(keys.stream("prompts")))
    except (RedisError, OSError):
        return None


async def _most_idle_s(redis: aioredis.Redis, key: str, group: str, consumer: str) -> float | None:
    try:
        rows: Any = await redis.xpending_range(key, group, min="-", max="+", count=_PENDING_SAMPLE,
                                               consumername=consumer)
    except ResponseError:
        return None
    return max((int(r["time_since_delivered"]) / 1000 for r in rows), default=None)
