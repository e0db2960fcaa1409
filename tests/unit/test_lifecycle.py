"""``WorkerLifecycle`` without Redis: heartbeat written and cancelled, leases renewed, back-off on a connection
error, and the grace period on exit (work that finishes in time is kept, the rest is cancelled)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any, cast

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from structlog.testing import capture_logs

from pipeline import metrics
from pipeline.stages.lifecycle import Heartbeat, RunStats, WorkerLifecycle
from pipeline.transport.connection import Backoff
from pipeline.transport.identity import NameHeld
from pipeline.transport.keys import Keys

KEY = "t:health:teacher:w1"


class FakeRedis:
    """``set`` and ``delete`` as the heartbeat calls them; the first ``fail`` sets raise a connection error."""

    def __init__(self, fail: int = 0) -> None:
        self.values: dict[str, str] = {}
        self.ttl_ms: dict[str, int | None] = {}
        self.fail = fail
        self.deleted: list[str] = []
        self.incidents: list[dict[str, str]] = []
        self.wrote = asyncio.Event()

    async def set(self, key: str, value: str, px: int | None = None) -> None:
        if self.fail:
            self.fail -= 1
            raise RedisConnectionError("connection refused")
        self.values[key], self.ttl_ms[key] = value, px
        self.wrote.set()

    async def delete(self, *keys: str) -> None:
        for k in keys:
            self.values.pop(k, None)
            self.deleted.append(k)

    async def xadd(self, key: str, fields: dict[str, str], **kw: Any) -> None:
        self.incidents.append(fields)

    def register_script(self, script: str) -> Any:
        """The two scripts of ``pipeline.transport.identity``: the compare-and-set write and the release."""
        async def run(keys: list[str], args: list[Any]) -> Any:
            cur = self.values.get(keys[0])
            if "SET" in script:
                if cur is not None and args[1] not in cur:
                    return cur.encode()
                await self.set(keys[0], args[0], px=args[2])
                return None
            if cur is not None and args[0] in cur:
                await self.delete(keys[0])
            return 0
        return run

    async def next_write(self) -> dict[str, Any]:
        self.wrote.clear()
        await asyncio.wait_for(self.wrote.wait(), 5)
        info: dict[str, Any] = json.loads(self.values[KEY])
        return info


class FakeConsumer:
    """``touch`` as lease renewal calls it; the first call raises a connection error."""

    def __init__(self) -> None:
        self.touches = 0
        self.touched = asyncio.Event()

    async def touch(self) -> None:
        self.touches += 1
        if self.touches == 1:
            raise RedisConnectionError("connection refused")
        self.touched.set()


def errors(stage: str) -> float:
    value: float = metrics.REDIS_ERRORS.labels(stage)._value.get()
    return value


def heartbeat(redis: FakeRedis, interval_s: float = 0.01) -> Heartbeat:
    return Heartbeat(cast(Any, redis), Keys("t"), "teacher", "w1", interval_s,
                     lambda: {"unhealthy": None, "tokens_scored": 7})


async def test_heartbeat_is_written_periodically_then_cancelled_and_deleted_on_exit() -> None:
    redis, stop = FakeRedis(), asyncio.Event()
    stats = RunStats(handled=3, outcomes=Counter(emitted=3))
    async with WorkerLifecycle("teacher", stop, stats, heartbeat=heartbeat(redis)) as life:
        (beat_task,) = life._background
        first = await redis.next_write()
        assert first["handled"] == 3 and first["outcomes"] == {"emitted": 3} and first["tokens_scored"] == 7
        assert {"pid", "host", "started", "ts", "unhealthy"} <= first.keys()
        assert redis.ttl_ms[KEY] == 30  # three intervals
        stats.handled, stats.outcomes["emitted"] = 5, 5
        second = await redis.next_write()  # the next beat carries the new figures
        assert second["handled"] == 5 and second["ts"] >= first["ts"] and second["started"] == first["started"]
        assert not beat_task.done()
    assert beat_task.done() and not life._background
    assert KEY not in redis.values and redis.deleted == [KEY]


async def test_a_failed_heartbeat_write_is_counted_and_the_next_one_is_made() -> None:
    redis = FakeRedis(fail=1)  # the claim at entry is retried through the error
    async with WorkerLifecycle("teacher", asyncio.Event(), heartbeat=heartbeat(redis)):
        await redis.next_write()
        before = errors("heartbeat")
        redis.fail = 1
        info = await redis.next_write()
    assert info["handled"] == 0 and errors("heartbeat") == before + 1


async def test_leases_are_renewed_until_exit_and_a_redis_error_does_not_end_renewal() -> None:
    consumer = FakeConsumer()
    before = errors("lease-test")
    async with WorkerLifecycle("lease-test", asyncio.Event(), leases=cast(Any, consumer), claim_idle_ms=30) as life:
        (lease_task,) = life._background
        await asyncio.wait_for(consumer.touched.wait(), 5)
    assert consumer.touches >= 2 and errors("lease-test") == before + 1
    assert lease_task.cancelled()


async def test_no_heartbeat_nor_leases_unless_given() -> None:
    async with WorkerLifecycle("atropos", asyncio.Event()) as life:
        assert life._background == []


async def test_a_connection_error_is_counted_logged_and_backed_off_and_success_resets_the_delays() -> None:
    life = WorkerLifecycle("backoff-test", asyncio.Event(), backoff=Backoff(base=0.001, cap=0.004))
    before = errors("backoff-test")
    with capture_logs() as logs:
        delays = [await life.redis_error(RedisConnectionError("connection refused")) for _ in range(3)]
    assert errors("backoff-test") == before + 3
    assert [e["event"] for e in logs] == ["redis_unavailable"] * 3
    assert all(e["stage"] == "backoff-test" and e["error"] == "connection refused" for e in logs)
    assert [e["retry_in"] for e in logs] == [round(d, 2) for d in delays]
    assert all(0 <= d <= bound for d, bound in zip(delays, (0.002, 0.004, 0.004), strict=True))  # capped
    assert life.backoff.attempt == 3
    life.ok()
    assert life.backoff.attempt == 0


async def test_a_back_off_ends_when_stop_is_set() -> None:
    stop = asyncio.Event()
    life = WorkerLifecycle("backoff-test", stop, backoff=Backoff(base=600, cap=600))
    waiting = asyncio.create_task(life.redis_error(RedisConnectionError("down")))
    await asyncio.sleep(0)
    assert not waiting.done()
    stop.set()
    assert await asyncio.wait_for(waiting, 5) >= 0  # returned at stop, not after its delay


async def test_in_flight_work_gets_the_grace_period_then_is_cancelled() -> None:
    stop = asyncio.Event()
    finished: list[str] = []
    cancelled: list[str] = []

    async def work(name: str, until: asyncio.Event) -> None:
        try:
            await until.wait()
            finished.append(name)
        except asyncio.CancelledError:
            cancelled.append(name)
            raise

    with capture_logs() as logs:
        async with WorkerLifecycle("teacher", stop, grace_s=0.05) as life:
            life.spawn(work("quick", stop), 2)  # finishes once stop is set
            life.spawn(work("stuck", asyncio.Event()), 3)  # never finishes by itself
            assert life.in_flight == 5
            stop.set()  # the loop body stops reading and leaves the block
    assert finished == ["quick"] and cancelled == ["stuck"] and life.in_flight == 0
    events = {e["event"]: e for e in logs}
    assert events["draining"]["in_flight"] == 5 and events["draining"]["grace_s"] == 0.05
    assert events["cancelled_in_flight"]["batches"] == 1


async def test_work_done_within_the_grace_period_is_not_cancelled() -> None:
    stop = asyncio.Event()
    done: list[int] = []

    async def work() -> None:
        await stop.wait()
        done.append(1)

    with capture_logs() as logs:
        async with WorkerLifecycle("teacher", stop, grace_s=600) as life:
            life.spawn(work())
            stop.set()
    assert done == [1] and "cancelled_in_flight" not in [e["event"] for e in logs]


async def test_wait_slot_returns_when_spawned_work_ends_and_a_failure_is_logged() -> None:
    go = asyncio.Event()

    async def fails() -> None:
        await go.wait()
        raise RuntimeError("boom")

    with capture_logs() as logs:
        async with WorkerLifecycle("teacher", asyncio.Event()) as life:
            life.spawn(fails())
            slot = asyncio.create_task(life.wait_slot())
            await asyncio.sleep(0)
            assert not slot.done() and life.in_flight == 1
            go.set()
            await asyncio.wait_for(slot, 5)
            assert life.in_flight == 0
    failed = [e for e in logs if e["event"] == "batch_failed"]
    assert len(failed) == 1 and isinstance(failed[0]["exc_info"], RuntimeError)


async def test_until_stopped_and_within_grace_for_work_started_elsewhere() -> None:
    stop = asyncio.Event()
    life = WorkerLifecycle("rollout", stop, grace_s=0.05)
    finished = asyncio.create_task(asyncio.sleep(0))
    assert await asyncio.wait_for(life.until_stopped(finished), 5) is True
    never = asyncio.create_task(asyncio.Event().wait())
    stop.set()
    assert await asyncio.wait_for(life.until_stopped(never), 5) is False
    assert await life.within_grace([never, finished]) == {never}
    assert not never.done()  # the caller decides how to cancel it
    never.cancel()


async def test_a_name_held_by_a_live_process_is_refused_after_the_wait_and_a_lost_one_stops_the_worker() -> None:
    redis = FakeRedis()
    other = heartbeat(redis)
    await other.take(wait_s=0)
    mine = heartbeat(redis)
    with pytest.raises(NameHeld, match=r"teacher consumer w1 is held by a live process \(pid \d+ on host"):
        await mine.take(wait_s=0.05)
    assert [i["kind"] for i in redis.incidents] == ["name_refused"]  # for distillq stats
    await other.clear()
    stop = asyncio.Event()
    with pytest.raises(NameHeld, match="was taken by another process"):
        async with WorkerLifecycle("teacher", stop, heartbeat=mine):
            await redis.next_write()
            redis.values[KEY] = json.dumps({"pid": 1, "host": "elsewhere", "token": "theirs"})  # taken meanwhile
            await asyncio.wait_for(stop.wait(), 5)  # the next beat finds it taken and stops the worker
    assert "theirs" in redis.values[KEY]  # leaving never frees the name of the new holder
