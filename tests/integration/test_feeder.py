"""Feeder and learner client against a real redis-server."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis

from pipeline.learner.client import AsyncLearner, Learner
from pipeline.stages.batching import BatchingConfig
from pipeline.stages.feeder import Feeder
from pipeline.stages.kl_control import AdaptiveKL, ConstantKL, load_controller
from pipeline.transport.claimcheck import decode_header
from pipeline.transport.consumer import StreamConsumer
from pipeline.transport.keys import Keys
from pipeline.transport.producer import StreamProducer
from schemas import BatchManifest, DistillStatus, ScoredGroup, decode, encode
from schemas.build import synthetic_rollout, synthetic_scored
from tests.streams import fast, make_idle

pytestmark = pytest.mark.redis


async def push_scored(r: aioredis.Redis, keys: Keys, n: int, *, version: int = 0, lens: int = 16) -> list[str]:
    prod = StreamProducer(r, keys, "scored", fast())
    ids = []
    for i in range(n):
        g = synthetic_rollout(2, lens, group_id=f"g{i:03d}", policy_version=version, seed=i)
        await prod.send(synthetic_scored(g, k=4, seed=i))
        ids.append(g.group_id)
    return ids


def manifests(entries: list[tuple[bytes, dict[bytes, bytes]]]) -> list[BatchManifest]:
    out = [decode(f[b"d"]) for _, f in entries]
    assert all(isinstance(m, BatchManifest) for m in out)
    return out  # type: ignore[return-value]


async def payload_keys(r: aioredis.Redis, keys: Keys) -> list[bytes]:
    return sorted(await r.keys(f"{{{keys.namespace}:scored}}:payload:*"))


async def test_feeder_batches_oldest_first_within_budget(r: aioredis.Redis, keys: Keys) -> None:
    ids = await push_scored(r, keys, 10)  # 32 tokens per group
    assert len(await payload_keys(r, keys)) == 10  # claim check: entry = header + key of the payload
    feeder = Feeder(r, keys, BatchingConfig(max_batch_tokens=100, max_wait_s=3600), ConstantKL(0.1), fast())
    await asyncio.wait_for(feeder.run(asyncio.Event(), burst=True), 20)
    batches = manifests(await r.xrange(keys.stream("batches")))
    order = [ref.group_id for b in batches for ref in b.refs]
    assert order == ids  # oldest first, every group once
    assert all(b.stats is not None and b.stats["tokens"] <= 100 for b in batches)
    assert [len(b.refs) for b in batches] == [3, 3, 3, 1]
    assert await r.xlen(keys.stream("scored")) == 0
    assert len(await payload_keys(r, keys)) == 10  # the feeder passed the payloads on untouched
    learner = AsyncLearner(redis=r, namespace=keys.namespace, settings=fast())
    got = [b async for b in learner.batches(timeout_s=0.5)]
    assert [g for b in got for g in b.group_ids] == ids
    for b in got:
        assert [len(a.numpy()) for a in b.batch.advantages] == [s.length for g in b.batch.groups
                                                               for s in g.group.sequences]
        await learner.ack(b)
    assert await payload_keys(r, keys) == []  # acked batches take their groups' payloads with them


async def test_stale_groups_are_dropped_and_counted(r: aioredis.Redis, keys: Keys) -> None:
    await r.set(keys.policy_version, 10)
    await push_scored(r, keys, 3, version=5)  # 5 versions behind
    fresh = StreamProducer(r, keys, "scored", fast())
    await fresh.send(synthetic_scored(synthetic_rollout(2, 16, group_id="fresh", policy_version=9), k=4))
    feeder = Feeder(r, keys, BatchingConfig(max_staleness=2, max_wait_s=0), ConstantKL(0.1), fast())
    stats = await asyncio.wait_for(feeder.run(asyncio.Event(), burst=True), 20)
    assert stats.outcomes["stale"] == 3 and stats.outcomes["batched"] == 1
    learner = AsyncLearner(redis=r, namespace=keys.namespace, settings=fast())
    b = await learner.next_batch(timeout_s=2)
    assert b is not None and b.group_ids == ["fresh"]


async def test_learner_redelivery_after_crash_before_ack(r: aioredis.Redis, keys: Keys) -> None:
    await push_scored(r, keys, 4)
    feeder = Feeder(r, keys, BatchingConfig(max_batch_groups=1, max_wait_s=0), ConstantKL(0.1), fast())
    await asyncio.wait_for(feeder.run(asyncio.Event(), burst=True), 20)
    crashed = AsyncLearner(redis=r, namespace=keys.namespace, settings=fast())
    first = await crashed.next_batch(timeout_s=2)
    second = await crashed.next_batch(timeout_s=2)
    assert first and second
    await crashed.ack(first)  # the learner dies after one optimiser step
    await crashed.aclose()  # (its name is free: a killed one's expires with its heartbeat)
    restarted = AsyncLearner(redis=r, namespace=keys.namespace, settings=fast())
    again = await restarted.next_batch(timeout_s=2)
    assert again is not None and again.entry_id == second.entry_id and again.redelivered
    await restarted.ack(again)
    rest = [b async for b in restarted.batches(timeout_s=0.5)]
    seen = first.group_ids + again.group_ids + [g for b in rest for g in b.group_ids]
    assert sorted(seen) == ["g000", "g001", "g002", "g003"]


def test_sync_learner_and_policy_version(redis_url: str, keys: Keys) -> None:
    async def prepare() -> None:
        from pipeline.config import RedisSettings
        from pipeline.transport.connection import connect

        r = connect(RedisSettings(redis_url=redis_url))
        await push_scored(r, keys, 2)
        await Feeder(r, keys, BatchingConfig(max_wait_s=0), ConstantKL(0.1), fast()).run(asyncio.Event(), burst=True)
        await r.aclose()

    asyncio.run(prepare())
    with Learner(redis_url, namespace=keys.namespace, settings=fast()) as learner:
        got = list(learner.batches(timeout_s=0.5))
        assert sum(len(b.group_ids) for b in got) == 2
        seq = next(got[0].sequences())
        assert seq["tokens"] is not None and seq["advantages"] is not None
        assert seq["tokens"].shape == seq["advantages"].shape
        for b in got:
            learner.ack(b)
        learner.publish_policy_version(7)
        assert learner.policy_version() == 7


async def test_kl_controller_state_persists_across_restart(r: aioredis.Redis, keys: Keys) -> None:
    await push_scored(r, keys, 4)
    ctl = AdaptiveKL(init_coef=0.2, target=0.01, horizon=10)
    f1 = Feeder(r, keys, BatchingConfig(max_batch_groups=1, max_wait_s=0), ctl, fast())
    await asyncio.wait_for(f1.run(asyncio.Event(), burst=True, max_batches=2), 20)
    stored = load_controller(await r.get(keys.kl_state))
    assert stored.value != pytest.approx(0.2)  # it adapted
    f2 = Feeder(r, keys, BatchingConfig(max_batch_groups=1, max_wait_s=0),
                AdaptiveKL(init_coef=0.2, target=0.01, horizon=10), fast())
    await f2.restore_controller()
    assert f2.controller.value == pytest.approx(stored.value)
    await asyncio.wait_for(f2.run(asyncio.Event(), burst=True), 20)
    coefs = [m.kl_coef for m in manifests(await r.xrange(keys.stream("batches")))]
    assert coefs[2] == pytest.approx(stored.value)  # the restarted feeder continued from the stored state


async def test_restarted_feeder_never_batches_a_group_twice(r: aioredis.Redis, keys: Keys) -> None:
    """A feeder wrote a batch and died before acking its inputs: the next one must not re-send them."""
    await push_scored(r, keys, 3)
    s = fast()
    f1 = Feeder(r, keys, BatchingConfig(max_batch_groups=2, max_wait_s=0), ConstantKL(0.1), s, consumer_name="f1")
    await f1.consumer.ensure_group()
    got = await f1.consumer.read(3)
    from pipeline.stages.batching import Pending, build_batch

    assert all(d.payload == b"" and d.header is not None for d in got)  # the feeder reads headers only
    items = [Pending(d.entry_id, decode_header(d.header or b""), d.payload_key or "") for d in got[:2]]
    await f1.producer.send(build_batch(items, 0.1, 0, f1.cfg).batch)  # ... crash before XACK
    assert await make_idle(f1.consumer) == 3
    f2 = Feeder(r, keys, BatchingConfig(max_batch_groups=2, max_wait_s=0), ConstantKL(0.1), s, consumer_name="f2")
    stats = await asyncio.wait_for(f2.run(asyncio.Event(), burst=True), 20)
    groups = [ref.group_id for m in manifests(await r.xrange(keys.stream("batches"))) for ref in m.refs]
    assert sorted(groups) == ["g000", "g001", "g002"]  # each exactly once
    assert stats.outcomes["already_batched"] == 2
    learner = AsyncLearner(redis=r, namespace=keys.namespace, settings=fast())
    trained = []
    async for b in learner.batches(timeout_s=0.5):
        trained += [g.group_id for g in b.batch.groups]
        await learner.ack(b)
    assert sorted(trained) == ["g000", "g001", "g002"] and await payload_keys(r, keys) == []


async def test_feeder_dead_letters_garbage_and_keeps_dropped_groups(r: aioredis.Redis, keys: Keys) -> None:
    await r.xadd(keys.stream("scored"), {b"t": b"scored", b"gid": b"junk", b"d": b"\xc1garbage"})
    g = synthetic_rollout(2, 16, group_id="dropped")
    await StreamProducer(r, keys, "scored", fast()).send(
        ScoredGroup(group=g, status=DistillStatus.DROPPED, reason="teacher_error: boom"))
    await r.xadd(keys.stream("scored"), {b"t": b"scored", b"gid": b"wrongtype", b"d": encode(g)})
    stats = await asyncio.wait_for(
        Feeder(r, keys, BatchingConfig(max_wait_s=0), ConstantKL(0.1), fast()).run(asyncio.Event(), burst=True), 20)
    assert stats.outcomes["dead_letter"] == 2 and stats.outcomes["batched"] == 1
    reasons = [f[b"reason"].decode() for _, f in await r.xrange(keys.dlq)]
    assert all(x.startswith("decode_error") for x in reasons)


async def test_a_scored_entry_without_a_header_is_dead_lettered_with_its_bytes(
    r: aioredis.Redis, keys: Keys
) -> None:
    """Only claim-checked entries are batched: one carrying its payload inline goes to the DLQ whole (replayable),
    and the claim-checked groups beside it reach the learner."""
    g = synthetic_scored(synthetic_rollout(2, 16, group_id="inline", seed=3), k=4, seed=3)
    await r.xadd(keys.stream("scored"), {b"t": b"scored", b"gid": b"inline", b"d": encode(g)})
    await push_scored(r, keys, 1)
    stats = await asyncio.wait_for(
        Feeder(r, keys, BatchingConfig(max_wait_s=0), ConstantKL(0.1), fast()).run(asyncio.Event(), burst=True), 20)
    assert stats.outcomes["batched"] == 1 and stats.outcomes["dead_letter"] == 1
    (_, letter), = await r.xrange(keys.dlq)
    assert letter[b"stage"] == b"feeder" and letter[b"reason"].startswith(b"decode_error: h: missing")
    assert letter[b"orig_gid"] == b"inline" and letter[b"orig_d"] == encode(g)
    learner = AsyncLearner(redis=r, namespace=keys.namespace, settings=fast())
    got = [b async for b in learner.batches(timeout_s=0.5)]
    assert [x.group_id for b in got for x in b.batch.groups] == ["g000"]
    for b in got:
        await learner.ack(b)
    assert await payload_keys(r, keys) == []


async def test_bad_header_and_bad_payload_are_dead_lettered_with_their_bytes(r: aioredis.Redis, keys: Keys) -> None:
    """A corrupt header stops at the feeder; a corrupt payload behind a good header stops at the learner,
    which trains on the rest of the batch. Both dead letters keep the payload bytes."""
    await push_scored(r, keys, 3)
    rows = await r.xrange(keys.stream("scored"))
    (_, f0), (_, f1) = rows[0], rows[1]
    await r.xadd(keys.stream("scored"), {**f0, b"h": b"\xc1not a header"})  # g000 again, header broken
    await r.xdel(keys.stream("scored"), rows[0][0])
    await r.set(f1[b"p"], b"\x93garbage payload")  # g001's payload corrupted in Redis
    stats = await asyncio.wait_for(
        Feeder(r, keys, BatchingConfig(max_wait_s=3600), ConstantKL(0.1), fast()).run(asyncio.Event(), burst=True),
        20)
    assert stats.outcomes["dead_letter"] == 1 and stats.outcomes["batched"] == 2
    learner = AsyncLearner(redis=r, namespace=keys.namespace, settings=fast())
    b = await learner.next_batch(timeout_s=2)
    assert b is not None and b.group_ids == ["g002"]
    await learner.ack(b)
    dlq = {f[b"orig_gid"].decode(): f for _, f in await r.xrange(keys.dlq)}
    assert dlq["g000"][b"stage"] == b"feeder" and dlq["g000"][b"reason"].startswith(b"decode_error: h")
    assert decode(dlq["g000"][b"orig_d"], expect=ScoredGroup).group_id == "g000"  # the payload went with it
    assert dlq["g001"][b"stage"] == b"learner" and dlq["g001"][b"orig_d"] == b"\x93garbage payload"
    assert await payload_keys(r, keys) == []


async def test_prefetched_batch_is_not_lost_when_the_learner_closes(r: aioredis.Redis, keys: Keys) -> None:
    """The client reads the next batch while the caller trains: closing it then must leave that batch
    pending for the next learner under the same name, never lose it."""
    await push_scored(r, keys, 3)
    feeder = Feeder(r, keys, BatchingConfig(max_batch_groups=1, max_wait_s=0), ConstantKL(0.1), fast())
    await asyncio.wait_for(feeder.run(asyncio.Event(), burst=True), 20)
    first = AsyncLearner(redis=r, namespace=keys.namespace, settings=fast())
    one = await first.next_batch(timeout_s=2)
    assert one is not None
    await first.ack(one)

    async def prefetched() -> bool:
        return int((await r.xpending(keys.stream("batches"), "learner"))["pending"]) == 1

    for _ in range(100):  # the background read of the second batch
        if await prefetched():
            break
        await asyncio.sleep(0.02)
    assert await prefetched()
    await first.aclose()  # the caller never saw the prefetched batch
    second = AsyncLearner(redis=r, namespace=keys.namespace, settings=fast(), prefetch=False)
    got = [b async for b in second.batches(timeout_s=0.5)]
    assert [b.redelivered for b in got] == [True, False]  # the prefetched one first, then the last
    assert sorted(one.group_ids + [g for b in got for g in b.group_ids]) == ["g000", "g001", "g002"]
    for b in got:
        await second.ack(b)
    assert await payload_keys(r, keys) == []


def test_sync_learner_raises_the_clients_errors_and_closes(redis_url: str, keys: Keys) -> None:
    """The sync client runs its loop in a thread: errors come back to the caller, close stops the thread."""
    learner = Learner(redis_url, namespace=keys.namespace, settings=fast())
    assert learner.next_batch(timeout_s=0.1) is None
    thread = learner._thread
    with pytest.raises(ValueError):
        learner.publish_policy_version("not a number")  # type: ignore[arg-type]
    learner.close()
    assert not thread.is_alive()


async def test_missing_payloads_are_dead_lettered_never_handed_out(r: aioredis.Redis, keys: Keys) -> None:
    """A payload key deleted behind the pipeline's back: a resolving reader dead-letters the entry
    (``payload_missing``); the learner dead-letters that group and trains on the rest of the batch."""
    await push_scored(r, keys, 4)
    rows = await r.xrange(keys.stream("scored"))
    await r.delete(rows[0][1][b"p"])  # g000: gone before anyone read it
    reader = StreamConsumer(r, keys, "scored", "tool", fast(), group="tools")
    await reader.ensure_group()
    got = await reader.read(10)
    assert [d.group_id for d in got] == ["g001", "g002", "g003"] and all(d.payload for d in got)
    reader.release(got)
    stats = await asyncio.wait_for(
        Feeder(r, keys, BatchingConfig(max_wait_s=3600), ConstantKL(0.1), fast()).run(asyncio.Event(), burst=True),
        20)
    assert stats.outcomes["batched"] == 3  # g000 left the stream as a dead letter; the feeder reads headers only
    await r.delete(rows[1][1][b"p"])  # g001: gone after batching
    learner = AsyncLearner(redis=r, namespace=keys.namespace, settings=fast())
    b = await learner.next_batch(timeout_s=2)
    assert b is not None and b.group_ids == ["g002", "g003"]
    await learner.ack(b)
    letters = {f[b"orig_gid"].decode(): f for _, f in await r.xrange(keys.dlq)}
    assert set(letters) == {"g000", "g001"}
    assert letters["g000"][b"stage"] == b"tools" and letters["g000"][b"reason"].startswith(b"payload_missing")
    assert letters["g001"][b"stage"] == b"learner" and letters["g001"][b"reason"].startswith(b"payload_missing")
    assert await payload_keys(r, keys) == []


async def roll_back(r: aioredis.Redis, keys: Keys, group_id: str) -> None:
    """What Redis restarted from an AOF that lacks the teacher's write of ``group_id`` looks like: no
    scored entry, no pending entry, no payload key, no dedupe marker (the rollouts entry it came from is
    pending again)."""
    rows = {f[b"gid"].decode(): (eid, f) for eid, f in await r.xrange(keys.stream("scored"))}
    eid, fields = rows[group_id]
    await r.xack(keys.stream("scored"), keys.consumer_group("scored"), eid)
    await r.xdel(keys.stream("scored"), eid)
    await r.delete(fields[b"p"], keys.seen("scored", group_id))


async def learn_all(r: aioredis.Redis, keys: Keys) -> list[str]:
    learner = AsyncLearner(redis=r, namespace=keys.namespace, settings=fast())
    trained = []
    async for b in learner.batches(timeout_s=0.5):
        trained += [g.group_id for g in b.batch.groups]
        await learner.ack(b)
    return trained


async def rescore(r: aioredis.Redis, keys: Keys, group_id: str, seed: int) -> None:
    """The teacher writes the group again from its rollout, which the rollback left pending."""
    g = synthetic_rollout(2, 16, group_id=group_id, seed=seed)
    await StreamProducer(r, keys, "scored", fast()).send(synthetic_scored(g, k=4, seed=seed))


async def test_entries_rolled_back_by_a_redis_restart_are_not_batched(r: aioredis.Redis, keys: Keys) -> None:
    """The feeder holds three headers; Redis comes back from an AOF without g001's write. Batching g001
    would hand the learner a key that does not exist and, through the batch dedupe, refuse the copy the
    teacher writes again: g001 would never train. It is left out and the copy goes through."""
    await push_scored(r, keys, 3)
    feeder = Feeder(r, keys, BatchingConfig(max_wait_s=3600), ConstantKL(0.1), fast())
    await feeder.consumer.ensure_group()
    for d in await feeder.consumer.read(10):
        await feeder._admit(d)
    assert [p.group_id for p in feeder.state.buffer] == ["g000", "g001", "g002"]
    await roll_back(r, keys, "g001")
    items, feeder.state.buffer = feeder.state.buffer, []
    assert await feeder._write(items, asyncio.Event())
    batches = manifests(await r.xrange(keys.stream("batches")))
    assert [[ref.group_id for ref in m.refs] for m in batches] == [["g000", "g002"]]
    assert feeder.state.stats.outcomes["entry_gone"] == 1 and feeder.consumer.owned == set()
    await rescore(r, keys, "g001", seed=1)
    await asyncio.wait_for(feeder.run(asyncio.Event(), burst=True), 20)
    assert sorted(await learn_all(r, keys)) == ["g000", "g001", "g002"]
    assert await r.xlen(keys.dlq) == 0 and await payload_keys(r, keys) == []


async def test_rollback_during_the_batch_write_lets_the_copy_through(r: aioredis.Redis, keys: Keys) -> None:
    """Redis rolls back while the batch is being written (the producer's retry lands on the restarted
    server): g001 is in the batch but its entry and key are gone. The feeder sees its ack miss, clears
    g001's batch dedupe marker, and the teacher's copy reaches the learner; the dangling reference is
    dead-lettered as payload_missing, never handed out."""
    await push_scored(r, keys, 3)
    feeder = Feeder(r, keys, BatchingConfig(max_wait_s=3600), ConstantKL(0.1), fast())
    await feeder.consumer.ensure_group()
    for d in await feeder.consumer.read(10):
        await feeder._admit(d)
    send = feeder.producer.send

    async def send_then_roll_back(*args: Any, **kwargs: Any) -> Any:
        added = await send(*args, **kwargs)
        await roll_back(r, keys, "g001")
        return added

    feeder.producer.send = send_then_roll_back  # type: ignore[method-assign]
    items, feeder.state.buffer = feeder.state.buffer, []
    assert await feeder._write(items, asyncio.Event())
    feeder.producer.send = send  # type: ignore[method-assign]
    assert feeder.state.stats.outcomes["entry_gone_after_batching"] == 1
    assert await r.exists(keys.seen("batches", "g001")) == 0 and await r.exists(keys.seen("batches", "g000")) == 1
    await rescore(r, keys, "g001", seed=1)
    await asyncio.wait_for(feeder.run(asyncio.Event(), burst=True), 20)
    assert sorted(await learn_all(r, keys)) == ["g000", "g001", "g002"]
    letters = [f for _, f in await r.xrange(keys.dlq)]
    assert [(f[b"orig_gid"], f[b"reason"][:15]) for f in letters] == [(b"g001", b"payload_missing")]
    assert await payload_keys(r, keys) == []
