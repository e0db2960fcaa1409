"""Stream behaviour against a real redis-server (never fakeredis)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import msgspec
import pytest
import redis.asyncio as aioredis

from pipeline.stages.lifecycle import RunStats
from pipeline.stages.runloop import Ack, DeadLetter, Emit, Outcome, Retry, StageRunner
from pipeline.transport.claimcheck import decode_header
from pipeline.transport.consumer import StreamConsumer, resolve_payloads
from pipeline.transport.keys import Keys
from pipeline.transport.producer import AddResult, BackpressureTimeout, StreamProducer
from schemas import DistillStatus, RolloutGroup, ScoredGroup, decode
from schemas.build import synthetic_rollout
from tests.streams import fast, leaping_clock, make_idle

pytestmark = pytest.mark.redis


async def test_produce_consume_ack_deletes(r: aioredis.Redis, keys: Keys) -> None:
    prod = StreamProducer(r, keys, "rollouts", fast())
    cons = StreamConsumer(r, keys, "rollouts", "c1", fast())
    await cons.ensure_group()
    groups = [synthetic_rollout(2, 16, group_id=f"g{i}", seed=i) for i in range(5)]
    for g in groups:
        assert (await prod.send(g)).result is AddResult.ADDED
    got = await cons.read(10)
    assert [d.group_id for d in got] == [f"g{i}" for i in range(5)]
    decoded = [decode(d.payload, expect=RolloutGroup) for d in got]
    assert decoded[3].sequences[1].tokens.numpy().tolist() == groups[3].sequences[1].tokens.numpy().tolist()
    assert await cons.pending_count() == 5
    await cons.ack(got)
    assert await cons.pending_count() == 0
    assert await r.xlen(keys.stream("rollouts")) == 0  # acked entries are deleted


@pytest.mark.parametrize("tokens", [8, 9000], ids=["one_script", "reserve_then_multi"])
async def test_dedupe_by_group_id(r: aioredis.Redis, keys: Keys, tokens: int) -> None:
    prod = StreamProducer(r, keys, "scored", fast())
    g = ScoredGroup(group=synthetic_rollout(1, tokens, group_id="same"), status=DistillStatus.SKIPPED, reason="r")
    first = await prod.send(g)
    second = await prod.send(g)
    assert first.result is AddResult.ADDED and second.result is AddResult.DUPLICATE
    assert second.entry_id == first.entry_id
    assert await r.xlen(keys.stream("scored")) == 1
    assert len(await r.keys(f"{keys.stream('scored')}:payload:same:*")) == 1  # one payload, not two
    assert 0 < await r.pttl(keys.seen("scored", "same")) <= fast().dedupe_ttl_s * 1000


async def test_backpressure_waits_then_proceeds_and_never_trims(r: aioredis.Redis, keys: Keys) -> None:
    s = fast(max_backlog=3)
    prod = StreamProducer(r, keys, "rollouts", s)
    cons = StreamConsumer(r, keys, "rollouts", "c1", s)
    await cons.ensure_group()
    for i in range(3):
        await prod.send(synthetic_rollout(1, 8, group_id=f"g{i}"))
    blocked = asyncio.create_task(prod.send(synthetic_rollout(1, 8, group_id="g3")))
    await asyncio.sleep(0.3)
    assert not blocked.done()  # waiting for capacity, not trimming
    assert await r.xlen(keys.stream("rollouts")) == 3
    got = await cons.read(1)
    await cons.ack(got)
    added = await asyncio.wait_for(blocked, 5)
    assert added.result is AddResult.ADDED
    rest = await cons.read(10)
    assert [d.group_id for d in rest] == ["g1", "g2", "g3"]


async def test_oversized_message_is_refused_before_redis(r: aioredis.Redis, keys: Keys) -> None:
    from pipeline.transport.producer import MessageTooLarge

    prod = StreamProducer(r, keys, "rollouts", fast(max_message_bytes=4096))
    with pytest.raises(MessageTooLarge, match="exceeds max_message_bytes"):
        await prod.send(synthetic_rollout(4, 512, group_id="big"))
    assert await r.exists(keys.stream("rollouts")) == 0
    await prod.send(synthetic_rollout(1, 8, group_id="small"))
    assert await r.xlen(keys.stream("rollouts")) == 1


async def test_backpressure_timeout_is_clear(r: aioredis.Redis, keys: Keys) -> None:
    prod = StreamProducer(r, keys, "rollouts", fast(max_backlog=1, backpressure_timeout_s=0.3))
    await prod.send(synthetic_rollout(1, 8, group_id="a"))
    with pytest.raises(BackpressureTimeout, match="is its consumer running"):
        await prod.send(synthetic_rollout(1, 8, group_id="b"))
    assert await r.xlen(keys.stream("rollouts")) == 1


async def test_reclaim_after_consumer_dies(r: aioredis.Redis, keys: Keys) -> None:
    s = fast()
    prod = StreamProducer(r, keys, "rollouts", s)
    dead = StreamConsumer(r, keys, "rollouts", "dead", s)
    await dead.ensure_group()
    for i in range(3):
        await prod.send(synthetic_rollout(1, 8, group_id=f"g{i}"))
    taken = await dead.read(3)  # the dead consumer never acks
    assert len(taken) == 3
    live = StreamConsumer(r, keys, "rollouts", "live", s, clock=leaping_clock())
    assert await live.read(3, block_ms=10) == []  # not idle long enough yet
    assert await make_idle(dead) == 3  # idle for an hour...
    await dead.touch()  # ...but a live owner renews its lease...
    assert await live.read(3, block_ms=10) == []  # ...so nothing is taken from it
    assert await make_idle(dead) == 3  # it renews no more
    again = await live.read(3)
    assert sorted(d.group_id for d in again) == ["g0", "g1", "g2"]
    assert all(d.reclaimed and d.deliveries == 2 for d in again)
    await live.ack(again)
    assert await live.pending_count() == 0


async def test_dead_letter_after_max_deliveries(r: aioredis.Redis, keys: Keys) -> None:
    s = fast(max_deliveries=2)
    prod = StreamProducer(r, keys, "rollouts", s)
    c = StreamConsumer(r, keys, "rollouts", "c", s, clock=leaping_clock())
    await c.ensure_group()
    await prod.send(synthetic_rollout(1, 8, group_id="poison"))
    first = await c.read(1)  # delivery 1
    assert len(first) == 1
    c.release(first)  # handling failed: not acked, no longer in flight
    assert await make_idle(c) == 1
    second = await c.read(1)  # delivery 2 (reclaimed by itself)
    assert second and second[0].deliveries == 2
    c.release(second)
    assert await make_idle(c) == 1
    assert await c.read(1, block_ms=10) == []  # delivery 3 exceeds the max -> DLQ
    dlq = await r.xrange(keys.dlq)
    assert len(dlq) == 1
    fields = dlq[0][1]
    assert fields[b"stage"] == b"teacher" and fields[b"reason"].startswith(b"max_deliveries")
    assert fields[b"orig_gid"] == b"poison"
    decode(fields[b"orig_d"], expect=RolloutGroup)  # original bytes kept intact
    assert await c.pending_count() == 0


class Echo:
    """Test stage: scores nothing, marks every group skipped; 'bad' ids dead-letter, 'boom' raises."""

    name = "teacher"

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def handle(self, msgs: Sequence[RolloutGroup]) -> Sequence[Outcome]:
        if any(m.group_id.startswith("boom") for m in msgs):
            raise RuntimeError("boom")
        out: list[Outcome] = []
        for m in msgs:
            self.seen.append(m.group_id)
            if m.group_id.startswith("bad"):
                out.append(DeadLetter("test_reason: bad group"))
            elif m.group_id.startswith("drop"):
                out.append(Ack("dropped_by_test"))
            elif m.group_id.startswith("later"):
                out.append(Retry("not yet"))
            else:
                out.append(Emit(ScoredGroup(group=m, status=DistillStatus.SKIPPED, reason="test")))
        return out


async def test_stage_runner_burst_outcomes(r: aioredis.Redis, keys: Keys) -> None:
    s = fast(max_deliveries=2, claim_idle_ms=50)
    prod = StreamProducer(r, keys, "rollouts", s)
    ids = ["ok1", "bad1", "drop1", "ok2", "boom1", "ok3"]
    for gid in ids:
        await prod.send(synthetic_rollout(1, 8, group_id=gid))
    await r.xadd(keys.stream("rollouts"), {b"t": b"rollout", b"gid": b"junk", b"d": b"\x00not msgpack"})
    logic = Echo()
    runner = StageRunner(r, keys, logic, RolloutGroup, "rollouts", "scored", s, consumer_name="w1")
    stats = await asyncio.wait_for(runner.run(asyncio.Event(), burst=True), 20)
    scored = await r.xrange(keys.stream("scored"))
    assert sorted(f[b"gid"].decode() for _, f in scored) == ["ok1", "ok2", "ok3"]
    dlq = {f[b"orig_gid"].decode(): f[b"reason"].decode() for _, f in await r.xrange(keys.dlq)}
    assert dlq["bad1"].startswith("test_reason")
    assert dlq["junk"].startswith("decode_error")
    assert dlq["boom1"].startswith("max_deliveries")  # raised every time -> retried, then dead-lettered
    assert stats.outcomes["emitted"] == 3 and stats.outcomes["dropped_by_test"] == 1
    assert await r.xlen(keys.stream("rollouts")) == 0
    assert await r.exists(keys.heartbeat("teacher", "w1")) == 0  # cleared on exit


async def test_redelivered_entry_is_not_emitted_twice(r: aioredis.Redis, keys: Keys) -> None:
    """A worker that wrote its output but died before acking: the next worker acks without re-emitting."""
    s = fast()
    prod = StreamProducer(r, keys, "rollouts", s)
    await prod.send(synthetic_rollout(1, 8, group_id="g"))
    dying = StreamConsumer(r, keys, "rollouts", "dying", s)
    await dying.ensure_group()
    (d,) = await dying.read(1)
    g = decode(d.payload, expect=RolloutGroup)
    await StreamProducer(r, keys, "scored", s).send(ScoredGroup(group=g, status=DistillStatus.SKIPPED))
    assert await make_idle(dying) == 1  # ... and died before XACK
    logic = Echo()
    runner = StageRunner(r, keys, logic, RolloutGroup, "rollouts", "scored", s, consumer_name="w2")
    stats = await asyncio.wait_for(runner.run(asyncio.Event(), burst=True), 10)
    assert logic.seen == []  # no teacher work spent on it
    assert stats.outcomes["already_emitted"] == 1
    assert await r.xlen(keys.stream("scored")) == 1


async def test_two_runners_share_work_each_group_once(r: aioredis.Redis, keys: Keys) -> None:
    s = fast(read_count=2)
    prod = StreamProducer(r, keys, "rollouts", s)
    for i in range(40):
        await prod.send(synthetic_rollout(1, 8, group_id=f"g{i}"))
    logics = [Echo(), Echo()]
    runners = [StageRunner(r, keys, lg, RolloutGroup, "rollouts", "scored", s, consumer_name=f"w{i}")
               for i, lg in enumerate(logics)]
    await asyncio.wait_for(asyncio.gather(*(x.run(asyncio.Event(), burst=True) for x in runners)), 20)
    seen = logics[0].seen + logics[1].seen
    assert sorted(seen) == sorted(f"g{i}" for i in range(40))
    assert logics[0].seen and logics[1].seen  # both did work
    assert await r.xlen(keys.stream("scored")) == 40


async def test_graceful_stop_leaves_unfinished_work_pending(r: aioredis.Redis, keys: Keys) -> None:
    s = fast(shutdown_grace_s=0.2)
    prod = StreamProducer(r, keys, "rollouts", s)
    await prod.send(synthetic_rollout(1, 8, group_id="slow"))

    class Slow(Echo):
        async def handle(self, msgs: Sequence[RolloutGroup]) -> Sequence[Outcome]:
            await asyncio.sleep(30)
            return await super().handle(msgs)

    stop = asyncio.Event()
    runner = StageRunner(r, keys, Slow(), RolloutGroup, "rollouts", "scored", s, consumer_name="w")
    task = asyncio.create_task(runner.run(stop))
    for _ in range(100):
        if runner.in_flight:
            break
        await asyncio.sleep(0.02)
    stop.set()
    await asyncio.wait_for(task, 5)
    c = StreamConsumer(r, keys, "rollouts", "x", s)
    assert await c.pending_count() == 1  # not acked, not lost
    assert await r.xlen(keys.stream("scored")) == 0


async def test_scored_entry_roundtrip_preserves_group(r: aioredis.Redis, keys: Keys) -> None:
    g = synthetic_rollout(3, [5, 9, 17], group_id="x", group_overrides={"teacher_top_k": 4})
    await StreamProducer(r, keys, "scored", fast()).send(ScoredGroup(group=g, status=DistillStatus.SKIPPED, reason="r"))
    (_, fields), = await r.xrange(keys.stream("scored"))
    assert b"d" not in fields and decode_header(fields[b"h"]).tokens == 31  # claim check: header + key
    assert await resolve_payloads(r, [fields]) == [True]
    back = decode(fields[b"d"], expect=ScoredGroup)
    assert msgspec.structs.asdict(back.group)["group_overrides"] == {"teacher_top_k": 4}
    assert [s.length for s in back.group.sequences] == [5, 9, 17]


async def test_crash_loop_under_a_stable_name_is_dead_lettered(r: aioredis.Redis, keys: Keys) -> None:
    """A message that kills its worker every time: restarts under the same name must not loop forever."""
    s = fast(max_deliveries=2)
    await StreamProducer(r, keys, "rollouts", s).send(synthetic_rollout(1, 8, group_id="killer"))
    for _ in range(2):  # two lives, each dying while holding the entry
        c = StreamConsumer(r, keys, "rollouts", "stable", s)
        await c.ensure_group()
        assert [d.group_id for d in await c.read(1, block_ms=50)] == ["killer"]
    restarted = StreamConsumer(r, keys, "rollouts", "stable", s)
    assert await restarted.read(1, block_ms=50) == []  # third delivery exceeds the max
    (_, fields), = await r.xrange(keys.dlq)
    assert fields[b"orig_gid"] == b"killer" and fields[b"reason"].startswith(b"max_deliveries")
    assert await restarted.pending_count() == 0


async def test_a_lost_lease_counts_one_group_emitted_across_both_workers(r: aioredis.Redis, keys: Keys) -> None:
    """Worker a's lease is taken while it scores (as after a pause past ``claim_idle_ms``); worker b scores and
    writes the group; a's write then finds b's: one scored entry, ``emitted`` 1 in all, a's work named
    ``already_emitted``."""
    s = fast()
    await StreamProducer(r, keys, "rollouts", s).send(synthetic_rollout(1, 8, group_id="g"))
    b_logic = Echo()
    b = StageRunner(r, keys, b_logic, RolloutGroup, "rollouts", "scored", s, consumer_name="b")
    b_stats: list[RunStats] = []

    class LeaseLost(Echo):
        async def handle(self, msgs: Sequence[RolloutGroup]) -> Sequence[Outcome]:
            assert await make_idle(StreamConsumer(r, keys, "rollouts", "probe", s)) == 1
            b_stats.append(await b.run(asyncio.Event(), burst=True))  # b reclaims, scores, writes, acks
            return await super().handle(msgs)

    a_logic = LeaseLost()
    a = StageRunner(r, keys, a_logic, RolloutGroup, "rollouts", "scored", s, consumer_name="a")
    a_stats = await asyncio.wait_for(a.run(asyncio.Event(), burst=True), 20)
    (bs,) = b_stats
    assert a_logic.seen == ["g"] and b_logic.seen == ["g"]  # both did the work
    assert a_stats.outcomes == {"already_emitted": 1}
    assert bs.outcomes == {"emitted": 1}
    assert await r.xlen(keys.stream("scored")) == 1
    assert await r.xlen(keys.stream("rollouts")) == 0
