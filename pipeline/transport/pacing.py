"""Pacing: rollout workers sample no further ahead of the learner than ``max_ahead`` policy versions.

The rule (AReaL's bound on off-policyness): a prompt may start sampling only while

    started < (V + 1 + max_ahead) * groups_per_step

where ``V`` is the learner's newest policy version (``ns:policy_version``), ``groups_per_step`` the groups one
learner step trains (the feeder's ``--max-batch-groups``) and ``started`` the groups whose sampling began in the
namespace (``ns:pacing``, counted by the check itself, atomically). So group ``i`` starts at a version above
``i / groups_per_step - 1 - max_ahead``; trained in step ``i // groups_per_step``, in order, it is at most
``max_ahead`` versions stale, and sampling runs at most ``(1 + max_ahead) * groups_per_step`` groups ahead of
the learner. A prompt sampled again (its worker died, its sample failed) counts again: pacing errs on the slow
side. A learner that starts over below the version last seen (a new run in the same namespace) starts the count
afresh.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from pipeline.transport.keys import Keys

__all__ = ["Pace", "try_start"]

# KEYS[1] the pacing hash; ARGV: version, max_ahead, groups_per_step. Returns {allowed, started, bound}.
_START = """
local v = tonumber(ARGV[1])
local seen = tonumber(redis.call('HGET', KEYS[1], 'version') or '-1')
local started = tonumber(redis.call('HGET', KEYS[1], 'started') or '0')
if v < seen then started = 0 end
local bound = (v + 1 + tonumber(ARGV[2])) * tonumber(ARGV[3])
if started < bound then
  started = started + 1
  redis.call('HSET', KEYS[1], 'started', started, 'version', v)
  return {1, started, bound}
end
if v ~= seen then redis.call('HSET', KEYS[1], 'started', started, 'version', v) end
return {0, started, bound}
"""


@dataclass(frozen=True)
class Pace:
    """One check: whether a group may start now, the groups started, and the bound at the version read."""

    allowed: bool
    started: int
    bound: int
    version: int


async def try_start(redis: aioredis.Redis, keys: Keys, *, max_ahead: int, groups_per_step: int) -> Pace:
    """Count one group as started if the rule allows it now (see the module)."""
    raw = await redis.get(keys.policy_version)
    version = int(raw) if raw is not None else 0
    allowed, started, bound = await redis.register_script(_START)(
        keys=[keys.pacing], args=[version, max_ahead, groups_per_step])
    return Pace(bool(allowed), int(started), int(bound), version)
