"""A consumer whose group is gone (NOGROUP) creates it again and names what happened; the namespace sentinel
tells a loss of Redis's data from a group destroyed by hand (``pipeline.transport.resets``)."""

from __future__ import annotations

import redis.asyncio as aioredis

from pipeline.transport import incidents
from pipeline.transport.consumer import StreamConsumer
from pipeline.transport.keys import Keys
from pipeline.transport.producer import StreamProducer
from pipeline.transport.resets import DataState, Sentinel
from schemas.build import synthetic_rollout


async def test_the_sentinel_names_one_loss_once(r: aioredis.Redis, keys: Keys) -> None:
    a, b, fresh = Sentinel(r, keys), Sentinel(r, keys), Sentinel(r, keys)
    assert await a.check() is DataState.SAME and await b.check() is DataState.SAME  # first sight: remembered
    assert a.token == b.token and await a.check() is DataState.SAME
    await r.delete(keys.sentinel)  # the namespace's data is gone
    assert await fresh.check() is DataState.SAME  # a process started after the loss knows nothing of it
    assert await a.check() is DataState.LOST_HERE  # the first that knew the old token names it...
    assert await b.check() is DataState.LOST  # ...the others learn it was named
    assert a.token == b.token == fresh.token
    assert await a.check() is DataState.SAME and await b.check() is DataState.SAME


async def test_a_destroyed_group_is_created_again_by_the_next_read(r: aioredis.Redis, keys: Keys) -> None:
    prod = StreamProducer(r, keys, "rollouts")
    c = StreamConsumer(r, keys, "rollouts", "c1")
    await c.ensure_group()
    await prod.send(synthetic_rollout(2, 5, group_id="g1"))
    (held,) = await c.read(1, block_ms=10)
    assert await r.xgroup_destroy(c.key, c.group) == 1
    await c.touch()  # a lease renewal meanwhile: no error
    assert await c.pending_count() == 0
    assert await c.read(10, block_ms=10) == []  # this read recreates the group...
    again = await c.read(10, block_ms=10)  # ...which reads the stream from its start
    assert [d.group_id for d in again] == ["g1"] and again[0].entry_id == held.entry_id
    (inc,) = await incidents.recent(r, keys)
    assert inc.kind == "group_destroyed" and inc.writer == "c1"
    assert inc.text == (f"consumer group teacher of stream {c.key} was gone (destroyed by hand?): created again, "
                        "its unacknowledged entries are read again from the start")


async def test_entries_held_when_the_stream_went_are_named_and_none_is_pending(
    r: aioredis.Redis, keys: Keys
) -> None:
    prod = StreamProducer(r, keys, "rollouts")
    c = StreamConsumer(r, keys, "rollouts", "c1")
    await c.ensure_group()
    for i in range(5):
        await prod.send(synthetic_rollout(2, 5, group_id=f"g{i}", seed=i))
    held = await c.read(3, block_ms=10)
    assert len(held) == 3
    await c.touch()  # a lease renewal sees the stream's length: 3 pending here, 2 waiting
    await r.delete(c.key, keys.sentinel)  # the stream and the namespace's sentinel gone, as in a restart empty
    assert await c.still_pending(held) == []  # gone: none of them is pending any more, and no error
    named = await incidents.recent(r, keys)
    assert sorted(i.kind for i in named) == ["redis_data_lost", "stream_reset"]
    reset = next(i for i in named if i.kind == "stream_reset")
    assert reset.text == (f"stream {c.key} was reset: 3 entries pending at c1 are gone, and the stream held 5 "
                          "entries (waiting or pending) when last seen 0 s before")
    assert reset.fields["entries"] == 3 and reset.fields["stream_entries"] == 5
    assert await r.exists(c.key) == 1 and c.owned == set()  # the group is back (MKSTREAM), nothing owned
