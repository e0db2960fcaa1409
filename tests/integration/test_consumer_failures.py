"""A Redis error in the middle of a read never strands an entry: what the read took is released, so a
later reclaim hands it out (an entry left in ``owned`` has its lease renewed and is skipped by reclaim).

Found by tests/reliability/test_redis_crash.py: after a Redis process crash, one scored entry stayed
pending to the feeder for good (the feeder's version read failed right after its XREADGROUP)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from pipeline.stages.batching import BatchingConfig
from pipeline.stages.feeder import Feeder
from pipeline.stages.kl_control import ConstantKL
from pipeline.transport.consumer import StreamConsumer
from pipeline.transport.keys import Keys
from pipeline.transport.producer import StreamProducer
from pipeline.transport.sharding import ShardedConsumer
from schemas.build import synthetic_rollout, synthetic_scored
from tests.streams import fast, leaping_clock, make_idle

pytestmark = pytest.mark.redis


def fail_once(obj: Any, name: str, *, first_arg: Any = None) -> list[int]:
    """Make ``obj.name`` raise a connection error on its next call (with ``first_arg``, if given) only;
    returns a counter of those calls."""
    real, calls = getattr(obj, name), [0]

    async def flaky(*args: Any, **kwargs: Any) -> Any:
        if first_arg is None or (args and args[0] == first_arg):
            calls[0] += 1
            if calls[0] == 1:
                raise RedisConnectionError("Connection closed by server.")
        return await real(*args, **kwargs)

    setattr(obj, name, flaky)
    return calls


async def test_reclaimed_entries_are_released_when_the_read_after_them_fails(r: aioredis.Redis, keys: Keys) -> None:
    stream = keys.stream("rollouts")
    crashed = StreamConsumer(r, keys, "rollouts", "crashed", fast())
    await crashed.ensure_group()
    await r.xadd(stream, {b"t": b"rollout", b"gid": b"g0", b"d": b"x"})
    [held] = await crashed.read(1)  # pending to a consumer that then dies
    assert await make_idle(crashed) == 1  # idle past claim_idle_ms
    c = StreamConsumer(r, keys, "rollouts", "c", fast(), clock=leaping_clock())
    c._own_cursor = None  # a fresh name: nothing of its own to re-read
    fail_once(r, "xreadgroup")  # the reclaim succeeds, the XREADGROUP after it fails
    with pytest.raises(RedisConnectionError):
        await c.read(4)
    assert c.owned == set()
    assert await make_idle(c) == 1  # the reclaimed entry, released: pending to c, idle again
    again = await c.read(4)
    assert [d.entry_id for d in again] == [held.entry_id] and again[0].reclaimed


async def test_a_failing_shard_releases_what_the_others_gave(r: aioredis.Redis, keys: Keys) -> None:
    c = ShardedConsumer(r, keys, "rollouts", "c", fast(), shards=[0, 1], total=2)
    for part in c.parts.values():
        part._clock = leaping_clock()  # every read reclaims
    await c.ensure_group()
    for i in range(2):
        await r.xadd(keys.stream("rollouts", i, 2), {b"t": b"rollout", b"gid": f"g{i}".encode(), b"d": b"x"})
    c._next = 0
    fail_once(c.parts[1], "read")
    with pytest.raises(RedisConnectionError):
        await c.read(4)
    assert c.owned == set()
    assert await make_idle(c) == 1  # what shard 0 gave, released: pending, idle past claim_idle_ms
    got = await c.read(4)
    assert sorted(d.group_id for d in got) == ["g0", "g1"]


async def test_feeder_batches_what_it_read_when_the_version_read_fails(r: aioredis.Redis, keys: Keys) -> None:
    prod = StreamProducer(r, keys, "scored", fast())
    for i in range(3):
        await prod.send(synthetic_scored(synthetic_rollout(2, 16, group_id=f"g{i}", seed=i), k=4, seed=i))
    feeder = Feeder(r, keys, BatchingConfig(max_wait_s=0), ConstantKL(0.1), fast(claim_idle_ms=60_000))
    # The policy version read right after the first XREADGROUP fails.
    calls = fail_once(feeder.redis, "get", first_arg=keys.policy_version)
    stats = await asyncio.wait_for(feeder.run(asyncio.Event(), burst=True), 20)
    assert calls[0] >= 2 and stats.outcomes["batched"] == 3
    assert feeder.consumer.owned == set() and await r.xlen(keys.stream("scored")) == 0
