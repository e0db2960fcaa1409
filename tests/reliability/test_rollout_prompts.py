"""The rollout stage under faults, with real worker processes: kill -9 of a rollout worker holding prompts (they are
sampled again within the reclaim time, each prompt yields exactly one group), and a stale group's prompt sampled
again with ``distillq dlq resample`` until its new group reaches the learner."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from pipeline.cli.main import main
from pipeline.demo.tinymodels import ensure_tiny_models
from pipeline.learner.client import AsyncLearner
from pipeline.stages import rollout_worker
from pipeline.stages.rollout_worker import RolloutWorker
from pipeline.transport.keys import Keys
from pipeline.transport.prompts import PromptJob, enqueue_prompts
from tests.integration.test_rollout_worker import Scripted
from tests.redis_server import RedisServer
from tests.reliability.harness import Workers, fast_settings, redis_client, report, wait_until

pytestmark = [pytest.mark.redis, pytest.mark.slow]  # worker processes end to end
#: Enough prompts that both workers hold some while their stream is full: each takes up to ``max_jobs`` into its
#: slots and ``PARKED_PER_JOB * max_jobs`` more that wait for room unsampled (``pipeline.stages.rollout_worker``).
N = 2 * (1 + rollout_worker.PARKED_PER_JOB) * 2 + 4


async def _pending_of(r: Any, keys: Keys, consumer: str) -> int:
    try:
        rows = await r.xpending_range(keys.stream("prompts"), "rollout", min="-", max="+", count=100,
                                      consumername=consumer)
    except Exception:  # the group is not there yet
        return 0
    return len(rows)


@pytest.mark.timeout(400)
async def test_kill_9_of_a_rollout_worker_its_prompts_run_again_within_the_reclaim_time(
    private_redis: RedisServer, namespace: str, workers: Workers
) -> None:
    keys, r = Keys(namespace), redis_client(private_redis.url)
    await enqueue_prompts(r, keys, [PromptJob(id=f"p{i}", prompt=f"{i}+{i}=", answer=str(2 * i)) for i in range(N)])
    tiny = ensure_tiny_models()
    argv = ("--backend", "hf", "--model", str(tiny.student), "--group-size", "2", "--max-tokens", "4",
            "--reward", "math", "--max-jobs", "2")
    env = {"DISTILLQ_MAX_BACKLOG": "2", "DISTILLQ_BACKPRESSURE_TIMEOUT_S": "1"}  # nobody reads rollouts yet
    victim = workers.add("r1", "rollout", *argv, env=env)
    workers.add("r2", "rollout", *argv, env=env)
    # both wait behind the full stream, each holding prompts (in its slots and waiting for room): kill one then
    assert await wait_until(lambda: _both_hold(r, keys), 240), victim.log_text()[-3000:]
    held = await _pending_of(r, keys, "r1")
    victim.kill()
    killed_at = time.monotonic()
    seen: list[str] = []
    reclaimed_after: float | None = None
    end = time.monotonic() + 120
    while time.monotonic() < end and len(seen) < N:  # a stand-in teacher drains rollouts
        for eid, f in await r.xrange(keys.stream("rollouts")):
            seen.append(f[b"gid"].decode())
            await r.xdel(keys.stream("rollouts"), eid)
        if reclaimed_after is None and await _pending_of(r, keys, "r1") == 0:
            reclaimed_after = time.monotonic() - killed_at
        await asyncio.sleep(0.05)
    report("rollout_kill9", prompts=N, held_by_killed=held, reclaimed_after_s=reclaimed_after or -1.0,
           groups=len(seen), distinct=len(set(seen)))
    assert sorted(seen) == sorted(f"0:p{i}" for i in range(N))  # every prompt exactly one group
    assert reclaimed_after is not None and reclaimed_after < 5.0  # claim_idle_ms is 1 s here
    assert await r.xlen(keys.stream("prompts")) == 0 and await r.xlen(keys.dlq) == 0


async def _both_hold(r: Any, keys: Keys) -> bool:
    return await _pending_of(r, keys, "r1") > 0 and await _pending_of(r, keys, "r2") > 0


@pytest.mark.timeout(300)
async def test_a_stale_group_is_resampled_with_one_command_and_its_new_group_reaches_the_learner(
    private_redis: RedisServer, namespace: str, workers: Workers, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys, r = Keys(namespace), redis_client(private_redis.url)
    await enqueue_prompts(r, keys, [PromptJob(id="p", prompt="1+1=", answer="2")])
    settings = fast_settings()
    await asyncio.wait_for(RolloutWorker(r, keys, Scripted(), settings, burst=True).run(asyncio.Event()), 30)
    workers.teacher("t0")
    workers.add("f0", "feeder", "--max-batch-groups", "1", "--max-wait", "0.2")  # max staleness 4 at the feeder
    assert await wait_until(lambda: _stream_has(r, keys.stream("batches")), 60)
    await r.set(keys.policy_version, 5)  # the learner moved on: the group is 5 versions behind at delivery
    learner = AsyncLearner(redis=r, namespace=namespace, settings=settings, prefetch=False)
    assert await learner.next_batch(timeout_s=5) is None  # its only group dead-lettered as stale
    ((_, fields),) = await r.xrange(keys.dlq)
    assert fields[b"stage"] == b"learner" and fields[b"reason"].startswith(b"stale:")
    common = ["--redis-url", private_redis.url, "--namespace", namespace]
    assert await asyncio.to_thread(main, ["where", "0:p", *common]) == 0
    assert "distillq dlq resample 0:p" in capsys.readouterr().out
    assert await asyncio.to_thread(main, ["dlq", "resample", "0:p", *common]) == 0
    assert "as group 0:p@v5" in capsys.readouterr().out
    assert await r.xlen(keys.dlq) == 0
    assert await asyncio.to_thread(main, ["dlq", "resample", "0:p", *common]) == 1  # once per stale group
    stage = Scripted(version=5)
    await asyncio.wait_for(RolloutWorker(r, keys, stage, settings, burst=True).run(asyncio.Event()), 30)
    batch = await learner.next_batch(timeout_s=60)
    assert batch is not None and [g.group_id for g in batch.batch.groups] == ["0:p@v5"]
    assert stage.calls == {"p": 1}
    await learner.ack(batch)
    where = json.loads(await _where_json(private_redis.url, namespace, "0:p@v5"))
    assert where["summary"].startswith("batched and acknowledged by the learner (batch entry ")
    assert where["summary"].endswith("): it reached training")


async def _stream_has(r: Any, key: str) -> bool:
    return int(await r.xlen(key)) > 0


async def _where_json(url: str, namespace: str, gid: str) -> str:
    import subprocess
    import sys

    p = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "pipeline.cli.main", "where", gid, "--json",
                                                 "--redis-url", url, "--namespace", namespace],
                                capture_output=True, text=True, timeout=60, check=False)
    return p.stdout
