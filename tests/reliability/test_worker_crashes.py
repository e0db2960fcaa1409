"""Worker crashes: 1,000 groups through two teacher processes and a feeder while a chaos driver SIGKILLs a
random one of them 20 times and restarts it under the same consumer name. The learner must see every group
exactly once, with the teacher arrays of a clean run."""

from __future__ import annotations

import asyncio
import functools
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest

from pipeline.transport.keys import Keys
from pipeline.transport.producer import AddResult, StreamProducer
from schemas import RolloutGroup
from schemas.build import synthetic_rollout
from tests.redis_server import RedisServer
from tests.reliability.harness import (
    RecordingLearner,
    WorkerProc,
    Workers,
    fast_settings,
    heartbeat_pid,
    redis_client,
    report,
    synthetic_reference,
    teacher_matches,
    wait_until,
)

pytestmark = [pytest.mark.reliability, pytest.mark.slow, pytest.mark.redis, pytest.mark.timeout(240)]

GROUPS = 1000
KILLS = 20
K = 8


def log_events(procs: list[WorkerProc], event: str) -> int:
    """How many JSON log lines of ``procs`` (all their restarts) carry ``event``."""
    n = 0
    for p in procs:
        for line in p.log_text().splitlines():
            if f'"{event}"' in line:
                try:
                    n += json.loads(line).get("event") == event
                except json.JSONDecodeError:
                    continue
    return n


async def pending_of(r: Any, keys: Keys, stream: str, group: str, consumer: str) -> int:
    rows = await r.xpending_range(keys.stream(stream), group, "-", "+", 10_000, consumername=consumer)
    return len(rows)


class Chaos:
    """SIGKILLs a random worker ``KILLS`` times, restarting it under its name; counts what each kill hit."""

    STAGE: ClassVar[dict[str, str]] = {"t1": "teacher", "t2": "teacher", "f1": "feeder"}
    SOURCE: ClassVar[dict[str, tuple[str, str]]] = {"teacher": ("rollouts", "teacher"), "feeder": ("scored", "feeder")}

    def __init__(self, r: Any, keys: Keys, procs: dict[str, WorkerProc]) -> None:
        self.r, self.keys, self.procs = r, keys, procs
        self.rng = random.Random(20261122)
        self.kills: dict[str, int] = dict.fromkeys(procs, 0)
        self.orphaned: list[int] = []  # entries pending on the victim at each kill
        self.recovery: list[float] = []  # SIGKILL -> the restarted worker's first heartbeat
        self.done = 0

    async def up(self, name: str) -> bool:
        key = self.keys.heartbeat(self.STAGE[name], name)
        return await heartbeat_pid(self.r, key) == self.procs[name].pid

    async def run(self) -> None:
        for _ in range(KILLS):
            await asyncio.sleep(self.rng.uniform(0.2, 0.6))
            name = self.rng.choice(sorted(self.procs))
            stream, group = self.SOURCE[self.STAGE[name]]
            self.orphaned.append(await pending_of(self.r, self.keys, stream, group, name))
            self.procs[name].kill()
            killed_at = time.monotonic()
            self.kills[name] += 1
            await asyncio.sleep(self.rng.uniform(0.0, 0.3))
            self.procs[name].start()
            assert await wait_until(functools.partial(self.up, name), 30), f"{name} did not come back"
            self.recovery.append(time.monotonic() - killed_at)
            self.done += 1


async def produce(r: Any, keys: Keys, chaos: Chaos, sent: dict[str, RolloutGroup]) -> None:
    """``GROUPS`` groups, spread over the whole chaos run (paced by the kills done so far)."""
    prod = StreamProducer(r, keys, "rollouts", fast_settings())
    for i in range(GROUPS):
        while i >= GROUPS * (chaos.done + 1) / (KILLS + 1):
            await asyncio.sleep(0.02)
        g = synthetic_rollout(2, 32, group_id=f"g{i:04d}", seed=i)
        assert (await prod.send(g)).result is AddResult.ADDED
        sent[g.group_id] = g
        await asyncio.sleep(0.004)


async def test_sigkill_chaos_delivers_every_group_exactly_once(
    workers: Workers, private_redis: RedisServer, namespace: str, tmp_path: Path
) -> None:
    keys = Keys(namespace)
    r = redis_client(private_redis.url)
    # A 0.2 s teacher call keeps entries in flight, so kills land on pending work (the point of the test).
    teacher_args = ("--top-k", str(K), "--synthetic-latency", "0.2")
    procs = {"t1": workers.teacher("t1", *teacher_args), "t2": workers.teacher("t2", *teacher_args),
             "f1": workers.feeder("f1")}
    chaos = Chaos(r, keys, procs)
    for name, proc in procs.items():
        assert await wait_until(functools.partial(chaos.up, name), 30), f"{name} did not start: {proc.log_text()}"
    learner = RecordingLearner(private_redis.url, namespace)
    stop = asyncio.Event()
    learner_task = asyncio.create_task(learner.run(stop))
    sent: dict[str, RolloutGroup] = {}
    t0 = time.monotonic()
    producer = asyncio.create_task(produce(r, keys, chaos, sent))
    await chaos.run()
    await asyncio.wait_for(producer, 60)

    last = [len(learner.counts), time.monotonic()]

    async def settled() -> bool:
        """All arrived and the streams are empty, or the streams are empty and nothing arrived for 35 s
        (longer than a producer reservation, RESERVE_MS): what is missing then will not come."""
        if len(learner.counts) != last[0]:
            last[:] = [len(learner.counts), time.monotonic()]
        lens = [int(await r.xlen(keys.stream(s))) for s in ("rollouts", "scored", "batches")]
        return sum(lens) == 0 and (len(learner.counts) >= GROUPS or time.monotonic() - last[1] > 35)

    all_in = await wait_until(settled, 90) and len(learner.counts) >= GROUPS
    await asyncio.sleep(1.5)  # a late duplicate would show up here
    stop.set()
    await learner_task
    elapsed = time.monotonic() - t0

    refs = {gid: await synthetic_reference(g, K) for gid, g in sent.items()}
    mismatched = {gid: why for gid, s in learner.first.items() if gid in sent
                  for why in [teacher_matches(s, sent[gid], refs[gid])] if why}
    missing = sorted(set(sent) - set(learner.counts))
    unknown = sorted(set(learner.counts) - set(sent))
    dlq = await r.xlen(keys.dlq)
    figures: dict[str, Any] = dict(
        sent=len(sent), received=len(learner.counts), duplicated=learner.duplicates, lost=len(missing),
        unknown=len(unknown), arrays_differing=len(mismatched), dead_lettered=dlq, faults_injected=KILLS,
        kills_by_worker=",".join(f"{k}:{v}" for k, v in sorted(chaos.kills.items())),
        orphaned_pending_at_kill=sum(chaos.orphaned), kills_with_pending=sum(1 for o in chaos.orphaned if o),
        own_pending_rereads=log_events(list(procs.values()), "own_pending_redelivered"),
        reclaims=log_events(list(procs.values()), "reclaimed"),
        already_batched=log_events([procs["f1"]], "group_already_batched"),
        recovery_s_median=statistics.median(chaos.recovery), recovery_s_max=max(chaos.recovery),
        batches=learner.batches, elapsed_s=elapsed,
    )
    report("worker_crashes", **figures)
    await learner.aclose()
    where = {gid: await trace(r, keys, gid) for gid in missing[:5]}
    assert all_in, f"pipeline did not drain: {figures}; lost groups: {where}"
    assert not missing, f"lost {len(missing)} groups: {where}"
    assert learner.duplicates == 0, f"duplicates: {[g for g, n in learner.counts.items() if n > 1][:5]}"
    assert not unknown
    assert not mismatched, f"teacher arrays differ from a clean run: {list(mismatched.items())[:3]}"
    assert dlq == 0
    # Most kills must land on a worker holding pending entries, or the test proves little.
    assert sum(1 for o in chaos.orphaned if o) >= KILLS // 4, f"kills with pending work: {chaos.orphaned}"
    assert workers.all_alive()
    await r.aclose()


async def trace(r: Any, keys: Keys, gid: str) -> dict[str, object]:
    """Where a lost group was last seen: dedupe markers per stream and whether an entry still holds it."""
    out: dict[str, object] = {}
    for stream in ("rollouts", "scored", "batches"):
        marker = await r.get(keys.seen(stream, gid))
        entries = [e for e, f in await r.xrange(keys.stream(stream)) if f.get(b"gid") == gid.encode()]
        out[stream] = {"marker": marker.decode() if marker else None, "entries": len(entries)}
    return out


async def test_crash_between_reserve_and_write_loses_nothing(
    workers: Workers, private_redis: RedisServer, namespace: str
) -> None:
    """A teacher SIGKILLed after reserving its output's dedupe marker but before writing the entry (the
    producer's two steps) leaves a ``pending:`` reservation. The restarted teacher must not take that
    reservation for a written output and acknowledge the input."""
    keys = Keys(namespace)
    r = redis_client(private_redis.url)
    await r.xgroup_create(keys.stream("rollouts"), "teacher", id="0", mkstream=True)
    await StreamProducer(r, keys, "rollouts", fast_settings()).send(synthetic_rollout(2, 16, group_id="X"))
    await r.xreadgroup("teacher", "t1", {keys.stream("rollouts"): ">"}, count=1)  # t1 took X...
    await r.set(keys.seen("scored", "X"), "pending:0123456789abcdef", px=30_000)  # ...reserved, and died
    t1 = workers.teacher("t1")  # restarted under its name: re-reads X from its own pending entries
    await asyncio.sleep(5.0)
    held = int(await r.xlen(keys.stream("rollouts")))
    written = int(await r.xlen(keys.stream("scored")))
    report("crash_between_reserve_and_write", input_still_held=held, output_written=written, teacher_alive=t1.alive)
    await r.aclose()
    assert held == 1 or written == 1, "X was acknowledged as already emitted, but its output was never written"
