"""End-to-end transport throughput: distillq's stages versus a raw-bytes stub on the same Redis.

Topology (both sides, in-process asyncio tasks in one process, each stage with its own connection):
producer -> ``rollouts`` -> teacher worker -> ``scored`` -> feeder -> ``batches`` -> learner (ack).

* distillq: ``StreamProducer.send`` -> ``StageRunner`` + ``TeacherStage`` + ``Scorer(SyntheticTeacher())``
  -> ``pipeline.stages.feeder.Feeder`` -> ``pipeline.learner.client.AsyncLearner`` (decode, validate, ack each batch).
* stub: ``bench.stub_pipeline``: the same stream operations with pre-built bytes of the same sizes;
  ``stub_producer`` is the stub writing through ``StreamProducer.send_raw`` (the write protocol's price).

Closed loop: the producer keeps ``window`` groups between push and learner ack. Throughput is groups
acked per second after a warm-up, with the process CPU and Redis CPU (``INFO cpu``) per group.
Also shared by the other rows: workloads, the private Redis, and the in-process pipeline builder.
"""

from __future__ import annotations

import asyncio
import logging
import os
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import redis.asyncio as aioredis
import structlog

from pipeline.config import RedisSettings, StreamSettings
from pipeline.learner.client import AsyncLearner
from pipeline.stages.batching import BatchingConfig
from pipeline.stages.feeder import Feeder
from pipeline.stages.kl_control import ConstantKL
from pipeline.stages.runloop import StageRunner
from pipeline.stages.scoring import Scorer, ScoringConfig
from pipeline.stages.teacher_stage import TeacherStage
from pipeline.teacher.synthetic import SyntheticTeacher
from pipeline.transport.connection import connect
from pipeline.transport.keys import Keys
from pipeline.transport.producer import StreamProducer
from schemas import RolloutGroup, encode
from schemas.build import synthetic_rollout, synthetic_scored

VOCAB = 32000
BATCH_TOKENS = 65536


def quiet_logs() -> None:
    """Warnings only: the stages log one line per batch at INFO."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
                        logger_factory=structlog.PrintLoggerFactory())


@dataclass(frozen=True)
class Workload:
    """Groups of ``seqs`` sequences of ``seq_len`` tokens, teacher top-k ``k``."""

    seqs: int = 8
    seq_len: int = 1024
    k: int = 20

    @property
    def label(self) -> str:
        return f"{self.seqs}x{self.seq_len}"

    @property
    def group_tokens(self) -> int:
        return self.seqs * self.seq_len

    @property
    def batch_groups(self) -> int:
        """Whole groups per train batch of ``BATCH_TOKENS`` tokens."""
        return max(1, BATCH_TOKENS // self.group_tokens)

    def rollout(self) -> RolloutGroup:
        return synthetic_rollout(self.seqs, self.seq_len, vocab=VOCAB, seed=1)

    def payload_sizes(self) -> dict[str, int]:
        """Encoded bytes of one rollout and one scored group."""
        r = self.rollout()
        return {"rollout": len(encode(r)), "scored": len(encode(synthetic_scored(r, self.k, vocab=VOCAB)))}


def new_group(template: RolloutGroup, gid: str) -> RolloutGroup:
    """``template`` under a fresh group id (arrays shared, nothing copied)."""
    return msgspec.structs.replace(template, group_id=gid, created_at=time.time())


def new_keys() -> Keys:
    return Keys(f"bench{uuid.uuid4().hex[:8]}")


def client(url: str) -> aioredis.Redis:
    return connect(RedisSettings(redis_url=url))


async def drop_namespace(r: aioredis.Redis, keys: Keys) -> None:
    """Delete every key of ``keys``' namespace, ``ns:*`` and ``{ns:*`` (our private server only)."""
    for pattern in (f"{keys.namespace}:*", f"{{{keys.namespace}:*"):
        batch: list[Any] = []
        async for k in r.scan_iter(match=pattern, count=1000):
            batch.append(k)
            if len(batch) >= 1000:
                await r.unlink(*batch)
                batch.clear()
        if batch:
            await r.unlink(*batch)


async def redis_cpu(r: aioredis.Redis) -> float:
    """Redis server CPU seconds so far (user + sys)."""
    info = await r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs from ``/proc/stat``: busy cores = d(busy) / d(total) x nproc."""
    with open("/proc/stat") as f:
        vals = [float(x) for x in f.readline().split()[1:]]
    return sum(vals) - vals[3] - vals[4], sum(vals)


class Window:
    """Closed-loop flow control: at most ``size`` groups between push and learner ack."""

    def __init__(self, size: int) -> None:
        self.size, self.open = size, 0
        self._cond = asyncio.Condition()

    async def acquire(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: self.open < self.size)
            self.open += 1

    async def release(self, n: int) -> None:
        async with self._cond:
            self.open -= n
            self._cond.notify_all()

    async def close(self) -> None:
        """Let every waiting producer through (it then sees the stop event)."""
        await self.release(10**9)


@dataclass
class Meter:
    """Groups acked by the learner over time, plus process and Redis CPU at the window edges."""

    marks: list[tuple[float, int]] = field(default_factory=list)
    total: int = 0

    def add(self, n: int) -> None:
        self.total += n
        self.marks.append((time.perf_counter(), self.total))


@dataclass
class Throughput:
    """One measured run."""

    groups_per_s: float
    groups: int
    seconds: float
    cpu_per_group_ms: float  # this process
    redis_cpu_per_group_ms: float
    machine_cores: float  # busy cores of the whole machine (other sessions included) during the window

    def as_dict(self) -> dict[str, float]:
        return {"groups_per_s": self.groups_per_s, "groups": self.groups, "seconds": self.seconds,
                "cpu_ms": self.cpu_per_group_ms, "redis_cpu_ms": self.redis_cpu_per_group_ms,
                "machine_cores": self.machine_cores}


Runner = Callable[[asyncio.Event, Window, Meter], list[Awaitable[Any]]]


async def measure(url: str, start: Runner, warmup_s: float, duration_s: float, window: int) -> Throughput:
    """Run the tasks ``start`` returns; count groups acked during ``duration_s`` after ``warmup_s``."""
    stop, win, meter = asyncio.Event(), Window(window), Meter()
    probe = client(url)
    tasks = [asyncio.ensure_future(t) for t in start(stop, win, meter)]
    try:
        await asyncio.sleep(warmup_s)
        g0, c0, r0, m0, t0 = meter.total, time.process_time(), await redis_cpu(probe), machine_cpu(), time.time()
        await asyncio.sleep(duration_s)
        g1, c1, r1, m1, t1 = meter.total, time.process_time(), await redis_cpu(probe), machine_cpu(), time.time()
    finally:
        stop.set()
        await win.close()
        done, pending = await asyncio.wait(tasks, timeout=30)
        for t in pending:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for t in done:
            if not t.cancelled() and t.exception() is not None:
                raise RuntimeError("a pipeline task failed") from t.exception()
        await probe.aclose()
    n = g1 - g0
    per = max(n, 1)
    busy = (m1[0] - m0[0]) / (m1[1] - m0[1]) * (os.cpu_count() or 1)
    return Throughput(n / (t1 - t0), n, t1 - t0, (c1 - c0) * 1e3 / per, (r1 - r0) * 1e3 / per, busy)


def stream_settings() -> StreamSettings:
    return StreamSettings(max_backlog=10_000, heartbeat_interval_s=5.0, shutdown_grace_s=10.0)


@dataclass
class Pipeline:
    """distillq's stages, in-process, on their own connections; ``tasks`` starts them."""

    url: str
    keys: Keys
    work: Workload
    batch_groups: int | None = None  # groups per train batch (default: the workload's)
    teacher_latency_s: float = 0.0
    settings: StreamSettings = field(default_factory=stream_settings)
    clients: list[aioredis.Redis] = field(default_factory=list)
    scorer: Scorer | None = None

    def _client(self) -> aioredis.Redis:
        self.clients.append(client(self.url))
        return self.clients[-1]

    def producer(self) -> StreamProducer:
        return StreamProducer(self._client(), self.keys, "rollouts", self.settings)

    def stages(self, stop: asyncio.Event) -> list[Awaitable[Any]]:
        """Teacher worker and feeder tasks."""
        s, w = self.settings, self.work
        self.scorer = Scorer(SyntheticTeacher(vocab_size=VOCAB, latency_s=self.teacher_latency_s),
                             ScoringConfig(default_k=w.k))
        teacher = StageRunner(self._client(), self.keys, TeacherStage(self.scorer), RolloutGroup,
                              "rollouts", "scored", s, consumer_name="teacher-0")
        cfg = BatchingConfig(max_batch_tokens=BATCH_TOKENS, max_batch_groups=self.batch_groups or w.batch_groups,
                             max_staleness=None, max_wait_s=0.5)
        feeder = Feeder(self._client(), self.keys, cfg, ConstantKL(1.0), s, consumer_name="feeder-0")
        return [teacher.run(stop), feeder.run(stop)]

    def learner(self) -> AsyncLearner:
        return AsyncLearner(namespace=self.keys.namespace, redis=self._client(), settings=self.settings)

    async def close(self) -> None:
        for c in self.clients:
            await c.aclose()
        self.clients.clear()


def distillq_runner(p: Pipeline) -> Runner:
    """Closed-loop producer and acking learner around ``p``'s stages."""

    def start(stop: asyncio.Event, win: Window, meter: Meter) -> list[Awaitable[Any]]:
        template, producer, learner = p.work.rollout(), p.producer(), p.learner()

        async def produce() -> None:
            i = 0
            while not stop.is_set():
                await win.acquire()
                if stop.is_set():
                    return
                await producer.send(new_group(template, f"g{i}"), stop=stop)
                i += 1

        async def learn() -> None:
            while not stop.is_set():
                b = await learner.next_batch(timeout_s=0.2)
                if b is not None:
                    await learner.ack(b)
                    meter.add(len(b.batch.groups))
                    await win.release(len(b.batch.groups))

        return [produce(), learn(), *p.stages(stop)]

    return start


async def run_distillq(url: str, work: Workload, warmup_s: float, duration_s: float) -> Throughput:
    p = Pipeline(url, new_keys(), work)
    try:
        return await measure(url, distillq_runner(p), warmup_s, duration_s, window=4 * work.batch_groups)
    finally:
        probe = client(url)
        await drop_namespace(probe, p.keys)
        await probe.aclose()
        await p.close()


async def run_stub(url: str, work: Workload, warmup_s: float, duration_s: float, *, producer: bool = False
                   ) -> Throughput:
    from bench.stub_pipeline import StubPipeline

    stub = await StubPipeline.build(url, new_keys(), work, producer=producer)
    try:
        return await measure(url, stub.start, warmup_s, duration_s, window=4 * work.batch_groups)
    finally:
        await stub.close()


@dataclass
class SideBySide:
    """Alternating runs of distillq, the stub, and the stub writing through ``StreamProducer``."""

    work: Workload
    runs: dict[str, list[Throughput]] = field(default_factory=lambda: {"distillq": [], "stub": [], "stub_producer": []})

    def best(self, name: str) -> Throughput:
        return max(self.runs[name], key=lambda t: t.groups_per_s)

    def median(self, name: str) -> float:
        return statistics.median(t.groups_per_s for t in self.runs[name])

    def ratio(self, name: str = "distillq", base: str = "stub") -> tuple[float, float]:
        """(best over best, median over median) groups/s."""
        return self.best(name).groups_per_s / self.best(base).groups_per_s, self.median(name) / self.median(base)


async def side_by_side(url: str, work: Workload, rounds: int, warmup_s: float, duration_s: float,
                       variants: tuple[str, ...] = ("distillq", "stub", "stub_producer")) -> SideBySide:
    """``rounds`` rounds of every variant, the order rotated each round so drift hits all alike."""
    out = SideBySide(work)
    for i in range(rounds):
        for name in variants[i % len(variants):] + variants[: i % len(variants)]:
            if name == "distillq":
                t = await run_distillq(url, work, warmup_s, duration_s)
            else:
                t = await run_stub(url, work, warmup_s, duration_s, producer=name == "stub_producer")
            out.runs[name].append(t)
    return out


async def _main() -> None:  # manual use: python -m bench.transport [rounds]
    import sys

    from tests.redis_server import RedisServer

    quiet_logs()
    server = RedisServer().start()
    try:
        for n in (1024, 4096):
            s = await side_by_side(server.url, Workload(8, n), int(sys.argv[1]) if len(sys.argv) > 1 else 2, 1.5, 4)
            for name, runs in s.runs.items():
                for t in runs:
                    print(s.work.label, name, {k: round(v, 2) for k, v in t.as_dict().items()})
            print(s.work.label, "distillq/stub best {:.2f} median {:.2f}".format(*s.ratio()))
    finally:
        server.stop()


if __name__ == "__main__":
    asyncio.run(_main())
