"""Learner stall: the learner stops for 15 s (shortened from the issue's 60 s) while a producer keeps
offering groups. Every stream stays within ``DISTILLQ_MAX_BACKLOG``, the producer waits, Redis memory
stays bounded and flat, nothing unconsumed is trimmed, and after the learner resumes every group arrives."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from pipeline.transport.keys import Keys
from pipeline.transport.producer import SMALL_MESSAGE_BYTES, AddResult, ProducerStopped, StreamProducer
from schemas import encode
from schemas.build import synthetic_rollout, synthetic_scored
from tests.redis_server import RedisServer
from tests.reliability.harness import (
    RecordingLearner,
    Workers,
    fast_settings,
    heartbeat_pid,
    redis_client,
    report,
    wait_until,
)

pytestmark = [pytest.mark.reliability, pytest.mark.slow, pytest.mark.redis, pytest.mark.timeout(150)]

CAP = 50
GROUPS = 600
STALL_S = 15.0
K = 8
GROUPS_PER_BATCH = 4
STREAMS = ("rollouts", "scored", "batches")


@dataclass
class Samples:
    at: list[float] = field(default_factory=list)
    lengths: dict[str, list[int]] = field(default_factory=lambda: {s: [] for s in STREAMS})
    memory: list[int] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)

    def window(self, start: float, end: float) -> list[int]:
        return [i for i, t in enumerate(self.at) if start <= t <= end]


async def sample(r: Any, keys: Keys, sent: list[float], stop: asyncio.Event, out: Samples) -> None:
    while not stop.is_set():
        out.at.append(time.monotonic())
        for s in STREAMS:
            out.lengths[s].append(int(await r.xlen(keys.stream(s))))
        out.memory.append(int((await r.info("memory"))["used_memory"]))
        out.sent.append(len(sent))
        await asyncio.sleep(0.2)


async def produce(r: Any, keys: Keys, sent: list[float]) -> None:
    prod = StreamProducer(r, keys, "rollouts", fast_settings(max_backlog=CAP, backpressure_timeout_s=120))
    for i in range(GROUPS):
        added = await prod.send(synthetic_rollout(2, 32, group_id=f"g{i:04d}", seed=i))
        assert added.result is AddResult.ADDED
        sent.append(time.monotonic())


def memory_bound() -> int:
    """Bytes a full pipeline may hold: every stream at its cap, entries at twice their payload size,
    plus three dedupe markers per group (~200 B each) and 2 MiB for Redis' own churn."""
    rollout = synthetic_rollout(2, 32, seed=0)
    scored = len(encode(synthetic_scored(rollout, k=K)))
    per_entry = len(encode(rollout)) + scored + GROUPS_PER_BATCH * (scored + 2 * 32 * 4)
    return 2 * CAP * per_entry + GROUPS * 3 * 200 + (2 << 20)


async def test_learner_stall_bounded_streams_and_memory(
    workers: Workers, private_redis: RedisServer, namespace: str
) -> None:
    keys = Keys(namespace)
    r = redis_client(private_redis.url)
    workers.env["DISTILLQ_MAX_BACKLOG"] = str(CAP)
    t1 = workers.teacher("t1", "--top-k", str(K))
    # --max-ready-batches 0: the batches stream is bounded by DISTILLQ_MAX_BACKLOG alone, the cap under test.
    f1 = workers.add("f1", "feeder", "--max-batch-groups", str(GROUPS_PER_BATCH), "--max-wait", "0.2",
                     "--max-staleness", "-1", "--max-ready-batches", "0")
    for stage, p in (("teacher", t1), ("feeder", f1)):
        up = functools.partial(_has_pid, r, keys.heartbeat(stage, p.name), p.pid)
        assert await wait_until(up, 30), p.log_text()[-2000:]
    baseline = int((await r.info("memory"))["used_memory"])

    learner = RecordingLearner(private_redis.url, namespace)
    stop, stop_sampling = asyncio.Event(), asyncio.Event()
    sent: list[float] = []
    samples = Samples()
    tasks = [asyncio.create_task(learner.run(stop)), asyncio.create_task(produce(r, keys, sent)),
             asyncio.create_task(sample(r, keys, sent, stop_sampling, samples))]
    assert await wait_until(lambda: _true(learner.batches >= 5), 30)
    learner.running.clear()
    stall_start = time.monotonic()
    await asyncio.sleep(STALL_S)
    stall_end = time.monotonic()
    learner.running.set()
    await asyncio.wait_for(tasks[1], 60)
    all_in = await wait_until(lambda: _true(len(learner.counts) >= GROUPS), 60)
    await asyncio.sleep(1.0)
    stop.set()
    stop_sampling.set()
    await asyncio.gather(tasks[0], tasks[2])
    await learner.aclose()
    # What stays after the drain: the dedupe markers (three per group), until their TTL.
    retained = int((await r.info("memory"))["used_memory"]) - baseline
    markers = len([k async for k in r.scan_iter(match=f"*{namespace}*:seen:*", count=1000)])

    plateau = samples.window(stall_start + 5.0, stall_end)  # the pipeline is full by then
    mem_plateau = [samples.memory[i] for i in plateau]
    sent_in_plateau = samples.sent[plateau[-1]] - samples.sent[plateau[0]]
    longest_wait = max(b - a for a, b in zip([stall_start, *sent], sent, strict=False))
    peak = max(samples.memory)
    expected = {f"g{i:04d}" for i in range(GROUPS)}
    figures: dict[str, Any] = dict(
        stall_s=stall_end - stall_start, cap=CAP,
        **{f"max_len_{s}": max(v) for s, v in samples.lengths.items()},
        sent=len(sent), received=len(set(learner.counts) & expected), duplicated=learner.duplicates,
        lost=len(expected - set(learner.counts)), sent_while_full=sent_in_plateau,
        producer_longest_wait_s=longest_wait, memory_baseline_mib=baseline / 2**20,
        memory_peak_mib=peak / 2**20, memory_growth_mib=(peak - baseline) / 2**20,
        memory_bound_mib=memory_bound() / 2**20,
        memory_drift_in_stall_kib=(max(mem_plateau) - min(mem_plateau)) / 1024,
        dead_lettered=int(await r.xlen(keys.dlq)), dedupe_markers_after_drain=markers,
        retained_bytes_per_group_after_drain=retained // GROUPS,
    )
    report("learner_stall", **figures)
    await r.aclose()
    # Strict: concurrent writers (the teacher has up to max_in_flight sends at once) must not overshoot.
    assert all(figures[f"max_len_{s}"] <= CAP for s in STREAMS), figures
    assert figures["max_len_batches"] == CAP, "the stall never filled the batches stream"
    assert sent_in_plateau == 0, "the producer kept writing into a full pipeline"
    assert longest_wait > STALL_S - 5.0
    assert peak - baseline <= memory_bound()
    assert figures["memory_drift_in_stall_kib"] < 256
    assert all_in and not figures["lost"], "groups lost after the stall"
    assert learner.duplicates == 0
    assert figures["dead_lettered"] == 0
    assert workers.all_alive()


async def _has_pid(r: Any, key: str, pid: int) -> bool:
    return await heartbeat_pid(r, key) == pid


async def _true(x: bool) -> bool:
    return x


@pytest.mark.parametrize("tokens", [8, 9000], ids=["one_script", "reserve_then_multi"])
async def test_backlog_cap_holds_under_concurrent_producers(
    private_redis: RedisServer, namespace: str, tokens: int
) -> None:
    """Both write paths of the producer: small messages (one script) and large ones (reservation, then MULTI)."""
    assert (len(encode(synthetic_rollout(1, tokens))) <= SMALL_MESSAGE_BYTES) == (tokens == 8)
    keys = Keys(namespace)
    r = redis_client(private_redis.url)
    prod = StreamProducer(r, keys, "rollouts", fast_settings(max_backlog=CAP, backpressure_timeout_s=30))
    for i in range(CAP - 1):
        await prod.send(synthetic_rollout(1, tokens, group_id=f"a{i}"))
    stop = asyncio.Event()

    async def one(i: int) -> None:
        with contextlib.suppress(ProducerStopped):
            await prod.send(synthetic_rollout(1, tokens, group_id=f"b{i}"), stop=stop)

    tasks = [asyncio.create_task(one(i)) for i in range(10)]
    await asyncio.sleep(1.0)
    stop.set()
    await asyncio.gather(*tasks)
    length = int(await r.xlen(keys.stream("rollouts")))
    await r.aclose()
    report("backlog_cap_concurrent_producers", cap=CAP, concurrent_sends=10, length=length, path=tokens)
    assert length <= CAP
