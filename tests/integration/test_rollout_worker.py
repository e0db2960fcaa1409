"""The rollout stage on the prompts stream, at least once: 20 prompts through 2 real-model workers; a full
rollouts stream past the backpressure timeout; a sample that always raises (dead-lettered with its reason, then
replayed); a graceful stop while waiting; a redelivered prompt whose group was written; ``enqueue --again``;
``where`` for a prompt in each state."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from pathlib import Path

import msgspec
import numpy as np
import pytest
import redis.asyncio as aioredis
from structlog.testing import capture_logs

from pipeline.backoff import BackoffPolicy
from pipeline.cli.locate import locate
from pipeline.cli.main import build_parser, main
from pipeline.demo.tinymodels import arithmetic_problem, ensure_tiny_models
from pipeline.stages import rollout_worker
from pipeline.stages.rollout_stage import RolloutStage
from pipeline.stages.rollout_worker import RolloutWorker
from pipeline.transport.consumer import StreamConsumer
from pipeline.transport.keys import Keys, pool_stream
from pipeline.transport.pacing import try_start
from pipeline.transport.pools import PoolProducer
from pipeline.transport.producer import StreamProducer
from pipeline.transport.prompts import Added, PromptJob, enqueue_prompts, read_record
from schemas import RolloutGroup, decode
from schemas.build import synthetic_rollout
from tests.streams import fast
from workers import rollout

pytestmark = pytest.mark.redis
G = 3


def write_prompts(path: Path, n: int) -> None:
    rng = random.Random(1)
    lines = []
    for i in range(n):
        q, a = arithmetic_problem(rng)
        lines.append(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": q}], "answer": a}))
    path.write_text("\n".join(lines) + "\n")


class Scripted(RolloutStage):
    """A stage that samples a synthetic group (of policy ``version``) per prompt; ``fail`` ids raise; ``gate`` (when
    set) is awaited first."""

    def __init__(self, fail: frozenset[str] = frozenset(), gate: asyncio.Event | None = None, version: int = 0) -> None:
        self.synced, self.fail, self.gate, self.version = None, fail, gate, version
        self.calls: Counter[str] = Counter()
        self.times: dict[str, list[float]] = {}  # when each prompt was sampled (monotonic)
        self.started = asyncio.Event()

    async def sample(self, job: PromptJob, epoch: int, group_id: str | None = None) -> RolloutGroup | None:
        self.calls[job.id] += 1
        self.times.setdefault(job.id, []).append(time.monotonic())
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        if job.id in self.fail:
            raise ValueError(f"no sample for {job.id}")
        return synthetic_rollout(1, 8, group_id=group_id or f"{epoch}:{job.id}", policy_version=self.version)


async def group_ids(r: aioredis.Redis, keys: Keys) -> list[str]:
    return [f[b"gid"].decode() for _, f in await r.xrange(keys.stream("rollouts"))]


async def drain_rollouts(r: aioredis.Redis, keys: Keys, seen: list[str], stop: asyncio.Event,
                         pool: str = "default") -> None:
    """A stand-in teacher of ``pool``: takes every entry off its stream (recording its group id) until ``stop``."""
    key = keys.stream(pool_stream(pool))
    while not stop.is_set():
        for eid, f in await r.xrange(key):
            seen.append(f[b"gid"].decode())
            await r.xdel(key, eid)
        await asyncio.sleep(0.05)


@pytest.mark.slow
async def test_enqueue_and_two_rollout_workers(tmp_path: Path, redis_url: str, keys: Keys,
                                               r: aioredis.Redis) -> None:
    tiny = ensure_tiny_models()
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 20)
    common = ["--redis-url", redis_url, "--namespace", keys.namespace]
    assert await asyncio.to_thread(main, ["enqueue", str(prompts), "--epoch", "1", *common]) == 0
    assert await asyncio.to_thread(main, ["enqueue", str(prompts), "--epoch", "1", *common]) == 0  # no-op
    assert await r.xlen(keys.stream("prompts")) == 20
    await r.set(keys.policy_version, 7)
    argv = ["worker", "rollout", "--backend", "hf", "--model", str(tiny.student), "--group-size", str(G),
            "--max-tokens", "6", "--reward", "math", "--max-jobs", "2", "--burst", *common]
    args = [build_parser().parse_args([*argv, "--consumer-name", f"w{i}"]) for i in range(2)]
    await asyncio.wait_for(asyncio.gather(*(rollout.serve(a, r, keys, asyncio.Event()) for a in args)), 120)
    entries = await r.xrange(keys.stream("rollouts"))
    groups = [decode(f[b"d"], expect=RolloutGroup) for _, f in entries]
    assert sorted(g.group_id for g in groups) == sorted(f"1:p{i}" for i in range(20))  # each once
    for g in groups:
        assert len(g.sequences) == G and g.policy_version == 7
        for s in g.sequences:
            mask = s.loss_mask.numpy()
            assert s.prompt_len >= 2 and not mask[: s.prompt_len].any()
            assert mask[s.prompt_len :].all() and s.length > s.prompt_len  # completion tokens are trainable
            lp = s.logprobs.numpy()  # type: ignore[union-attr]
            assert (lp[mask == 1] < 0).all() and (lp[mask == 0] == 0).all()
            assert s.score in (0.0, 1.0)
    assert np.isfinite([s.score for g in groups for s in g.sequences]).all()
    assert await r.xlen(keys.stream("prompts")) == 0  # every prompt acknowledged (and deleted)
    record = await read_record(r, keys, 1, "p3")
    assert record is not None and record["done"] == "1:p3"
    # a new epoch is not a no-op
    assert await asyncio.to_thread(main, ["enqueue", str(prompts), "--epoch", "2", *common]) == 0
    assert await r.xlen(keys.stream("prompts")) == 20


def test_enqueue_rejects_bad_file_entirely(tmp_path: Path, redis_url: str, keys: Keys,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text('{"id": "a", "prompt": "1+1="}\n{"id": "b"}\nnot json\n')
    assert main(["enqueue", str(f), "--redis-url", redis_url, "--namespace", keys.namespace]) == 1
    err = capsys.readouterr().err
    assert "line 2" in err and "line 3" in err and "nothing enqueued" in err


async def test_four_prompts_behind_a_full_stream_past_the_backpressure_timeout_all_arrive(
    keys: Keys, r: aioredis.Redis
) -> None:
    await enqueue_prompts(r, keys, [PromptJob(id=f"q{i}", prompt=f"{i}+1=") for i in range(4)])
    stage = Scripted()
    worker = RolloutWorker(r, keys, stage, fast(max_backlog=1, backpressure_timeout_s=0.3), consumer_name="w",
                           max_jobs=4)
    stop, drained = asyncio.Event(), asyncio.Event()
    with capture_logs() as logs:
        run = asyncio.create_task(worker.run(stop))
        await asyncio.sleep(1.5)  # five times the backpressure timeout, nobody reading rollouts
        assert len(await group_ids(r, keys)) == 1
        assert await StreamConsumer(r, keys, "prompts", "x").pending_count() == 3  # the rest wait, leased
        seen: list[str] = []
        teacher = asyncio.create_task(drain_rollouts(r, keys, seen, drained))
        for _ in range(100):
            if len(seen) == 4:
                break
            await asyncio.sleep(0.05)
        stop.set()
        stats = await asyncio.wait_for(run, 10)
        drained.set()
        await teacher
    assert sorted(seen) == [f"0:q{i}" for i in range(4)]
    assert stats.outcomes["emitted"] == 4 and sum(stage.calls.values()) == 4  # each sampled once
    assert await r.xlen(keys.stream("prompts")) == 0
    assert any(e["event"] == "downstream_full" for e in logs)


async def test_a_prompt_that_fails_every_time_is_dead_lettered_with_its_error_and_replayable(
    redis_url: str, keys: Keys, r: aioredis.Redis, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rollout_worker, "RETRY_BACKOFF", BackoffPolicy(base=0.4, cap=5.0, jitter=False))
    await enqueue_prompts(r, keys, [PromptJob(id="bad", prompt="?"), PromptJob(id="good", prompt="1+1=")])
    stage = Scripted(fail=frozenset({"bad"}))
    worker = RolloutWorker(r, keys, stage, fast(max_deliveries=3), consumer_name="w", burst=True)
    stats = await asyncio.wait_for(worker.run(asyncio.Event()), 30)
    assert stage.calls == {"bad": 3, "good": 1}  # max_deliveries=3 tries, then given up
    # Tries spaced by the backoff (0.4 s, then 0.8 s, the entry leased meanwhile), then the reclaim: idle for
    # claim_idle_ms (0.3 s) since its last lease renewal, which came at most a third of that before the release.
    t = stage.times["bad"]
    assert t[1] - t[0] >= 0.4 + 0.2 and t[2] - t[1] >= 0.8 + 0.2 and t[2] - t[1] > t[1] - t[0], t
    assert stats.outcomes["failed"] == 3 and stats.outcomes["dead_letter"] == 1
    assert await group_ids(r, keys) == ["0:good"]
    ((eid, fields),) = await r.xrange(keys.dlq)
    assert fields[b"stage"] == b"rollout" and fields[b"source"] == b"prompts" and fields[b"orig_gid"] == b"0:bad"
    assert fields[b"reason"] == b"rollout_failed: ValueError: no sample for bad (delivered 3 times)"
    record = await read_record(r, keys, 0, "bad")
    assert record is not None and record["error"] == "rollout_failed: ValueError: no sample for bad"
    common = ["--redis-url", redis_url, "--namespace", keys.namespace]
    assert await asyncio.to_thread(main, ["where", "0:bad", *common]) == 0
    out = capsys.readouterr().out
    assert "dead-lettered (stage rollout: rollout_failed: ValueError" in out
    assert f"distillq dlq replay {eid.decode()} sends the prompt back to prompts" in out
    assert await asyncio.to_thread(main, ["stats", "--json", *common]) == 0
    assert json.loads(capsys.readouterr().out)["dead_letters"] == 1
    # replayed, it is sampled again (it works now) and yields its group
    assert await asyncio.to_thread(main, ["dlq", "replay", eid.decode(), *common]) == 0
    assert "replayed" in capsys.readouterr().out
    assert await r.xlen(keys.dlq) == 0 and await r.xlen(keys.stream("prompts")) == 1
    again = RolloutWorker(r, keys, Scripted(), fast(), consumer_name="w2", burst=True)
    await asyncio.wait_for(again.run(asyncio.Event()), 30)
    assert await group_ids(r, keys) == ["0:good", "0:bad"]


async def test_a_graceful_stop_while_waiting_for_capacity_loses_nothing(keys: Keys, r: aioredis.Redis) -> None:
    await StreamProducer(r, keys, "rollouts").send(synthetic_rollout(1, 8, group_id="other"))  # the stream is full
    await enqueue_prompts(r, keys, [PromptJob(id="a", prompt="1+1="), PromptJob(id="b", prompt="2+2=")])
    settings = fast(max_backlog=1, backpressure_timeout_s=60)
    stop = asyncio.Event()
    first = RolloutWorker(r, keys, Scripted(), settings, consumer_name="w1", max_jobs=2)
    run = asyncio.create_task(first.run(stop))
    for _ in range(200):
        if first.stats.outcomes == {} and await StreamConsumer(r, keys, "prompts", "x").pending_count() == 2:
            break
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)  # both samples done, both pushes waiting
    stop.set()
    stats = await asyncio.wait_for(run, 10)
    assert stats.handled == 0 and await group_ids(r, keys) == ["other"]
    assert await StreamConsumer(r, keys, "prompts", "x").pending_count() == 2  # left pending, not lost
    assert (await read_record(r, keys, 0, "a") or {}).get("done") is None
    await r.delete(keys.stream("rollouts"))  # downstream drained
    second = RolloutWorker(r, keys, Scripted(), fast(), consumer_name="w2", burst=True)
    await asyncio.wait_for(second.run(asyncio.Event()), 30)  # reclaims them after claim_idle_ms
    assert sorted(await group_ids(r, keys)) == ["0:a", "0:b"]


async def test_a_redelivered_prompt_whose_group_was_written_is_acked_without_sampling(
    keys: Keys, r: aioredis.Redis
) -> None:
    await enqueue_prompts(r, keys, [PromptJob(id="p", prompt="1+1=")])
    dead = StreamConsumer(r, keys, "prompts", "dead", fast())
    await dead.ensure_group()
    assert len(await dead.read(1, block_ms=50)) == 1  # read by a worker that pushed the group and died
    await StreamProducer(r, keys, "rollouts").send(synthetic_rollout(1, 8, group_id="0:p"))
    stage = Scripted()
    stats = await asyncio.wait_for(RolloutWorker(r, keys, stage, fast(), consumer_name="w", burst=True)
                                   .run(asyncio.Event()), 30)
    assert stage.calls == {} and stats.outcomes == {"already_emitted": 1}
    assert await group_ids(r, keys) == ["0:p"] and await r.xlen(keys.stream("prompts")) == 0


async def test_enqueue_again_takes_only_prompts_that_left_no_group(keys: Keys, r: aioredis.Redis) -> None:
    jobs = [PromptJob(id=i, prompt="1+1=") for i in ("done", "dead", "queued")]
    assert (await enqueue_prompts(r, keys, jobs))[Added.ADDED] == 3
    assert (await enqueue_prompts(r, keys, jobs))[Added.ENQUEUED_BEFORE] == 3  # idempotent
    stage = Scripted(fail=frozenset({"dead"}))
    worker = RolloutWorker(r, keys, stage, fast(max_deliveries=1), consumer_name="w", max_jobs=2)
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))
    for _ in range(200):
        if await r.xlen(keys.dlq) == 1 and len(await group_ids(r, keys)) == 2:
            break
        await asyncio.sleep(0.02)
    stop.set()
    await asyncio.wait_for(run, 10)
    await enqueue_prompts(r, keys, [PromptJob(id="late", prompt="3+3=")])  # still queued
    got = await enqueue_prompts(r, keys, [*jobs, PromptJob(id="late", prompt="3+3=")], again=True)
    assert got[Added.ADDED] == 1 and got[Added.DONE] == 2 and got[Added.STILL_QUEUED] == 1
    assert (await locate(r, keys, "0:late")).summary.startswith("prompt queued for a rollout worker")


async def test_where_reports_a_prompt_in_flight_with_its_deliveries_and_last_error(
    keys: Keys, r: aioredis.Redis
) -> None:
    await enqueue_prompts(r, keys, [PromptJob(id="p", prompt="1+1=")])
    gate = asyncio.Event()
    stage = Scripted(fail=frozenset({"p"}))
    worker = RolloutWorker(r, keys, stage, fast(max_deliveries=5), consumer_name="w1")
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))
    for _ in range(200):  # its first try failed: the error is on the record
        if (await read_record(r, keys, 0, "p") or {}).get("error"):
            break
        await asyncio.sleep(0.02)
    stage.fail, stage.gate = frozenset(), gate  # the next try hangs, in flight
    for _ in range(200):
        if stage.calls["p"] == 2:
            break
        await asyncio.sleep(0.02)
    w = await locate(r, keys, "0:p")
    assert w.summary.startswith("prompt in flight at rollout worker w1 for ")
    assert "delivered 2 time(s); last error: rollout_failed: ValueError: no sample for p" in w.summary
    gate.set()
    for _ in range(200):
        if await group_ids(r, keys):
            break
        await asyncio.sleep(0.02)
    stop.set()
    await asyncio.wait_for(run, 10)
    w = await locate(r, keys, "0:p")
    assert w.prompt is not None and w.prompt["done"] == "0:p" and w.summary == "waiting for a teacher worker"


class PoolScripted(Scripted):
    """``Scripted``, its groups carrying the prompt's ``group_overrides`` (so each goes to its teacher pool)."""

    async def sample(self, job: PromptJob, epoch: int, group_id: str | None = None) -> RolloutGroup | None:
        group = await super().sample(job, epoch, group_id)
        return None if group is None else msgspec.structs.replace(group, group_overrides=job.group_overrides)


async def test_a_full_pool_holds_back_its_own_prompts_only(keys: Keys, r: aioredis.Redis) -> None:
    """Pool ``down`` has no teacher and its stream is at the cap; its prompts come first and would take both job
    slots. They wait unsampled outside the slots, and every prompt of the pool with room goes on."""
    settings = fast(max_backlog=1)
    full = msgspec.structs.replace(synthetic_rollout(1, 8, group_id="x"), group_overrides={"teacher": "down"})
    await PoolProducer(r, keys, settings).send(full)
    jobs = [PromptJob(id=f"d{i}", prompt="1+1=", teacher="down") for i in range(3)]
    jobs += [PromptJob(id=f"u{i}", prompt="2+2=") for i in range(4)]
    await enqueue_prompts(r, keys, jobs)
    stage = PoolScripted()
    worker = RolloutWorker(r, keys, stage, settings, consumer_name="w", max_jobs=2)
    stop, drained = asyncio.Event(), asyncio.Event()
    seen: list[str] = []
    teacher = asyncio.create_task(drain_rollouts(r, keys, seen, drained))  # the default pool's teacher
    with capture_logs() as logs:
        run = asyncio.create_task(worker.run(stop))
        for _ in range(200):
            if len(seen) == 4:
                break
            await asyncio.sleep(0.05)
        assert sorted(seen) == [f"0:u{i}" for i in range(4)]
        assert {k: n for k, n in stage.calls.items() if k.startswith("d")} == {}  # never sampled while full
        assert worker.parked == 3
        await r.delete(keys.stream(pool_stream("down")))  # its teacher comes: room for one group at a time
        got: list[str] = []
        down_teacher = asyncio.create_task(drain_rollouts(r, keys, got, drained, pool="down"))
        for _ in range(200):
            if len(got) == 3:
                break
            await asyncio.sleep(0.05)
        stop.set()
        stats = await asyncio.wait_for(run, 10)
        drained.set()
        await asyncio.gather(teacher, down_teacher)
    assert sorted(got) == [f"0:d{i}" for i in range(3)] and stats.outcomes["emitted"] == 7
    assert sum(stage.calls.values()) == 7 and worker.parked == 0
    assert [e["pool"] for e in logs if e["event"] == "pool_full_waiting"].count("down") == 3  # once each


class Versioned(Scripted):
    """``Scripted``, each group tagged with the learner's policy version when its sampling starts."""

    def __init__(self, r: aioredis.Redis, keys: Keys) -> None:
        super().__init__()
        self.r, self.keys = r, keys

    async def sample(self, job: PromptJob, epoch: int, group_id: str | None = None) -> RolloutGroup | None:
        raw = await self.r.get(self.keys.policy_version)
        self.version = int(raw) if raw is not None else 0
        await asyncio.sleep(0.01)
        return await super().sample(job, epoch, group_id)


@pytest.mark.parametrize("max_ahead", [0, 2])
async def test_max_ahead_bounds_staleness_and_lead_with_two_workers(keys: Keys, r: aioredis.Redis,
                                                                     max_ahead: int) -> None:
    """Two rollout workers, 40 queued prompts, a learner that trains G = 2 groups a step in order and publishes a
    version after each: no group trains more than ``max_ahead`` versions stale, and sampling never runs more
    than ``(1 + max_ahead) * G`` groups ahead of what the learner trained."""
    per_step, n = 2, 40
    await enqueue_prompts(r, keys, [PromptJob(id=f"p{i:02d}", prompt="1+1=") for i in range(n)])
    workers = [RolloutWorker(r, keys, Versioned(r, keys), fast(), consumer_name=f"w{i}", max_jobs=2,
                             pace=(max_ahead, per_step)) for i in range(2)]
    stop = asyncio.Event()
    runs = [asyncio.create_task(w.run(stop)) for w in workers]
    key, trained, stale, leads = keys.stream("rollouts"), 0, [], []
    version = 0
    while trained < n:
        entries = (await r.xrange(key))[:per_step]
        if len(entries) < per_step and trained + len(entries) < n:
            await asyncio.sleep(0.02)
            continue
        started = int(await r.hget(keys.pacing, "started") or 0)  # type: ignore[misc]
        leads.append(started - trained)
        for eid, f in entries:
            group = decode(await r.get(f[b"h"]) if b"h" in f else f[b"d"])
            assert isinstance(group, RolloutGroup)
            stale.append(version - group.policy_version)
            await r.xdel(key, eid)
        trained += len(entries)
        version += 1
        await r.set(keys.policy_version, version)
        await asyncio.sleep(0.05)  # a learner step
    stop.set()
    await asyncio.gather(*runs)
    assert len(stale) == n and max(stale) <= max_ahead
    assert max(leads) <= (1 + max_ahead) * per_step
    assert sum(w.stats.outcomes["emitted"] for w in workers) == n


async def test_pacing_counts_starts_against_the_version_and_starts_over_for_a_new_run(keys: Keys,
                                                                                      r: aioredis.Redis) -> None:
    async def start() -> bool:
        return (await try_start(r, keys, max_ahead=1, groups_per_step=2)).allowed

    assert [await start() for _ in range(5)] == [True] * 4 + [False]  # (0 + 1 + 1) x 2 at version 0
    await r.set(keys.policy_version, 3)
    assert [await start() for _ in range(7)] == [True] * 6 + [False]  # (3 + 1 + 1) x 2 = 10 by version 3
    await r.set(keys.policy_version, 0)  # a new learner run from version 0 in the same namespace
    assert await start() and int(await r.hget(keys.pacing, "started")) == 1  # type: ignore[misc]
