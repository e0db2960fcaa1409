"""Learner rank heartbeats in ``distillq stats`` against a real redis-server, with real learner clients reading
batches the real feeder wrote: the ranks appear with their step and held batches, a killed rank is named missing
once its heartbeat expires, a batch held past ``--hold-warn`` is named with its rank, and a heartbeat that cannot
be written never fails the learner."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
import structlog

from pipeline.cli.main import main
from pipeline.config import RedisSettings
from pipeline.learner.client import AsyncLearner, Learner
from pipeline.learner.health import LearnerHeartbeat, LearnerProgress
from pipeline.transport.connection import connect
from pipeline.transport.keys import Keys
from tests.integration.test_learner_ranks import batches_of_uneven_groups
from tests.streams import fast

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]
BEAT_S = 0.2  # heartbeat interval of these tests' learners: the TTL is 0.6 s


@pytest.fixture(autouse=True)
def _wide_console(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("COLUMNS", "200")
    yield
    structlog.reset_defaults()


def stats(capsys: pytest.CaptureFixture[str], url: str, keys: Keys, *argv: str) -> dict[str, Any]:
    capsys.readouterr()
    code = main(["stats", "--json", *argv, "--redis-url", url, "--namespace", keys.namespace])
    out, err = capsys.readouterr()
    assert code == 0, err
    return dict(json.loads(out))


async def astats(capsys: pytest.CaptureFixture[str], url: str, keys: Keys, *argv: str) -> dict[str, Any]:
    return await asyncio.to_thread(stats, capsys, url, keys, *argv)


def ranks(snap: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {b["rank"]: b for b in snap["learners"]}


async def eventually(probe: Any, pred: Any, timeout: float = 15.0) -> Any:
    """``await probe()`` until ``pred`` holds on its value; the last value."""
    end = time.monotonic() + timeout
    while True:
        got = await probe()
        if pred(got) or time.monotonic() > end:
            return got
        await asyncio.sleep(0.1)


async def test_two_ranks_appear_with_their_step_and_held_batches_and_a_long_hold_is_named(
    r: aioredis.Redis, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    await batches_of_uneven_groups(r, keys)  # 4 batches of 6 groups
    learners = [AsyncLearner(redis_url, namespace=keys.namespace, settings=fast(heartbeat_interval_s=BEAT_S),
                             rank=i, world_size=2) for i in range(2)]
    try:
        first = await asyncio.gather(*(lr.next_batch(30) for lr in learners))
        assert all(lb is not None for lb in first)
        await asyncio.gather(*(lr.ack(lb) for lr, lb in zip(learners, first, strict=True) if lb is not None))
        held = await asyncio.gather(*(lr.next_batch(30) for lr in learners))  # the second batch: held, not acked
        assert all(lb is not None for lb in held)
        await learners[0].publish_policy_version(0)

        snap = await eventually(lambda: astats(capsys, redis_url, keys),
                                lambda s: {(b["step"], b["held"]) for b in s["learners"]} == {(1, 1)}
                                and ranks(s).get(0, {}).get("published_version") == 0)
        got = ranks(snap)
        assert sorted(got) == [0, 1]
        for rank, b in got.items():
            assert (b["consumer"], b["world_size"], b["step"], b["held"]) == ("learner-0", 2, 1, 1)
            assert b["pid"] == os.getpid() and b["delivered_version"] == 0
            assert b["last_ack_s"] is not None and b["held_s"] is not None and b["age_s"] < 1.0
            assert b["published_version"] == (0 if rank == 0 else None)
        assert not any("missing" in line or "has held" in line for line in snap["attention"]), snap["attention"]

        await asyncio.sleep(1.0)
        snap = await astats(capsys, redis_url, keys, "--hold-warn", "0.5")
        lines = sorted(x for x in snap["attention"] if "has held a batch" in x)
        assert [x.split(" (host")[0] for x in lines] == [f"learner learner-0 rank {i} of 2" for i in range(2)]
        assert all("(1 held; over 0 s, --hold-warn)" in x for x in lines), lines
        # the per-rank line replaces the stream's entry-age line for a consumer whose ranks heartbeat
        assert not any("holds" in x and "unacknowledged" in x for x in snap["attention"]), snap["attention"]

        await asyncio.gather(*(lr.ack(lb) for lr, lb in zip(learners, held, strict=True) if lb is not None))
        snap = await eventually(lambda: astats(capsys, redis_url, keys, "--hold-warn", "0.5"),
                                lambda s: {(b["step"], b["held"]) for b in s["learners"]} == {(2, 0)})
        assert {(b["step"], b["held"], b["held_s"]) for b in snap["learners"]} == {(2, 0, None)}
        assert not any("has held" in x for x in snap["attention"]), snap["attention"]
    finally:
        for lr in learners:
            await lr.aclose()
    assert await r.keys(keys.learner_health()) == []  # closing deletes the heartbeats
    assert (await astats(capsys, redis_url, keys))["learners"] == []


def test_the_sync_learner_reports_its_batches_and_the_version_it_published(
    redis_url: str, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    async def fill() -> None:
        r = connect(RedisSettings(redis_url=redis_url))
        try:
            await batches_of_uneven_groups(r, keys)
        finally:
            await r.aclose()

    asyncio.run(fill())
    with Learner(redis_url, namespace=keys.namespace, consumer_name="trainer-a",
                 settings=fast(heartbeat_interval_s=BEAT_S)) as learner:
        a, b = learner.next_batch(30), learner.next_batch(30)
        assert a is not None and b is not None
        assert learner.ack(a)
        learner.publish_policy_version(7)
        deadline = time.monotonic() + 15
        while True:
            snap = stats(capsys, redis_url, keys)
            beats = snap["learners"]
            if (beats and beats[0]["step"] == 1 and beats[0]["published_version"] == 7) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        (beat,) = beats
        assert (beat["consumer"], beat["rank"], beat["world_size"]) == ("trainer-a", 0, 1)
        assert (beat["step"], beat["held"], beat["published_version"], beat["delivered_version"]) == (1, 1, 7, 0)
        assert beat["pid"] == os.getpid()
        time.sleep(0.6)
        (line,) = [x for x in stats(capsys, redis_url, keys, "--hold-warn", "0.5")["attention"] if "has held" in x]
        assert line.startswith(f"learner trainer-a (host {beat['host']}, pid {os.getpid()}) has held a batch for ")
        learner.ack(b)
    assert stats(capsys, redis_url, keys)["learners"] == []


CHILD = f"""
import sys, time
from pipeline.learner.client import Learner
from tests.streams import fast
url, ns = sys.argv[1], sys.argv[2]
learner = Learner(url, namespace=ns, settings=fast(heartbeat_interval_s={BEAT_S!r}), rank=1, world_size=2)
lb = learner.next_batch(60)
print("got" if lb is not None else "none", flush=True)
time.sleep(3600)
"""


async def test_a_killed_rank_is_named_missing_once_its_heartbeat_expires(
    r: aioredis.Redis, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    await batches_of_uneven_groups(r, keys)
    child = subprocess.Popen([sys.executable, "-c", CHILD, redis_url, keys.namespace], cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL)
    rank0 = AsyncLearner(redis_url, namespace=keys.namespace, settings=fast(heartbeat_interval_s=BEAT_S),
                         rank=0, world_size=2)
    try:
        assert await rank0.next_batch(60) is not None
        assert child.stdout is not None
        lines: list[bytes] = []
        while not lines or lines[-1].strip() not in (b"got", b"none", b""):  # the child logs to stdout too
            lines.append(await asyncio.to_thread(child.stdout.readline))
        assert lines[-1].strip() == b"got", lines
        snap = await eventually(lambda: astats(capsys, redis_url, keys),
                                lambda s: {rk: b["held"] for rk, b in ranks(s).items()} == {0: 1, 1: 1})
        assert {rk: b["held"] for rk, b in ranks(snap).items()} == {0: 1, 1: 1}
        assert ranks(snap)[1]["pid"] == child.pid
        assert not any("missing" in x for x in snap["attention"])

        os.kill(child.pid, signal.SIGKILL)
        await asyncio.to_thread(child.wait)
        killed = time.monotonic()
        snap = await eventually(lambda: astats(capsys, redis_url, keys), lambda s: sorted(ranks(s)) == [0])
        assert sorted(ranks(snap)) == [0]
        assert time.monotonic() - killed < 3 * BEAT_S + 5  # gone within its TTL (and the test's polling)
        assert ("learner learner-0: rank(s) 1 of 2 missing (no heartbeat): the process is gone, not started yet, "
                "or its event loop is blocked; the other ranks wait for it (learner_ranks_waiting in their logs)"
                in snap["attention"]), snap["attention"]
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
        if child.stdout is not None:
            child.stdout.close()
        await rank0.aclose()


async def test_a_heartbeat_redis_refuses_never_fails_the_learner(keys: Keys) -> None:
    """Redis unreachable: each beat gives up within its interval, is counted and logged once per outage."""
    dead = connect(RedisSettings(redis_url="redis://127.0.0.1:1/0"))
    hb = LearnerHeartbeat(dead, keys, "learner-0", 0, 1, BEAT_S, LearnerProgress())
    try:
        with structlog.testing.capture_logs() as logs:
            started = time.monotonic()
            assert await hb.beat_once() is False
            assert await hb.beat_once() is False
            assert time.monotonic() - started < 10 * BEAT_S + 2
        assert [e["event"] for e in logs if e["event"].startswith("learner_heartbeat")] == ["learner_heartbeat_failed"]
        task = asyncio.ensure_future(hb.run())
        await asyncio.sleep(3 * BEAT_S)
        assert not task.done()  # still beating (and failing) quietly
        task.cancel()
        await hb.clear(timeout_s=1.0)  # best effort: returns although Redis is away
    finally:
        await dead.aclose()
