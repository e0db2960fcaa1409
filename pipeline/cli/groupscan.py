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


def _s(v: object) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


async def find_entries(redis: aioredis.Redis, key: str, group_id: str, field_name: bytes) -> list[str]:
    """Ids of the entries of stream ``key`` whose field ``field_name`` is ``group_id`` (matched in Redis)."""
    ids = await redis.register_script(_FIND)(keys=[key], args=[group_id, field_name])
    return [_s(i) for i in ids]


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
