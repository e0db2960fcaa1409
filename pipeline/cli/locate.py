"""Where is group G: its entries in ``rollouts``, ``scored``, ``batches`` and the DLQ, their pending state,
its dedupe markers and the feeder's drop record (``distillq where``). Reads only; joins no consumer group.

Entries of ``rollouts``, ``scored`` and the DLQ are matched on their group id field inside Redis (a script
pages through the stream and returns entry ids only, so no payload crosses the network); batches are
matched on the group ids their manifests list.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Final

import redis.asyncio as aioredis

from pipeline.config import StreamSettings
from pipeline.transport.keys import CONSUMER_GROUPS, Keys
from pipeline.transport.producer import F_DATA, F_ID
from pipeline.transport.sharding import get_shards
from schemas import BatchManifest, DecodeError, TrainBatch, decode

_PAGE: Final = 200

# Entry ids whose field ARGV[2] equals ARGV[1], paging through the whole stream server-side.
_FIND: Final = """
local found, start = {}, '-'
while true do
  local page = redis.call('XRANGE', KEYS[1], start, '+', 'COUNT', 200)
  for _, e in ipairs(page) do
    local f = e[2]
    for i = 1, #f, 2 do
      if f[i] == ARGV[2] and f[i + 1] == ARGV[1] then table.insert(found, e[1]) end
    end
  end
  if #page < 200 then return found end
  start = '(' .. page[#page][1]
end
"""


@dataclass(slots=True)
class Sighting:
    stream: str
    entry_id: str
    consumer: str | None = None  # the consumer holding it (delivered, not acknowledged)
    idle_s: float | None = None
    deliveries: int | None = None
    detail: str = ""


@dataclass(slots=True)
class Marker:
    stream: str
    value: str
    expires_in_s: float | None


@dataclass(slots=True)
class Whereabouts:
    group_id: str
    namespace: str
    entries: list[Sighting] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)
    dropped: dict[str, Any] | None = None  # the feeder's drop record
    summary: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _s(v: object) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


async def _pending(redis: aioredis.Redis, key: str, group: str, entry_id: str, s: Sighting) -> None:
    try:
        rows: Any = await redis.xpending_range(key, group, min=entry_id, max=entry_id, count=1)
    except aioredis.ResponseError:  # no such group yet
        return
    if rows:
        s.consumer = _s(rows[0]["consumer"])
        s.idle_s = int(rows[0]["time_since_delivered"]) / 1000
        s.deliveries = int(rows[0]["times_delivered"])


async def _find(redis: aioredis.Redis, key: str, group_id: str, field_name: bytes) -> list[str]:
    ids = await redis.register_script(_FIND)(keys=[key], args=[group_id, field_name])
    return [_s(i) for i in ids]


async def _in_batches(redis: aioredis.Redis, key: str, group_id: str) -> list[tuple[str, str]]:
    """(entry id, batch id) of each batch whose manifest lists ``group_id``."""
    out: list[tuple[str, str]] = []
    limits = StreamSettings().limits()
    start = "-"
    while True:
        page = await redis.xrange(key, min=start, max="+", count=_PAGE)
        for eid, fields in page:
            try:
                msg = decode(fields.get(F_DATA, b""), limits)
            except DecodeError:
                continue
            ids = ([r.group_id for r in msg.refs] if isinstance(msg, BatchManifest)
                   else [g.group_id for g in msg.groups] if isinstance(msg, TrainBatch) else [])
            if group_id in ids:
                out.append((_s(eid), msg.batch_id))  # type: ignore[union-attr]
        if len(page) < _PAGE:
            return out
        start = f"({_s(page[-1][0])}"


async def locate(redis: aioredis.Redis, keys: Keys, group_id: str) -> Whereabouts:
    w = Whereabouts(group_id, keys.namespace)
    shards = await get_shards(redis, keys)
    for stream in ("rollouts", "scored"):
        key = keys.stream_for(stream, group_id, shards)
        for eid in await _find(redis, key, group_id, F_ID):
            s = Sighting(stream, eid)
            await _pending(redis, key, CONSUMER_GROUPS[stream], eid, s)
            w.entries.append(s)
    for eid, batch_id in await _in_batches(redis, keys.stream("batches"), group_id):
        s = Sighting("batches", eid, detail=f"batch {batch_id}")
        await _pending(redis, keys.stream("batches"), CONSUMER_GROUPS["batches"], eid, s)
        w.entries.append(s)
    for eid in await _find(redis, keys.dlq, group_id, b"orig_" + F_ID):
        fields = (await redis.xrange(keys.dlq, min=eid, max=eid))[0][1]
        w.entries.append(Sighting("dlq", eid, detail=f"stage {_s(fields.get(b'stage', b''))}: "
                                                     f"{_s(fields.get(b'reason', b''))}"))
    for stream in ("rollouts", "scored", "batches"):
        mk = keys.seen(stream, group_id, shards)
        value, ttl = await redis.get(mk), await redis.pttl(mk)
        if value is not None:
            w.markers.append(Marker(stream, _s(value), None if ttl is None or ttl < 0 else ttl / 1000))
    raw = await redis.get(keys.dropped(group_id))
    if raw is not None:
        try:
            w.dropped = json.loads(raw)
        except ValueError:
            w.dropped = {"reason": _s(raw)}
    w.summary = summarize(w)
    return w


def _hours(s: float | None) -> str:
    return "until deleted" if s is None else f"for {s / 3600:.1f} h more"


def summarize(w: Whereabouts) -> str:
    """One sentence: where the group is now, or what became of it."""
    by = {s.stream for s in w.entries}
    marked = {m.stream: m for m in w.markers}
    if "dlq" in by:
        return "dead-lettered: distillq dlq show ENTRY_ID says why; distillq dlq replay ENTRY_ID sends it back"
    if "batches" in by:
        return "in a batch the learner has not acknowledged yet"
    if "scored" in by:
        return "scored, waiting for the feeder"
    if "rollouts" in by:
        return "waiting for a teacher worker"
    if w.dropped is not None:
        first = marked.get("rollouts") or marked.get("scored")
        return (f"dropped by the feeder ({w.dropped.get('reason')}); a push of the same group id is skipped as "
                f"already present {_hours(first.expires_in_s if first else None)}: push it again with "
                "distillq push --force (with --policy-version N for a stale one)")
    if "batches" in marked:
        return "batched and acknowledged by the learner: it reached training"
    if marked:
        return ("written (" + ", ".join(sorted(marked)) + ") and no longer in any stream: consumed, or dropped "
                "before the drop records existed")
    return "not found: no entry, dedupe marker or drop record for this group id in this namespace"
