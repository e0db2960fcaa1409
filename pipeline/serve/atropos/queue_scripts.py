"""The Redis scripts of the Atropos-compatible server's queue (``queue``): each moves groups onto or
off the queue and keeps the running counts (``{ns:atropos}:counts``) in the same step, so the counts
always match the queue."""

from __future__ import annotations

from typing import Final

# KEYS: seen marker, discard set, inflight hash, inflight_at zset, queue, env marker, counts; ARGV: group id,
# ttl ms, payload key, sequences, queue entry fields... -> 1 queued, 2 discarded (posted before a reset), or
# the marker's payload key (seen). The env id comes from the group's env marker (the in-flight record's
# for a group posted before markers existed).
ENQUEUE: Final = """
if redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1 then
  redis.call('SREM', KEYS[2], ARGV[1])
  redis.call('DEL', KEYS[6])
  return 2
end
local prev = redis.call('GET', KEYS[1])
if prev then return prev end
redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[2])
local env = redis.call('GET', KEYS[6])
if not env then env = string.match(redis.call('HGET', KEYS[3], ARGV[1]) or '', '^([^|]*)') end
redis.call('DEL', KEYS[6])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
redis.call('XADD', KEYS[5], '*', 'env', env, unpack(ARGV, 5))
redis.call('HINCRBY', KEYS[7], env .. '|' .. ARGV[4], 1)
return 1
"""

# Shared by the scripts that take groups off the queue: an entry id is a queue entry, or ``f:<id>`` for a
# group put back in front of it (``front`` hash). ``_where`` returns its ``env|sequences`` or nil (gone).
_LIB: Final = """
local function _where(queue, front, id)
  if string.sub(id, 1, 2) == 'f:' then
    local v = redis.call('HGET', front, string.sub(id, 3))
    if not v then return nil end
    local r = cjson.decode(v)
    return r[4] .. '|' .. r[3]
  end
  local e = redis.call('XRANGE', queue, id, id)
  if #e == 0 then return nil end
  local f, env, n = e[1][2], '', '0'
  for j = 1, #f, 2 do
    if f[j] == 'env' then env = f[j + 1] elseif f[j] == 'n' then n = f[j + 1] end
  end
  return env .. '|' .. n
end
local function _take(queue, front, counts, id, where)
  if string.sub(id, 1, 2) == 'f:' then redis.call('HDEL', front, string.sub(id, 3))
  else redis.call('XDEL', queue, id) end
  if redis.call('HINCRBY', counts, where, -1) <= 0 then redis.call('HDEL', counts, where) end
end
"""

# KEYS: queue, trainer, leases, lease deadlines, front, counts; ARGV: n, entry ids..., lease record or '',
# deadline ms, batch id. Takes the entries off and advances the step, or returns -1 (changing nothing) if any
# entry is gone.
COMMIT: Final = _LIB + """
local n = tonumber(ARGV[1])
local where = {}
for i = 2, n + 1 do
  where[i] = _where(KEYS[1], KEYS[5], ARGV[i])
  if not where[i] then return -1 end
end
for i = 2, n + 1 do _take(KEYS[1], KEYS[5], KEYS[6], ARGV[i], where[i]) end
local step = redis.call('HINCRBY', KEYS[2], 'step', 1)
if ARGV[n + 2] ~= '' then
  redis.call('HSET', KEYS[3], ARGV[n + 4], ARGV[n + 2])
  redis.call('ZADD', KEYS[4], ARGV[n + 3], ARGV[n + 4])
end
return step
"""

# KEYS: queue, front, counts; ARGV: entry id. Takes one entry off (1), or 0 if it is not queued.
REMOVE: Final = _LIB + """
local where = _where(KEYS[1], KEYS[2], ARGV[1])
if not where then return 0 end
_take(KEYS[1], KEYS[2], KEYS[3], ARGV[1], where)
return 1
"""

# KEYS: counts, queue, front. Counts every queued group once, when ``counts`` is missing (a queue written
# before it existed); a no-op otherwise.
RECOUNT: Final = _LIB + """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local n = 0
for _, e in ipairs(redis.call('XRANGE', KEYS[2], '-', '+')) do
  redis.call('HINCRBY', KEYS[1], _where(KEYS[2], KEYS[3], e[1]), 1)
  n = n + 1
end
for _, v in ipairs(redis.call('HVALS', KEYS[3])) do
  local r = cjson.decode(v)
  redis.call('HINCRBY', KEYS[1], r[4] .. '|' .. r[3], 1)
  n = n + 1
end
return n
"""
