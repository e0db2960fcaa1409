"""The producer's three write paths against a real redis-server: what each leaves in Redis, and its round trips."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from pipeline.transport.keys import Keys
from pipeline.transport.producer import RESERVE_MS, SMALL_MESSAGE_BYTES, WRITTEN, AddResult, StreamProducer
from schemas import DistillStatus, RolloutGroup, ScoredGroup, decode, encode
from schemas.build import synthetic_rollout, synthetic_scored
from tests.streams import fast

pytestmark = pytest.mark.redis


def big_scored(gid: str) -> ScoredGroup:
    """A scored group above SMALL_MESSAGE_BYTES: the claim-checked fast path."""
    g = synthetic_scored(synthetic_rollout(2, 600, group_id=gid, vocab=1000), 8)
    assert len(encode(g)) > SMALL_MESSAGE_BYTES
    return g


async def commands(r: aioredis.Redis) -> dict[str, int]:
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in (await r.info("commandstats")).items()}


async def payload_keys(r: aioredis.Redis, keys: Keys, gid: str) -> list[bytes]:
    return list(await r.keys(f"{keys.stream('scored')}:payload:{gid}:*"))


async def entry_fields(r: aioredis.Redis, keys: Keys) -> list[dict[bytes, bytes]]:
    return [f for _id, f in await r.xrange(keys.stream("scored"))]


async def test_claim_checked_write_is_one_round_trip_and_gives_the_payload_its_lifetime(
    r: aioredis.Redis, keys: Keys
) -> None:
    prod = StreamProducer(r, keys, "scored", fast())
    g = big_scored("cc")
    await prod.send(big_scored("warm-up"))  # scripts in Redis's cache (another test flushes it)
    await r.config_resetstat()  # our private server (conftest): no other client counts here
    added = await prod.send(g)
    calls = await commands(r)
    assert added.result is AddResult.ADDED
    # SET + EVALSHA pipelined; no reservation script, no MULTI, no marker round trip afterwards
    assert calls.get("evalsha") == 1 and "multi" not in calls and "exec" not in calls
    fields = (await entry_fields(r, keys))[1]
    (pkey,) = await payload_keys(r, keys, "cc")
    assert fields[b"p"] == pkey
    # the script gave it payload_ttl_s (7 days), not the reservation's 30 s: the learner's ack deletes it, and
    # an orphan (its batch deleted by hand) expires
    assert 7 * 86400 * 1000 - 60_000 < await r.pttl(pkey) <= 7 * 86400 * 1000
    assert decode(await r.get(pkey), expect=ScoredGroup).group_id == "cc"
    assert (await r.get(keys.seen("scored", "cc"))).decode() == added.entry_id
    assert await r.zcard(keys.reservations(keys.stream("scored"))) == 0


async def test_claim_checked_duplicate_keeps_the_first_payload_only(r: aioredis.Redis, keys: Keys) -> None:
    prod = StreamProducer(r, keys, "scored", fast())
    first, second = await prod.send(big_scored("dup")), await prod.send(big_scored("dup"))
    assert second.result is AddResult.DUPLICATE and second.entry_id == first.entry_id
    (pkey,) = await payload_keys(r, keys, "dup")  # the refused write's key was deleted by the script
    assert (await entry_fields(r, keys))[0][b"p"] == pkey


async def test_claim_checked_write_waits_at_the_cap_without_leaving_payloads(r: aioredis.Redis, keys: Keys) -> None:
    prod = StreamProducer(r, keys, "scored", fast(max_backlog=1))
    await prod.send(ScoredGroup(group=synthetic_rollout(1, 4, group_id="first"), status=DistillStatus.SKIPPED,
                                reason="r"))
    task = asyncio.create_task(prod.send(big_scored("waiting")))
    await asyncio.sleep(0.4)
    assert not task.done()  # the stream is at its cap: waiting, nothing trimmed
    assert await payload_keys(r, keys, "waiting") == []  # the refused fast attempt left no payload behind
    assert await r.xlen(keys.stream("scored")) == 1
    (eid, _), = await r.xrange(keys.stream("scored"))
    await r.xdel(keys.stream("scored"), eid)  # a consumer made room
    added = await asyncio.wait_for(task, 5)
    assert added.result is AddResult.ADDED
    (pkey,) = await payload_keys(r, keys, "waiting")  # written by the two-step path after the wait
    assert (await entry_fields(r, keys))[0][b"p"] == pkey and await r.pttl(pkey) > 86400_000
    assert await r.zcard(keys.reservations(keys.stream("scored"))) == 0


async def test_lost_reply_is_retried_without_a_second_entry_or_losing_the_payload(
    r: aioredis.Redis, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write ran but its reply was lost: the retry must find the marker, not write again, and must not
    delete the payload key the written entry references."""
    prod = StreamProducer(r, keys, "scored", fast())
    real = prod._add_claim_checked
    calls = 0

    async def reply_lost(*a: Any) -> list[Any]:
        nonlocal calls
        calls += 1
        out = await real(*a)
        if calls == 1:
            raise RedisConnectionError("reply lost")
        return out

    monkeypatch.setattr(prod, "_add_claim_checked", reply_lost)
    added = await prod.send(big_scored("lost"))
    assert calls == 2 and added.result is AddResult.DUPLICATE  # "it is in Redis", as the run loop reads it
    (eid, fields), = await r.xrange(keys.stream("scored"))
    assert added.entry_id == eid.decode()
    (pkey,) = await payload_keys(r, keys, "lost")  # the retry's own key was deleted, the first one kept
    assert fields[b"p"] == pkey and await r.pttl(pkey) > 86400_000
    assert decode(await r.get(pkey), expect=ScoredGroup).group_id == "lost"


async def test_a_payload_set_without_its_entry_expires(r: aioredis.Redis, keys: Keys,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer that dies between the SET and the script leaves a key with a TTL, never a permanent one."""
    prod = StreamProducer(r, keys, "scored", fast())
    monkeypatch.setattr(prod._add, "sha", "0" * 40)  # the script never runs: EVALSHA fails after the SET...
    real_load = r.script_load

    async def no_load(script: str) -> str:  # ...and the reload does not help either
        return str(await real_load("return nil"))

    monkeypatch.setattr(r, "script_load", no_load)
    with pytest.raises(Exception, match="No matching script"):
        await prod.send(big_scored("orphan"))
    orphans = await payload_keys(r, keys, "orphan")
    assert len(orphans) == 1 and await r.xlen(keys.stream("scored")) == 0  # no entry references it
    for k in orphans:
        assert 0 < await r.pttl(k) <= RESERVE_MS


async def test_flushed_script_cache_is_reloaded(r: aioredis.Redis, keys: Keys) -> None:
    prod = StreamProducer(r, keys, "scored", fast())
    await r.script_flush()  # as after a Redis restart
    assert (await prod.send(big_scored("flushed"))).result is AddResult.ADDED
    assert len(await payload_keys(r, keys, "flushed")) == 1


async def test_large_inline_write_marks_written_and_releases_its_reservation(r: aioredis.Redis, keys: Keys) -> None:
    prod = StreamProducer(r, keys, "rollouts", fast())
    g = synthetic_rollout(1, 9000, group_id="big")
    assert len(encode(g)) > SMALL_MESSAGE_BYTES
    await prod.send(synthetic_rollout(1, 9000, group_id="warm-up"))  # scripts in Redis's cache
    await r.config_resetstat()
    first = await prod.send(g)
    calls = await commands(r)
    assert first.result is AddResult.ADDED and calls.get("evalsha") == 1 and calls.get("exec") == 1
    assert calls.get("set", 0) == 2  # the reservation's marker in the script, the marker in the MULTI; no update
    assert (await r.get(keys.seen("rollouts", "big"))).decode() == WRITTEN
    assert await r.zcard(keys.reservations(keys.stream("rollouts"))) == 0
    second = await prod.send(g)
    assert second.result is AddResult.DUPLICATE and second.entry_id == WRITTEN
    (eid, fields) = (await r.xrange(keys.stream("rollouts")))[1]
    assert eid.decode() == first.entry_id
    assert decode(fields[b"d"], expect=RolloutGroup).group_id == "big"
