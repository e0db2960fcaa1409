"""Redis-side faults the workers and the learner client ride out, each named: Redis restarted *without* its
data, a consumer group destroyed by hand, Redis at ``maxmemory``.

Teacher and feeder run as real worker processes; the learner is an ``AsyncLearner`` driven by a plain loop
that catches nothing, so any error it let through would fail the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from redis.exceptions import ResponseError

from pipeline.learner.client import AsyncLearner
from pipeline.transport import incidents
from pipeline.transport.keys import Keys
from pipeline.transport.producer import StreamProducer
from schemas.build import synthetic_rollout
from tests.redis_server import RedisServer
from tests.reliability.harness import OPEN, Workers, fast_settings, redis_client, report, wait_until

pytestmark = [pytest.mark.reliability, pytest.mark.slow, pytest.mark.redis, pytest.mark.timeout(150)]


class BareLearner:
    """An ``AsyncLearner`` loop that records group ids and acks each batch; it catches nothing."""

    def __init__(self, url: str, namespace: str) -> None:
        self.client = AsyncLearner(url, namespace=namespace, settings=fast_settings())
        OPEN.append(self.client)
        self.groups: set[str] = set()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            b = await self.client.next_batch(timeout_s=0.2)
            if b is None:
                continue
            self.groups.update(g.group_id for g in b.batch.groups)
            await self.client.ack(b)


class Pipeline:
    """A teacher and a feeder process, a bare learner and a producer of rollouts on one private Redis."""

    def __init__(self, server: RedisServer, namespace: str, tmp_path: Path, *teacher_args: str) -> None:
        self.server, self.keys = server, Keys(namespace)
        self.workers = Workers(server.url, namespace, tmp_path)
        self.learner = BareLearner(server.url, namespace)
        self.stop = asyncio.Event()
        self.r = redis_client(server.url)
        self.producer = StreamProducer(self.r, self.keys, "rollouts", fast_settings(backpressure_timeout_s=120))
        self.teacher = self.workers.teacher("t1", *teacher_args)
        self.feeder = self.workers.feeder("f1")
        self.learning = asyncio.create_task(self.learner.run(self.stop))

    async def push(self, prefix: str, n: int, length: int = 9) -> list[str]:
        ids = [f"{prefix}{i}" for i in range(n)]
        for i, gid in enumerate(ids):
            await self.producer.send(synthetic_rollout(2, length, prompt_len=3, group_id=gid, seed=i))
        return ids

    async def arrived(self, ids: list[str], timeout_s: float) -> bool:
        async def all_in() -> bool:
            if self.learning.done():
                self.learning.result()  # the learner's error, if it died
            return set(ids) <= self.learner.groups
        return await wait_until(all_in, timeout_s)

    async def close(self) -> None:
        self.stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.learning, 10)
        self.workers.close()


def events(log: str, name: str) -> list[dict[str, Any]]:
    out = []
    for line in log.splitlines():
        with contextlib.suppress(ValueError):
            e = json.loads(line)
            if isinstance(e, dict) and e.get("event") == name:
                out.append(e)
    return out


async def test_redis_restarted_without_its_data_is_ridden_out_and_named_once(namespace: str, tmp_path: Path) -> None:
    server = RedisServer().start()  # no RDB, no AOF: a restart comes back empty
    p = Pipeline(server, namespace, tmp_path)
    try:
        before = await p.push("before", 6)
        assert await p.arrived(before, 60), p.teacher.log_text()[-2000:]
        await asyncio.to_thread(server.restart)
        t0 = time.monotonic()
        after = await p.push("after", 6)
        assert await p.arrived(after, 60), (p.teacher.log_text()[-2000:], p.feeder.log_text()[-2000:])
        recovered_s = time.monotonic() - t0
        assert p.teacher.alive and p.feeder.alive and not p.learning.done()
        named = await incidents.recent(p.r, p.keys)
        kinds = [i.kind for i in named]
        report("redis_restarted_empty", recovered_s=recovered_s, incidents=",".join(kinds))
        assert kinds.count("redis_data_lost") == 1, named  # three consumers noticed; one names it
        lost = next(i for i in named if i.kind == "redis_data_lost")
        assert namespace in lost.text and "without persistence" in lost.text
        assert "group_destroyed" not in kinds  # a lost namespace is not mistaken for a group destroyed by hand
        for proc in (p.teacher, p.feeder):
            (e, *_) = events(proc.log_text(), "consumer_group_recreated")
            assert e["data"] in ("lost", "lost_here") and e["level"] == "warning"
    finally:
        await p.close()
        server.stop()


async def test_entries_a_worker_held_when_redis_lost_its_data_are_named(namespace: str, tmp_path: Path) -> None:
    server = RedisServer().start()
    p = Pipeline(server, namespace, tmp_path, "--synthetic-latency", "3")  # each call holds its groups 3 s
    try:
        await p.push("held", 3)
        key = p.keys.stream("rollouts")

        async def in_flight() -> bool:
            with contextlib.suppress(ResponseError):  # NOGROUP until the teacher has created its group
                return int((await p.r.xpending(key, "teacher"))["pending"]) == 3
            return False
        assert await wait_until(in_flight, 30)
        await asyncio.to_thread(server.restart)  # empty: the three entries the teacher holds are gone
        after = await p.push("after", 3)
        assert await p.arrived(after, 60), p.teacher.log_text()[-2000:]
        named = await incidents.recent(p.r, p.keys)
        (reset,) = [i for i in named if i.kind == "stream_reset"]
        assert reset.text.startswith(f"stream {key} was reset: 3 entries pending at t1 are gone, and the stream "
                                     "held 3 entries (waiting or pending) when last seen "), reset
        assert reset.writer == "t1" and reset.fields["entries"] == 3 and reset.fields["stream_entries"] == 3
        assert [i.kind for i in named].count("redis_data_lost") == 1
        assert p.teacher.alive and p.feeder.alive
    finally:
        await p.close()
        server.stop()


async def test_every_connection_dropped_at_once_like_a_failover_is_ridden_out(namespace: str, tmp_path: Path) -> None:
    """A failover cuts every client's connections (in-flight commands included: redis-py re-sends none of
    them, distillq's own retries take over); nothing is lost, nothing is named as lost."""
    server = RedisServer().start()
    p = Pipeline(server, namespace, tmp_path)
    try:
        ids = await p.push("warm", 2)
        assert await p.arrived(ids, 60)  # every process is connected
        for round_ in range(3):
            ids += await p.push(f"r{round_}-", 4)
            killed = await p.r.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
            assert int(killed) >= 3  # the teacher's, the feeder's and the learner's connections at least
            await asyncio.sleep(0.3)
        assert await p.arrived(ids, 60), (p.teacher.log_text()[-2000:], p.feeder.log_text()[-2000:])
        assert p.teacher.alive and p.feeder.alive and not p.learning.done()
        assert await p.r.xlen(p.keys.dlq) == 0 and await incidents.recent(p.r, p.keys) == []
    finally:
        await p.close()
        server.stop()


async def test_a_consumer_group_destroyed_by_hand_is_created_again(namespace: str, tmp_path: Path) -> None:
    server = RedisServer().start()
    p = Pipeline(server, namespace, tmp_path)
    try:
        first = await p.push("first", 4)
        assert await p.arrived(first, 60)
        assert await p.r.xgroup_destroy(p.keys.stream("rollouts"), p.keys.consumer_group("rollouts")) == 1
        second = await p.push("second", 4)
        assert await p.arrived(second, 60), p.teacher.log_text()[-2000:]
        assert p.teacher.alive and p.teacher.popen is not None and p.teacher.popen.poll() is None
        named = await incidents.recent(p.r, p.keys)
        (destroyed,) = [i for i in named if i.kind == "group_destroyed"]
        assert destroyed.text.startswith(f"consumer group teacher of stream {p.keys.stream('rollouts')} was gone")
        assert destroyed.writer == "t1" and "redis_data_lost" not in [i.kind for i in named]
        (e,) = events(p.teacher.log_text(), "consumer_group_recreated")
        assert e["data"] == "same" and e["created_here"] is True and "NOGROUP" in e["error"]
    finally:
        await p.close()
        server.stop()


async def test_redis_at_maxmemory_is_backpressure_with_its_cause_named_not_dead_letters(
    namespace: str, tmp_path: Path
) -> None:
    server = RedisServer(extra_args=["--maxmemory-policy", "noeviction"]).start()
    p = Pipeline(server, namespace, tmp_path)
    try:
        warm = await p.push("warm", 3)
        assert await p.arrived(warm, 60)
        os.kill(p.teacher.pid, signal.SIGSTOP)  # the next groups wait for it, unread
        # Long enough that each scored group is claim-checked with its payload SET on its own (>32 KiB): a
        # plain write, refused at maxmemory (a flagless script whose first write needs no memory is not).
        held = await p.push("held", 5, length=400)
        used = int((await p.r.info("memory"))["used_memory"])
        await p.r.config_set("maxmemory", str(used // 2))  # full: every write that needs memory is refused
        os.kill(p.teacher.pid, signal.SIGCONT)
        # Long enough for every entry to be reclaimed max_deliveries (5) times over at claim_idle_ms = 1 s,
        # if a refused write counted as a failed delivery.
        await asyncio.sleep(8.0)
        full_log = p.teacher.log_text()
        waits = events(full_log, "redis_full")
        assert waits, full_log[-3000:]
        assert any(("maxmemory" in e.get("reason", "") and "used" in e.get("reason", ""))  # the producer's wait
                   or ("maxmemory" in e and "used_memory" in e) for e in waits), waits  # a bookkeeping write's
        assert await p.r.xlen(p.keys.dlq) == 0
        assert not events(full_log, "batch_failed") and not events(full_log, "dead_lettered")
        pending: Any = await p.r.xpending_range(p.keys.stream("rollouts"), "teacher", "-", "+", 100)
        assert pending and all(int(x["times_delivered"]) == 1 for x in pending), pending  # never redelivered
        await p.r.config_set("maxmemory", "0")  # memory freed: the pipeline resumes by itself
        t0 = time.monotonic()
        assert await p.arrived(held, 60), p.teacher.log_text()[-2000:]
        report("redis_at_maxmemory", full_waits_logged=len(waits), resumed_s=time.monotonic() - t0,
               dead_letters=await p.r.xlen(p.keys.dlq))
        assert await p.r.xlen(p.keys.dlq) == 0 and p.teacher.alive and p.feeder.alive
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.teacher.pid, signal.SIGCONT)
        await p.close()
        server.stop()


async def test_learner_ranks_wait_out_a_redis_restart() -> None:
    """Two learner ranks move through their batches together while Redis crashes and restarts (on its AOF) under
    them: the rank polling for the next batch and the one coming back after it wait, neither raises, and every
    batch reaches both ranks once."""
    from tests.integration.test_learner_ranks import batches_of_uneven_groups

    server = RedisServer(extra_args=["--appendonly", "yes", "--appendfsync", "always"]).start()
    keys = Keys("ranks-restart")
    r = redis_client(server.url)
    ranks = [AsyncLearner(server.url, namespace=keys.namespace, settings=fast_settings(), rank=i, world_size=2)
             for i in range(2)]
    got: dict[int, list[str]] = {0: [], 1: []}
    restarted = asyncio.Event()
    try:
        batches = await batches_of_uneven_groups(r, keys)

        async def run(rank: int) -> None:
            for _ in batches:
                if rank == 1 and got[1]:
                    await restarted.wait()  # rank 1 asks again only once Redis came back; rank 0 polls through
                b = await ranks[rank].next_batch(60)
                assert b is not None
                got[rank].append(b.entry_id)
                assert await ranks[rank].ack(b)

        both = asyncio.gather(run(0), run(1))
        assert await wait_until(lambda: _true(len(got[1]) == 1), 30)
        await asyncio.sleep(0.5)  # rank 0 is polling for the next batch, which waits for rank 1's ack
        await asyncio.to_thread(server.kill)  # a crash, then 3 s away: longer than a connection's own retries
        await asyncio.sleep(3)
        await asyncio.to_thread(server.start)
        restarted.set()
        await asyncio.wait_for(both, 90)
        assert got[0] == got[1] == [eid for eid, _ in batches]
        assert await r.xlen(keys.stream("batches")) == 0
        report("learner_ranks_redis_restart", batches=len(batches), per_rank=[len(got[0]), len(got[1])])
    finally:
        for x in ranks:
            await x.aclose()
        await r.aclose()
        server.stop()


async def _true(value: bool) -> bool:
    return value
