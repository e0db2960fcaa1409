"""Numbers behind ``distillq stats``: one snapshot of every stage stream, its consumer group and workers.

``collect`` reads Redis (XINFO, XPENDING, MEMORY USAGE, heartbeat keys; ``pipelinestate`` adds the learner
ranks' heartbeats); everything else is pure.
Times come from the Redis server clock (stream ids use it too), so client clock skew does not matter;
heartbeat ages too (``pipeline.stages.liveness``), which also measures each worker's clock skew.

Throughput comes from two sources:

* ``added_in_window``: ids newer than ``window_s`` still in the stream (counted server-side, capped).
  Exact for the DLQ; a lower bound for stage streams, whose entries are deleted once acknowledged.
* ``added_per_s`` / ``read_per_s``: deltas of the stream's ``entries-added`` and the group's
  ``entries-read`` counters between two snapshots (``with_rates``; ``--watch`` shows them).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Final

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from pipeline.learner.health import RankBeat
from pipeline.stages import liveness
from pipeline.stages.liveness import Beat, read_beats
from pipeline.transport.keys import CONSUMER_GROUPS, SHARDABLE, Keys, family, pool_stream, stream_pool
from pipeline.transport.pools import known_pools
from pipeline.transport.sharding import get_shards

#: Most ids counted in the throughput window (the count runs inside Redis, no payload is sent).
WINDOW_CAP: Final = 100_000
server_time = liveness.server_time  # the Redis clock (``dlq purge`` reads it here too)
#: Pending entries read per group (oldest first) to count those delivered more than once.
PENDING_SAMPLE: Final = 1000

# [exists, entries-added, last-generated-id, ids newer than ARGV[1] (at most ARGV[2])]
_STREAM_INFO: Final = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, 0, '0-0', 0} end
local info = redis.call('XINFO', 'STREAM', KEYS[1])
local added, last = 0, '0-0'
for i = 1, #info, 2 do
  if info[i] == 'entries-added' then added = info[i + 1] end
  if info[i] == 'last-generated-id' then last = info[i + 1] end
end
local window = redis.call('XRANGE', KEYS[1], ARGV[1], '+', 'COUNT', ARGV[2])
return {1, added, last, #window}
"""


@dataclass(slots=True)
class ConsumerStats:
    name: str
    pending: int
    idle_s: float  # since the consumer's last read or claim
    inactive_s: float | None = None  # since its last successful read (Redis >= 7.2)
    heartbeat: bool | None = None  # a live worker heartbeat under this name (None: its stage writes none)
    reclaim_in_s: float | None = None  # no heartbeat: when its most idle entry becomes reclaimable (0: now)


@dataclass(slots=True)
class GroupStats:
    name: str
    exists: bool = False
    consumers: int = 0
    pending: int = 0  # delivered, not yet acknowledged
    lag: int = 0  # never delivered to the group
    lag_estimated: bool = False  # Redis could not tell; estimated as length - pending
    last_delivered_id: str = "0-0"
    entries_read: int | None = None
    oldest_pending_id: str | None = None
    oldest_pending_age_s: float | None = None  # since the entry was added
    oldest_pending_idle_s: float | None = None  # since it was last delivered (or its lease renewed)
    oldest_pending_consumer: str | None = None  # who holds it
    redelivered: int = 0  # pending entries delivered more than once (of the oldest PENDING_SAMPLE)
    max_deliveries: int = 0  # the most deliveries of one pending entry (same sample)
    read_per_s: float | None = None
    consumer_list: list[ConsumerStats] = field(default_factory=list)


@dataclass(slots=True)
class StreamStats:
    name: str
    key: str
    exists: bool = False
    length: int = 0
    memory_bytes: int = 0
    entries_added: int = 0  # ever, including deleted entries
    last_id: str = "0-0"
    window_s: float = 60.0
    added_in_window: int = 0
    window_capped: bool = False
    added_per_s: float | None = None  # from an earlier snapshot, see ``with_rates``
    full: bool = False  # at the backlog cap (a shard of it, for a sharded total): producers wait
    groups: list[GroupStats] = field(default_factory=list)

    @property
    def window_rate(self) -> float:
        """Ids per second in the window (a lower bound for consumed streams)."""
        return self.added_in_window / self.window_s if self.window_s > 0 else 0.0


@dataclass(slots=True)
class WorkerStats:
    stage: str
    consumer: str
    host: str = ""
    pid: int = 0
    handled: int = 0
    age_s: float | None = None  # since the last heartbeat
    started: float | None = None
    outcomes: dict[str, int] = field(default_factory=dict)  # by outcome (stale, batched, emitted, ...)
    drops: dict[str, int] = field(default_factory=dict)  # teacher: payloads dropped, by reason
    problem: str | None = None  # what the worker reports as wrong (teacher: its backend failing)
    slow: str | None = None  # alive and working, but slowly (teacher: its backend's calls take long)
    clamped_k: int = 0  # teacher: groups whose k was clamped to the cap (``--k-over-cap clamp``)
    checkpoint: str | None = None  # rollout: the published version it refused to load, and the one it kept
    weights_version: int | None = None  # rollout: the policy version of the last group it sampled
    settings: dict[str, Any] = field(default_factory=dict)  # feeder: its effective batching settings
    clock_skew_s: float | None = None  # the worker's clock minus Redis's at its last beat (None: unknown)
    pool: str | None = None  # teacher: the pool it serves
    # teacher of another tokenizer (``--cross-tokenizer``): the share of trained tokens in aligned chunks with teacher
    # signal, and the share of the teacher's top-k probability mass that mapped to student ids (None: none scored yet)
    cross_tokenizer: bool = False
    cross_aligned_share: float | None = None
    cross_topk_mapped_share: float | None = None


@dataclass(slots=True)
class PoolStats:
    """A teacher pool: its rollouts stream's backlog (groups waiting or being scored), the part no worker has
    read yet (lag), the oldest group's age, and its live teacher workers."""

    name: str
    stream: str
    backlog: int = 0
    lag: int = 0
    pending: int = 0
    oldest_pending_age_s: float | None = None
    workers: int = 0


@dataclass(slots=True)
class Snapshot:
    namespace: str
    time: float  # Redis server time, seconds
    streams: dict[str, StreamStats]
    dead_letters: int
    workers: list[WorkerStats]
    policy_version: int | None = None  # the learner's (None: never set)
    max_backlog: int = 0  # entries per stream key at which producers wait (this command's setting)
    rollout_jobs: int | None = None  # prompts queued for rollout workers, None if unreadable
    namespace_note: str | None = None  # the namespace has no keys here
    memory: RedisMemory | None = None  # Redis's INFO memory (None: unreadable)
    dead_letters_by_stage: dict[str, int] = field(default_factory=dict)  # of the newest DLQ_SAMPLE dead letters
    incidents: list[IncidentStats] = field(default_factory=list)  # recent, newest first
    claim_idle_s: float = 60.0  # this command's DISTILLQ_CLAIM_IDLE_MS, in seconds
    hold_warn_s: float = 300.0  # a learner holding a batch longer than this is named (``--hold-warn``)
    learners: list[RankBeat] = field(default_factory=list)  # learner rank heartbeats (``pipeline.learner.health``)
    pools: list[PoolStats] = field(default_factory=list)  # teacher pools (with the rollouts stream shown)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for name, s in self.streams.items():
            out["streams"][name]["window_rate"] = round(s.window_rate, 3)
        return out


@dataclass(slots=True)
class RedisMemory:
    """Redis's memory (INFO memory) and its refusals of writes for lack of it (INFO errorstats)."""

    used_bytes: int
    max_bytes: int  # 0: no maxmemory
    policy: str = "noeviction"
    oom_errors: int = 0  # OOM errors Redis answered since it started
    oom_errors_new: int | None = None  # since the previous snapshot (``with_rates``; None: one snapshot)

    @property
    def used_fraction(self) -> float | None:
        return self.used_bytes / self.max_bytes if self.max_bytes else None


@dataclass(slots=True)
class IncidentStats:
    """A recorded incident (``pipeline.transport.incidents``)."""

    kind: str
    text: str
    ts: float
    writer: str = ""
    age_s: float = 0.0  # on the Redis clock (the writer's ``ts`` may be skewed)


def id_ms(entry_id: str) -> int:
    """Milliseconds part of a stream id (``1700000000000-3`` -> ``1700000000000``)."""
    return int(entry_id.split("-", 1)[0])


def _str(v: object) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def _int_or_none(v: object) -> int | None:
    return None if v is None else int(v)  # type: ignore[call-overload]


def parse_group(raw: dict[str, Any], length: int) -> GroupStats:
    """One XINFO GROUPS row. ``lag`` is nil in Redis when it cannot be computed; then ``length - pending``
    (exact when acknowledged entries are deleted, as every distillq stage does)."""
    pending = int(raw.get("pending", 0))
    lag = raw.get("lag")
    g = GroupStats(
        name=_str(raw["name"]), exists=True, consumers=int(raw.get("consumers", 0)), pending=pending,
        last_delivered_id=_str(raw.get("last-delivered-id", "0-0")), entries_read=_int_or_none(raw.get("entries-read")),
    )
    if g.entries_read is None and g.last_delivered_id == "0-0":
        g.entries_read = 0  # nothing read yet (Redis reports nil)
    if lag is None:
        g.lag, g.lag_estimated = max(0, length - pending), True
    else:
        g.lag = int(lag)
    return g


def parse_consumer(raw: dict[str, Any]) -> ConsumerStats:
    inactive = raw.get("inactive")
    return ConsumerStats(
        name=_str(raw["name"]), pending=int(raw.get("pending", 0)), idle_s=int(raw.get("idle", 0)) / 1000,
        inactive_s=None if inactive is None or int(inactive) < 0 else int(inactive) / 1000,
    )


def worker_of(b: Beat) -> WorkerStats:
    """A heartbeat as ``stats`` shows it (the stage's report fields it knows; unknown ones are ignored)."""
    info = b.info
    settings = info.get("settings")
    return WorkerStats(
        stage=b.stage, consumer=b.consumer, host=str(info.get("host", "")),
        pid=int(info.get("pid", 0) or 0), handled=int(info.get("handled", 0) or 0), age_s=b.age_s,
        started=None if info.get("started") is None else float(info["started"]),
        outcomes=_counts(info.get("outcomes")), drops=_counts(info.get("drops")),
        problem=None if not info.get("unhealthy") else str(info["unhealthy"]),
        slow=None if not info.get("slow") else str(info["slow"]),
        clamped_k=_counts({"n": info.get("clamped_k")}).get("n", 0),
        checkpoint=None if not info.get("checkpoint_not_loadable") else str(info["checkpoint_not_loadable"]),
        weights_version=_int_or_none(info.get("weights_version")) if b.stage == "rollout" else None,
        settings=dict(settings) if isinstance(settings, dict) else {},
        clock_skew_s=b.skew_s, pool=str(info["pool"]) if b.stage == "teacher" and info.get("pool") else None,
        cross_tokenizer=b.stage == "teacher" and "cross_aligned_share" in info,
        cross_aligned_share=_share(info.get("cross_aligned_share")),
        cross_topk_mapped_share=_share(info.get("cross_topk_mapped_share")),
    )


def _share(v: object) -> float | None:
    """A share in [0, 1] from a heartbeat (None when absent, not a number or out of range)."""
    if not isinstance(v, int | float) or isinstance(v, bool) or not 0.0 <= v <= 1.0:
        return None
    return float(v)


def serves(w: WorkerStats, pool: str) -> bool:
    """``w`` is a teacher worker of ``pool`` (a heartbeat without a pool is one of the pool ``default``)."""
    return w.stage == "teacher" and (w.pool or "default") == pool


def pool_stats(streams: dict[str, StreamStats], workers: list[WorkerStats], pools: list[str]) -> list[PoolStats]:
    """One row per pool whose stream is in ``streams``."""
    out: list[PoolStats] = []
    for pool in pools:
        s = streams.get(pool_stream(pool))
        if s is None:
            continue
        g = next((g for g in s.groups if g.name == "teacher"), None)
        out.append(PoolStats(
            name=pool, stream=s.name, backlog=s.length, lag=g.lag if g is not None else s.length,
            pending=g.pending if g is not None else 0,
            oldest_pending_age_s=g.oldest_pending_age_s if g is not None else None,
            workers=sum(serves(w, pool) for w in workers)))
    return out


def _counts(raw: object) -> dict[str, int]:
    if not isinstance(raw, dict):
        return {}
    return {str(k): int(v) for k, v in raw.items() if isinstance(v, int | float) and v}


def with_rates(prev: Snapshot | None, cur: Snapshot) -> Snapshot:
    """Fill ``added_per_s`` and ``read_per_s`` of ``cur`` from counter deltas since ``prev``."""
    if prev is None or cur.time <= prev.time:
        return cur
    dt = cur.time - prev.time
    if cur.memory is not None and prev.memory is not None:
        cur.memory.oom_errors_new = max(0, cur.memory.oom_errors - prev.memory.oom_errors)
    for name, s in cur.streams.items():
        before = prev.streams.get(name)
        if before is None or not before.exists or not s.exists:
            continue
        s.added_per_s = max(0, s.entries_added - before.entries_added) / dt
        old = {g.name: g for g in before.groups}
        for g in s.groups:
            o = old.get(g.name)
            if o is not None and g.entries_read is not None and o.entries_read is not None:
                g.read_per_s = max(0, g.entries_read - o.entries_read) / dt
    return cur


async def _group(redis: aioredis.Redis, key: str, g: GroupStats, now: float) -> None:
    """Add the oldest pending entry and the consumers of an existing group."""
    if g.pending:
        rows: Any = await redis.xpending_range(key, g.name, min="-", max="+", count=PENDING_SAMPLE)
        if rows:
            eid = _str(rows[0]["message_id"])
            g.oldest_pending_id, g.oldest_pending_consumer = eid, _str(rows[0]["consumer"])
            g.oldest_pending_age_s = round(max(0.0, now - id_ms(eid) / 1000), 3)
            g.oldest_pending_idle_s = int(rows[0]["time_since_delivered"]) / 1000
            deliveries = [int(r["times_delivered"]) for r in rows]
            g.redelivered, g.max_deliveries = sum(n > 1 for n in deliveries), max(deliveries)
    consumers: Any = await redis.xinfo_consumers(key, g.name)
    g.consumer_list = [parse_consumer(c) for c in consumers]


async def stream_stats(
    redis: aioredis.Redis, keys: Keys, name: str, now: float, *, window_s: float = 60.0, cap: int = WINDOW_CAP,
    shard: int | None = None, shards: int = 1,
) -> StreamStats:
    key = keys.stream(name, shard, shards)
    s = StreamStats(name=name if shard is None else f"{name}:{shard}", key=key, window_s=window_s)
    since = f"{max(0, int((now - window_s) * 1000))}-0"
    script = redis.register_script(_STREAM_INFO)
    exists, added, last, in_window = await script(keys=[key], args=[since, cap])
    if exists:
        s.exists, s.entries_added, s.last_id = True, int(added), _str(last)
        s.added_in_window, s.window_capped = int(in_window), int(in_window) >= cap
        s.length = int(await redis.xlen(key))
        s.memory_bytes = int(await redis.memory_usage(key) or 0)
        try:
            raw_groups: Any = await redis.xinfo_groups(key)
        except ResponseError:  # deleted in between
            raw_groups = []
        s.groups = [parse_group(raw, s.length) for raw in raw_groups]
        for g in s.groups:
            await _group(redis, key, g, now)
    expected = CONSUMER_GROUPS.get(family(name))
    if expected is not None and all(g.name != expected for g in s.groups):
        s.groups.insert(0, GroupStats(name=expected, lag=s.length))  # not created yet: all of it is lag
    return s


async def workers(redis: aioredis.Redis, keys: Keys) -> list[WorkerStats]:
    """Every live worker (a heartbeat key), aged on the Redis clock."""
    _, beats = await read_beats(redis, keys)
    return [worker_of(b) for b in beats]


def total_of(name: str, parts: list[StreamStats]) -> StreamStats:
    """One row summing the shards of a stream (groups merged by name)."""
    t = StreamStats(name=name, key=f"({len(parts)} shards)", window_s=parts[0].window_s)
    t.exists = any(p.exists for p in parts)
    t.length = sum(p.length for p in parts)
    t.memory_bytes = sum(p.memory_bytes for p in parts)
    t.entries_added = sum(p.entries_added for p in parts)
    t.added_in_window = sum(p.added_in_window for p in parts)
    t.window_capped = any(p.window_capped for p in parts)
    merged: dict[str, GroupStats] = {}
    for p in parts:
        for g in p.groups:
            m = merged.setdefault(g.name, GroupStats(name=g.name, lag=0))
            m.lag = (m.lag or 0) + (g.lag or 0)
            m.pending += g.pending
            m.exists = m.exists or g.exists
            if g.oldest_pending_age_s is not None and (m.oldest_pending_age_s is None
                                                       or g.oldest_pending_age_s > m.oldest_pending_age_s):
                m.oldest_pending_age_s, m.oldest_pending_id = g.oldest_pending_age_s, g.oldest_pending_id
                m.oldest_pending_idle_s, m.oldest_pending_consumer = g.oldest_pending_idle_s, g.oldest_pending_consumer
            m.redelivered += g.redelivered
            m.max_deliveries = max(m.max_deliveries, g.max_deliveries)
            m.consumer_list = merge_consumers(m.consumer_list + g.consumer_list)
            m.consumers = max(m.consumers, g.consumers, len(m.consumer_list))
    t.groups = list(merged.values())
    return t


def merge_consumers(rows: list[ConsumerStats]) -> list[ConsumerStats]:
    """One row per consumer name (a worker reads every shard, so it is a consumer of each): pending summed,
    idle and inactive times the shortest (its latest read on any shard)."""
    out: dict[str, ConsumerStats] = {}
    for c in rows:
        m = out.get(c.name)
        if m is None:
            out[c.name] = ConsumerStats(name=c.name, pending=c.pending, idle_s=c.idle_s, inactive_s=c.inactive_s)
            continue
        m.pending += c.pending
        m.idle_s = min(m.idle_s, c.idle_s)
        times = [x for x in (m.inactive_s, c.inactive_s) if x is not None]
        m.inactive_s = min(times) if times else None
    return list(out.values())


async def collect(
    redis: aioredis.Redis, keys: Keys, streams: list[str], *, window_s: float = 60.0, cap: int = WINDOW_CAP
) -> Snapshot:
    """One snapshot of ``streams`` (short names), the DLQ length and the live workers (``pipelinestate`` adds the
    rest of what ``distillq stats`` shows)."""
    now = await server_time(redis)
    shards = await get_shards(redis, keys)
    out: dict[str, StreamStats] = {}
    pools = await known_pools(redis, keys) if "rollouts" in streams else [
        p for n in streams if (p := stream_pool(n)) is not None]
    if "rollouts" in streams:  # every teacher pool's stream right after it
        at = streams.index("rollouts") + 1
        streams = [*streams[:at], *(pool_stream(p) for p in pools if pool_stream(p) not in streams), *streams[at:]]
    for n in streams:
        if shards > 1 and family(n) in SHARDABLE:
            parts = [await stream_stats(redis, keys, n, now, window_s=window_s, cap=cap, shard=i, shards=shards)
                     for i in range(shards)]
            out[n] = total_of(n, parts)
            out.update((p.name, p) for p in parts)
        else:
            out[n] = await stream_stats(redis, keys, n, now, window_s=window_s, cap=cap)
    dead = out["dlq"].length if "dlq" in out else int(await redis.xlen(keys.dlq))
    live = await workers(redis, keys)
    return Snapshot(namespace=keys.namespace, time=now, streams=out, dead_letters=dead, workers=live,
                    pools=pool_stats(out, live, pools))
