"""Finding one group's entries in a stream without moving payloads: the ids of entries whose group id field
matches (matched inside Redis by a script that pages through the stream and returns entry ids only), and the
batches whose manifests list the group. Reads only."""

from __future__ import annotations

from typing import Final

import redis.asyncio as aioredis

from pipeline.config import StreamSettings
from pipeline.transport.keys import Keys
from pipeline.transport.producer import F_DATA
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


# A page of (entry id, value of field ARGV[2]) pairs from ARGV[1] on (ARGV[3] entries), and where the next starts.
_PAIRS: Final = """
local page = redis.call('XRANGE', KEYS[1], ARGV[1], '+', 'COUNT', tonumber(ARGV[3]))
local out = {}
for _, e in ipairs(page) do
  local f, v = e[2], ''
  for i = 1, #f, 2 do
    if f[i] == ARGV[2] then v = f[i + 1] end
  end
  table.insert(out, e[1])
  table.insert(out, v)
end
return out
"""


def _s(v: object) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


async def find_entries(redis: aioredis.Redis, key: str, group_id: str, field_name: bytes) -> list[str]:
    """Ids of the entries of stream ``key`` whose field ``field_name`` is ``group_id`` (matched in Redis)."""
    ids = await redis.register_script(_FIND)(keys=[key], args=[group_id, field_name])
    return [_s(i) for i in ids]


async def index_entries(redis: aioredis.Redis, key: str, field_name: bytes) -> dict[str, list[str]]:
    """Every entry id of stream ``key`` by the value of its field ``field_name``, oldest first, in one pass (a
    page per call, matched in Redis, no payload moved): what ``find_entries`` answers for every value at once,
    for a command that asks about many groups."""
    index: dict[str, list[str]] = {}
    script, start = redis.register_script(_PAIRS), "-"
    while True:
        flat = await script(keys=[key], args=[start, field_name, _PAGE])
        for i in range(0, len(flat), 2):
            index.setdefault(_s(flat[i + 1]), []).append(_s(flat[i]))
        if len(flat) < 2 * _PAGE:
            return index
        start = f"({_s(flat[-2])}"


async def batches_listing(redis: aioredis.Redis, keys: Keys, group_id: str) -> list[tuple[str, str]]:
    """(entry id, batch id) of each batch in the batches stream whose manifest lists ``group_id``."""
    key = keys.stream("batches")
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
