"""Feeder and learner client against a real redis-server."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from pipeline.batching import BatchingConfig
from pipeline.config import StreamSettings
from pipeline.feeder import Feeder
from pipeline.keys import Keys
from pipeline.kl_control import AdaptiveKL, ConstantKL, load_controller
from pipeline.learner import AsyncLearner, Learner
from pipeline.producer import StreamProducer
from schemas import DistillStatus, ScoredGroup, TrainBatch, encode
from schemas.build import synthetic_rollout, synthetic_scored

pytestmark = pytest.mark.redis


def fast(**kw: object) -> StreamSettings:
    base: dict[str, object] = dict(block_ms=100, claim_idle_ms=300, claim_interval_ms=50, heartbeat_interval_s=0.2,
                                   shutdown_grace_s=1.0, backpressure_timeout_s=10.0)
    base.update(kw)
    return StreamSettings(**base)  # type: ignore[arg-type]


async def push_scored(r: aioredis.Redis, keys: Keys, n: int, *, version: int = 0, lens: int = 16) -> list[str]:
    prod = StreamProducer(r, keys, "scored", fast())
    ids = []
    for i in range(n):
        g = synthetic_rollout(2, lens, group_id=f"g{i:03d}", policy_version=version, seed=i)
        await prod.send(synthetic_scored(g, k=4, seed=i))
        ids.append(g.group_id)
    return ids


async def test_feeder_batches_oldest_first_within_budget(r: aioredis.Redis, keys: Keys) -> None:
    ids = await push_scored(r, keys, 10)  # 32 tokens per group
    feeder = Feeder(r, keys, BatchingConfig(max_batch_tokens=100, max_wait_s=3600), ConstantKL(0.1), fast())
    await asyncio.wait_for(feeder.run(asyncio.Event(), burst=True), 20)
    entries = await r.xrange(keys.stream("batches"))
    from schemas import decode

    batches = [decode(f[b"d"], expect=TrainBatch) for _, f in entries]
    order = [g.group_id for b in batches for g in b.groups]
    assert order == ids  # oldest first, every group once
    assert all(sum(g.group.num_tokens for g in b.groups) <= 100 for b in batches)
    assert [len(b.groups) for b in batches] == [3, 3, 3, 1]
    assert await r.xlen(keys.stream("scored")) == 0


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
        from pipeline.connection import connect

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
    from schemas import decode

    coefs = [decode(f[b"d"], expect=TrainBatch).kl_coef for _, f in await r.xrange(keys.stream("batches"))]
    assert coefs[2] == pytest.approx(stored.value)  # the restarted feeder continued from the stored state


async def test_restarted_feeder_never_batches_a_group_twice(r: aioredis.Redis, keys: Keys) -> None:
    """A feeder wrote a batch and died before acking its inputs: the next one must not re-send them."""
    await push_scored(r, keys, 3)
    s = fast()
    f1 = Feeder(r, keys, BatchingConfig(max_batch_groups=2, max_wait_s=0), ConstantKL(0.1), s, consumer_name="f1")
    await f1.consumer.ensure_group()
    got = await f1.consumer.read(3)
    from pipeline.batching import Pending, build_batch
    from schemas import decode

    items = [Pending(d.entry_id, decode(d.payload, expect=ScoredGroup)) for d in got[:2]]
    await f1.producer.send(build_batch(items, 0.1, 0, f1.cfg).batch)  # ... crash before XACK
    await asyncio.sleep(0.4)
    f2 = Feeder(r, keys, BatchingConfig(max_batch_groups=2, max_wait_s=0), ConstantKL(0.1), s, consumer_name="f2")
    stats = await asyncio.wait_for(f2.run(asyncio.Event(), burst=True), 20)
    groups = [g.group_id for _, f in await r.xrange(keys.stream("batches"))
              for g in decode(f[b"d"], expect=TrainBatch).groups]
    assert sorted(groups) == ["g000", "g001", "g002"]  # each exactly once
    assert stats.outcomes["already_batched"] == 2


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
