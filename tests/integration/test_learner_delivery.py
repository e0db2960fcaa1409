"""The learner client at delivery, against a real redis-server: staleness checked against the current policy
version, a bound on batches ready ahead of the learner, leases renewed during a long step, clear errors."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import structlog

from pipeline.learner.checks import LearnerConnectionError
from pipeline.learner.client import AsyncLearner, Learner
from pipeline.stages.batching import BatchingConfig
from pipeline.stages.feeder import Feeder
from pipeline.stages.kl_control import ConstantKL
from pipeline.transport.keys import Keys
from pipeline.transport.producer import StreamProducer
from schemas.build import synthetic_rollout, synthetic_scored
from tests.integration.test_feeder import payload_keys
from tests.streams import fast

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]
ROOT = Path(__file__).resolve().parents[2]


async def push(r: aioredis.Redis, keys: Keys, versions: list[int]) -> list[str]:
    prod = StreamProducer(r, keys, "scored", fast())
    ids = []
    for i, v in enumerate(versions):
        g = synthetic_rollout(2, 16, group_id=f"g{i:03d}", policy_version=v, seed=i)
        await prod.send(synthetic_scored(g, k=4, seed=i))
        ids.append(g.group_id)
    return ids


async def feed(r: aioredis.Redis, keys: Keys, **cfg: object) -> None:
    c = BatchingConfig(**{"max_wait_s": 3600.0, **cfg})  # type: ignore[arg-type]
    await asyncio.wait_for(Feeder(r, keys, c, ConstantKL(0.1), fast()).run(asyncio.Event(), burst=True), 20)


async def dead_letters(r: aioredis.Redis, keys: Keys) -> list[tuple[str, str]]:
    return [(f[b"orig_gid"].decode(), f[b"reason"].decode()) for _, f in await r.xrange(keys.dlq)]


async def test_groups_too_old_at_delivery_are_dead_lettered_with_the_reason(r: aioredis.Redis, keys: Keys) -> None:
    await r.set(keys.policy_version, 6)
    ids = await push(r, keys, [2, 5, 6, 3])  # all within --max-staleness 4 when batched at version 6
    await feed(r, keys, max_staleness=4)
    await r.set(keys.policy_version, 9)  # the learner trained on: at delivery, versions 2 and 3 are too old
    learner = AsyncLearner(redis=r, namespace=keys.namespace, settings=fast())
    lb = await learner.next_batch(2)
    assert lb is not None and lb.group_ids == [ids[1], ids[2]]
    stats = lb.batch.stats or {}
    assert stats["staleness_4"] == 1 and stats["staleness_3"] == 1 and stats["stale_dropped"] == 2
    assert stats["delivered_version"] == 9 and stats["batched_staleness_0"] == 1 and stats["max_staleness"] == 4
    assert not any(k.startswith("staleness_") and int(k.split("_")[1]) > 4 for k in stats)
    dl = await dead_letters(r, keys)
    assert [g for g, _ in dl] == [ids[0], ids[3]]
    assert dl[0][1] == "stale: sampled by policy version 2, 7 versions behind version 9 at delivery (max_staleness 4)"
    await learner.ack(lb)
    assert await payload_keys(r, keys) == []


async def test_a_batch_entirely_stale_is_skipped_and_the_learner_can_choose_its_own_bound(
    r: aioredis.Redis, keys: Keys
) -> None:
    ids = await push(r, keys, [0, 0, 1, 1])
    await feed(r, keys, max_staleness=4, max_batch_groups=2)
    await r.set(keys.policy_version, 10)
    deliver = AsyncLearner(redis=r, namespace=keys.namespace, settings=fast(), on_stale="deliver")
    lb = await deliver.next_batch(2)  # handed out anyway, the staleness at delivery in its stats
    assert lb is not None and lb.group_ids == ids[:2] and (lb.batch.stats or {})["staleness_10"] == 2
    await deliver.ack(lb)
    await deliver.aclose()  # one live process per consumer name: the next learner-0 starts after it
    strict = AsyncLearner(redis=r, namespace=keys.namespace, settings=fast(), max_staleness=8)
    assert await strict.next_batch(1) is None  # version 1 is 9 behind: both groups dead-lettered, batch settled
    assert [g for g, _ in await dead_letters(r, keys)] == ids[2:]
    assert await r.xlen(keys.stream("batches")) == 0


async def test_feeder_stops_building_batches_far_ahead_of_the_learner(r: aioredis.Redis, keys: Keys) -> None:
    await push(r, keys, [0] * 10)
    cfg = BatchingConfig(max_batch_groups=2, max_wait_s=3600, max_staleness=None)
    feeder = Feeder(r, keys, cfg, ConstantKL(0.1), fast(backpressure_timeout_s=30), max_ready_batches=2)
    stop = asyncio.Event()
    task = asyncio.create_task(feeder.run(stop, burst=True))
    await asyncio.sleep(1.5)
    assert await r.xlen(keys.stream("batches")) == 2  # two ready; the rest of the groups wait, pending
    assert await r.xlen(keys.stream("scored")) == 6
    learner = AsyncLearner(redis=r, namespace=keys.namespace, settings=fast(), prefetch=False)
    got = 0
    while got < 5:
        lb = await learner.next_batch(5)
        assert lb is not None
        assert await r.xlen(keys.stream("batches")) <= 2
        await learner.ack(lb)
        got += 1
    await asyncio.wait_for(task, 10)
    assert await r.xlen(keys.stream("scored")) == 0


async def test_a_step_longer_than_the_reclaim_idle_time_keeps_its_batch(r: aioredis.Redis, keys: Keys) -> None:
    await push(r, keys, [0, 0])
    await feed(r, keys, max_batch_groups=1)
    settings = fast(claim_idle_ms=300, claim_interval_ms=50)
    slow = AsyncLearner(redis=r, namespace=keys.namespace, settings=settings, prefetch=False)
    other = AsyncLearner(redis=r, namespace=keys.namespace, settings=settings, consumer_name="learner-1",
                         prefetch=False)
    held = await slow.next_batch(2)
    assert held is not None
    second = await other.next_batch(2)
    assert second is not None and second.entry_id != held.entry_id
    await other.ack(second)
    # A 1.5 s step, five times the idle time: the lease is renewed, so the other consumer never takes it.
    assert await other.next_batch(1.5) is None
    await slow.ack(held)
    await slow.aclose()
    await other.aclose()
    assert await r.xlen(keys.stream("batches")) == 0


async def test_a_batch_left_by_a_stopped_learner_is_reclaimed_once_idle(r: aioredis.Redis, keys: Keys) -> None:
    await push(r, keys, [0])
    await feed(r, keys)
    settings = fast(claim_idle_ms=300, claim_interval_ms=50)
    gone = AsyncLearner(redis=r, namespace=keys.namespace, settings=settings, prefetch=False)
    held = await gone.next_batch(2)
    assert held is not None
    await gone.aclose()  # stops renewing; the batch stays pending
    other = AsyncLearner(redis=r, namespace=keys.namespace, settings=settings, consumer_name="learner-1")
    again = await other.next_batch(3)
    assert again is not None and again.entry_id == held.entry_id and again.redelivered
    await other.ack(again)
    await other.aclose()


def test_unreachable_redis_is_one_line() -> None:
    with pytest.raises(LearnerConnectionError) as e:
        Learner("redis://:secret@127.0.0.1:1/0")
    msg = str(e.value)
    assert msg.startswith("cannot reach Redis at redis://:***@127.0.0.1:1/0: ") and "\n" not in msg
    assert "secret" not in msg and e.value.__cause__ is None and e.value.__suppress_context__


async def test_a_namespace_without_feeder_warns_and_names_the_ones_with_one(r: aioredis.Redis, keys: Keys) -> None:
    other = Keys(f"{keys.namespace}x")
    await r.set(other.heartbeat("feeder", "f1"), "{}", ex=30)
    learner = AsyncLearner(redis=r, namespace=keys.namespace, settings=fast())
    with structlog.testing.capture_logs() as logs:
        assert await learner.next_batch(0.5) is None
    hints = [x for x in logs if x["event"] == "no_feeder_in_namespace"]
    assert len(hints) == 1 and f"namespace {keys.namespace!r} has no feeder heartbeat" in hints[0]["hint"]
    assert other.namespace in hints[0]["hint"]
    await learner.aclose()
    # With a feeder heartbeat in the namespace: no warning.
    await r.set(keys.heartbeat("feeder", "f1"), "{}", ex=30)
    quiet = AsyncLearner(redis=r, namespace=keys.namespace, settings=fast())
    with structlog.testing.capture_logs() as logs:
        assert await quiet.next_batch(0.5) is None
    assert not [x for x in logs if x["event"] == "no_feeder_in_namespace"]
    await quiet.aclose()


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_documented_order_loses_no_update_after_kill_9(r: aioredis.Redis, keys: Keys, redis_url: str,
                                                             tmp_path: Path) -> None:
    """Step, checkpoint, ack, publish: a learner killed with SIGKILL between each two of them (at steps 2, 3
    and 4) and restarted each time ends with the same weights, bit for bit, as one that never stopped:
    every batch trained exactly once."""
    from safetensors import safe_open

    ref = Keys(f"{keys.namespace}ref")
    for k in (keys, ref):
        await push(r, k, [0] * 10)
        await feed(r, k, max_batch_groups=2, max_staleness=None)

    def run(k: Keys, name: str, *extra: str) -> int:
        argv = [sys.executable, "-m", "tests.learner_resume", redis_url, k.namespace, str(tmp_path / f"{name}.ckpt"),
                str(tmp_path / f"{name}.safetensors"), *extra]
        # a short heartbeat: the name a killed learner held is free 1.5 s after, not 15 s (transport.identity)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "DISTILLQ_HEARTBEAT_INTERVAL_S": "0.5"}
        p = subprocess.run(argv, cwd=ROOT, env=env, timeout=120,
                           capture_output=True, text=True, check=False)
        (tmp_path / f"{name}.log").write_text(p.stdout + p.stderr)
        return p.returncode

    assert await asyncio.to_thread(run, ref, "ref") == 0, (tmp_path / "ref.log").read_text()[-3000:]
    for step, point in ((2, "after_step"), (3, "after_checkpoint"), (4, "after_ack")):
        code = await asyncio.to_thread(run, keys, "crash", "--crash-at", str(step), "--crash-point", point)
        assert code == -9, (tmp_path / "crash.log").read_text()[-3000:]
        # Killed before version ``step`` was published (after_ack: the checkpoint holds it; published on restart)
        assert await r.get(keys.policy_version) == str(step - 1).encode()
    assert await asyncio.to_thread(run, keys, "crash") == 0, (tmp_path / "crash.log").read_text()[-3000:]
    out: list[dict[str, object]] = []
    for name in ("ref", "crash"):
        with safe_open(str(tmp_path / f"{name}.safetensors"), framework="pt") as f:
            out.append({"meta": f.metadata(), **{k: f.get_tensor(k) for k in f.keys()}})  # noqa: SIM118
    assert out[0]["meta"] == out[1]["meta"] == {"version": "5", "step": "5"}
    for k, v in out[0].items():
        if k != "meta":
            assert v.equal(out[1][k]), k  # type: ignore[attr-defined]
    assert await r.get(keys.policy_version) == b"5"
    assert await r.xlen(keys.stream("batches")) == 0 and await payload_keys(r, keys) == []
