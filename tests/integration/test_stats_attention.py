"""``distillq stats`` ``attention:`` against a real redis-server with real heartbeats (``Heartbeat`` writes them as
every worker does), through ``distillq`` main(); ``worker --check`` reads the same heartbeats the same way."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis
import structlog
from redis.exceptions import OutOfMemoryError

from pipeline.cli.main import main
from pipeline.config import RedisSettings
from pipeline.learner.health import LearnerHeartbeat, LearnerProgress
from pipeline.stages.batching import BatchingConfig
from pipeline.stages.feeder import Feeder
from pipeline.stages.kl_control import ConstantKL
from pipeline.stages.lifecycle import Heartbeat
from pipeline.stages.worker_main import check_health
from pipeline.transport import incidents
from pipeline.transport.connection import connect
from pipeline.transport.keys import CONSUMER_GROUPS, Keys
from pipeline.transport.producer import StreamProducer
from schemas.build import synthetic_rollout
from tests.redis_server import RedisServer

pytestmark = pytest.mark.redis


@pytest.fixture(autouse=True)
def _reset_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("COLUMNS", "200")
    yield
    structlog.reset_defaults()


async def stats(capsys: pytest.CaptureFixture[str], url: str, keys: Keys, *argv: str) -> dict[str, Any]:
    capsys.readouterr()
    code = await asyncio.to_thread(main, ["stats", "--json", *argv, "--redis-url", url, "--namespace",
                                          keys.namespace])
    out, err = capsys.readouterr()
    assert code == 0, err
    return dict(json.loads(out))


async def beat(r: aioredis.Redis, keys: Keys, stage: str, consumer: str, **report: object) -> Heartbeat:
    hb = Heartbeat(r, keys, stage, consumer, 5.0)
    await hb.beat(handled=0, outcomes={}, **report)
    return hb


async def test_a_stream_with_entries_and_no_live_teacher_until_one_beats(
    r: aioredis.Redis, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for i in range(3):
        await StreamProducer(r, keys, "rollouts").send(synthetic_rollout(1, 6, group_id=f"g{i}"))
    snap = await stats(capsys, redis_url, keys)
    assert ("stream rollouts has 3 entries and no live teacher worker: start one (distillq worker teacher)"
            in snap["attention"])
    await beat(r, keys, "teacher", "t1")
    snap = await stats(capsys, redis_url, keys)
    assert not any("no live" in line for line in snap["attention"]), snap["attention"]


async def test_clock_skew_is_named_and_check_agrees_with_stats(
    r: aioredis.Redis, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker whose clock is 42 s behind: ages on the writer's clock called it stale (``--check`` failed while
    ``stats`` listed it live); on the Redis clock both see it fresh and both name the skew."""
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 42)
    await beat(r, keys, "teacher", "teacher-h-1")
    monkeypatch.setattr(time, "time", lambda: real() + 42)
    await beat(r, keys, "teacher", "teacher-h-2")
    monkeypatch.setattr(time, "time", real)
    await beat(r, keys, "teacher", "teacher-h-3")

    snap = await stats(capsys, redis_url, keys)
    clocks = [line for line in snap["attention"] if " clock is " in line]
    assert [c.split(" (over")[0].split(" (host")[0] + c.split(")", 1)[1].split(" (over")[0] for c in clocks] == [
        "worker teacher-h-1 clock is 42 s behind Redis", "worker teacher-h-2 clock is 42 s ahead of Redis"]
    ages = {w["consumer"]: w["age_s"] for w in snap["workers"]}
    assert all(a < 5 for a in ages.values()), ages
    skews = {w["consumer"]: w["clock_skew_s"] for w in snap["workers"]}
    assert skews["teacher-h-1"] == pytest.approx(-42, abs=1) and skews["teacher-h-2"] == pytest.approx(42, abs=1)
    assert abs(skews["teacher-h-3"]) < 1

    ok, text = await check_health(RedisSettings(redis_url=redis_url, namespace=keys.namespace), "teacher", 30.0)
    assert ok, text
    assert text.startswith("3 teacher worker(s) healthy")
    assert "worker teacher-h-1" in text and "clock is 42 s behind Redis" in text
    assert "clock is 42 s ahead of Redis" in text


async def test_an_old_heartbeat_fails_check_by_the_redis_clock(
    r: aioredis.Redis, keys: Keys, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 13)
    hb = Heartbeat(r, keys, "teacher", "t1", 5.0)
    await hb.beat(handled=0)
    await r.pexpire(hb.key, 2000)  # written 13 s ago (TTL 15 s), by a clock that agrees with Redis's
    settings = RedisSettings(redis_url=redis_url, namespace=keys.namespace)
    ok, text = await check_health(settings, "teacher", 10.0)
    assert not ok and text == "1 teacher heartbeat(s), none fresher than 10 s"
    assert (await check_health(settings, "teacher", 30.0))[0]


async def test_feeders_with_different_settings_are_flagged(
    r: aioredis.Redis, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    a = Feeder(r, keys, BatchingConfig(max_batch_tokens=65536, max_staleness=4), ConstantKL(0.0), consumer_name="f1")
    b = Feeder(r, keys, BatchingConfig(max_batch_tokens=8192, max_staleness=4), ConstantKL(0.0), consumer_name="f2")
    for f in (a, b):
        await f.heartbeat.beat(handled=0, outcomes={}, **f.report())
    snap = await stats(capsys, redis_url, keys)
    (line,) = [x for x in snap["attention"] if x.startswith("feeders disagree")]
    assert line.startswith("feeders disagree on max_batch_tokens: f1 65536, f2 8192")
    (fw,) = [w for w in snap["workers"] if w["consumer"] == "f1"]
    assert fw["settings"]["max_staleness"] == 4 and fw["settings"]["kl"] == "constant 0.0"


async def test_batches_held_by_a_learner_name_no_live_process_has(
    r: aioredis.Redis, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    key = keys.stream("batches")
    await r.xadd(key, {b"t": b"batch", b"d": b"x"})
    await r.xgroup_create(key, "learner", id="0")
    await r.xreadgroup("learner", "learner-0", {key: ">"}, count=1)  # read by a learner that then failed
    snap = await stats(capsys, redis_url, keys)
    (line,) = [x for x in snap["attention"] if "holds" in x]
    assert line.startswith("learner learner-0 holds 1 batch(es) unacknowledged and no learner process of that name "
                           "is alive (no heartbeat): it stopped or failed")
    hb = LearnerHeartbeat(r, keys, "learner-0", 0, 1, 5.0, LearnerProgress())
    await hb.beat()  # a live learner-0: its own heartbeat tells the hold (learner_rank_notes)
    snap = await stats(capsys, redis_url, keys)
    assert not any("no learner process of that name" in x for x in snap["attention"])


@pytest.mark.skipif("prompts" not in CONSUMER_GROUPS, reason="the rollout stage reads no prompts stream here")
async def test_rollout_jobs_retrying_and_dead_lettered(
    r: aioredis.Redis, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    key = keys.stream("prompts")
    ids = [await r.xadd(key, {b"p": str(i).encode()}) for i in range(3)]
    await r.xgroup_create(key, "rollout", id="0")
    await r.xreadgroup("rollout", "r1", {key: ">"}, count=3)
    await r.xclaim(key, "rollout", "r1", 0, ids[:2])  # delivered again: twice
    await r.xclaim(key, "rollout", "r1", 0, ids[:1])  # three times
    await r.xadd(keys.dlq, {b"stage": b"rollout", b"reason": b"max_deliveries: delivered 6 times",
                            b"source": b"prompts"})
    await beat(r, keys, "rollout", "r1")
    snap = await stats(capsys, redis_url, keys)
    assert ("rollout jobs retrying: prompts: 2 entries delivered more than once (up to 3 times): rollout work on "
            "them failed or its worker died holding them; after DISTILLQ_MAX_DELIVERIES they are dead-lettered"
            in snap["attention"])
    assert ("rollout jobs failed: 1 prompt(s) dead-lettered by stage rollout, with the reason: distillq dlq list"
            in snap["attention"])
    assert snap["dead_letters_by_stage"] == {"rollout": 1}


async def test_teacher_report_fields_incidents_show(
    r: aioredis.Redis, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    await beat(r, keys, "teacher", "t1", clamped_k=4, slow="backend calls take 31 s (timeout 10 s)", unhealthy=None,
               drops={"invalid_logprobs": 2})
    await incidents.record(r, keys, "stream_reset", "stream rollouts was reset: 5 entries pending before are gone",
                           writer="teacher-1")
    await incidents.record(r, keys, "group_recreated", "consumer group teacher of rollouts was recreated",
                           writer="teacher-1")
    snap = await stats(capsys, redis_url, keys)
    lines = snap["attention"]
    assert "teacher t1 clamped k for 4 groups (k asked above the cap)" in lines
    assert "teacher t1: backend calls take 31 s (timeout 10 s) (slow but alive, not unreachable)" in lines
    assert any(x.startswith("teacher t1 got invalid teacher values for 2 group(s)") for x in lines)
    assert not any("backend failing" in x for x in lines)  # slow is not a problem line
    found = [x for x in lines if x.startswith("incident ")]
    assert len(found) == 2 and "(group_recreated, teacher-1): consumer group teacher" in found[0]
    assert "(stream_reset, teacher-1): stream rollouts was reset: 5 entries pending before are gone" in found[1]


@pytest.fixture
async def own_redis() -> AsyncIterator[tuple[RedisServer, aioredis.Redis]]:
    """A redis-server of this test only: its maxmemory is changed."""
    server = RedisServer().start()
    client = connect(RedisSettings(redis_url=server.url))
    try:
        yield server, client
    finally:
        await client.aclose()
        server.stop()


async def test_redis_memory_near_and_at_maxmemory(
    own_redis: tuple[RedisServer, aioredis.Redis], keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    server, r = own_redis
    # 16 MiB, so the memory of stats' own connections (tens of KiB each) moves the share by well under 5%; in small
    # writes, since one large write leaves a query buffer that Redis frees later
    for i in range(256):
        await r.set(f"filler{i}", b"x" * (64 << 10))
    used = int((await r.info("memory"))["used_memory"])
    await r.config_set("maxmemory", str(int(used / 0.95)))
    snap = await stats(capsys, server.url, keys)
    assert snap["memory"]["max_bytes"] > 0 and snap["memory"]["policy"] == "noeviction"
    assert any(x.startswith("Redis is nearly full (used ") and x.endswith("at maxmemory writes wait")
               for x in snap["attention"]), (snap["attention"], snap["memory"], used)
    await r.config_set("maxmemory", str(used // 2))
    with pytest.raises(OutOfMemoryError, match="maxmemory"):
        await r.set("more", b"y" * 1000)
    snap = await stats(capsys, server.url, keys)
    assert snap["memory"]["oom_errors"] == 1
    assert any(x.startswith("Redis is full: writes wait (used ") for x in snap["attention"]), snap["attention"]
    capsys.readouterr()
    code = await asyncio.to_thread(main, ["stats", "--redis-url", server.url, "--namespace", keys.namespace])
    out = capsys.readouterr().out
    assert code == 0 and "Redis memory: " in out and "1 write(s) refused for memory since Redis started" in out


async def test_each_rollout_worker_shows_the_policy_version_it_samples_with(
    r: aioredis.Redis, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    await beat(r, keys, "rollout", "rollout-0", weights_version=7, checkpoint_not_loadable=None)
    await beat(r, keys, "rollout", "rollout-1", weights_version=None, checkpoint_not_loadable=None)
    snap = await stats(capsys, redis_url, keys)
    assert {w["consumer"]: w["weights_version"] for w in snap["workers"]} == {"rollout-0": 7, "rollout-1": None}
    capsys.readouterr()
    assert await asyncio.to_thread(main, ["stats", "--redis-url", redis_url, "--namespace", keys.namespace]) == 0
    out = capsys.readouterr().out
    assert "weights version" in out and " v7 " in out and "none yet" in out
