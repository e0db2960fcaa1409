"""Entries a stage stream lost outside distillq: trimmed (``XTRIM``, ``XDEL`` by hand) or deleted with the stream.

Every stage deletes the entries it acknowledges, so a stream holds its consumer group's pending entries and the
entries not yet delivered, nothing else. Redis 7 counts both sides: ``XINFO GROUPS`` gives the group's ``lag``
(entries added and not yet delivered to it, from the stream's ``entries-added`` counter) and its ``pending``
count, ``XLEN`` what the stream holds. So

    lost = lag + pending - length

is the number of entries added to the stream that no consumer acknowledged and that are no longer in it: removed
by hand before anyone read them, or while they were pending (a stream no group reads yet: ``entries-added -
length``). A stream deleted (``DEL``) takes its group with it;
its last audit record (``<stream key>:audit``, in the stream's hash slot) still says how many entries it held.

``audit`` reads one stream and its record in one script (atomic: two auditors never report one loss twice) and
returns what was lost since the last audit; ``audit_streams`` does it for every stage stream of a namespace
(``prompts``, ``rollouts`` and every teacher pool's, each shard, ``scored``, ``batches``) and records an incident
(``stream_trimmed`` or ``stream_deleted``) for each loss, which ``distillq stats`` shows. The feeder audits every
``AUDIT_EVERY_S``; ``distillq stats`` audits when it runs. Nothing here is on the path of a message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import redis.asyncio as aioredis

from pipeline.transport import incidents
from pipeline.transport.keys import CONSUMER_GROUPS, Keys, family, pool_stream
from pipeline.transport.pools import known_pools
from pipeline.transport.sharding import get_shards

#: How often the feeder audits the stage streams (seconds).
AUDIT_EVERY_S: Final = 30.0

# KEYS: the stream, its audit record. ARGV: the consumer group. The record is "entries-added,length,lost"
# (lost: what ``lag + pending - length`` said last time). Returns false, or {kind, count, length at the last
# audit}: kind 'trimmed' (count entries lost since the last audit) or 'deleted' (the stream is gone or was made
# again; count: the entries it held at the last audit).
_AUDIT: Final = """
local rec = redis.call('GET', KEYS[2])
local p_added, p_len, p_lost = 0, 0, 0
if rec then
  local a, l, x = string.match(rec, '^(%d+),(%d+),(%d+)$')
  if a then p_added, p_len, p_lost = tonumber(a), tonumber(l), tonumber(x) end
end
if redis.call('EXISTS', KEYS[1]) == 0 then
  if rec then redis.call('DEL', KEYS[2]) end
  if rec and p_len > 0 then return {'deleted', p_len, p_len} end
  return false
end
local added, len = 0, redis.call('XLEN', KEYS[1])
local info = redis.call('XINFO', 'STREAM', KEYS[1])
for i = 1, #info, 2 do
  if info[i] == 'entries-added' then added = tonumber(info[i + 1]) end
end
local lost, groups = 0, redis.call('XINFO', 'GROUPS', KEYS[1])
if #groups == 0 then lost = math.max(0, added - len) end  -- nobody ever read it: all it had is there or lost
for _, g in ipairs(groups) do
  local name, lag, pending = nil, nil, 0
  for i = 1, #g, 2 do
    if g[i] == 'name' then name = g[i + 1] end
    if g[i] == 'lag' then lag = g[i + 1] end
    if g[i] == 'pending' then pending = tonumber(g[i + 1]) end
  end
  if name == ARGV[1] and lag then lost = math.max(0, tonumber(lag) + pending - len) end
end
redis.call('SET', KEYS[2], added .. ',' .. len .. ',' .. lost)
if rec and added < p_added then return {'deleted', p_len, p_len} end
if lost > p_lost then return {'trimmed', lost - p_lost, p_len} end
return false
"""


@dataclass(frozen=True, slots=True)
class Loss:
    """Entries a stream lost since its last audit."""

    key: str
    stream: str  # short name (``rollouts``, ``scored:2``, ``rollouts.math``)
    kind: str  # ``trimmed`` or ``deleted``
    entries: int

    def text(self) -> str:
        reader = CONSUMER_GROUPS[family(self.stream.split(":")[0])]
        if self.kind == "deleted":
            return (f"stream {self.key} was deleted (DEL, FLUSHDB or UNLINK by hand) holding {self.entries} entries "
                    f"its {reader} consumers had not acknowledged: they are lost; distillq where GROUP_ID names each "
                    "group's fate, distillq push --force FILE sends lost ones again")
        return (f"{self.entries} entries of stream {self.key} were removed (XTRIM or XDEL by hand) before its {reader} "
                "consumers acknowledged them: they are lost; distillq where GROUP_ID names each group's fate, "
                "distillq push --force FILE sends lost ones again")


async def audit(redis: aioredis.Redis, key: str, stream: str) -> Loss | None:
    """What stream ``key`` (short name ``stream``) lost since its last audit, if anything; updates the record."""
    group = CONSUMER_GROUPS[family(stream.split(":", maxsplit=1)[0])]
    res: Any = await redis.eval(_AUDIT, 2, key, Keys.audit(key), group)  # type: ignore[misc]
    if not res:
        return None
    kind = res[0].decode() if isinstance(res[0], bytes) else str(res[0])
    return Loss(key, stream, kind, int(res[1]))


async def stage_streams(redis: aioredis.Redis, keys: Keys) -> list[tuple[str, str]]:
    """(short name, key) of every stage stream of the namespace: each shard of each, every teacher pool's."""
    shards = await get_shards(redis, keys)
    out: list[tuple[str, str]] = []
    for name in ("prompts", "batches", *(pool_stream(p) for p in await known_pools(redis, keys)), "scored"):
        parts = keys.streams(name, shards)  # one key unsharded, else one per shard
        out += [(name if len(parts) == 1 else f"{name}:{i}", k) for i, k in enumerate(parts)]
    return out


async def audit_streams(redis: aioredis.Redis, keys: Keys, writer: str) -> list[Loss]:
    """Audit every stage stream; an incident for each loss found (``writer``: who audited)."""
    found: list[Loss] = []
    for name, key in await stage_streams(redis, keys):
        loss = await audit(redis, key, name)
        if loss is not None:
            found.append(loss)
            await incidents.record(redis, keys, f"stream_{loss.kind}", loss.text(), writer=writer, stream=name,
                                   key=key, entries=loss.entries)
    return found
