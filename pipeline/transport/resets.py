"""Noticing that Redis lost a namespace's data (restarted without persistence, flushed, a failover to a
replica that had nothing): the namespace sentinel.

``ns:sentinel`` (a hash) holds a random ``token`` that the first consumer of a namespace writes; it lives
as long as the namespace's data. A process remembers the token it saw (``Sentinel.check``, at start); when
a consumer later finds its group gone (NOGROUP), it checks again: the token missing or different means
the data went with it. The first process to find a given loss writes a new token and records that it saw
the old one go (``previous``), so one loss is named once (``LOST_HERE``) however many workers notice it;
the others learn ``LOST``. A group destroyed by hand leaves the token in place (``SAME``).
"""

from __future__ import annotations

import enum
import uuid
from typing import Final

import redis.asyncio as aioredis

from pipeline.transport.keys import Keys

# KEYS[1]: the sentinel hash. ARGV[1]: the token this process saw ('' before it saw any), ARGV[2]: a new token.
# Returns {state, token now}: 0 same (or first sight), 1 lost and named elsewhere, 2 lost and named by this call.
_CHECK: Final = """
local cur = redis.call('HGET', KEYS[1], 'token')
if not cur then
  redis.call('HSET', KEYS[1], 'token', ARGV[2], 'previous', ARGV[1])
  if ARGV[1] == '' then return {0, ARGV[2]} end
  return {2, ARGV[2]}
end
if ARGV[1] == '' or cur == ARGV[1] then return {0, cur} end
if redis.call('HGET', KEYS[1], 'previous') == ARGV[1] then return {1, cur} end
redis.call('HSET', KEYS[1], 'previous', ARGV[1])
return {2, cur}
"""


class DataState(enum.Enum):
    SAME = "same"  # the namespace's data is the data this process started with
    LOST = "lost"  # it was lost since; another process named it
    LOST_HERE = "lost_here"  # it was lost since, and this check is the first to notice: name it


class Sentinel:
    """This process's view of one namespace's sentinel."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis, self.keys = redis, keys
        self.token = ""
        self._script = redis.register_script(_CHECK)

    async def check(self) -> DataState:
        """Compare the sentinel with the token seen before (the first call only remembers it)."""
        state, token = await self._script(keys=[self.keys.sentinel], args=[self.token, uuid.uuid4().hex])
        self.token = token.decode() if isinstance(token, bytes) else str(token)
        return (DataState.SAME, DataState.LOST, DataState.LOST_HERE)[int(state)]
