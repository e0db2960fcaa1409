"""``distillq stats`` ``attention:`` with real worker processes: a stage with work and no worker, then two feeders
with different settings, then kill -9 of both (their batches wait for a learner that is not there); a teacher
whose backend sends vLLM's -9999 sentinel, then one that is slow, which ``--check`` keeps healthy."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pipeline.transport.keys import Keys
from pipeline.transport.producer import StreamProducer
from schemas.build import synthetic_rollout, synthetic_scored
from tests.redis_server import RedisServer
from tests.reliability.harness import FAST_ENV, Workers, heartbeat_pid, redis_client, wait_until
from tests.reliability.teacher_stub import MODEL, SwitchableTeacher
from tests.reliability.test_debugging import dq, stats_json

pytestmark = [pytest.mark.reliability, pytest.mark.slow, pytest.mark.redis, pytest.mark.timeout(120)]


def attention(url: str, ns: str) -> list[str]:
    return list(stats_json(url, ns)["attention"])


async def _says(url: str, ns: str, text: str) -> bool:
    return any(text in line for line in await asyncio.to_thread(attention, url, ns))


async def test_no_live_feeder_then_feeders_that_disagree_then_batches_without_a_learner(
    workers: Workers, private_redis: RedisServer, namespace: str
) -> None:
    url, keys = private_redis.url, Keys(namespace)
    r = redis_client(url)
    prod = StreamProducer(r, keys, "scored")
    for i in range(4):
        await prod.send(synthetic_scored(synthetic_rollout(1, 8, group_id=f"s{i}", seed=i), k=4))
    assert "stream scored has 4 entries and no live feeder worker: start one (distillq worker feeder)" in \
        attention(url, namespace)

    f1 = workers.feeder("f1", "--max-batch-tokens", "4096")
    f2 = workers.feeder("f2", "--max-batch-tokens", "8192")
    want = "feeders disagree on max_batch_tokens: f1 4096, f2 8192"
    assert await wait_until(lambda: _says(url, namespace, want), 30), f1.log_text()[-2000:] + f2.log_text()[-2000:]
    lines = attention(url, namespace)
    assert not any("no live feeder" in x for x in lines), lines
    assert sum(x.startswith("feeders disagree") for x in lines) == 1, lines  # the other settings agree

    assert await wait_until(lambda: _batched(r, keys), 30), f1.log_text()[-2000:]
    f1.kill()
    f2.kill()
    assert await wait_until(lambda: _says(url, namespace, "no live learner worker (no consumer in its group)"), 10)

    async def agreed() -> bool:  # their heartbeats expired (three intervals after the kill): no disagreement left
        return not await _says(url, namespace, "disagree")
    assert await wait_until(agreed, 10), attention(url, namespace)


async def _beats(r: Any, key: str, pid: int) -> bool:
    return await heartbeat_pid(r, key) == pid


async def _batched(r: Any, keys: Keys) -> bool:
    return int(await r.xlen(keys.stream("batches"))) > 0 and int(await r.xlen(keys.stream("scored"))) == 0


async def test_a_teacher_sending_the_sentinel_then_a_slow_teacher(
    workers: Workers, private_redis: RedisServer, namespace: str
) -> None:
    url, keys = private_redis.url, Keys(namespace)
    r = redis_client(url)
    stub = SwitchableTeacher()
    await stub.start()
    try:
        teacher = workers.add("t1", "teacher", "--backend", "vllm", "--url", stub.url, "--model", MODEL, "--top-k",
                              "4", "--timeout", "1", "--retries", "0")
        assert await wait_until(lambda: _beats(r, keys.heartbeat("teacher", "t1"), teacher.pid), 30), \
            teacher.log_text()[-2000:]
        await stub.set_mode("sentinel")  # after its start-up self-test, which would refuse the sentinel
        prod = StreamProducer(r, keys, "rollouts")
        for i in range(2):
            await prod.send(synthetic_rollout(1, 8, group_id=f"g{i}", seed=i))
        want = "teacher t1 got invalid teacher values for 2 group(s)"
        assert await wait_until(lambda: _says(url, namespace, want), 30), teacher.log_text()[-3000:]

        await stub.set_mode("hang")  # takes the request, never answers: every call times out after 1 s
        await prod.send(synthetic_rollout(1, 8, group_id="slow", seed=7))
        assert await wait_until(lambda: _says(url, namespace, "(slow but alive, not unreachable)"), 30), \
            teacher.log_text()[-3000:]
        lines = attention(url, namespace)
        assert not any("unreachable:" in x or "backend failing" in x for x in lines), lines
        env = {"DISTILLQ_HEARTBEAT_INTERVAL_S": FAST_ENV["DISTILLQ_HEARTBEAT_INTERVAL_S"]}
        p = dq(url, namespace, "worker", "teacher", "--check", "--any-host", env=env)
        assert p.returncode == 0, p.stdout + p.stderr
        assert "1 teacher worker(s) healthy; 1 slow: t1: teacher slow: " in p.stdout + p.stderr
    finally:
        await stub.close()
